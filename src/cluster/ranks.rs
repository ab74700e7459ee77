//! [`Ranks`]: what a driver (`replay`, `python -m cp_hicache.replay`) needs from "the CP
//! group", whether this process holds every rank ([`Cluster`]) or only its own
//! ([`RankCache`], one engine process of a group whose peers are other processes).
//!
//! The driver runs the same code either way, so a multi-process replay reports exactly what
//! the in-process one does: every call here is made by every rank, in the same order, and
//! anything a report shows that one rank alone could not know (bytes moved by every rank, the
//! digests, whether any rank's device lanes disagree) goes through the group.

use super::{Cluster, GroupInfo};
use crate::allocator::StateDigest;
use crate::rank::{
    BatchServed, ClusterError, DeploymentKernels, LiveShape, PeerErrorKind, RankCache,
    RequestStats, RollbackDrops, RANK_COUNTS,
};

/// The CP group as a driver sees it. See the module documentation.
pub trait Ranks {
    /// Serves one prompt on every rank ([`RankCache::serve`]). Byte counts and load-path
    /// stalls are summed over the ranks; everything else is replicated.
    fn serve(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError>;

    /// Serves one prompt as a live request on every rank ([`RankCache::serve_live`]);
    /// counts as [`Ranks::serve`].
    fn serve_live(
        &mut self,
        tokens: &[u32],
        shape: &LiveShape,
    ) -> Result<RequestStats, ClusterError>;

    /// Serves `prompts` together, batched as a scheduler steps them
    /// ([`RankCache::serve_batch`]); each request's counts as [`Ranks::serve`], and each
    /// failed request's error the rank's that caused it.
    fn serve_batch(
        &mut self,
        prompts: &[Vec<u32>],
        shapes: &[LiveShape],
    ) -> Result<BatchServed, ClusterError>;

    /// Starts every rank reading ahead the records it would read for `prompt`, a request
    /// still to come, past its first `skip_tokens` ([`RankCache::prefetch`]; no round).
    fn prefetch(&mut self, prompt: &[u32], skip_tokens: usize) -> Result<usize, ClusterError>;

    /// Every rank's digest, in rank order.
    fn replica_digests(&self) -> Result<Vec<StateDigest>, ClusterError>;

    /// Whether every rank's digest is the same.
    fn replicas_agree(&self) -> Result<bool, ClusterError> {
        let d = self.replica_digests()?;
        Ok(!d.is_empty() && d.windows(2).all(|w| w[0] == w[1]))
    }

    /// What the rollback of the last failed request dropped (replicated).
    fn last_rollback(&self) -> RollbackDrops;

    /// Compares every rank's device lane stacks with its host mirror; the first rank that
    /// disagrees is the error on every rank.
    fn check_device_lanes(&self) -> Result<(), ClusterError>;

    /// Makes `rank`'s first launch of request number `request` fail.
    fn inject_launch_failure_on(&mut self, rank: usize, request: usize);

    /// Materialise and verify on the first `n` ranks only.
    fn set_verifying_ranks(&mut self, n: usize);

    /// Whether loads in steps run layer by layer, their readers waiting for each layer
    /// ([`RankCache::set_layer_waits`]).
    fn set_layer_waits(&mut self, on: bool);

    /// How the group runs, for the report.
    fn group_info(&self) -> GroupInfo;

    /// The deployment's kernels (this process's).
    fn kernels(&self) -> &DeploymentKernels;

    /// Whether this process reports (prints, writes files): the one process of a
    /// [`Cluster`], rank 0 of a multi-process group. Every rank still takes part in every
    /// call.
    fn reports(&self) -> bool;
}

impl Ranks for Cluster {
    fn serve(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError> {
        Cluster::serve(self, tokens)
    }

    fn serve_live(
        &mut self,
        tokens: &[u32],
        shape: &LiveShape,
    ) -> Result<RequestStats, ClusterError> {
        Cluster::serve_live(self, tokens, shape)
    }

    fn serve_batch(
        &mut self,
        prompts: &[Vec<u32>],
        shapes: &[LiveShape],
    ) -> Result<BatchServed, ClusterError> {
        Cluster::serve_batch(self, prompts, shapes)
    }

    fn prefetch(&mut self, prompt: &[u32], skip_tokens: usize) -> Result<usize, ClusterError> {
        Cluster::prefetch(self, prompt, skip_tokens)
    }

    fn replica_digests(&self) -> Result<Vec<StateDigest>, ClusterError> {
        self.try_replica_digests()
    }

    fn last_rollback(&self) -> RollbackDrops {
        Cluster::last_rollback(self)
    }

    fn check_device_lanes(&self) -> Result<(), ClusterError> {
        Cluster::check_device_lanes(self)
    }

    fn inject_launch_failure_on(&mut self, rank: usize, request: usize) {
        Cluster::inject_launch_failure_on(self, rank, request);
    }

    fn set_verifying_ranks(&mut self, n: usize) {
        Cluster::set_verifying_ranks(self, n);
    }

    fn set_layer_waits(&mut self, on: bool) {
        Cluster::set_layer_waits(self, on);
    }

    fn group_info(&self) -> GroupInfo {
        Cluster::group_info(self).clone()
    }

    fn kernels(&self) -> &DeploymentKernels {
        Cluster::kernels(self)
    }

    fn reports(&self) -> bool {
        true
    }
}

/// This process's rank of a group whose other ranks are other processes.
impl Ranks for RankCache {
    fn serve(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError> {
        let n = self.requests_served();
        let mut stats = match RankCache::serve(self, tokens) {
            Ok(stats) => stats,
            Err(e) if e.is_group_broken() => return Err(e),
            Err(e) => return Err(agree_on_error(self, n, e)?),
        };
        // Every rank succeeded (a failure on any rank fails the request on every rank); each
        // rank's counts came with the outcome round.
        stats.set_rank_counts(self.group_sums());
        Ok(stats)
    }

    fn serve_live(
        &mut self,
        tokens: &[u32],
        shape: &LiveShape,
    ) -> Result<RequestStats, ClusterError> {
        let n = self.requests_served();
        let mut stats = match RankCache::serve_live(self, tokens, shape) {
            Ok(stats) => stats,
            Err(e) if e.is_group_broken() => return Err(e),
            Err(e) => return Err(agree_on_error(self, n, e)?),
        };
        // The steps' counts are this rank's: one round sums them for the report.
        let mine: Vec<u8> = stats
            .rank_counts()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let all = self
            .group()
            .all_gather(&format!("request {n} byte counts"), &mine)?;
        let mut sums = [0u64; RANK_COUNTS];
        for b in &all {
            if b.len() != 8 * RANK_COUNTS {
                return Err(ClusterError::Config(format!(
                    "request {n} byte counts: a peer sent {} bytes, not {RANK_COUNTS} counts",
                    b.len()
                )));
            }
            for (s, c) in sums.iter_mut().zip(b.chunks_exact(8)) {
                *s += u64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        stats.set_rank_counts(sums);
        Ok(stats)
    }

    fn serve_batch(
        &mut self,
        prompts: &[Vec<u32>],
        shapes: &[LiveShape],
    ) -> Result<BatchServed, ClusterError> {
        let n = self.requests_served();
        let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let mut out = RankCache::serve_batch(self, &views, shapes)?;
        // One round for the whole batch: each request's counts, or this rank's error.
        let mut mine = Vec::new();
        for r in &out.requests {
            match r {
                Ok(stats) => {
                    mine.push(0);
                    mine.extend(stats.rank_counts().iter().flat_map(|v| v.to_le_bytes()));
                }
                Err(e) if e.is_peer_failure() => mine.push(1),
                Err(e) => {
                    let why = e.to_string();
                    mine.push(2 + PeerErrorKind::of(e).to_byte());
                    mine.extend((why.len() as u32).to_le_bytes());
                    mine.extend(why.into_bytes());
                }
            }
        }
        let round = format!("requests {n}.. of a batch: byte counts and errors");
        let all = self.group().all_gather(&round, &mine)?;
        let me = usize::from(self.rank().0);
        let malformed = |peer: usize| {
            ClusterError::Config(format!("{round}: rank {peer} sent a malformed report"))
        };
        let mut at = vec![0usize; all.len()];
        for r in &mut out.requests {
            let mut sums = [0u64; RANK_COUNTS];
            let mut reported: Option<(usize, PeerErrorKind, String)> = None;
            for (peer, b) in all.iter().enumerate() {
                let p = &mut at[peer];
                let kind = *b.get(*p).ok_or_else(|| malformed(peer))?;
                *p += 1;
                match kind {
                    0 => {
                        let c = b
                            .get(*p..*p + 8 * RANK_COUNTS)
                            .ok_or_else(|| malformed(peer))?;
                        *p += 8 * RANK_COUNTS;
                        for (s, v) in sums.iter_mut().zip(c.chunks_exact(8)) {
                            *s += u64::from_le_bytes(v.try_into().expect("8 bytes"));
                        }
                    }
                    1 => {}
                    k => {
                        let len = b.get(*p..*p + 4).ok_or_else(|| malformed(peer))?;
                        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
                        let msg = b.get(*p + 4..*p + 4 + len).ok_or_else(|| malformed(peer))?;
                        *p += 4 + len;
                        if reported.is_none() {
                            let msg = String::from_utf8_lossy(msg).into_owned();
                            reported = Some((peer, PeerErrorKind::from_byte(k - 2), msg));
                        }
                    }
                }
            }
            match r {
                Ok(stats) => stats.set_rank_counts(sums),
                Err(e) => {
                    if let Some((peer, kind, message)) = reported {
                        if peer != me {
                            *e = ClusterError::PeerReported {
                                rank: peer,
                                message,
                                kind,
                            };
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    fn prefetch(&mut self, prompt: &[u32], skip_tokens: usize) -> Result<usize, ClusterError> {
        RankCache::prefetch(self, prompt, skip_tokens)
    }

    fn replica_digests(&self) -> Result<Vec<StateDigest>, ClusterError> {
        self.all_digests(&format!(
            "digests after {} requests",
            self.requests_served()
        ))
    }

    fn last_rollback(&self) -> RollbackDrops {
        RankCache::last_rollback(self)
    }

    fn check_device_lanes(&self) -> Result<(), ClusterError> {
        let mine = RankCache::check_device_lanes(self);
        let why = mine
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default();
        let all = self
            .group()
            .all_gather("device lane check", why.as_bytes())?;
        match mine {
            Err(e) => Err(e),
            Ok(()) => match all.iter().enumerate().find(|(_, w)| !w.is_empty()) {
                None => Ok(()),
                Some((rank, w)) => Err(ClusterError::PeerReported {
                    rank,
                    message: String::from_utf8_lossy(w).into_owned(),
                    kind: PeerErrorKind::Failure,
                }),
            },
        }
    }

    fn inject_launch_failure_on(&mut self, rank: usize, request: usize) {
        if usize::from(self.rank().0) == rank {
            self.inject_launch_failure(request);
        }
    }

    fn set_verifying_ranks(&mut self, n: usize) {
        RankCache::set_verifying_ranks(self, n);
    }

    fn set_layer_waits(&mut self, on: bool) {
        RankCache::set_layer_waits(self, on);
    }

    fn group_info(&self) -> GroupInfo {
        GroupInfo {
            kind: self.group_kind(),
            ranks: self.group().size(),
            peer_pools: self.peer_pools(),
            executor_per_rank: true,
            verifying_ranks: self.verifying_ranks(),
        }
    }

    fn kernels(&self) -> &DeploymentKernels {
        RankCache::kernels(self)
    }

    fn reports(&self) -> bool {
        self.rank().0 == 0
    }
}

/// The one error every rank reports for a failed request: ranks learn of a failure at
/// different steps (one fails a launch while its peers find the pool too small), and a driver
/// that branched on each rank's own error would then make different calls on different
/// ranks. Like [`Cluster`]'s, the choice is the lowest rank's own error (not a peer's
/// failure); the other ranks relay it as [`ClusterError::PeerReported`] of the same kind.
fn agree_on_error(
    rank: &RankCache,
    n: usize,
    e: ClusterError,
) -> Result<ClusterError, ClusterError> {
    let mine: Vec<u8> = if e.is_peer_failure() {
        vec![0]
    } else {
        let mut v = vec![PeerErrorKind::of(&e).to_byte()];
        v.extend(e.to_string().into_bytes());
        v
    };
    let all = rank
        .group()
        .all_gather(&format!("request {n} errors"), &mine)?;
    let me = usize::from(rank.rank().0);
    Ok(
        match all
            .iter()
            .enumerate()
            .find(|(_, v)| v.first().is_some_and(|&k| k != 0))
        {
            Some((r, v)) if r != me => ClusterError::PeerReported {
                rank: r,
                message: String::from_utf8_lossy(&v[1..]).into_owned(),
                kind: PeerErrorKind::from_byte(v[0]),
            },
            _ => e,
        },
    )
}
