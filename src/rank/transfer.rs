//! The transfer path of a rank: its page pairs between its host and device pools, by the
//! transfer kernel (the device pools as page tables) or by DMA (regions of the cache's own
//! layer-major pools, or of an engine's memory layer by layer through its page table), and
//! the checks every transfer passes first.

use super::{ClusterError, RankCache};
use crate::exec::{EventId, LoadOp};
use crate::kernels::{
    clamp_layer_range, layer_range_args, transfer_args, transfer_regions, transfer_regions_at,
    Direction, PoolShape,
};
use std::ops::Range;

/// Where a transfer runs, and what marks its end.
pub(super) enum On<'a> {
    /// The cache's stream, in order with everything else; with a list, one event marking
    /// every layer is pushed there once per layer.
    Cache(Option<&'a mut Vec<EventId>>),
    /// A load with a reader per layer: a layer at a time on the executor's load stream
    /// ([`crate::exec::Executor::load_layers`]), or a few when the pages are few
    /// ([`crate::kernels::KernelSpec::layers_per_launch`]), each launch followed by its
    /// event, pushed there once per layer it covers, and by the recordings of the given
    /// interprocess events of its layers (one per layer, or none).
    LayerWise(&'a mut Vec<EventId>, &'a [EventId]),
    /// A backup: on the executor's backup stream ([`crate::exec::Executor::backup`]); the
    /// event after it is put there.
    Backup(&'a mut Option<EventId>),
}

impl RankCache {
    /// Copies this rank's page pairs for every buffer kind and every layer of `layers`
    /// (clamped to the pools' layers; `0..layers` for all of them), with the transfer kernel
    /// or by DMA as the deployment says, where `on` says; returns bytes moved. The pairs are
    /// checked and uploaded once either way: by the cache's stream into its scratch, or, for
    /// work on a stream of its own, by that stream into buffers only such work uses (so the
    /// cache's stream never rewrites page ids it still reads).
    pub(super) fn transfer(
        &mut self,
        dir: Direction,
        src: &[u32],
        dst: &[u32],
        layers: Range<u32>,
        on: On<'_>,
    ) -> Result<u64, ClusterError> {
        let g = self.pools.geometry();
        let (first_layer, layer_count) = layer_range_args(&layers);
        let moved = clamp_layer_range(first_layer, layer_count, g.layers);
        if src.is_empty() {
            match on {
                On::Cache(None) => {}
                On::Cache(Some(events)) | On::LayerWise(events, _) => {
                    let all = self.exec.record_event()?;
                    events.extend(moved.map(|_| all));
                }
                On::Backup(event) => *event = Some(self.exec.record_event()?),
            }
            return Ok(0);
        }
        let pools = PoolShape {
            layers: g.layers,
            device_pages: g.local_pages,
            host_pages: g.host_pages,
        };
        check_transfer_pages(dir, usize::from(self.rank.0), src, dst, &pools)?;
        let dma = self.config.deployment.transfer_path.dma_mode();
        // Layer by layer when the load has a consumer that waits for each layer (on the
        // executor's load stream); otherwise one step for every layer.
        let layer_wise = matches!(on, On::LayerWise(..));
        // The page ids of work on a stream of its own are its own, written first on that
        // stream; every other transfer's go through the cache's stream's scratch.
        let own_ids = (dma.is_none() && !matches!(on, On::Cache(_)))
            .then(|| (super::pools::u32_bytes(src), super::pools::u32_bytes(dst)));
        let pairs = match (&own_ids, &on, dma) {
            (_, _, Some(_)) => None,
            (Some(_), On::Backup(_), None) => Some(self.pools.backup_pairs(src.len())?),
            (Some(_), _, None) => Some(self.pools.load_pairs(src.len())?),
            (None, _, None) => Some(self.pools.upload_pairs(src, dst)?),
        };
        let spec = self.config.deployment.transfer(dir);
        // A layer-wise kernel load of few pages takes a few layers a launch (each layer
        // still gets an event: its launch's).
        let per_step = match pairs {
            Some(_) if layer_wise => self
                .kernels
                .transfer(dir)
                .spec
                .layers_per_launch(src.len() as u32),
            _ => 1,
        };
        let steps: Vec<Range<u32>> = if layer_wise {
            moved
                .clone()
                .step_by(per_step as usize)
                .map(|l| l..(l + per_step).min(moved.end))
                .collect()
        } else {
            vec![moved.clone()]
        };
        let buffers = self.config.deployment.model.buffers();
        // (source pool, destination pool) of each buffer, in the spec's descriptor order, for
        // the DMA path over the cache's own layer-major pools; `None` for an engine's memory,
        // reached layer by layer through its page table.
        let ends: Vec<Option<(crate::exec::BufferId, crate::exec::BufferId)>> = buffers
            .iter()
            .map(|&b| {
                let device = self.pools.device(b)?;
                Some(match dir {
                    Direction::HostToDevice => (self.pools.host(b), device),
                    Direction::DeviceToHost => (device, self.pools.host(b)),
                })
            })
            .collect();
        let tables: Vec<_> = buffers
            .iter()
            .map(|&b| self.pools.device_table(b))
            .collect();
        // (device pool's page table, host pool) of each buffer, for the kernel.
        let kernel_ends: Vec<_> = tables
            .iter()
            .zip(buffers)
            .map(|(t, b)| (t, (self.pools.host(b), 0)))
            .collect();
        let mut bytes = 0;
        let mut work: Vec<Vec<LoadOp<'_>>> = Vec::with_capacity(steps.len());
        for step in steps.iter().cloned() {
            let mut ops = Vec::new();
            if let (Some((s, d)), Some((sb, db)), true) = (&own_ids, pairs, work.is_empty()) {
                ops.push(LoadOp::Upload {
                    buffer: sb,
                    offset: 0,
                    data: s,
                });
                ops.push(LoadOp::Upload {
                    buffer: db,
                    offset: 0,
                    data: d,
                });
            }
            match pairs {
                None => {
                    let mode = dma.unwrap_or_default();
                    for ((d, end), (table, b)) in spec
                        .descriptors()
                        .iter()
                        .zip(&ends)
                        .zip(tables.iter().zip(buffers))
                    {
                        if let Some((from, to)) = *end {
                            let regions = transfer_regions(d, src, dst, pools, step.clone());
                            ops.push(LoadOp::Copy {
                                src: from,
                                dst: to,
                                regions,
                                mode,
                            });
                            continue;
                        }
                        // An engine's memory: each layer's pages from its table entry.
                        let host = self.pools.host(b);
                        let stride = u64::from(table.page_stride);
                        for l in clamp_layer_range(step.start, step.len() as u32, g.layers) {
                            let (layer, base) = table.entries[l as usize];
                            let regions =
                                transfer_regions_at(d, src, dst, pools, l..l + 1, |p, _| {
                                    base + u64::from(p) * stride
                                });
                            let (from, to) = match dir {
                                Direction::HostToDevice => (host, layer),
                                Direction::DeviceToHost => (layer, host),
                            };
                            ops.push(LoadOp::Copy {
                                src: from,
                                dst: to,
                                regions,
                                mode,
                            });
                        }
                    }
                }
                Some((sb, db)) => {
                    // One launch moves every buffer.
                    let k = self.kernels.transfer(dir);
                    ops.push(LoadOp::Launch {
                        kernel: k.id,
                        config: k.launch(src.len() as u32, step.len() as u32),
                        args: transfer_args(
                            &kernel_ends,
                            (sb, db),
                            src.len() as u32,
                            pools,
                            layer_range_args(&step),
                        ),
                    });
                }
            }
            bytes += src.len() as u64 * step.len() as u64 * spec.total_page_bytes();
            work.push(ops);
        }
        match on {
            On::LayerWise(events, shared) => {
                // One event a step, given to each of its layers; each layer's interprocess
                // event recorded after its step.
                let signals: Vec<&[EventId]> = if shared.is_empty() {
                    Vec::new()
                } else {
                    steps
                        .iter()
                        .map(|s| &shared[s.start as usize..s.end as usize])
                        .collect()
                };
                let done = self.exec.load_layers(&work, &signals)?;
                for (event, step) in done.into_iter().zip(&steps) {
                    events.extend(step.clone().map(|_| event));
                }
            }
            On::Backup(event) => {
                let ops: Vec<LoadOp<'_>> = work.into_iter().flatten().collect();
                *event = Some(self.exec.backup(&ops)?);
            }
            On::Cache(events) => {
                // On the executor's own stream, in order with everything else; one event
                // marks every layer.
                for op in work.iter().flatten() {
                    op.run(self.exec.as_ref())?;
                }
                if let Some(events) = events {
                    let all = self.exec.record_event()?;
                    events.extend(moved.map(|_| all));
                }
            }
        }
        Ok(bytes)
    }
}

/// Refuses a transfer whose page lists differ in length, name a page outside its pool
/// (`pools`' device pages per rank, host pages), or name one destination page twice (on a GPU
/// the two copies would interleave: `kernels::check_distinct_destinations`).
pub(crate) fn check_transfer_pages(
    dir: Direction,
    rank: usize,
    src: &[u32],
    dst: &[u32],
    pools: &PoolShape,
) -> Result<(), ClusterError> {
    let bad = |what: String| Err(ClusterError::BadTransfer { rank, what });
    if src.len() != dst.len() {
        return bad(format!(
            "{dir} transfer of {} source pages to {} destination pages",
            src.len(),
            dst.len()
        ));
    }
    let [src_pool, dst_pool] = pools.ends(dir);
    for (pages, (pool, cap)) in [(src, src_pool), (dst, dst_pool)] {
        if let Some(p) = pages.iter().find(|&&p| p >= cap) {
            return bad(format!(
                "{dir} transfer names {pool} page {p}, outside the {pool} pool of {cap} pages"
            ));
        }
    }
    if let Err(e) = crate::kernels::check_distinct_destinations(dst) {
        return bad(format!("{dir} transfer: {e}"));
    }
    Ok(())
}
