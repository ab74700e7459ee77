//! [`RankView`]: one rank's handle on an executor that several ranks share (ranks as threads
//! of one process on one device), with operation counters of its own.
//!
//! Counters are how a path proves it did not stall the device (`load_path_syncs` must be 0).
//! An executor's own counters add up every caller's work, so with ranks on threads a rank's
//! load path would be charged for its peers' read-backs and synchronisations. Each view
//! counts only what its rank did: it takes what the shared executor counted during each of
//! its calls, under one lock all views of that executor hold around their calls (the
//! executors already serialise their calls, so this costs no parallelism).

use super::{
    Backend, BufferId, CopyRegion, Counters, DmaMode, EventId, ExecError, Executor, KernelArg,
    KernelArtifact, KernelId, LaunchConfig, LoadOp, MemKind,
};
use std::sync::{Arc, Mutex, MutexGuard};

/// One rank's view of a shared executor. See the module documentation.
pub struct RankView {
    inner: Arc<dyn Executor>,
    gate: Arc<Mutex<()>>,
    mine: Mutex<Counters>,
}

impl RankView {
    /// `n` views of `exec`, one per rank.
    pub fn split(exec: Arc<dyn Executor>, n: usize) -> Vec<Arc<dyn Executor>> {
        let gate = Arc::new(Mutex::new(()));
        (0..n)
            .map(|_| {
                Arc::new(RankView {
                    inner: exec.clone(),
                    gate: gate.clone(),
                    mine: Mutex::new(Counters::default()),
                }) as Arc<dyn Executor>
            })
            .collect()
    }

    fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `op` on the shared executor and charges this view what it counted meanwhile.
    fn counted<T>(&self, op: impl FnOnce(&dyn Executor) -> T) -> T {
        let _gate = Self::lock(&self.gate);
        let before = self.inner.counters();
        let out = op(self.inner.as_ref());
        let d = self.inner.counters().since(&before);
        let mut m = self.mine.lock().unwrap_or_else(|p| p.into_inner());
        *m = m.plus(&d);
        out
    }
}

impl Executor for RankView {
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn compute_capability(&self) -> Option<(u32, u32)> {
        self.inner.compute_capability()
    }
    fn runs_emulated_kernels(&self) -> bool {
        self.inner.runs_emulated_kernels()
    }
    fn multiprocessors(&self) -> Option<u32> {
        self.inner.multiprocessors()
    }
    fn alloc(&self, kind: MemKind, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        self.counted(|e| e.alloc(kind, bytes, fill))
    }
    fn free(&self, buffer: BufferId) -> Result<(), ExecError> {
        self.counted(|e| e.free(buffer))
    }
    fn alloc_shareable(&self, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        self.counted(|e| e.alloc_shareable(bytes, fill))
    }
    fn export(&self, buffer: BufferId) -> Result<Vec<u8>, ExecError> {
        self.counted(|e| e.export(buffer))
    }
    fn import(&self, handle: &[u8]) -> Result<BufferId, ExecError> {
        self.counted(|e| e.import(handle))
    }
    fn seal_shareable(&self, buffer: BufferId) -> Result<(), ExecError> {
        self.inner.seal_shareable(buffer)
    }
    unsafe fn adopt(&self, addr: u64, bytes: usize) -> Result<BufferId, ExecError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.adopt(addr, bytes) }
    }
    unsafe fn follow_stream(&self, stream: u64) -> Result<(), ExecError> {
        // SAFETY: as above.
        unsafe { self.inner.follow_stream(stream) }
    }
    unsafe fn lead_stream(&self, stream: u64) -> Result<(), ExecError> {
        // SAFETY: as above.
        unsafe { self.inner.lead_stream(stream) }
    }
    fn peer_mapping(&self) -> Option<&'static str> {
        self.inner.peer_mapping()
    }
    fn maps_in_process(&self) -> bool {
        self.inner.maps_in_process()
    }
    fn size(&self, buffer: BufferId) -> Result<usize, ExecError> {
        self.inner.size(buffer)
    }
    fn address(&self, buffer: BufferId) -> Result<super::Address, ExecError> {
        self.inner.address(buffer)
    }
    fn upload(&self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), ExecError> {
        self.counted(|e| e.upload(buffer, offset, data))
    }
    fn read(&self, buffer: BufferId, offset: u64, out: &mut [u8]) -> Result<(), ExecError> {
        self.counted(|e| e.read(buffer, offset, out))
    }
    unsafe fn load_kernel(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the inner executor's.
        self.counted(|e| unsafe { e.load_kernel(artifact) })
    }
    unsafe fn launch_with(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the inner executor's.
        self.counted(|e| unsafe { e.launch_with(kernel, config, args, unsigned_ok) })
    }
    fn copy_regions(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
    ) -> Result<(), ExecError> {
        self.counted(|e| e.copy_regions(src, dst, regions))
    }
    fn copy_regions_with(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
        mode: DmaMode,
    ) -> Result<(), ExecError> {
        self.counted(|e| e.copy_regions_with(src, dst, regions, mode))
    }
    fn batched_copies(&self) -> bool {
        self.inner.batched_copies()
    }
    fn fill(&self, buffer: BufferId, ranges: &[(u64, u64)], byte: u8) -> Result<(), ExecError> {
        self.counted(|e| e.fill(buffer, ranges, byte))
    }
    fn synchronize(&self) -> Result<(), ExecError> {
        self.counted(|e| e.synchronize())
    }
    fn counters(&self) -> Counters {
        *self.mine.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn record_event(&self) -> Result<EventId, ExecError> {
        self.counted(|e| e.record_event())
    }
    fn load_layers(
        &self,
        layers: &[Vec<LoadOp<'_>>],
        signals: &[&[EventId]],
    ) -> Result<Vec<EventId>, ExecError> {
        self.counted(|e| e.load_layers(layers, signals))
    }
    fn backup(&self, ops: &[LoadOp<'_>]) -> Result<EventId, ExecError> {
        self.counted(|e| e.backup(ops))
    }
    fn event_done(&self, event: EventId) -> Result<bool, ExecError> {
        self.counted(|e| e.event_done(event))
    }
    fn wait_event(&self, event: EventId) -> Result<(), ExecError> {
        self.counted(|e| e.wait_event(event))
    }
    unsafe fn wait_event_on(&self, event: EventId, stream: u64) -> Result<(), ExecError> {
        // SAFETY: the caller's contract, passed on.
        self.counted(|e| unsafe { e.wait_event_on(event, stream) })
    }
    fn release_event(&self, event: EventId) {
        self.counted(|e| e.release_event(event))
    }
    fn shared_event(&self) -> Result<(EventId, Vec<u8>), ExecError> {
        self.counted(|e| e.shared_event())
    }
    fn record_shared(&self, event: EventId) -> Result<(), ExecError> {
        self.counted(|e| e.record_shared(event))
    }
    fn open_shared_event(&self, handle: &[u8]) -> Result<EventId, ExecError> {
        self.counted(|e| e.open_shared_event(handle))
    }
    fn sync_event(&self, event: EventId) -> Result<(), ExecError> {
        self.counted(|e| e.sync_event(event))
    }
    fn inject_launch_failure(&self) {
        let _gate = Self::lock(&self.gate);
        self.inner.inject_launch_failure()
    }
    fn disarm_launch_failure(&self) -> bool {
        let _gate = Self::lock(&self.gate);
        self.inner.disarm_launch_failure()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{HostExecutor, HostOptions};

    #[test]
    fn each_view_counts_only_its_own_calls() {
        let shared: Arc<dyn Executor> = Arc::new(HostExecutor::new(HostOptions::default()));
        let views = RankView::split(shared.clone(), 2);
        let b = views[0].alloc(MemKind::Device, 64, 0).unwrap();
        let mut out = [0u8; 8];
        views[1].read(b, 0, &mut out).unwrap();
        views[1].synchronize().unwrap();
        assert_eq!(
            (views[0].counters().allocs, views[0].counters().reads),
            (1, 0)
        );
        assert_eq!(views[1].counters().stalls(), 2);
        assert_eq!(shared.counters().stalls(), 3);
        views[0].free(b).unwrap();
    }
}
