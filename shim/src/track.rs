//! This process's device allocations and the 2 MiB chunks of device memory
//! they occupy. The driver hands out memory in 2 MiB chunks: an allocation
//! of 2 MiB or more takes whole chunks, and smaller ones share a chunk until
//! the last of them is freed (measured on the H100: the first 1 MiB costs
//! 2 MiB, a second costs nothing, freeing every other one of 16 gives back
//! nothing). Charging chunks, not requested bytes, makes a container pay
//! what the driver takes. Sharded by chunk so threads rarely contend.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

pub const CHUNK: u64 = 2 << 20;

/// One live allocation: where, how big, on which capped device and in
/// which context (destroying the context frees it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub dev: usize,
    pub ctx: usize,
    pub ptr: u64,
    pub size: u64,
}

impl Allocation {
    fn first_chunk(&self) -> u64 {
        self.ptr / CHUNK
    }

    fn last_chunk(&self) -> u64 {
        (self.ptr.saturating_add(self.size.max(1)) - 1) / CHUNK
    }

    fn covers_whole(&self, chunk: u64) -> bool {
        let start = chunk * CHUNK;
        self.ptr <= start && start.saturating_add(CHUNK) <= self.ptr.saturating_add(self.size)
    }

    /// The chunks it only partly covers (shared with others): at most two.
    fn partial_chunks(&self) -> impl Iterator<Item = u64> + '_ {
        let (first, last) = (self.first_chunk(), self.last_chunk());
        [first, last]
            .into_iter()
            .enumerate()
            .filter(move |&(i, c)| (i == 0 || c != first) && !self.covers_whole(c))
            .map(|(_, c)| c)
    }

    /// Bytes of the chunks it covers whole: nobody else's.
    fn whole_bytes(&self) -> u64 {
        let chunks = self.last_chunk() - self.first_chunk() + 1;
        let partial = self.partial_chunks().count() as u64;
        (chunks - partial) * CHUNK
    }
}

/// What to charge before the driver says where an allocation of `size`
/// goes: every chunk it can cover if none is shared.
pub fn upper_bound(size: u64) -> u64 {
    size.div_ceil(CHUNK).saturating_mul(CHUNK)
}

#[derive(Default)]
struct Shard {
    /// By pointer, in the shard of the allocation's first chunk.
    records: BTreeMap<u64, Allocation>,
    /// Live allocations per partly used chunk, in the chunk's shard.
    occupancy: BTreeMap<u64, u32>,
}

const SHARDS: usize = 64;

pub struct Allocations {
    shards: [Mutex<Shard>; SHARDS],
}

impl Allocations {
    pub const fn new() -> Self {
        Allocations {
            shards: [const {
                Mutex::new(Shard {
                    records: BTreeMap::new(),
                    occupancy: BTreeMap::new(),
                })
            }; SHARDS],
        }
    }

    fn shard(&self, chunk: u64) -> MutexGuard<'_, Shard> {
        let shard = &self.shards[((chunk ^ (chunk >> 6)) as usize) % SHARDS];
        // A panic while holding a shard cannot leave a half-written entry.
        shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a new allocation; returns the bytes it newly takes: its whole
    /// chunks, and each partial chunk no other live allocation was using.
    pub fn insert(&self, allocation: Allocation) -> u64 {
        let first = allocation.first_chunk();
        self.shard(first).records.insert(allocation.ptr, allocation);
        let mut taken = allocation.whole_bytes();
        for chunk in allocation.partial_chunks() {
            let mut shard = self.shard(chunk);
            let users = shard.occupancy.entry(chunk).or_insert(0);
            *users += 1;
            if *users == 1 {
                taken += CHUNK;
            }
        }
        taken
    }

    /// Takes the record of `ptr` out before it is freed, so an address the
    /// driver hands out again meanwhile is not mistaken for it.
    pub fn remove(&self, ptr: u64) -> Option<Allocation> {
        self.shard(ptr / CHUNK).records.remove(&ptr)
    }

    /// Puts back a record whose free failed.
    pub fn restore(&self, allocation: Allocation) {
        self.shard(allocation.first_chunk())
            .records
            .insert(allocation.ptr, allocation);
    }

    /// Accounts for a freed allocation; returns the bytes the driver got
    /// back: its whole chunks, and each partial chunk it was the last in.
    pub fn released(&self, allocation: &Allocation) -> u64 {
        let mut back = allocation.whole_bytes();
        for chunk in allocation.partial_chunks() {
            let mut shard = self.shard(chunk);
            if let Some(users) = shard.occupancy.get_mut(&chunk) {
                *users -= 1;
                if *users == 0 {
                    shard.occupancy.remove(&chunk);
                    back += CHUNK;
                }
            }
        }
        back
    }

    /// Takes out every allocation of a destroyed context (the driver freed
    /// them with it); pass each to `released`.
    pub fn drain_context(&self, ctx: usize) -> Vec<Allocation> {
        let mut gone = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.records.retain(|_, a| {
                if a.ctx == ctx {
                    gone.push(*a);
                }
                a.ctx != ctx
            });
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const BASE: u64 = 0x7f00_0000_0000;

    fn at(ptr: u64, size: u64) -> Allocation {
        Allocation {
            dev: 0,
            ctx: 1,
            ptr,
            size,
        }
    }

    #[test]
    fn small_allocations_share_a_chunk_until_the_last_is_freed() {
        let t = Allocations::new();
        let (a, b) = (at(BASE, MIB), at(BASE + MIB, MIB));
        assert_eq!(t.insert(a), 2 * MIB, "the first takes the chunk");
        assert_eq!(t.insert(b), 0, "the second shares it");
        assert_eq!(t.remove(a.ptr), Some(a));
        assert_eq!(t.released(&a), 0, "still in use");
        assert_eq!(t.remove(b.ptr), Some(b));
        assert_eq!(t.released(&b), 2 * MIB);
        assert_eq!(t.remove(b.ptr), None);
    }

    #[test]
    fn large_allocations_take_whole_chunks_and_share_their_tail() {
        let t = Allocations::new();
        let big = at(BASE, 64 * MIB + 1);
        assert_eq!(upper_bound(big.size), 66 * MIB);
        assert_eq!(t.insert(big), 66 * MIB);
        let tail = at(BASE + 64 * MIB + 4096, 4096);
        assert_eq!(t.insert(tail), 0, "in the big one's last chunk");
        assert_eq!(t.released(&big), 64 * MIB);
        assert_eq!(t.released(&tail), 2 * MIB);
        let exact = at(BASE + 128 * MIB, 4 * MIB);
        assert_eq!(t.insert(exact), 4 * MIB);
        assert_eq!(t.released(&exact), 4 * MIB);
    }

    #[test]
    fn an_allocation_across_a_chunk_boundary_uses_both() {
        let t = Allocations::new();
        let across = at(BASE + MIB, 2 * MIB);
        assert_eq!(t.insert(across), 4 * MIB);
        assert_eq!(t.released(&across), 4 * MIB);
    }

    #[test]
    fn a_destroyed_context_takes_its_allocations() {
        let t = Allocations::new();
        let mut other = at(BASE + 2 * MIB, MIB);
        other.ctx = 2;
        t.insert(at(BASE, MIB));
        t.insert(other);
        let gone = t.drain_context(1);
        assert_eq!(gone, [at(BASE, MIB)]);
        assert_eq!(t.remove(other.ptr), Some(other));
    }
}
