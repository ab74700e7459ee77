//! [`LocalGroup`]: C ranks as threads of one process, meeting at a shared rendezvous.

use super::{Collective, GroupError};
use crate::layout::Rank;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The default bound on one collective call: long enough for a rank to compile a kernel or
/// serve a large request on a slow machine, short enough that a lost rank ends the run.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A group of ranks in one process. [`LocalGroup::members`] hands out one [`LocalMember`]
/// per rank, each to be moved to that rank's thread.
pub struct LocalGroup;

impl LocalGroup {
    /// `size` members (one per rank, in rank order) whose calls wait at most `timeout`.
    pub fn members(size: u8, timeout: Duration) -> Vec<LocalMember> {
        let size = usize::from(size);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                round: 0,
                arrived: vec![None; size],
                result: Arc::new(Ok(Vec::new())),
                last_step: vec!["not started".to_string(); size],
                aborted: None,
            }),
            cv: Condvar::new(),
            timeout,
        });
        (0..size)
            .map(|r| LocalMember {
                rank: Rank(r as u8),
                size,
                shared: shared.clone(),
                left: false,
            })
            .collect()
    }
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank's contribution to a round: the call's tag and its bytes, or why it failed.
type Arrival = (String, Result<Vec<u8>, String>);

struct State {
    /// Completed rounds; a member's call joins round `round`.
    round: u64,
    /// This round's contributions: the call's tag and bytes, or a failure (`Err(why)`),
    /// which matches any tag.
    arrived: Vec<Option<Arrival>>,
    /// The last completed round's result. A member reads it before it can join the next
    /// round, which cannot complete without it, so one result is all that must be kept.
    result: Arc<Result<Vec<Vec<u8>>, GroupError>>,
    /// Each rank's current or last step, for error messages.
    last_step: Vec<String>,
    /// The first abort: (rank, its step, why).
    aborted: Option<(u8, String, String)>,
}

impl State {
    fn aborted_error(&self) -> Option<GroupError> {
        self.aborted
            .as_ref()
            .map(|(by, what, why)| GroupError::Aborted {
                by: *by,
                what: what.clone(),
                why: why.clone(),
            })
    }
}

/// One rank's handle on a [`LocalGroup`]. Dropping it while the thread panics aborts the
/// group ("rank r panicked"), and so does dropping it before [`LocalMember::leave`] while
/// peers may still call ("rank r left the group"), so peers never wait for a rank that is
/// gone.
pub struct LocalMember {
    rank: Rank,
    size: usize,
    shared: Arc<Shared>,
    left: bool,
}

impl LocalMember {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never leaves the state half-updated (every update is one assignment under
        // the lock), so a poisoned lock is taken over.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leaves the group after this rank's last call: peers that still call, or are waiting
    /// in a round this rank will never join, fail at once with [`GroupError::Aborted`]
    /// ("rank r left the group") instead of waiting out the timeout. A round this rank
    /// completed before leaving still returns its result to every peer.
    pub fn leave(mut self) {
        self.left = true;
        let me = usize::from(self.rank.0);
        let mut st = self.lock();
        let step = st.last_step[me].clone();
        st.last_step[me] = format!("gone (after {step})");
        if st.aborted.is_none() {
            st.aborted = Some((
                self.rank.0,
                step,
                format!("rank {} left the group", self.rank.0),
            ));
        }
        drop(st);
        self.shared.cv.notify_all();
    }

    fn abort_with(&self, why: String) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            let what = st.last_step[usize::from(self.rank.0)].clone();
            st.aborted = Some((self.rank.0, what, why));
        }
        drop(st);
        self.shared.cv.notify_all();
    }
}

impl Drop for LocalMember {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort_with(format!("rank {} panicked", self.rank.0));
        } else if !self.left {
            self.abort_with(format!("rank {} left the group", self.rank.0));
        }
    }
}

impl Collective for LocalMember {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn kind(&self) -> &'static str {
        "local"
    }

    fn abort(&self, why: &str) {
        self.abort_with(why.to_string());
    }

    fn exchange(&self, what: &str, mine: Result<&[u8], &str>) -> Result<Vec<Vec<u8>>, GroupError> {
        let me = usize::from(self.rank.0);
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.lock();
        if let Some(e) = st.aborted_error() {
            return Err(e);
        }
        st.last_step[me] = what.to_string();
        // A peer that arrived with another call means the ranks diverged (a failure matches
        // any call: the failed rank cannot know where its peers are).
        let diverged = st
            .arrived
            .iter()
            .enumerate()
            .filter_map(|(r, a)| a.as_ref().map(|a| (r, a)))
            .find(|(_, (tag, data))| data.is_ok() && mine.is_ok() && tag != what)
            .map(|(r, (tag, _))| (r, tag.clone()));
        if let Some((other, theirs)) = diverged {
            let e = GroupError::Diverged {
                rank: self.rank.0,
                mine: what.to_string(),
                other: other as u8,
                theirs,
            };
            let why = e.to_string();
            st.aborted
                .get_or_insert((self.rank.0, what.to_string(), why));
            drop(st);
            self.shared.cv.notify_all();
            return Err(e);
        }
        st.arrived[me] = Some((
            what.to_string(),
            mine.map(<[u8]>::to_vec).map_err(str::to_string),
        ));
        let round = st.round;
        if st.arrived.iter().all(Option::is_some) {
            let all: Vec<Arrival> = st
                .arrived
                .iter_mut()
                .map(|a| a.take().expect("all arrived"))
                .collect();
            let failures: Vec<(u8, String)> = all
                .iter()
                .enumerate()
                .filter_map(|(r, (_, d))| d.as_ref().err().map(|why| (r as u8, why.clone())))
                .collect();
            st.result = Arc::new(if failures.is_empty() {
                Ok(all
                    .into_iter()
                    .map(|(_, d)| d.expect("no failure"))
                    .collect())
            } else {
                Err(GroupError::PeerFailed { failures })
            });
            st.round += 1;
            let result = st.result.clone();
            drop(st);
            self.shared.cv.notify_all();
            return result.as_ref().clone();
        }
        loop {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<(u8, String)> = st
                    .arrived
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.is_none())
                    .map(|(r, _)| (r as u8, st.last_step[r].clone()))
                    .collect();
                let e = GroupError::Timeout {
                    rank: self.rank.0,
                    what: what.to_string(),
                    timeout: self.shared.timeout,
                    missing,
                };
                let why = e.to_string();
                st.aborted
                    .get_or_insert((self.rank.0, what.to_string(), why));
                drop(st);
                self.shared.cv.notify_all();
                return Err(e);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if st.round > round {
                return st.result.as_ref().clone();
            }
            if let Some(e) = st.aborted_error() {
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ReduceOp;
    use super::*;
    use std::thread;

    /// Runs `f` on one thread per member and returns each rank's result.
    fn on_threads<T: Send + 'static>(
        members: Vec<LocalMember>,
        f: impl Fn(LocalMember) -> T + Send + Sync + 'static,
    ) -> Vec<thread::Result<T>> {
        let f = Arc::new(f);
        let handles: Vec<_> = members
            .into_iter()
            .map(|m| {
                let f = f.clone();
                thread::spawn(move || f(m))
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    }

    #[test]
    fn gathers_reduces_and_barriers_over_many_rounds() {
        let out = on_threads(LocalGroup::members(4, Duration::from_secs(20)), |m| {
            let r = u64::from(m.rank().0);
            let mut sums = Vec::new();
            for round in 0..50u64 {
                let all = m.all_gather("gather", &[m.rank().0; 3]).unwrap();
                assert_eq!(all, (0..4u8).map(|r| vec![r; 3]).collect::<Vec<_>>());
                let s = m.all_reduce("sum", ReduceOp::Sum, &[r, round, 1]).unwrap();
                assert_eq!(m.all_reduce("max", ReduceOp::Max, &[r]).unwrap(), [3]);
                assert_eq!(m.all_reduce("min", ReduceOp::Min, &[r + 1]).unwrap(), [1]);
                m.barrier("step").unwrap();
                assert!(m.any("failed?", r == round % 4).unwrap());
                sums.push(s);
            }
            m.leave();
            sums
        });
        for r in out {
            let sums = r.unwrap();
            assert_eq!(sums[7], vec![6, 28, 4]);
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_named_with_its_step() {
        let members = LocalGroup::members(3, Duration::from_millis(200));
        let out = on_threads(members, |m| {
            if m.rank().0 == 1 {
                m.barrier("request 0 synthesise").unwrap();
                // Rank 1 is stuck in its own work and never reaches the next call.
                thread::sleep(Duration::from_millis(800));
                let late = m.barrier("request 0 materialise").unwrap_err();
                m.leave();
                return late.to_string();
            }
            m.barrier("request 0 synthesise").unwrap();
            let e = m.barrier("request 0 materialise").unwrap_err();
            m.leave();
            e.to_string()
        });
        let errs: Vec<String> = out.into_iter().map(Result::unwrap).collect();
        let timed_out = errs
            .iter()
            .find(|e| e.contains("timed out"))
            .unwrap_or_else(|| panic!("{errs:?}"));
        assert!(
            timed_out.contains("waiting for rank 1 (last seen request 0 synthesise (barrier))"),
            "{timed_out}"
        );
        // The late rank fails at once with the abort, not after its own timeout.
        assert!(errs[1].contains("aborted by rank"), "{}", errs[1]);
    }

    #[test]
    fn a_panicking_rank_aborts_every_peer_promptly() {
        let members = LocalGroup::members(4, Duration::from_secs(60));
        let start = Instant::now();
        let out = on_threads(members, |m| {
            m.barrier("start").unwrap();
            if m.rank().0 == 3 {
                panic!("rank 3 fell over mid-request");
            }
            let e = m.all_gather("request 5 digests", b"x").unwrap_err();
            m.leave();
            e
        });
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "peers waited for the timeout"
        );
        assert!(out[3].is_err(), "rank 3 panicked");
        for e in out.into_iter().take(3) {
            let e = e.unwrap();
            assert!(
                matches!(&e, GroupError::Aborted { by: 3, why, .. } if why == "rank 3 panicked"),
                "{e}"
            );
            assert!(
                e.to_string().contains("while it was start (barrier)"),
                "{e}"
            );
        }
    }

    #[test]
    fn diverged_calls_fail_instead_of_pairing_up() {
        let members = LocalGroup::members(2, Duration::from_secs(60));
        let out = on_threads(members, |m| {
            let what = if m.rank().0 == 0 { "backup" } else { "evict" };
            let e = m.barrier(what).unwrap_err();
            m.leave();
            e
        });
        let errs: Vec<GroupError> = out.into_iter().map(Result::unwrap).collect();
        assert!(
            errs.iter()
                .any(|e| matches!(e, GroupError::Diverged { .. })),
            "{errs:?}"
        );
        let shown: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert!(
            shown.iter().any(|e| e.contains("the ranks diverged")),
            "{shown:?}"
        );
    }

    #[test]
    fn mismatched_reduce_lengths_are_a_shape_error() {
        let members = LocalGroup::members(2, Duration::from_secs(60));
        let out = on_threads(members, |m| {
            let v = vec![1u64; usize::from(m.rank().0) + 1];
            let e = m.all_reduce("counts", ReduceOp::Sum, &v).unwrap_err();
            m.leave();
            e
        });
        for e in out {
            assert!(matches!(e.unwrap(), GroupError::Shape { .. }));
        }
    }

    #[test]
    fn a_sum_that_overflows_is_an_error() {
        let out = on_threads(LocalGroup::members(2, Duration::from_secs(60)), |m| {
            let e = m
                .all_reduce("bytes", ReduceOp::Sum, &[u64::MAX])
                .unwrap_err();
            m.leave();
            e
        });
        for e in out {
            assert!(matches!(e.unwrap(), GroupError::Overflow { .. }));
        }
    }

    /// A rank whose step failed stands in for whatever call its peers make: the round
    /// ends with the failure everywhere, the group stays usable, and the next rounds work.
    #[test]
    fn a_failed_step_ends_the_round_everywhere_and_the_group_goes_on() {
        let out = on_threads(LocalGroup::members(3, Duration::from_secs(20)), |m| {
            let r = m.rank().0;
            let first = if r == 2 {
                m.fail("request 4 outcome", "launch failed")
                    .map(|f| f.len())
            } else {
                match m.all_gather("request 4 backup shortfalls", b"s") {
                    Err(GroupError::PeerFailed { failures }) => Ok(failures.len()),
                    other => panic!("{other:?}"),
                }
            };
            assert_eq!(first.unwrap(), 1);
            let again = m.all_gather("request 4 recovery", &[r]).unwrap();
            m.leave();
            again
        });
        for r in out {
            assert_eq!(r.unwrap(), vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_single_rank_group_never_waits() {
        let m = LocalGroup::members(1, Duration::from_millis(1))
            .pop()
            .unwrap();
        assert_eq!(m.all_gather("x", b"ab").unwrap(), vec![b"ab".to_vec()]);
        assert_eq!(m.all_reduce("y", ReduceOp::Sum, &[4, 5]).unwrap(), [4, 5]);
        m.leave();
    }

    /// A member that leaves ends its peers' waits at once: one already waiting in a round
    /// the leaver will never join, and one that calls later.
    #[test]
    fn a_member_that_leaves_aborts_its_peers_promptly() {
        let start = Instant::now();
        let out = on_threads(LocalGroup::members(3, Duration::from_secs(60)), |m| {
            m.barrier("start").unwrap();
            match m.rank().0 {
                1 => {
                    m.leave();
                    None
                }
                r => {
                    if r == 2 {
                        thread::sleep(Duration::from_millis(200));
                    }
                    let e = m.all_gather("request 0 begin outcome", b"x").unwrap_err();
                    m.leave();
                    Some(e)
                }
            }
        });
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "a peer waited out the timeout"
        );
        for (r, e) in out.into_iter().enumerate() {
            let Some(e) = e.unwrap() else { continue };
            assert!(
                matches!(&e, GroupError::Aborted { by: 1, why, .. } if why == "rank 1 left the group"),
                "rank {r}: {e}"
            );
        }
    }

    #[test]
    fn after_an_abort_every_call_fails() {
        let mut members = LocalGroup::members(2, Duration::from_secs(60));
        let b = members.pop().unwrap();
        let a = members.pop().unwrap();
        a.abort("rank 0 failed to build its pools");
        for m in [&a, &b] {
            let e = m.barrier("serve").unwrap_err();
            assert!(
                e.to_string().contains("rank 0 failed to build its pools"),
                "{e}"
            );
        }
        a.leave();
        b.leave();
    }
}
