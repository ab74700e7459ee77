//! What shapes a rank's cache (the deployment-wide settings every rank shares), the faults
//! that can be injected on purpose, and the errors a rank reports.

use super::kernels::KernelLoadError;
use super::pools::PoolGeometry;
use crate::allocator::kernel::KernelAllocError;
use crate::allocator::AllocError;
use crate::group::GroupError;
use crate::hicache::host_pool::HostPoolError;
use crate::hicache::tree::TreeError;
use crate::jit::Sanitize;
use crate::kernels::Deployment;
use crate::layout::{CpLayout, Layout, LayoutError, LoadBack};
use crate::metadata::MetadataError;
use std::fmt;
use std::str::FromStr;

/// When device pages are backed up to the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WritePolicy {
    /// Back up every node when it is inserted.
    #[default]
    WriteThrough,
    /// Back up a node only when it is about to be evicted from the device.
    WriteBack,
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteBack => "write_back",
        })
    }
}

impl FromStr for WritePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "write_through" | "write-through" => Ok(WritePolicy::WriteThrough),
            "write_back" | "write-back" => Ok(WritePolicy::WriteBack),
            _ => Err(format!(
                "unknown write policy `{s}` (expected write_through or write_back)"
            )),
        }
    }
}

/// Faults injected on purpose to exercise failure paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The seed's bug: load-back allocates with plain `alloc_pages`, ignoring owners.
    PlainAllocOnLoad,
    /// The seed's bug in the positional layouts' form: a load-back puts sequence page `i`
    /// of each granule on the page of the next rank (`(i + 1) % cp`), while rank `i % cp`
    /// loads its bytes, so the page is read from another rank's slot.
    GranuleShiftOnLoad,
    /// Half of lane 0 is reserved for ever, so lane 0 runs short first.
    LaneExhaustion,
    /// The host pools hold almost nothing, so backups evict host LRU or are skipped.
    HostPoolFull,
    /// One kernel's source is broken before compiling.
    CompileError,
    /// The executor fails one launch (of the request given to [`RankCache::inject_launch_failure`](crate::rank::RankCache::inject_launch_failure)).
    LaunchError,
    /// One storage record read in three is torn first (cut short): refused, a miss.
    StorageTorn,
    /// One storage record read in three has a payload byte flipped first: refused, a miss.
    StorageFlip,
    /// One storage record read in three is replaced first by another deployment's record
    /// under the same key: refused, a miss.
    StorageForeign,
    /// One storage record read in three is served with a byte changed after the store's
    /// checksum passed: only verification catches it (mismatches, exit status 1).
    StorageUnchecked,
    /// One storage read and one write in three fail with an I/O error: each is counted,
    /// the read served as a miss, the record left out; the request goes on.
    StorageIo,
    /// One storage record read in three is replaced first by all but one of its parts, as
    /// when a rank died before writing its part of a split page: refused as incomplete
    /// (counted as torn), a miss.
    StoragePartMissing,
}

impl Fault {
    /// Every fault, for help texts.
    pub const ALL: [Fault; 12] = [
        Fault::PlainAllocOnLoad,
        Fault::GranuleShiftOnLoad,
        Fault::LaneExhaustion,
        Fault::HostPoolFull,
        Fault::CompileError,
        Fault::LaunchError,
        Fault::StorageTorn,
        Fault::StorageFlip,
        Fault::StorageForeign,
        Fault::StorageUnchecked,
        Fault::StorageIo,
        Fault::StoragePartMissing,
    ];

    /// The damage a storage fault does to the records it reads.
    pub fn storage_damage(self) -> Option<crate::storage::Damage> {
        use crate::storage::Damage;
        match self {
            Fault::StorageTorn => Some(Damage::Torn),
            Fault::StorageFlip => Some(Damage::Flip),
            Fault::StorageForeign => Some(Damage::Foreign),
            Fault::StorageUnchecked => Some(Damage::Unchecked),
            Fault::StorageIo => Some(Damage::Io),
            Fault::StoragePartMissing => Some(Damage::PartMissing),
            _ => None,
        }
    }
}

impl Fault {
    /// Whether the fault means anything under `layout`; why not, when it does not.
    pub fn check_layout(self, layout: Layout) -> Result<(), String> {
        if layout.load_back() == LoadBack::RecordedOwners {
            return match self {
                Fault::GranuleShiftOnLoad => Err(format!(
                    "under {layout} a granule is one page, so there is nothing to shift: \
                     plain-alloc-on-load loses the recorded owners there"
                )),
                _ => Ok(()),
            };
        }
        match self {
            Fault::PlainAllocOnLoad => Err(format!(
                "under {layout} ownership is positional and pages are allocated in aligned \
                 groups of one page per rank, from lanes kept in lockstep: a plain allocation \
                 returns the very pages an owner-preserving one does, so there are no owners \
                 to lose"
            )),
            Fault::LaneExhaustion => Err(format!(
                "under {layout} pages are allocated in aligned groups of one page per rank, \
                 from lanes kept in lockstep: one lane cannot run short alone"
            )),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::PlainAllocOnLoad => "plain-alloc-on-load",
            Fault::GranuleShiftOnLoad => "granule-shift-on-load",
            Fault::LaneExhaustion => "lane-exhaustion",
            Fault::HostPoolFull => "host-pool-full",
            Fault::CompileError => "compile-error",
            Fault::LaunchError => "launch-error",
            Fault::StorageTorn => "storage-torn",
            Fault::StorageFlip => "storage-flip",
            Fault::StorageForeign => "storage-foreign",
            Fault::StorageUnchecked => "storage-unchecked",
            Fault::StorageIo => "storage-io",
            Fault::StoragePartMissing => "storage-part-missing",
        })
    }
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Fault::ALL
            .into_iter()
            .find(|f| f.to_string() == s)
            .ok_or_else(|| {
                let names: Vec<String> = Fault::ALL.iter().map(Fault::to_string).collect();
                format!(
                    "unknown fault `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// Everything that shapes a cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Model shapes, page size, CP degree and kernel launch shapes.
    pub deployment: Deployment,
    /// Layers per buffer kind.
    pub layers: u32,
    /// Logical device pages (the layout's page count, null page included).
    pub device_pages: u32,
    /// Host pages per rank.
    pub host_pages: u32,
    /// Backup policy.
    pub policy: WritePolicy,
    /// A fault to inject, if any.
    pub fault: Option<Fault>,
    /// Sanitizer build of host-emulation kernels.
    pub sanitize: Sanitize,
}

/// Host pages per rank left when [`Fault::HostPoolFull`] is injected.
const HOST_PAGES_UNDER_FAULT: u32 = 2;

impl ClusterConfig {
    /// The layout of the device pages, allocated in the deployment layout's granule (an
    /// invalid page size, CP degree or page count is an error).
    pub fn layout(&self) -> Result<CpLayout, ClusterError> {
        let dep = &self.deployment;
        if let Some(fault) = self.fault {
            fault.check_layout(dep.layout).map_err(|why| {
                ClusterError::Config(format!("fault {fault} under {}: {why}", dep.layout))
            })?;
        }
        Ok(
            CpLayout::new(u32::from(dep.cp), dep.page_size, self.device_pages)?
                .with_granule(dep.layout.granule_pages(dep.cp))?,
        )
    }

    /// The pools a cluster of this configuration allocates: each rank's share of the device
    /// pages, and its host pages (fewer under [`Fault::HostPoolFull`]). Known before anything
    /// is allocated, so a caller can check them against the memory it has.
    pub fn pool_geometry(&self) -> Result<PoolGeometry, ClusterError> {
        let host_pages = if self.fault == Some(Fault::HostPoolFull) {
            self.host_pages.min(HOST_PAGES_UNDER_FAULT)
        } else {
            self.host_pages
        };
        Ok(PoolGeometry {
            layers: self.layers,
            local_pages: self.layout()?.local_pages_per_rank(),
            host_pages,
        })
    }
}

/// Why a rank (or the cluster of them) could not serve a request (its state is then
/// unchanged).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Invalid layout settings.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The storage tier failed (its file system, not a refused record: those are misses).
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
    /// The kernels could not be made ready.
    #[error(transparent)]
    Kernels(#[from] KernelLoadError),
    /// An executor operation failed (for example a failed launch).
    #[error(transparent)]
    Exec(#[from] crate::exec::ExecError),
    /// An allocator misuse (a bug, never a shortage).
    #[error("allocator: {0}")]
    Alloc(#[from] AllocError),
    /// The kernel-backed allocator failed (a launch, an upload, or a misuse).
    #[error("allocator: {0}")]
    KernelAlloc(#[from] KernelAllocError),
    /// A host pool misuse (a bug, never a shortage: backups check the free counts first).
    #[error(transparent)]
    HostPool(#[from] HostPoolError),
    /// A tree operation was refused.
    #[error(transparent)]
    Tree(#[from] TreeError),
    /// Invalid metadata was produced.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The rank replicas, which see the same calls, decided differently (a bug).
    #[error("rank replicas diverged: {what}")]
    ReplicasDiverged {
        /// How.
        what: String,
    },
    /// A rank's device lane stacks differ from its allocator's host mirror.
    #[error("rank {rank}: {source}")]
    DeviceLanes {
        /// The rank.
        rank: u8,
        /// The difference (or why the lanes could not be read).
        source: KernelAllocError,
    },
    /// A pool cannot hold what a request needs even after evicting everything it may.
    #[error("{what}: raise {flag}")]
    PoolTooSmall {
        /// What did not fit.
        what: String,
        /// The option that sizes the pool.
        flag: &'static str,
        /// Pages the request needs at once.
        needed: u64,
        /// Pages it could have: free ones once everything unlocked is evicted, plus the ones
        /// it already holds (lanes can still be short when this is not below `needed`).
        available: u64,
    },
    /// Settings that cannot work together.
    #[error("invalid cluster setting: {0}")]
    Config(String),
    /// An engine's device buffer that the cache cannot adopt: which one (`device[kv] layer
    /// 3`) and the rule it breaks.
    #[error("engine buffer {what}: {why}")]
    EngineBuffer {
        /// The buffer (and layer).
        what: String,
        /// The rule it breaks.
        why: String,
    },
    /// The CP group failed: a peer's step failed (the request is rolled back on every
    /// rank, [`GroupError::PeerFailed`]), or the group broke (a timeout, a rank that
    /// diverged, left or panicked: nothing more can be served).
    #[error(transparent)]
    Group(#[from] GroupError),
    /// A rank's thread died (it panicked): the group was aborted, and the cluster cannot
    /// serve any more.
    #[error(
        "rank {rank}'s thread died (it panicked) while {what}; the cluster cannot serve any more"
    )]
    RankDied {
        /// The rank.
        rank: usize,
        /// What the cluster was doing.
        what: String,
    },
    /// A rank could not map a peer's pools.
    #[error("rank {rank}: cannot map rank {peer}'s {buffer} pool: {source}")]
    PeerPool {
        /// The rank mapping.
        rank: u8,
        /// The peer.
        peer: u8,
        /// The buffer kind.
        buffer: crate::kernels::BufferKind,
        /// Why.
        source: crate::exec::ExecError,
    },
    /// A rank could not open a peer's fence events (interprocess events, under
    /// [`PeerAccess::Mapped`](crate::rank::PeerAccess::Mapped)).
    #[error("rank {rank}: cannot open rank {peer}'s fence events: {source}")]
    PeerFence {
        /// The rank opening them.
        rank: u8,
        /// The peer.
        peer: u8,
        /// Why.
        source: crate::exec::ExecError,
    },
    /// A peer process reported a failure this rank can only relay (its device lanes disagree
    /// with its mirror, or its step of a request failed first): the peer's own message, and
    /// what kind of error it was, so that every rank takes the same branch on it.
    #[error("rank {rank}: {message}")]
    PeerReported {
        /// The rank that failed.
        rank: usize,
        /// Its message.
        message: String,
        /// What kind of error it was.
        kind: PeerErrorKind,
    },
    /// A rank could not start (its settings, its kernels, its pools, or its peers' pools):
    /// every rank learns of it in the group's first round, so none waits for a rank that
    /// will never serve.
    #[error(
        "rank {rank}: the CP group cannot start: {}",
        crate::group::describe_failures(failures)
    )]
    StartFailed {
        /// The rank reporting it.
        rank: u8,
        /// Each rank that could not start, and why.
        failures: Vec<(u8, String)>,
    },
    /// The ranks were started with settings that cannot serve together (pool sizes, the
    /// deployment and its kernels, the write policy, the layout): compared once at start-up,
    /// so that replicas never drift apart from their first request.
    #[error("rank {rank}: the ranks' configurations differ: {}", differences.join("; "))]
    ConfigDiverged {
        /// The rank reporting it.
        rank: u8,
        /// Each setting that differs, with every rank's value.
        differences: Vec<String>,
    },
    /// The ranks decided one step differently (different prompts, or replicas that drifted):
    /// the step was undone on every rank, and the group goes on.
    #[error(
        "rank {rank}: {step}: the ranks decided differently ({}); the step was undone on \
         every rank",
        describe_groups(groups)
    )]
    Diverged {
        /// The rank reporting it.
        rank: u8,
        /// The step.
        step: String,
        /// The ranks, grouped by what they decided (the largest group first).
        groups: Vec<Vec<u8>>,
    },
    /// A rank ended a request with `ok = false` (its forward failed) or abandoned it while
    /// this rank finished it: every rank abandoned it.
    #[error(
        "rank {rank}: request {request} was abandoned on every rank: rank(s) {} could not \
         finish it",
        by.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    )]
    Abandoned {
        /// The rank reporting it.
        rank: u8,
        /// The request.
        request: usize,
        /// The ranks that did not finish it.
        by: Vec<u8>,
    },
    /// A peer's contribution to a round could not be what the round carries (a length, a
    /// flag): the group's transport is broken or lies. The group was aborted: a replica
    /// that believed it could differ from its peers.
    #[error("rank {rank}: {round}: rank {peer} sent {what}; the group was aborted")]
    Malformed {
        /// The rank reporting it.
        rank: u8,
        /// The round.
        round: String,
        /// The rank whose contribution is malformed.
        peer: u8,
        /// What is wrong with it.
        what: String,
    },
    /// A transfer named a page outside its pool, had unequal page lists, or named one
    /// destination page in two pairs. A bug (the pools hand out only their own pages, each
    /// once), refused before anything moves: the kernel and the DMA path would skip a pair
    /// outside its pool silently and leave the page's old bytes, and on a GPU two pairs
    /// writing one page interleave their sources.
    #[error("rank {rank}: {what}")]
    BadTransfer {
        /// The rank whose pools the transfer is between.
        rank: usize,
        /// What is wrong with it.
        what: String,
    },
}

fn describe_groups(groups: &[Vec<u8>]) -> String {
    let each: Vec<String> = groups
        .iter()
        .map(|g| {
            let ranks: Vec<String> = g.iter().map(ToString::to_string).collect();
            format!("rank(s) {}", ranks.join(", "))
        })
        .collect();
    each.join(" vs ")
}

/// The kind of a peer's error ([`ClusterError::PeerReported`]), as the branches of a driver
/// tell errors apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerErrorKind {
    /// A failure (the request is rolled back and counted as failed).
    Failure,
    /// The request does not fit in the pools ([`ClusterError::is_pool_too_small`]).
    PoolTooSmall,
    /// The settings ([`ClusterError::is_usage`]).
    Usage,
}

impl PeerErrorKind {
    /// The kind of `e`, as a peer would report it.
    pub fn of(e: &ClusterError) -> PeerErrorKind {
        if e.is_pool_too_small() {
            PeerErrorKind::PoolTooSmall
        } else if e.is_usage() {
            PeerErrorKind::Usage
        } else {
            PeerErrorKind::Failure
        }
    }

    /// One byte on the wire.
    pub fn to_byte(self) -> u8 {
        match self {
            PeerErrorKind::Failure => 1,
            PeerErrorKind::PoolTooSmall => 2,
            PeerErrorKind::Usage => 3,
        }
    }

    /// From [`PeerErrorKind::to_byte`]; anything else is a failure.
    pub fn from_byte(b: u8) -> PeerErrorKind {
        match b {
            2 => PeerErrorKind::PoolTooSmall,
            3 => PeerErrorKind::Usage,
            _ => PeerErrorKind::Failure,
        }
    }
}

impl ClusterError {
    /// Why a kernel launch failed, when this error is a failed launch (of a cache kernel or
    /// of an allocator kernel), e.g. [`LaunchFailure::Injected`](crate::exec::LaunchFailure).
    pub fn launch_failure(&self) -> Option<crate::exec::LaunchFailure> {
        match self {
            ClusterError::Exec(e) | ClusterError::KernelAlloc(KernelAllocError::Exec(e)) => {
                e.launch_failure()
            }
            _ => None,
        }
    }

    /// Whether a request could not fit in the pools at all (it was rolled back; later,
    /// smaller requests can still be served).
    pub fn is_pool_too_small(&self) -> bool {
        matches!(
            self,
            ClusterError::PoolTooSmall { .. }
                | ClusterError::PeerReported {
                    kind: PeerErrorKind::PoolTooSmall,
                    ..
                }
        )
    }

    /// Whether this only says that another rank's step failed (this rank rolled back too;
    /// the error worth reporting is that rank's).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, ClusterError::Group(g) if g.is_peer_failure())
    }

    /// Whether the CP group itself broke (timeout, divergence, a rank gone): no later
    /// request can be served.
    pub fn is_group_broken(&self) -> bool {
        matches!(self, ClusterError::Group(g) if !g.is_peer_failure())
            || matches!(
                self,
                ClusterError::RankDied { .. }
                    | ClusterError::StartFailed { .. }
                    | ClusterError::Malformed { .. }
            )
    }

    /// Whether the error comes from the settings (exit status 2) rather than a failure.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            ClusterError::Layout(_)
                | ClusterError::PoolTooSmall { .. }
                | ClusterError::Config(_)
                | ClusterError::EngineBuffer { .. }
                | ClusterError::ConfigDiverged { .. }
                | ClusterError::PeerReported {
                    kind: PeerErrorKind::PoolTooSmall | PeerErrorKind::Usage,
                    ..
                }
        )
    }
}
