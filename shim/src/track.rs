//! This process's device allocations and the 2 MiB chunks of device memory
//! they occupy. The driver hands out memory in 2 MiB chunks: an allocation
//! of 2 MiB or more takes whole chunks, and smaller ones share a chunk until
//! the last of them is freed (measured on an H100, docs/GPU_VERIFICATION.md: the first 1 MiB costs
//! 2 MiB, a second costs nothing, freeing every other one of 16 gives back
//! nothing). Charging chunks, not requested bytes, makes a container pay
//! what the driver takes. Sharded by chunk so threads rarely contend.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::spin::{SpinGuard, SpinLock};

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

/// The chunks an allocation covers: whole ones are its alone, partial ones
/// (at most the first and the last) may be shared.
struct Span {
    whole: u64,
    partial: [Option<u64>; 2],
}

impl Allocation {
    fn first_chunk(&self) -> u64 {
        self.ptr / CHUNK
    }

    fn span(&self) -> Span {
        let (start, end) = (self.ptr, self.ptr.saturating_add(self.size.max(1)));
        let (first, last) = (start / CHUNK, (end - 1) / CHUNK);
        let first_whole = start % CHUNK == 0 && end >= (first + 1) * CHUNK;
        let last_whole = end % CHUNK == 0;
        let partial = if first == last {
            [(!first_whole).then_some(first), None]
        } else {
            [
                (!first_whole).then_some(first),
                (!last_whole).then_some(last),
            ]
        };
        let shared = partial.iter().flatten().count() as u64;
        Span {
            whole: (last - first + 1 - shared) * CHUNK,
            partial,
        }
    }
}

/// What to charge before the driver says where an allocation of `size`
/// goes: every chunk it can cover if none is shared.
pub fn upper_bound(size: u64) -> u64 {
    size.div_ceil(CHUNK).saturating_mul(CHUNK)
}

/// Device addresses are spread already: a multiply is hash enough, and
/// needs no random state, so the maps can be built in a `const`.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = (key ^ (key >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

struct Shard {
    /// By pointer, in the shard of the allocation's first chunk. A hash map
    /// keeps its room when emptied, so a steady alloc/free loop does not
    /// allocate (a B-tree would, for every first entry of a shard).
    records: HashMap<u64, Allocation, BuildHasherDefault<AddressHasher>>,
    /// Live allocations per partly used chunk, in the chunk's shard: a few
    /// per shard at most (chunks being filled by small allocations), so a
    /// short list, which keeps its room and never allocates once warm.
    occupancy: Vec<(u64, u32)>,
}

impl Shard {
    /// One more user of `chunk`; whether it is the first.
    fn enter(&mut self, chunk: u64) -> bool {
        match self.occupancy.iter_mut().find(|(c, _)| *c == chunk) {
            Some((_, users)) => {
                *users += 1;
                false
            }
            None => {
                self.occupancy.push((chunk, 1));
                true
            }
        }
    }

    /// One user fewer of `chunk`; whether it was the last.
    fn leave(&mut self, chunk: u64) -> bool {
        let Some(at) = self.occupancy.iter().position(|(c, _)| *c == chunk) else {
            return false;
        };
        let users = &mut self.occupancy[at].1;
        *users -= 1;
        if *users > 0 {
            return false;
        }
        self.occupancy.swap_remove(at);
        true
    }
}

const SHARDS: usize = 64;

fn shard_of(chunk: u64) -> usize {
    ((chunk ^ (chunk >> 6)) as usize) % SHARDS
}

pub struct Allocations {
    shards: [SpinLock<Shard>; SHARDS],
}

impl Allocations {
    pub const fn new() -> Self {
        Allocations {
            shards: [const {
                SpinLock::new(Shard {
                    records: HashMap::with_hasher(BuildHasherDefault::new()),
                    occupancy: Vec::new(),
                })
            }; SHARDS],
        }
    }

    fn lock(&self, shard: usize) -> SpinGuard<'_, Shard> {
        self.shards[shard].lock()
    }

    /// Runs `each` on the shard of every partial chunk of `allocation`,
    /// reusing `home` (the locked shard of its first chunk) where it can:
    /// a small allocation takes one lock.
    fn partials(
        &self,
        span: &Span,
        first: u64,
        home: &mut SpinGuard<'_, Shard>,
        mut each: impl FnMut(&mut Shard, u64),
    ) {
        for chunk in span.partial.into_iter().flatten() {
            if shard_of(chunk) == shard_of(first) {
                each(home, chunk);
            } else {
                each(&mut self.lock(shard_of(chunk)), chunk);
            }
        }
    }

    /// Records a new allocation; returns the bytes it newly takes: its whole
    /// chunks, and each partial chunk no other live allocation was using.
    pub fn insert(&self, allocation: Allocation) -> u64 {
        let (span, first) = (allocation.span(), allocation.first_chunk());
        let mut home = self.lock(shard_of(first));
        home.records.insert(allocation.ptr, allocation);
        let mut taken = span.whole;
        self.partials(&span, first, &mut home, |shard, chunk| {
            if shard.enter(chunk) {
                taken += CHUNK;
            }
        });
        taken
    }

    /// Takes the allocation at `ptr` out before it is freed, so an address
    /// the driver hands out again meanwhile is not mistaken for it; returns
    /// it and the bytes the driver gets back (its whole chunks, and each
    /// partial chunk it is the last in). A chunk given up here that another
    /// allocation enters before the free completes is charged to that one.
    pub fn take(&self, ptr: u64) -> Option<(Allocation, u64)> {
        let first = ptr / CHUNK;
        let mut home = self.lock(shard_of(first));
        let allocation = home.records.remove(&ptr)?;
        let span = allocation.span();
        let mut back = span.whole;
        self.partials(&span, first, &mut home, |shard, chunk| {
            if shard.leave(chunk) {
                back += CHUNK;
            }
        });
        Some((allocation, back))
    }

    /// Puts back an allocation whose free failed.
    pub fn untake(&self, allocation: Allocation) {
        let (span, first) = (allocation.span(), allocation.first_chunk());
        let mut home = self.lock(shard_of(first));
        home.records.insert(allocation.ptr, allocation);
        self.partials(&span, first, &mut home, |shard, chunk| {
            shard.enter(chunk);
        });
    }

    /// Takes out every allocation of a destroyed context (the driver freed
    /// them with it), passing each and the bytes it gave back to `gone`.
    pub fn drain_context(&self, ctx: usize, mut gone: impl FnMut(&Allocation, u64)) {
        let mut dead = Vec::new();
        for shard in 0..SHARDS {
            self.lock(shard).records.retain(|_, a| {
                if a.ctx == ctx {
                    dead.push(*a);
                }
                a.ctx != ctx
            });
        }
        for allocation in dead {
            let span = allocation.span();
            let mut back = span.whole;
            for chunk in span.partial.into_iter().flatten() {
                if self.lock(shard_of(chunk)).leave(chunk) {
                    back += CHUNK;
                }
            }
            gone(&allocation, back);
        }
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
        assert_eq!(t.take(a.ptr), Some((a, 0)), "still in use");
        t.untake(a);
        assert_eq!(t.take(a.ptr), Some((a, 0)), "a failed free changes nothing");
        assert_eq!(t.take(b.ptr), Some((b, 2 * MIB)));
        assert_eq!(t.take(b.ptr), None);
    }

    #[test]
    fn large_allocations_take_whole_chunks_and_share_their_tail() {
        let t = Allocations::new();
        let big = at(BASE, 64 * MIB + 1);
        assert_eq!(upper_bound(big.size), 66 * MIB);
        assert_eq!(t.insert(big), 66 * MIB);
        let tail = at(BASE + 64 * MIB + 4096, 4096);
        assert_eq!(t.insert(tail), 0, "in the big one's last chunk");
        assert_eq!(t.take(big.ptr), Some((big, 64 * MIB)));
        assert_eq!(t.take(tail.ptr), Some((tail, 2 * MIB)));
        let exact = at(BASE + 128 * MIB, 4 * MIB);
        assert_eq!(t.insert(exact), 4 * MIB);
        assert_eq!(t.take(exact.ptr), Some((exact, 4 * MIB)));
    }

    #[test]
    fn an_allocation_across_a_chunk_boundary_uses_both() {
        let t = Allocations::new();
        let across = at(BASE + MIB, 2 * MIB);
        assert_eq!(t.insert(across), 4 * MIB);
        assert_eq!(t.take(across.ptr), Some((across, 4 * MIB)));
    }

    #[test]
    fn a_destroyed_context_takes_its_allocations() {
        let t = Allocations::new();
        let mut other = at(BASE + 2 * MIB, MIB);
        other.ctx = 2;
        t.insert(at(BASE, MIB));
        t.insert(other);
        let mut gone = Vec::new();
        t.drain_context(1, |a, back| gone.push((*a, back)));
        assert_eq!(gone, [(at(BASE, MIB), 2 * MIB)]);
        assert_eq!(t.take(other.ptr), Some((other, 2 * MIB)));
    }
}
