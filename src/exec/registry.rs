//! The handle table every executor keeps: its buffers and kernels by id, and the operation
//! counters. Executors differ in what a buffer or a kernel is, not in how they are found.

use super::{BufferId, Counters, ExecError, KernelId};
use std::collections::HashMap;

/// Buffers `B` and kernels `K` by handle; handles are never reused.
pub(crate) struct Registry<B, K> {
    buffers: HashMap<u64, B>,
    kernels: HashMap<u64, K>,
    next_id: u64,
    /// What the executor did so far.
    pub(crate) counters: Counters,
}

impl<B, K> Registry<B, K> {
    pub(crate) fn new() -> Self {
        Registry {
            buffers: HashMap::new(),
            kernels: HashMap::new(),
            next_id: 1,
            counters: Counters::default(),
        }
    }

    fn next(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
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

    /// Unregisters a buffer; dropping it releases the memory.
    pub(crate) fn remove_buffer(&mut self, id: BufferId) -> Result<B, ExecError> {
        self.buffers
            .remove(&id.0)
            .ok_or(ExecError::UnknownBuffer(id))
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
