//! A map keyed by device address, for the allocation path: open addressing
//! with linear probing, deletion by backward shift (no tombstones, so a
//! steady alloc/free loop never degrades), and room that only grows, so a
//! warm map never allocates. It takes half the instructions of std's map
//! for an insert and a remove (docs/BENCHMARKS.md), and is built in a
//! `const`.

/// Empty slots hold key 0, so the one entry with key 0 is kept aside.
const EMPTY: u64 = 0;

pub struct PtrMap<V> {
    slots: Vec<(u64, V)>,
    /// 64 − log2(slots): a key's home slot is the top bits of its hash.
    shift: u32,
    len: usize,
    null: Option<V>,
}

impl<V: Copy + Default> PtrMap<V> {
    pub const fn new() -> Self {
        PtrMap {
            slots: Vec::new(),
            shift: 64,
            len: 0,
            null: None,
        }
    }

    /// Fibonacci hashing: device addresses are aligned (their low bits are
    /// all alike), and the multiply carries every bit into the top ones.
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Where `key` is (`Ok`), or the empty slot ending its probe run
    /// (`Err`). The map must have room.
    fn probe(&self, key: u64) -> Result<usize, usize> {
        let mask = self.mask();
        let mut at = self.home(key);
        loop {
            match self.slots[at].0 {
                EMPTY => return Err(at),
                k if k == key => return Ok(at),
                _ => at = (at + 1) & mask,
            }
        }
    }

    /// Where `key` is, if present.
    fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        self.probe(key).ok()
    }

    /// The value at `key`, inserted as the default if absent.
    pub fn upsert(&mut self, key: u64) -> &mut V {
        if key == EMPTY {
            return self.null.get_or_insert_with(V::default);
        }
        self.make_room();
        let at = match self.probe(key) {
            Ok(at) => at,
            Err(at) => {
                self.slots[at].0 = key;
                self.len += 1;
                at
            }
        };
        &mut self.slots[at].1
    }

    /// Inserts `value` at `key`, returning what was there.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        if key == EMPTY {
            return self.null.replace(value);
        }
        self.make_room();
        match self.probe(key) {
            Ok(at) => Some(std::mem::replace(&mut self.slots[at].1, value)),
            Err(at) => {
                self.slots[at] = (key, value);
                self.len += 1;
                None
            }
        }
    }

    /// Lets `change` alter the value at `key`, and removes it unless
    /// `change` says to keep it; `None` if absent.
    pub fn update(&mut self, key: u64, change: impl FnOnce(&mut V) -> bool) -> Option<bool> {
        if key == EMPTY {
            let keep = change(self.null.as_mut()?);
            if !keep {
                self.null = None;
            }
            return Some(keep);
        }
        let at = self.find(key)?;
        let keep = change(&mut self.slots[at].1);
        if !keep {
            self.remove_at(at);
        }
        Some(keep)
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if key == EMPTY {
            return self.null.take();
        }
        let at = self.find(key)?;
        let value = self.slots[at].1;
        self.remove_at(at);
        Some(value)
    }

    /// Empties slot `hole`, then closes the gap: each later entry of the
    /// run whose probe path passes through the hole moves into it, leaving
    /// a hole behind.
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        let mut at = hole;
        loop {
            at = (at + 1) & mask;
            let key = self.slots[at].0;
            if key == EMPTY {
                break;
            }
            let from_home = at.wrapping_sub(self.home(key)) & mask;
            if from_home >= at.wrapping_sub(hole) & mask {
                self.slots[hole] = self.slots[at];
                hole = at;
            }
        }
        self.slots[hole] = (EMPTY, V::default());
        self.len -= 1;
    }

    /// Removes every entry `dead` says is, passing each to `gone`.
    pub fn remove_where(&mut self, dead: impl Fn(&V) -> bool, mut gone: impl FnMut(V)) {
        let keys: Vec<u64> = self
            .slots
            .iter()
            .filter(|(key, value)| *key != EMPTY && dead(value))
            .map(|(key, _)| *key)
            .collect();
        for key in keys {
            if let Some(value) = self.remove(key) {
                gone(value);
            }
        }
        if let Some(value) = self.null.take_if(|value| dead(value)) {
            gone(value);
        }
    }

    /// Room for one more entry, keeping the map at most half full so probe
    /// runs stay a slot or two long.
    fn make_room(&mut self) {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
    }

    #[cold]
    fn grow(&mut self) {
        let room = (self.slots.len() * 2).max(16);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, V::default()); room]);
        self.shift = 64 - room.trailing_zeros();
        self.len = 0;
        for (key, value) in old.into_iter().filter(|(key, _)| *key != EMPTY) {
            self.insert(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn agrees_with_a_std_map_through_random_inserts_and_removes() {
        let mut ours = PtrMap::new();
        let mut theirs = HashMap::new();
        // A small key space of 2 MiB-aligned addresses, so that keys collide,
        // runs wrap around the end and removals shift entries back.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..200_000u64 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let key = (state % 512) << 21;
            if state & (1 << 40) == 0 {
                assert_eq!(ours.insert(key, step), theirs.insert(key, step), "{key:#x}");
            } else if state & (1 << 41) == 0 {
                let mut seen = None;
                ours.update(key, |value| {
                    seen = Some(*value);
                    true
                });
                assert_eq!(seen, theirs.get(&key).copied(), "{key:#x}");
            } else {
                assert_eq!(ours.remove(key), theirs.remove(&key), "{key:#x}");
            }
            assert_eq!(ours.len + usize::from(ours.null.is_some()), theirs.len());
        }
        for (key, value) in theirs {
            assert_eq!(ours.remove(key), Some(value), "{key:#x}");
        }
        assert_eq!(ours.len, 0);
    }

    #[test]
    fn key_zero_is_an_ordinary_key() {
        let mut map = PtrMap::new();
        assert_eq!(map.remove(0), None);
        assert_eq!(map.insert(0, 7u64), None);
        assert_eq!(map.insert(0, 8), Some(7));
        assert_eq!(map.remove(0), Some(8));
        assert_eq!(map.remove(0), None);
    }

    #[test]
    fn remove_where_takes_exactly_the_matching_entries() {
        let mut map = PtrMap::new();
        for key in 0..100u64 {
            map.insert(key << 21, key);
        }
        let mut gone = Vec::new();
        map.remove_where(|v| v % 3 == 0, |v| gone.push(v));
        gone.sort_unstable();
        assert_eq!(gone, (0..100).filter(|v| v % 3 == 0).collect::<Vec<_>>());
        for key in 0..100u64 {
            assert_eq!(map.remove(key << 21).is_some(), key % 3 != 0, "{key}");
        }
        assert_eq!(map.len, 0);
    }
}
