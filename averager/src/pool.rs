//! Reusable f32 buffers. A round needs several buffers the size of the model (the flattened
//! vector, staging for each sender, deltas); fresh ones cost a page fault per 4 KiB every round
//! (the allocator hands large blocks back to the OS), which measured 10-15% of a round's time.
//! The pool keeps freed buffers for the next round, up to a byte limit.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use starling_node::lock::lock;

/// Free buffers, best fit first, holding at most `limit` bytes.
#[derive(Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<f32>>>,
    limit: AtomicUsize,
}

impl BufPool {
    /// Sets the most bytes the pool keeps between uses, dropping buffers over it.
    pub fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
        let mut free = lock(&self.free);
        // Keep the largest buffers (the ones rounds need), drop the rest.
        free.sort_by_key(|v| std::cmp::Reverse(v.capacity()));
        let mut held = 0usize;
        free.retain(|v| {
            held += v.capacity() * 4;
            held <= bytes
        });
    }

    /// Bytes held in free buffers.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        lock(&self.free).iter().map(|v| v.capacity() * 4).sum()
    }

    /// A zeroed buffer of `len` elements: the smallest free one that fits (and is at most twice
    /// as large, so small requests leave model-sized buffers alone), or a new one. (Every
    /// caller overwrites what it takes: they use [`BufPool::take_dirty`].)
    #[cfg(test)]
    pub fn take(self: &Arc<Self>, len: usize) -> PoolBuf {
        let mut b = self.take_dirty(len);
        b.fill(0.0);
        b
    }

    /// Like [`Self::take`] but not zeroed: a reused buffer keeps whatever values it held (every
    /// element is still an initialized f32). For buffers the caller overwrites completely before
    /// reading, which saves a pass over model-sized memory.
    pub fn take_dirty(self: &Arc<Self>, len: usize) -> PoolBuf {
        let reused = {
            let mut free = lock(&self.free);
            free.iter()
                .enumerate()
                .filter(|(_, v)| v.capacity() >= len && v.capacity() <= len.max(1024) * 2)
                .min_by_key(|(_, v)| v.capacity())
                .map(|(i, _)| i)
                .map(|best| free.swap_remove(best))
        };
        let mut vec = reused.unwrap_or_default();
        vec.truncate(len);
        vec.resize(len, 0.0);
        PoolBuf {
            vec,
            pool: self.clone(),
        }
    }

    /// A pooled copy of `data`.
    pub fn copy_of(self: &Arc<Self>, data: &[f32]) -> PoolBuf {
        // Overwritten whole: no need to zero it first.
        let mut b = self.take_dirty(data.len());
        b.copy_from_slice(data);
        b
    }

    fn give(&self, vec: Vec<f32>) {
        let bytes = vec.capacity() * 4;
        if bytes == 0 {
            return;
        }
        let mut free = lock(&self.free);
        let held: usize = free.iter().map(|v| v.capacity() * 4).sum();
        if held + bytes <= self.limit.load(Ordering::Relaxed) {
            free.push(vec);
        }
    }
}

/// A buffer that goes back to its pool when dropped.
pub(crate) struct PoolBuf {
    vec: Vec<f32>,
    pool: Arc<BufPool>,
}

impl Deref for PoolBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.vec
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.vec
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.vec));
    }
}

impl std::fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PoolBuf({} elements)", self.vec.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_zeroed_and_bounded() {
        let pool = Arc::new(BufPool::default());
        pool.set_limit(10_000 * 4);
        let mut a = pool.take(6000);
        a.fill(7.0);
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.held(), 6000 * 4);
        // Reused (same allocation), and zeroed.
        let b = pool.take(5000);
        assert_eq!(b.as_ptr(), ptr);
        assert!(b.iter().all(|x| *x == 0.0));
        assert_eq!(b.len(), 5000);
        // Two buffers over the limit: only what fits is kept.
        let c = pool.take(6000);
        drop(b);
        drop(c);
        assert_eq!(pool.held(), 6000 * 4);
        // A much smaller request leaves the big buffer in the pool.
        let small = pool.take(10);
        assert_eq!(pool.held(), 6000 * 4);
        drop(small);
        // A lower limit trims at once.
        pool.set_limit(100);
        assert_eq!(pool.held(), 0);
        let copy = pool.copy_of(&[1.0, 2.0]);
        assert_eq!(&copy[..], &[1.0, 2.0]);
    }
}
