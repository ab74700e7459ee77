//! Whether a replay's pools fit in this machine's memory, checked before they are
//! allocated, so a setting too large is a clear error, not an abort.

use super::cluster_error;
use crate::allocator::BufferSizes;
use crate::cluster::ClusterConfig;
use crate::exec::Backend;
use crate::layout::CpLayout;
/// Bytes of the cluster's kernel-backed lane allocators (one per rank), as
/// `(executor memory, host mirrors)`: each rank's buffers as the allocator sizes them
/// ([`BufferSizes`]), and its host mirror, a 4-byte page id per free page and one bit per page.
pub(super) fn allocator_bytes(layout: &CpLayout) -> (u64, u64) {
    let (cp, pages) = (u64::from(layout.cp()), u64::from(layout.pages()));
    let per_rank = BufferSizes::of(layout).total();
    let mirror = 4 * pages + pages.div_ceil(64) * 8;
    (per_rank.saturating_mul(cp), mirror.saturating_mul(cp))
}

/// What a replay holds in host memory, by part.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct MemoryNeed {
    /// Device pools (host memory only on the CPU executor).
    pub(super) device_pools: u64,
    /// Host pools.
    pub(super) host_pools: u64,
    /// The lane allocators' executor buffers (host memory only on the CPU executor).
    pub(super) allocators: u64,
    /// The lane allocators' host mirrors.
    pub(super) mirrors: u64,
    /// Whether device memory is off the host (CUDA).
    pub(super) on_gpu: bool,
}

impl MemoryNeed {
    pub(super) fn new(
        config: &ClusterConfig,
        backend: Backend,
    ) -> Result<MemoryNeed, crate::Error> {
        let geometry = config.pool_geometry().map_err(cluster_error)?;
        let (device_pools, host_pools) = geometry.pool_bytes(&config.deployment);
        let (allocators, mirrors) = allocator_bytes(&config.layout().map_err(cluster_error)?);
        Ok(MemoryNeed {
            device_pools,
            host_pools,
            allocators,
            mirrors,
            // An open executor is never `Auto`; only CUDA keeps device memory off the host.
            on_gpu: backend == Backend::Cuda,
        })
    }

    /// Host bytes in all: on the CPU the device pools count twice (the dense
    /// materialisation buffers hold at most one device pool's worth).
    pub(super) fn host_bytes(&self) -> u64 {
        let host = self.host_pools.saturating_add(self.mirrors);
        if self.on_gpu {
            host
        } else {
            host.saturating_add(self.device_pools.saturating_mul(2))
                .saturating_add(self.allocators)
        }
    }
}

/// Refuses, before anything is allocated, a replay whose pools and allocator buffers do not
/// fit in the memory available: allocating them would get the process killed without a
/// word. Host pools and the allocators' mirrors are host memory on every backend; on the
/// CPU so are the device pools, the dense materialisation buffers (at most one device
/// pool's worth) and the allocators' executor buffers.
pub(super) fn check_memory(config: &ClusterConfig, backend: Backend) -> Result<(), crate::Error> {
    let need = MemoryNeed::new(config, backend)?;
    let Some(available) = available_memory() else {
        return Ok(());
    };
    if need.host_bytes() <= available {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let parts = if need.on_gpu {
        format!(
            "pinned host pools {:.1} GiB, lane allocator mirrors {:.1} GiB",
            gib(need.host_pools),
            gib(need.mirrors)
        )
    } else {
        format!(
            "device pools {:.1} GiB and as much again for materialisation, host pools {:.1} \
             GiB, lane allocators {:.1} GiB",
            gib(need.device_pools),
            gib(need.host_pools),
            gib(need.allocators.saturating_add(need.mirrors))
        )
    };
    Err(crate::Error::Usage(format!(
        "this replay needs about {:.1} GiB of host memory ({parts}) but {:.1} GiB is \
         available: lower --layers, --device-pages or --host-pages",
        gib(need.host_bytes()),
        gib(available)
    )))
}

/// Refuses, before anything is allocated, one rank of `config` (an engine process's
/// `RankCache`) whose pools, allocator and materialisation buffers do not fit in the memory
/// available: the same check as the replay's, for one rank, in the words of an API (`what`
/// names the arguments to lower). A rank holds its share of the pools and allocators, and a
/// materialisation buffer as large as the whole sequence (every owner's pages).
pub fn check_rank_memory(
    config: &ClusterConfig,
    backend: Backend,
    what: &str,
) -> Result<(), crate::Error> {
    let all = MemoryNeed::new(config, backend)?;
    let cp = u64::from(config.deployment.cp);
    let share = |b: u64| b.div_ceil(cp);
    let host = share(all.host_pools).saturating_add(share(all.mirrors));
    let need = if all.on_gpu {
        host
    } else {
        host.saturating_add(share(all.device_pools))
            .saturating_add(all.device_pools)
            .saturating_add(share(all.allocators))
    };
    let Some(available) = available_memory() else {
        return Ok(());
    };
    if need <= available {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    Err(crate::Error::Usage(format!(
        "this rank needs about {:.1} GiB of host memory but {:.1} GiB is available: lower \
         {what}",
        gib(need),
        gib(available)
    )))
}

/// `MemAvailable` of `/proc/meminfo` in bytes; `None` where it cannot be read.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
