//! How CP ranks agree: the [`Collective`] trait, [`LocalGroup`], C ranks as threads of one
//! process, and [`FileGroup`], ranks in processes of one machine over a folder's files.
//!
//! Everything a rank decides from replicated state (matching, allocation, device eviction)
//! it decides alone, and every rank comes out the same by construction; digests prove it.
//! What depends on more than one rank's state goes through a collective: the settings and
//! host capacities at start-up, whether any rank failed a step (then all roll back),
//! mismatch counts (summed) and the digests of what each rank decided.
//!
//! The collective is a trait and not a transport of ours: in an engine it is the engine's own
//! group (`torch.distributed` over gloo for the CPU control plane, as SGLang does), and in one
//! process it is [`LocalGroup`].
//!
//! # The contract every implementation keeps
//!
//! - Every rank makes the same sequence of calls. Each call names its step (`what`); a rank
//!   whose call differs from its peers' (another operation or another step: the ranks
//!   diverged) fails it with [`GroupError::Diverged`] instead of pairing it with the wrong
//!   call, the deadlock SGLang's rank-divergence bugs show.
//! - No call waits for ever. A call that does not complete within the group's timeout fails
//!   with [`GroupError::Timeout`], naming the ranks that never arrived and the last step each
//!   was seen at.
//! - A failure is final: once a call failed, or a rank left or panicked
//!   ([`Collective::abort`]), every later call on every rank fails with
//!   [`GroupError::Aborted`], naming the rank and what it was doing. A rank never waits on a
//!   peer that is gone.

mod files;
mod local;

pub use files::FileGroup;
pub use local::{LocalGroup, LocalMember, DEFAULT_TIMEOUT};

use crate::layout::Rank;
use std::time::Duration;

/// How [`Collective::all_reduce`] combines the ranks' values, element by element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The smallest value.
    Min,
    /// The largest value.
    Max,
    /// The sum (wrapping is an error: [`GroupError::Overflow`]).
    Sum,
}

impl ReduceOp {
    fn name(self) -> &'static str {
        match self {
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Sum => "sum",
        }
    }
}

/// Why a collective call failed. After any of these but [`GroupError::PeerFailed`] the group
/// is unusable: every later call fails with [`GroupError::Aborted`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// Some rank failed its step ([`Collective::fail`]): every rank's call of this round
    /// ends with this, and every rank rolls the step back. The group stays usable.
    #[error("{}", describe_failures(failures))]
    PeerFailed {
        /// Each failed rank and why.
        failures: Vec<(u8, String)>,
    },
    /// Some ranks did not arrive within the timeout.
    #[error(
        "rank {rank}: {what} timed out after {timeout:?} waiting for {}",
        describe_missing(missing)
    )]
    Timeout {
        /// The rank that gave up.
        rank: u8,
        /// The step it was at.
        what: String,
        /// How long it waited.
        timeout: Duration,
        /// Each rank that never arrived, with the last step it was seen at.
        missing: Vec<(u8, String)>,
    },
    /// The ranks made different calls: they diverged (a bug, or a rank that skipped a step).
    #[error("rank {rank} called {mine} while rank {other} called {theirs}: the ranks diverged")]
    Diverged {
        /// The rank reporting it.
        rank: u8,
        /// Its call.
        mine: String,
        /// A rank that called something else.
        other: u8,
        /// That rank's call.
        theirs: String,
    },
    /// The group was aborted: a rank failed, left, panicked, or an earlier call failed.
    #[error("the CP group was aborted by rank {by} while it was {what}: {why}")]
    Aborted {
        /// The rank that aborted it.
        by: u8,
        /// What that rank was doing (its last step).
        what: String,
        /// Why.
        why: String,
    },
    /// Ranks contributed vectors of different lengths to one all-reduce.
    #[error("rank {rank}: {what}: the ranks' vectors have different lengths ({lens:?})")]
    Shape {
        /// The rank reporting it.
        rank: u8,
        /// The step.
        what: String,
        /// Each rank's length.
        lens: Vec<usize>,
    },
    /// A sum overflowed 64 bits.
    #[error("rank {rank}: {what}: the sum overflows 64 bits")]
    Overflow {
        /// The rank reporting it.
        rank: u8,
        /// The step.
        what: String,
    },
    /// The transport itself failed (an engine's group; never [`LocalGroup`]).
    #[error("rank {rank}: {what}: {message}")]
    Transport {
        /// The rank reporting it.
        rank: u8,
        /// The step.
        what: String,
        /// The transport's message.
        message: String,
    },
}

/// Each failed rank and why, as errors show them (`rank 3 failed: ...; rank 5 failed: ...`).
pub(crate) fn describe_failures(failures: &[(u8, String)]) -> String {
    let each: Vec<String> = failures
        .iter()
        .map(|(r, why)| format!("rank {r} failed: {why}"))
        .collect();
    each.join("; ")
}

impl GroupError {
    /// Whether this only reports a peer's failed step (the group is still usable and the
    /// step is rolled back everywhere), rather than a broken group.
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, GroupError::PeerFailed { .. })
    }
}

fn describe_missing(missing: &[(u8, String)]) -> String {
    let ranks: Vec<String> = missing
        .iter()
        .map(|(r, at)| format!("rank {r} (last seen {at})"))
        .collect();
    ranks.join(", ")
}

/// The operations ranks agree through. See the module documentation for the contract
/// (same call sequence, bounded waits, failures final). `what` names the step in errors
/// ("backup host shortfalls", "request 12 failure agreement"): keep it short and identical
/// on every rank.
pub trait Collective: Send {
    /// This member's rank.
    fn rank(&self) -> Rank;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// A short name of the transport, for reports (`"local"`, `"torch.distributed"`).
    fn kind(&self) -> &'static str;

    /// One round: every rank's contribution, in rank order (this rank's included). A rank
    /// contributes its bytes, or `Err(why)` when its step failed; a failure stands in for
    /// whatever call the other ranks make in this round (a failed rank cannot know which
    /// step its peers are at), and then the round ends for every rank with
    /// [`GroupError::PeerFailed`] naming each failed rank.
    fn exchange(&self, what: &str, mine: Result<&[u8], &str>) -> Result<Vec<Vec<u8>>, GroupError>;

    /// Every rank's `mine`, in rank order (this rank's included).
    fn all_gather(&self, what: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>, GroupError> {
        self.exchange(what, Ok(mine))
    }

    /// Tells the group this rank's step failed: the peers' current or next call fails with
    /// [`GroupError::PeerFailed`], as this one does. Returns the failures of this round
    /// (this rank's included); any other error means the group itself broke.
    fn fail(&self, what: &str, why: &str) -> Result<Vec<(u8, String)>, GroupError> {
        match self.exchange(what, Err(why)) {
            Err(GroupError::PeerFailed { failures }) => Ok(failures),
            Err(e) => Err(e),
            // A transport of someone else's (an engine's `exchange`) can break the contract:
            // then the group cannot be trusted with anything more.
            Ok(_) => {
                let e = GroupError::Transport {
                    rank: self.rank().0,
                    what: what.to_string(),
                    message: "the round this rank failed came back as a success: the \
                              group's exchange does not keep the collective contract"
                        .into(),
                };
                self.abort(&e.to_string());
                Err(e)
            }
        }
    }

    /// Marks the group failed, so that every rank's current and later calls fail with
    /// [`GroupError::Aborted`] naming this rank and `why`. Idempotent; the first abort wins.
    fn abort(&self, why: &str);

    /// Combines every rank's `values` element by element; every rank gets the same result.
    fn all_reduce(&self, what: &str, op: ReduceOp, values: &[u64]) -> Result<Vec<u64>, GroupError> {
        let mine: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let tag = format!("{what} (all-reduce {})", op.name());
        let all = self.all_gather(&tag, &mine)?;
        let rank = self.rank().0;
        let lens: Vec<usize> = all.iter().map(|v| v.len() / 8).collect();
        if lens.iter().any(|&l| l != values.len()) || all.iter().any(|v| v.len() % 8 != 0) {
            let e = GroupError::Shape {
                rank,
                what: what.to_string(),
                lens,
            };
            self.abort(&e.to_string());
            return Err(e);
        }
        let mut out = values.to_vec();
        for v in all
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != usize::from(rank))
        {
            for (i, c) in v.1.chunks_exact(8).enumerate() {
                let x = u64::from_le_bytes(c.try_into().expect("8 bytes"));
                out[i] = match op {
                    ReduceOp::Min => out[i].min(x),
                    ReduceOp::Max => out[i].max(x),
                    ReduceOp::Sum => out[i].checked_add(x).ok_or_else(|| GroupError::Overflow {
                        rank,
                        what: what.to_string(),
                    })?,
                };
            }
        }
        Ok(out)
    }

    /// Returns once every rank has called it.
    fn barrier(&self, what: &str) -> Result<(), GroupError> {
        self.all_gather(&format!("{what} (barrier)"), &[]).map(drop)
    }

    /// Whether any rank passes `true`: the failure agreement of a step that may fail on some
    /// ranks only (then every rank rolls back).
    fn any(&self, what: &str, mine: bool) -> Result<bool, GroupError> {
        Ok(self.all_reduce(what, ReduceOp::Max, &[u64::from(mine)])?[0] != 0)
    }
}

/// A member that counts the rounds it takes part in (every call is one round): what the
/// replay reports as rounds per request.
pub struct Counted {
    inner: Box<dyn Collective>,
    rounds: std::sync::atomic::AtomicU64,
}

impl Counted {
    /// Counts `inner`'s rounds from now on.
    pub fn new(inner: Box<dyn Collective>) -> Counted {
        Counted {
            inner,
            rounds: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Rounds so far.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Collective for Counted {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn exchange(&self, what: &str, mine: Result<&[u8], &str>) -> Result<Vec<Vec<u8>>, GroupError> {
        self.rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.exchange(what, mine)
    }

    fn abort(&self, why: &str) {
        self.inner.abort(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine's `exchange` that answers a failed round with a success: `fail` reports a
    /// broken transport and aborts the member, instead of panicking.
    #[test]
    fn a_transport_that_loses_failures_is_an_error_not_a_panic() {
        struct Liar(std::sync::Mutex<Option<String>>);
        impl Collective for Liar {
            fn rank(&self) -> Rank {
                Rank(0)
            }
            fn size(&self) -> usize {
                2
            }
            fn kind(&self) -> &'static str {
                "liar"
            }
            fn exchange(
                &self,
                _: &str,
                _: Result<&[u8], &str>,
            ) -> Result<Vec<Vec<u8>>, GroupError> {
                Ok(vec![Vec::new(), Vec::new()])
            }
            fn abort(&self, why: &str) {
                *self.0.lock().unwrap() = Some(why.to_string());
            }
        }
        let g = Liar(std::sync::Mutex::new(None));
        let e = g.fail("request 3 end", "forward failed").unwrap_err();
        assert!(
            matches!(&e, GroupError::Transport { rank: 0, what, .. } if what == "request 3 end"),
            "{e}"
        );
        assert!(g
            .0
            .lock()
            .unwrap()
            .as_deref()
            .unwrap()
            .contains("collective contract"));
    }

    #[test]
    fn errors_name_the_ranks_and_steps() {
        let e = GroupError::Timeout {
            rank: 0,
            what: "request 3 digests".into(),
            timeout: Duration::from_millis(50),
            missing: vec![(2, "request 3 materialise".into())],
        };
        assert_eq!(
            e.to_string(),
            "rank 0: request 3 digests timed out after 50ms waiting for rank 2 (last seen \
             request 3 materialise)"
        );
    }
}
