//! The fence between ranks whose peers read their pools through executors of their own
//! ([`PeerAccess::Mapped`](super::PeerAccess::Mapped): other processes on CUDA). A peer's
//! stream cannot wait on this rank's ordinary events, so each rank records an interprocess
//! event (`CU_EVENT_INTERPROCESS`) after the work its peers are about to read, before the
//! group round that tells them; after the round, each peer's cache stream waits for it on
//! the device. Before, the rank synchronised its stream on the host there: the step's
//! loads could not overlap anything the engine enqueued after them.
//!
//! Two slots alternate. A peer's wait takes the event's state when it is issued (after the
//! round that follows the recording), and a rank records the same slot again only after
//! the next round, which that peer reaches after its wait: so a wait never sees a later
//! recording than the one it was for. Executors without interprocess events (the host
//! executor, whose work has run when a call returns) fence on the host as before.

use super::{ClusterError, LoadHandle, RankCache};
use crate::exec::{EventId, ExecError, Executor};
use std::sync::Arc;

/// Slots of the ring (see the module documentation for why two suffice).
pub(super) const FENCE_SLOTS: usize = 2;

/// This rank's fence events and the handles its peers open them by.
pub(super) type OwnFences = (Vec<EventId>, Vec<Vec<u8>>);

/// This rank's interprocess events and its peers', opened here.
pub(super) struct Fences {
    exec: Arc<dyn Executor>,
    own: Vec<EventId>,
    /// `peers[r][slot]`: rank `r`'s events (none for this rank).
    peers: Vec<Vec<EventId>>,
    /// The slot the next recording takes.
    next: usize,
}

impl Fences {
    /// This rank's events and their handles (for the start-up round), or `None` where the
    /// executor has no interprocess events.
    pub(super) fn create(exec: &Arc<dyn Executor>) -> Result<Option<OwnFences>, ExecError> {
        let mut own = Vec::with_capacity(FENCE_SLOTS);
        let mut handles = Vec::with_capacity(FENCE_SLOTS);
        for _ in 0..FENCE_SLOTS {
            match exec.shared_event() {
                Ok((event, handle)) => {
                    own.push(event);
                    handles.push(handle);
                }
                Err(e) => {
                    for event in own {
                        exec.release_event(event);
                    }
                    return match e {
                        ExecError::Peer { .. } => Ok(None),
                        e => Err(e),
                    };
                }
            }
        }
        Ok(Some((own, handles)))
    }

    /// Opens every peer's events from the start-up round's handles (`all[r]`, rank `r`'s;
    /// `me` this rank). `None` (and this rank's events released) unless every rank offered
    /// a full ring: then every rank fences on the host alike. `Err((peer, error))` names the
    /// peer whose handle would not open.
    pub(super) fn open(
        exec: &Arc<dyn Executor>,
        own: Option<Vec<EventId>>,
        all: &[Vec<Vec<u8>>],
        me: usize,
    ) -> Result<Option<Fences>, (usize, ExecError)> {
        let Some(own) = own else {
            return Ok(None);
        };
        let mut fences = Fences {
            exec: exec.clone(),
            own,
            peers: vec![Vec::new(); all.len()],
            next: 0,
        };
        if all.iter().any(|h| h.len() != FENCE_SLOTS) {
            return Ok(None);
        }
        for (r, handles) in all.iter().enumerate() {
            if r == me {
                continue;
            }
            for h in handles {
                let event = exec.open_shared_event(h).map_err(|e| (r, e))?;
                fences.peers[r].push(event);
            }
        }
        Ok(Some(fences))
    }

    /// Records this rank's next slot at the current end of its cache's stream (which the
    /// caller has ordered after the work peers will read); returns the slot, for
    /// [`Fences::wait_peers`] after the round.
    pub(super) fn signal(&mut self) -> Result<usize, ExecError> {
        let slot = self.next;
        self.exec.record_shared(self.own[slot])?;
        self.next = (slot + 1) % FENCE_SLOTS;
        Ok(slot)
    }

    /// Makes this rank's cache stream wait, on the device, for every peer's recording of
    /// `slot` (every rank signalled it before the round this follows). A wait the device
    /// refuses falls back to waiting on the host for that peer's recording.
    pub(super) fn wait_peers(&self, slot: usize) -> Result<(), ExecError> {
        for events in self.peers.iter().filter(|e| !e.is_empty()) {
            let event = events[slot];
            if let Err(e) = self.exec.wait_event(event) {
                tracing::warn!(
                    "a peer's fence could not be waited for on the device ({e}); the host waits"
                );
                self.exec.sync_event(event)?;
            }
        }
        Ok(())
    }
}

impl RankCache {
    /// The fence before a round after which peers read what this rank enqueued (only for a
    /// [`PeerAccess::Mapped`](super::PeerAccess::Mapped) group of several ranks): with
    /// interprocess events, the cache's stream waits for `loads` on the device and this
    /// rank's next slot is recorded (returned, for [`RankCache::after_peer_fences`] after
    /// the round); otherwise the host synchronises the executor (`None`).
    pub(super) fn fence_own_work<'a>(
        &mut self,
        loads: impl IntoIterator<Item = &'a LoadHandle>,
    ) -> Result<Option<usize>, ExecError> {
        match self.fences.as_mut() {
            Some(fences) => {
                for load in loads {
                    load.wait_all()?;
                }
                fences.signal().map(Some)
            }
            None => self.exec.synchronize().map(|()| None),
        }
    }

    /// After the round that follows [`RankCache::fence_own_work`]'s `slot`: the cache's
    /// stream waits for every peer's fence, before anything this rank or its engine
    /// enqueues next reads their pools. A failure here (the device refused the wait and
    /// the host could not wait either: the device is gone) is the caller's error.
    pub(super) fn after_peer_fences(&self, slot: Option<usize>) -> Result<(), ClusterError> {
        match (slot, &self.fences) {
            (Some(slot), Some(fences)) => Ok(fences.wait_peers(slot)?),
            _ => Ok(()),
        }
    }
}

impl Drop for Fences {
    fn drop(&mut self) {
        for &event in self.own.iter().chain(self.peers.iter().flatten()) {
            self.exec.release_event(event);
        }
    }
}
