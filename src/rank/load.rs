//! Load-back: host-only nodes come back into pages with their recorded owners, layer by
//! layer, with a handle that says when each layer is ready.

use super::*;

/// A load-back in flight (step 2 of [`RankCache::serve`]): one executor event per layer, recorded
/// once that layer's copies are enqueued, so the work that reads layer `l` (attention, or
/// here materialisation) waits for layer `l` only, while later layers still load on the
/// executor's load stream, as SGLang's `layer_transfer_counter` lets a layer's forward wait
/// for its KV ([`RankCache::set_layer_waits`]; without it one event marks every layer).
/// Waiting is a device-side wait (no host synchronisation): the load path still reads
/// nothing back. Dropping the handle orders the cache's stream after the whole load and
/// gives the events back to the executor's pool.
pub struct LoadHandle {
    exec: Arc<dyn Executor>,
    layers: Vec<EventId>,
    /// Whether the load recorded this rank's per-layer interprocess fence
    /// (`src/rank/fence.rs`).
    pub(super) signalled: bool,
    /// The peers' per-layer fences of the step that loaded this (their loads of the same
    /// nodes), waited for with each layer: where peers read through executors of their own.
    pub(super) peers: Option<super::fence::PeerLayerFence>,
}

impl LoadHandle {
    /// Layers the load covers.
    pub fn layers(&self) -> u32 {
        self.layers.len() as u32
    }

    /// Makes work enqueued from now on wait until layer `layer` has loaded (in a group of
    /// processes that fences per layer, on every rank). A layer outside the load is an
    /// error.
    pub fn wait_layer(&self, layer: u32) -> Result<(), crate::exec::ExecError> {
        self.exec.wait_event(self.event(layer)?)?;
        match &self.peers {
            Some(peers) => peers.wait(layer, None),
            None => Ok(()),
        }
    }

    /// [`LoadHandle::wait_layer`] for work the engine enqueues on its own `stream` (its
    /// attention's; a raw `CUstream` handle, as in [`Executor::follow_stream`]): that work
    /// waits on the device until layer `layer` has loaded, while later layers still load,
    /// with no host synchronisation. The host executor has nothing to order (its copies ran
    /// before the load returned).
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of the cache's device context (on CUDA a `CUstream`
    /// of the device's primary context, or 0): the driver dereferences the handle.
    pub unsafe fn wait_layer_on(
        &self,
        layer: u32,
        stream: u64,
    ) -> Result<(), crate::exec::ExecError> {
        let event = self.event(layer)?;
        // SAFETY: the caller's contract, passed on.
        unsafe { self.exec.wait_event_on(event, stream) }?;
        match &self.peers {
            Some(peers) => peers.wait(layer, Some(stream)),
            None => Ok(()),
        }
    }

    fn event(&self, layer: u32) -> Result<EventId, crate::exec::ExecError> {
        self.layers
            .get(layer as usize)
            .copied()
            .ok_or_else(|| crate::exec::ExecError::Config {
                name: "layer",
                value: layer.to_string(),
                reason: format!("the load covers {} layers", self.layers.len()),
            })
    }

    /// Makes work enqueued from now on wait until every layer has loaded: the last layer's
    /// event, since the layers load in order on one stream.
    pub fn wait_all(&self) -> Result<(), crate::exec::ExecError> {
        match self.layers() {
            0 => Ok(()),
            n => self.wait_layer(n - 1),
        }
    }
}

impl Drop for LoadHandle {
    /// Work enqueued after the handle is gone (releases, poison fills, the next request's
    /// writes to these pages) runs after the whole load; then the events go back to the
    /// executor's pool.
    fn drop(&mut self) {
        if let Err(e) = self.wait_all() {
            tracing::warn!("a load's last layer could not be waited for: {e}");
        }
        let distinct: BTreeSet<EventId> = self.layers.iter().copied().collect();
        for e in distinct {
            self.exec.release_event(e);
        }
    }
}

impl RankCache {
    /// Loads host-only nodes back: one allocation with the concatenated `page_owners`,
    /// evicting as the compute path does on a shortage (lane-targeted, then LRU), then a
    /// miss. This rank copies the pages it owns; nothing is read back from the device.
    /// Returns the new pages, or `None` when the load degraded to a miss. SGLang:
    /// `HiRadixCache.init_load_back` / `HiCacheController.load`. `signal`: a layer-wise
    /// load records the per-layer fence for peers in other processes, where the group has
    /// one (a step's loads, whose readers wait per layer).
    pub(super) fn load_back(
        &mut self,
        nodes: &[NodeId],
        stats: &mut RequestStats,
        layer_wise: bool,
        signal: bool,
    ) -> Result<Option<(Vec<PageId>, LoadHandle)>, ClusterError> {
        let metas: Vec<&NodeMetadata> = nodes
            .iter()
            .map(|&id| {
                self.tree
                    .node(id)?
                    .host()
                    .ok_or(TreeError::NotBackedUp { node: id })
            })
            .collect::<Result<_, TreeError>>()?;
        let owners = NodeMetadata::concat(metas)?.page_owners().to_vec();
        let plain = self.config.fault == Some(Fault::PlainAllocOnLoad);
        // The same evictions as for computed pages, in the same order: a miss here would
        // only make the compute path evict the same nodes to recompute these pages.
        let Some(mut run) = self.alloc_evicting(&owners, plain, stats)? else {
            return Ok(None);
        };
        let shift = self.config.fault == Some(Fault::GranuleShiftOnLoad);
        if shift {
            // Each granule's pages move one rank on: sequence page i gets the page of rank
            // (i + 1) % cp, whose local page is the same, so each rank still loads its bytes
            // into its own pool, and readers go to the next rank's.
            let cp = usize::from(self.layout.cp());
            for group in run.chunks_mut(cp) {
                group.rotate_left(1);
            }
        }
        stats.pages_loaded_misowned += owners
            .iter()
            .zip(&run)
            .filter(|&(&o, &p)| self.layout.owner(p).0 != o)
            .count() as u64;

        // This rank moves the pages it owns: host page -> local page of the new owner page.
        let mut at = 0usize;
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for &id in nodes {
            let meta = self
                .tree
                .node(id)?
                .host()
                .ok_or(TreeError::NotBackedUp { node: id })?;
            for (i, host_page) in meta.owned_pages() {
                let slot = self.layout.local(run[at + i]).0;
                // Under the injected fault the owner may be another rank: the bytes land in
                // a slot nobody reads, which is exactly the seed's bug. Two such pages can
                // share this rank's slot; only the first writes it, since a transfer takes
                // each destination page once (on a GPU two would mix their bytes).
                if plain && dst.contains(&slot) {
                    continue;
                }
                src.push(host_page.0);
                dst.push(slot);
            }
            let n = self.tree.node(id)?.num_pages(self.layout.page_size());
            let slice = run[at..at + n].to_vec();
            if plain || shift {
                self.tree.set_device_ignoring_owners(id, slice)?;
            } else {
                self.tree.set_device(id, slice)?;
            }
            at += n;
        }
        // Layer by layer on the load stream when the reader waits per layer, each layer
        // followed by its event, so a layer's reader waits for that layer only; else one
        // transfer, one event for every layer.
        let layers = self.pools.geometry().layers;
        // Where peers read through executors of their own and wait per layer, each layer
        // also records this rank's per-layer fence (`src/rank/fence.rs`).
        let signals = match (&self.fences, signal) {
            (Some(fences), true) if layer_wise => fences.layer_signals(),
            _ => Vec::new(),
        };
        let mut handle = LoadHandle {
            exec: self.exec.clone(),
            layers: Vec::with_capacity(layers as usize),
            signalled: !signals.is_empty(),
            peers: None,
        };
        stats.bytes_h2d += self.transfer(
            Direction::HostToDevice,
            &src,
            &dst,
            0..layers,
            if layer_wise {
                On::LayerWise(&mut handle.layers, &signals)
            } else {
                On::Cache(Some(&mut handle.layers))
            },
        )?;
        Ok(Some((run, handle)))
    }
}
