//! This process's device allocations and the 2 MiB chunks of device memory
//! they occupy. The driver hands out memory in 2 MiB chunks: an allocation
//! of 2 MiB or more takes whole chunks, and smaller ones share a chunk until
//! the last of them is freed (measured on an H100, docs/GPU_VERIFICATION.md: the first 1 MiB costs
//! 2 MiB, a second costs nothing, freeing every other one of 16 gives back
//! nothing). Charging chunks, not requested bytes, makes a container pay
//! what the driver takes. Sharded by chunk so threads rarely contend.

use crate::ptrmap::PtrMap;
use crate::spin::{SpinGuard, SpinLock};

pub const CHUNK: u64 = 2 << 20;

/// One live allocation: where, how big, on which capped device and in
/// which context (destroying the context frees it; `NO_CONTEXT` for
/// stream-ordered memory, which no teardown frees).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Allocation {
    pub dev: usize,
    pub ctx: usize,
    pub ptr: u64,
    pub size: u64,
}

/// The chunks an allocation covers, `first..=last`: the first and the last
/// may be partly someone else's (`head`, `tail`: shared), every other is
/// wholly its own.
#[derive(Clone, Copy)]
struct Span {
    first: u64,
    last: u64,
    head: bool,
    tail: bool,
}

impl Span {
    /// The bytes of the chunks wholly this allocation's.
    fn whole(&self) -> u64 {
        let shared = u64::from(self.head) + u64::from(self.tail);
        (self.last - self.first + 1 - shared).saturating_mul(CHUNK)
    }
}

impl Allocation {
    fn span(&self) -> Span {
        let end = self.ptr.saturating_add(self.size.max(1));
        let (first, last) = (self.ptr / CHUNK, (end - 1) / CHUNK);
        Span {
            first,
            last,
            head: !self.ptr.is_multiple_of(CHUNK) || end - self.ptr < CHUNK,
            tail: last != first && !end.is_multiple_of(CHUNK),
        }
    }
}

/// What to charge before the driver says where an allocation of `size`
/// goes: every chunk it can cover if none is shared.
pub fn upper_bound(size: u64) -> u64 {
    size.div_ceil(CHUNK).saturating_mul(CHUNK)
}

struct Shard {
    /// By pointer, in the shard of the allocation's first chunk. The map
    /// keeps its room when emptied, so a steady alloc/free loop does not
    /// allocate (a B-tree would, for every first entry of a shard).
    records: PtrMap<Allocation>,
    /// Live allocations per partly used chunk, in the chunk's shard.
    occupancy: PtrMap<u32>,
}

impl Shard {
    /// One more user of `chunk`; whether it is the first.
    fn enter(&mut self, chunk: u64) -> bool {
        let users = self.occupancy.upsert(chunk);
        *users += 1;
        *users == 1
    }

    /// One user fewer of `chunk`; whether it was the last.
    fn leave(&mut self, chunk: u64) -> bool {
        let keep = self.occupancy.update(chunk, |users| {
            *users -= 1;
            *users > 0
        });
        keep == Some(false)
    }
}

/// What `Allocations::insert` did.
pub struct Inserted {
    /// The bytes the new allocation took.
    pub taken: u64,
    /// A record that was at the same address, and the bytes it gave back.
    pub stale: Option<(Allocation, u64)>,
}

/// A chunk's bytes if `entered_or_left`, else none.
fn bytes_if(entered_or_left: bool) -> u64 {
    if entered_or_left {
        CHUNK
    } else {
        0
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
                    records: PtrMap::new(),
                    occupancy: PtrMap::new(),
                })
            }; SHARDS],
        }
    }

    fn lock(&self, chunk: u64) -> SpinGuard<'_, Shard> {
        crate::fork::engage();
        self.shards[shard_of(chunk)].lock()
    }

    /// Runs `change` on the last chunk if it is shared, returning CHUNK if
    /// that made it the chunk's first or last user. The caller holds no
    /// other shard: one lock at a time, so two threads whose allocations
    /// straddle the same two shards in opposite order cannot deadlock.
    fn tail(&self, span: Span, change: fn(&mut Shard, u64) -> bool) -> u64 {
        bytes_if(span.tail && change(&mut self.lock(span.last), span.last))
    }

    /// What a record taken out gives back, its head chunk already left
    /// (`head`: it was the last there): its whole chunks, the head and,
    /// leaving it now, the tail if it was the last there too.
    fn given_back(&self, span: Span, head: bool) -> u64 {
        span.whole() + bytes_if(head) + self.tail(span, Shard::leave)
    }

    /// Records a new allocation; returns the bytes it newly takes (its
    /// whole chunks, and each partial chunk no other live allocation was
    /// using), and the record it replaced, taken out as by `take`.
    pub fn insert(&self, allocation: Allocation) -> Inserted {
        let span = allocation.span();
        // The tail is entered before the record can be seen: a context
        // drained in between would find the record, and leave a tail not
        // yet entered, which would then stay counted with no record.
        let tail = self.tail(span, Shard::enter);
        let (head, replaced) = {
            let mut home = self.lock(span.first);
            // The same address: the same first chunk, and shard.
            let replaced = home.records.insert(allocation.ptr, allocation).map(|old| {
                let old_span = old.span();
                (old, old_span, old_span.head && home.leave(span.first))
            });
            (span.head && home.enter(span.first), replaced)
        };
        let stale = replaced.map(|(old, old_span, head)| (old, self.given_back(old_span, head)));
        Inserted {
            taken: span.whole() + bytes_if(head) + tail,
            stale,
        }
    }

    /// Takes the allocation at `ptr` out before it is freed, so an address
    /// the driver hands out again meanwhile is not mistaken for it; returns
    /// it and the bytes the driver gets back (its whole chunks, and each
    /// partial chunk it is the last in). A chunk given up here that another
    /// allocation enters before the free completes is charged to that one.
    pub fn take(&self, ptr: u64) -> Option<(Allocation, u64)> {
        let (allocation, span, head) = {
            let mut home = self.lock(ptr / CHUNK);
            let allocation = home.records.remove(ptr)?;
            let span = allocation.span();
            let head = span.head && home.leave(span.first);
            (allocation, span, head)
        };
        let back = self.given_back(span, head);
        Some((allocation, back))
    }

    /// Takes out every allocation of a destroyed context (the driver freed
    /// them with it), passing each and the bytes it gave back to `gone`.
    pub fn drain_context(&self, ctx: usize, mut gone: impl FnMut(&Allocation, u64)) {
        let mut dead = Vec::new();
        crate::fork::engage();
        for shard in &self.shards {
            shard
                .lock()
                .records
                .remove_where(|a| a.ctx == ctx, |a| dead.push(a));
        }
        for allocation in dead {
            let span = allocation.span();
            let head = span.head && self.lock(span.first).leave(span.first);
            let back = self.given_back(span, head);
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
        assert_eq!(t.insert(a).taken, 2 * MIB, "the first takes the chunk");
        assert_eq!(t.insert(b).taken, 0, "the second shares it");
        assert_eq!(t.take(a.ptr), Some((a, 0)), "still in use");
        assert_eq!(t.insert(a).taken, 0, "a failed free puts it back");
        assert_eq!(t.take(a.ptr), Some((a, 0)));
        assert_eq!(t.take(b.ptr), Some((b, 2 * MIB)));
        assert_eq!(t.take(b.ptr), None);
    }

    #[test]
    fn large_allocations_take_whole_chunks_and_share_their_tail() {
        let t = Allocations::new();
        let big = at(BASE, 64 * MIB + 1);
        assert_eq!(upper_bound(big.size), 66 * MIB);
        assert_eq!(t.insert(big).taken, 66 * MIB);
        let tail = at(BASE + 64 * MIB + 4096, 4096);
        assert_eq!(t.insert(tail).taken, 0, "in the big one's last chunk");
        assert_eq!(t.take(big.ptr), Some((big, 64 * MIB)));
        assert_eq!(t.take(tail.ptr), Some((tail, 2 * MIB)));
        let exact = at(BASE + 128 * MIB, 4 * MIB);
        assert_eq!(t.insert(exact).taken, 4 * MIB);
        assert_eq!(t.take(exact.ptr), Some((exact, 4 * MIB)));
    }

    #[test]
    fn an_allocation_across_a_chunk_boundary_uses_both() {
        let t = Allocations::new();
        let across = at(BASE + MIB, 2 * MIB);
        assert_eq!(t.insert(across).taken, 4 * MIB);
        assert_eq!(t.take(across.ptr), Some((across, 4 * MIB)));
    }

    /// Two allocations, each over a chunk boundary and shared at both ends,
    /// whose chunks fall in the same two shards in opposite order: taking
    /// the second shard while holding the first would deadlock.
    #[test]
    fn threads_straddling_the_same_shards_in_opposite_order_never_deadlock() {
        let t = Allocations::new();
        let (a, b) = (at(MIB, 2 * MIB), at(64 * CHUNK + MIB, 2 * MIB));
        assert_eq!(shard_of(a.ptr / CHUNK), shard_of(b.ptr / CHUNK + 1));
        assert_eq!(shard_of(a.ptr / CHUNK + 1), shard_of(b.ptr / CHUNK));
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            for allocation in [a, b] {
                let (t, done) = (&t, done.clone());
                s.spawn(move || {
                    for _ in 0..200_000 {
                        assert_eq!(t.insert(allocation).taken, 4 * MIB);
                        assert_eq!(t.take(allocation.ptr), Some((allocation, 4 * MIB)));
                    }
                    let _ = done.send(());
                });
            }
            for _ in 0..2 {
                if finished
                    .recv_timeout(std::time::Duration::from_secs(60))
                    .is_err()
                {
                    eprintln!("deadlocked: two threads wait for each other's shard");
                    std::process::abort();
                }
            }
        });
    }

    /// The driver freed an allocation with its context and handed its
    /// address to another context's before the first context's records
    /// were dropped: the new record replaces the old one, which gives back
    /// what it held.
    #[test]
    fn a_record_at_a_reused_address_is_taken_out() {
        let t = Allocations::new();
        let old = at(BASE, 64 * MIB);
        let new = Allocation {
            ctx: 2,
            size: 2 * MIB,
            ..old
        };
        assert_eq!(t.insert(old).taken, 64 * MIB);
        let inserted = t.insert(new);
        assert_eq!(
            (inserted.taken, inserted.stale),
            (2 * MIB, Some((old, 64 * MIB)))
        );
        t.drain_context(1, |a, _| panic!("{a:?} was taken out already"));
        assert_eq!(t.take(new.ptr), Some((new, 2 * MIB)));
        // A small one over a reused address: the shared chunk changes hands.
        let (small, again) = (at(BASE + 4096, 4096), at(BASE + 4096, 8192));
        assert_eq!(t.insert(small).taken, 2 * MIB);
        let inserted = t.insert(again);
        assert_eq!(
            (inserted.taken, inserted.stale),
            (2 * MIB, Some((small, 2 * MIB)))
        );
    }

    /// A context drained while an allocation of it is being recorded: the
    /// chunks the allocation entered are all given back, by the drain or
    /// by the record's removal, never left counted without a record.
    #[test]
    fn a_drain_during_an_insert_leaves_no_chunk_counted_without_a_record() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        use std::time::{Duration, Instant};
        let t = Allocations::new();
        let mut phantoms = 0;
        for k in 0..400u64 {
            let head = 4096 * 64 + k * 64 * 3;
            if shard_of(head) >= shard_of(head + 1) {
                continue;
            }
            // Half a chunk in, a chunk long: shared head and tail chunks in
            // two shards.
            let a = at(head * CHUNK + CHUNK / 2, CHUNK);
            let started = AtomicBool::new(false);
            let mut charged: i128 = 0;
            std::thread::scope(|s| {
                // The insert stalls on the tail's shard.
                let held = t.shards[shard_of(head + 1)].lock();
                let insert = s.spawn(|| i128::from(t.insert(a).taken));
                let deadline = Instant::now() + Duration::from_millis(20);
                while Instant::now() < deadline
                    && t.shards[shard_of(head)]
                        .lock()
                        .records
                        .update(a.ptr, |_| true)
                        .is_none()
                {
                    std::thread::yield_now();
                }
                let drain = s.spawn(|| {
                    started.store(true, SeqCst);
                    let mut back = 0i128;
                    t.drain_context(1, |_, bytes| back += i128::from(bytes));
                    back
                });
                while !started.load(SeqCst) {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(1));
                drop(held);
                charged += insert.join().unwrap();
                charged -= drain.join().unwrap();
            });
            t.drain_context(1, |_, bytes| charged -= i128::from(bytes));
            if charged != 0 {
                phantoms += 1;
            }
        }
        assert_eq!(phantoms, 0, "rounds that left a chunk counted");
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
