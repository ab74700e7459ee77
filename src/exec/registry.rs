//! The handle table every executor keeps: its buffers and kernels by id, and the operation
//! counters. Executors differ in what a buffer or a kernel is, not in how they are found.

use super::{BufferId, Counters, ExecError, KernelId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bits of a handle that count within one registry; the bits above hold the registry's serial.
const COUNTER_BITS: u32 = 40;
const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// Serial of the next registry (process-wide), so that handles of two executors never alias:
/// a handle passed to the wrong executor is [`ExecError::UnknownBuffer`] / `UnknownKernel`,
/// not another executor's buffer. (It wraps only after 2^24 executors.)
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// Buffers `B` and kernels `K` by handle; handles are never reused within a registry and differ
/// between registries (registry serial in the high bits, a counter in the low 40).
pub(crate) struct Registry<B, K> {
    buffers: HashMap<u64, B>,
    kernels: HashMap<u64, K>,
    serial: u64,
    next_id: u64,
    /// What the executor did so far.
    pub(crate) counters: Counters,
}

impl<B, K> Registry<B, K> {
    pub(crate) fn new() -> Self {
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed) & (u64::MAX >> COUNTER_BITS);
        Registry {
            buffers: HashMap::new(),
            kernels: HashMap::new(),
            serial,
            next_id: 1,
            counters: Counters::default(),
        }
    }

    fn next(&mut self) -> u64 {
        // 2^40 handles per executor are never reached; wrapping keeps this total anyway.
        let id = (self.serial << COUNTER_BITS) | (self.next_id & COUNTER_MASK);
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    /// Registers a new buffer (counted as an allocation).
    pub(crate) fn add_buffer(&mut self, buffer: B) -> BufferId {
        let id = self.next();
        self.buffers.insert(id, buffer);
        self.counters.allocs += 1;
        BufferId(id)
    }

    pub(crate) fn buffer(&self, id: BufferId) -> Result<&B, ExecError> {
        self.buffers.get(&id.0).ok_or(ExecError::UnknownBuffer(id))
    }

    pub(crate) fn buffer_mut(&mut self, id: BufferId) -> Result<&mut B, ExecError> {
        self.buffers
            .get_mut(&id.0)
            .ok_or(ExecError::UnknownBuffer(id))
    }

    /// Two distinct buffers, the first shared and the second exclusive (`None` when `a == b`,
    /// which the caller handles within one buffer).
    pub(crate) fn pair_mut(
        &mut self,
        a: BufferId,
        b: BufferId,
    ) -> Result<Option<(&B, &mut B)>, ExecError> {
        self.buffer(a)?;
        self.buffer(b)?;
        if a == b {
            return Ok(None);
        }
        match self.buffers.get_disjoint_mut([&a.0, &b.0]) {
            [Some(x), Some(y)] => Ok(Some((&*x, y))),
            _ => Err(ExecError::UnknownBuffer(a)),
        }
    }

    /// Unregisters a buffer (counted in `frees`); dropping it releases the memory.
    pub(crate) fn remove_buffer(&mut self, id: BufferId) -> Result<B, ExecError> {
        let b = self
            .buffers
            .remove(&id.0)
            .ok_or(ExecError::UnknownBuffer(id))?;
        self.counters.frees += 1;
        Ok(b)
    }

    pub(crate) fn add_kernel(&mut self, kernel: K) -> KernelId {
        let id = self.next();
        self.kernels.insert(id, kernel);
        KernelId(id)
    }

    pub(crate) fn kernel(&self, id: KernelId) -> Result<&K, ExecError> {
        self.kernels.get(&id.0).ok_or(ExecError::UnknownKernel(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_of_two_registries_differ() {
        let mut a: Registry<u8, u8> = Registry::new();
        let mut b: Registry<u8, u8> = Registry::new();
        let (ba, bb) = (a.add_buffer(1), b.add_buffer(2));
        assert_ne!(ba, bb);
        assert!(matches!(b.buffer(ba), Err(ExecError::UnknownBuffer(id)) if id == ba));
        let (ka, kb) = (a.add_kernel(1), b.add_kernel(2));
        assert_ne!(ka, kb);
        assert!(matches!(a.kernel(kb), Err(ExecError::UnknownKernel(id)) if id == kb));
        assert_eq!(*a.buffer(ba).unwrap(), 1);
    }
}
