//! Locks taken whatever a panicking holder left behind.
//!
//! gpumem's holders change their data in steps that each leave it whole,
//! and never hold a lock across an await, so a lock poisoned by a panic
//! (a bug in one request) still guards consistent data: taking it as it is
//! keeps that one failure from failing every later request.

use std::sync::{Mutex, MutexGuard, PoisonError};

pub trait LockExt<T: ?Sized> {
    /// Locks, taking a poisoned lock as it is.
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
