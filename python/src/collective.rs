//! [`PyCollective`]: the core crate's `Collective` over a Python object, in practice
//! `cp_hicache.TorchCollective`, which runs each round as one `all_gather_object` on a
//! `torch.distributed` group (gloo, the CPU control plane SGLang uses too).
//!
//! The Python object does one thing, `exchange(what, payload, why)`: every rank's
//! `(what, payload, why)` in rank order. Everything the contract asks beyond that is kept
//! here, as `LocalGroup` keeps it in one process:
//! - a round in which some rank contributed a failure ends with `PeerFailed` on every rank;
//! - a round whose ranks named different steps fails as `Diverged` instead of pairing calls;
//! - a failure is final: after a transport error, a divergence or an abort, every later call
//!   fails with `Aborted` without touching the transport.
//!
//! Waits are bounded by the group's own timeout (`init_process_group(timeout=...)`); a peer
//! process that dies closes its sockets, so the survivors' next round fails at once with the
//! transport's message. The launcher names the rank that died.

use cp_hicache::group::{Collective, GroupError};
use cp_hicache::layout::Rank;
use pyo3::exceptions::{PyKeyboardInterrupt, PySystemExit};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::sync::{Arc, Mutex};

/// The state of a collective that failed for good.
#[derive(Clone)]
struct Broken {
    by: u8,
    what: String,
    why: String,
}

/// The group object, shared with the `RankCache` that owns this collective so that the
/// garbage collector can see it (`__traverse__`) and break a cycle through it (`__clear__`):
/// an engine object that is its own group holds its cache, which holds it.
pub(crate) type GroupSlot = Arc<Mutex<Option<Py<PyAny>>>>;

/// A `KeyboardInterrupt` or `SystemExit` raised inside `exchange`, kept to be raised again
/// as itself once the cache's call returns (the round fails with a transport error).
pub(crate) type InterruptSlot = Arc<Mutex<Option<PyErr>>>;

/// A `Collective` whose rounds are a Python object's `exchange`.
pub(crate) struct PyCollective {
    obj: GroupSlot,
    interrupt: InterruptSlot,
    rank: u8,
    size: usize,
    last: Mutex<String>,
    broken: Mutex<Option<Broken>>,
}

impl PyCollective {
    /// Wraps `obj`, which must have `rank`, `size` and `exchange(what, payload, why)`.
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<PyCollective> {
        let rank: usize = obj.getattr("rank")?.extract()?;
        let size: usize = obj.getattr("size")?.extract()?;
        if size == 0 || size > 16 || rank >= size {
            return Err(crate::errors::usage(format!(
                "a CP group has 1..=16 ranks and this rank is below its size; the group says \
                 rank {rank} of {size}"
            )));
        }
        Ok(PyCollective {
            obj: Arc::new(Mutex::new(Some(obj.clone().unbind()))),
            interrupt: Arc::new(Mutex::new(None)),
            rank: rank as u8,
            size,
            last: Mutex::new("start-up".into()),
            broken: Mutex::new(None),
        })
    }

    /// The group object's slot, for the owner's garbage-collector hooks.
    pub(crate) fn group_slot(&self) -> GroupSlot {
        self.obj.clone()
    }

    /// Where an interrupt raised inside `exchange` is kept.
    pub(crate) fn interrupt_slot(&self) -> InterruptSlot {
        self.interrupt.clone()
    }

    fn fail_for_good(&self, what: &str, why: String) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        b.get_or_insert(Broken {
            by: self.rank,
            what: what.to_string(),
            why,
        });
    }

    /// One round through Python: every rank's `(what, payload, why)`.
    #[allow(clippy::type_complexity)]
    fn round(
        &self,
        what: &str,
        mine: Result<&[u8], &str>,
    ) -> Result<Vec<(String, Option<Vec<u8>>, Option<String>)>, String> {
        Python::attach(|py| {
            let (payload, why): (Option<Bound<'_, PyBytes>>, Option<&str>) = match mine {
                Ok(b) => (Some(PyBytes::new(py, b)), None),
                Err(w) => (None, Some(w)),
            };
            let obj = self
                .obj
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|o| o.clone_ref(py))
                .ok_or("the group object was cleared by the garbage collector")?;
            let out = obj
                .call_method1(py, "exchange", (what, payload, why))
                .map_err(|e| {
                    let message = e.to_string();
                    if e.is_instance_of::<PyKeyboardInterrupt>(py)
                        || e.is_instance_of::<PySystemExit>(py)
                    {
                        *self.interrupt.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                    message
                })?;
            let list = out
                .bind(py)
                .cast::<PyList>()
                .map_err(|_| "exchange must return a list".to_string())?
                .clone();
            list.iter()
                .map(|item| {
                    let t = item.cast::<PyTuple>().map_err(|_| {
                        "exchange must return (what, payload, why) tuples".to_string()
                    })?;
                    let w: String = t
                        .get_item(0)
                        .and_then(|x| x.extract())
                        .map_err(|e| e.to_string())?;
                    let p = t.get_item(1).map_err(|e| e.to_string())?;
                    let p: Option<Vec<u8>> = if p.is_none() {
                        None
                    } else {
                        let b = p
                            .cast::<PyBytes>()
                            .map_err(|_| "a payload must be bytes or None".to_string())?;
                        Some(b.as_bytes().to_vec())
                    };
                    let y: Option<String> = t
                        .get_item(2)
                        .and_then(|x| x.extract())
                        .map_err(|e| e.to_string())?;
                    Ok((w, p, y))
                })
                .collect()
        })
    }
}

impl Collective for PyCollective {
    fn rank(&self) -> Rank {
        Rank(self.rank)
    }

    fn size(&self) -> usize {
        self.size
    }

    fn kind(&self) -> &'static str {
        "torch.distributed"
    }

    fn exchange(&self, what: &str, mine: Result<&[u8], &str>) -> Result<Vec<Vec<u8>>, GroupError> {
        if let Some(b) = self
            .broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(GroupError::Aborted {
                by: b.by,
                what: b.what,
                why: b.why,
            });
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = what.to_string();
        let all = match self.round(what, mine) {
            Ok(all) => all,
            Err(message) => {
                self.fail_for_good(what, message.clone());
                return Err(GroupError::Transport {
                    rank: self.rank,
                    what: what.to_string(),
                    message,
                });
            }
        };
        if all.len() != self.size {
            let message = format!("{} contributions in a group of {}", all.len(), self.size);
            self.fail_for_good(what, message.clone());
            return Err(GroupError::Transport {
                rank: self.rank,
                what: what.to_string(),
                message,
            });
        }
        let failures: Vec<(u8, String)> = all
            .iter()
            .enumerate()
            .filter_map(|(r, (_, _, why))| why.clone().map(|w| (r as u8, w)))
            .collect();
        if !failures.is_empty() {
            // A failed rank's contribution stands in for whatever call its peers made.
            return Err(GroupError::PeerFailed { failures });
        }
        if let Some((other, (theirs, _, _))) =
            all.iter().enumerate().find(|(_, (w, _, _))| w != what)
        {
            let e = GroupError::Diverged {
                rank: self.rank,
                mine: what.to_string(),
                other: other as u8,
                theirs: theirs.clone(),
            };
            self.fail_for_good(what, e.to_string());
            return Err(e);
        }
        Ok(all
            .into_iter()
            .map(|(_, p, _)| p.unwrap_or_default())
            .collect())
    }

    /// Breaks this member only: a Python group has no side channel to tell its peers. They
    /// learn of it when this process leaves the group (its sockets close: their next round
    /// fails at once) or, at the latest, at the group's timeout; so a process whose cache
    /// aborted exits or destroys its process group (the replay's ranks exit).
    fn abort(&self, why: &str) {
        let what = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        self.fail_for_good(&what, why.to_string());
    }
}
