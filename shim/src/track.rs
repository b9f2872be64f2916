//! Process-local memory of what each pointer or handle was charged, so a
//! free gives back exactly that. Sharded so threads rarely contend.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// What one allocation was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub dev: usize,
    pub bytes: u64,
}

const SHARDS: usize = 64;

/// Allocations keyed by device pointer or by `cuMemCreate` handle.
pub struct Tracker {
    shards: [Mutex<BTreeMap<u64, Charge>>; SHARDS],
}

impl Tracker {
    pub const fn new() -> Self {
        Tracker {
            shards: [const { Mutex::new(BTreeMap::new()) }; SHARDS],
        }
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, BTreeMap<u64, Charge>> {
        // Device allocations are at least 512-byte aligned and large ones
        // 2 MiB aligned: mix the bits above both into the shard index.
        let mixed = (key >> 9) ^ (key >> 21);
        let shard = &self.shards[(mixed as usize) % SHARDS];
        // A panic while holding a shard cannot leave a half-written entry.
        shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, key: u64, charge: Charge) {
        self.shard(key).insert(key, charge);
    }

    pub fn remove(&self, key: u64) -> Option<Charge> {
        self.shard(key).remove(&key)
    }

    pub fn get(&self, key: u64) -> Option<Charge> {
        self.shard(key).get(&key).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove() {
        let t = Tracker::new();
        let c = Charge {
            dev: 0,
            bytes: 2 << 20,
        };
        t.insert(0x7f00_0020_0000, c);
        assert_eq!(t.get(0x7f00_0020_0000), Some(c));
        assert_eq!(t.remove(0x7f00_0020_0000), Some(c));
        assert_eq!(t.remove(0x7f00_0020_0000), None);
    }
}
