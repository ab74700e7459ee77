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
//!
//! **Per layer.** Where the engine waits for a load layer by layer
//! ([`RankCache::set_layer_waits`]), a step's layer-wise loads record a second ring's
//! interprocess event for each layer on the load stream, right after that layer's copies
//! ([`Executor::load_layers`]'s signals), and nothing waits for the whole load before the
//! round. After it, each loaded request's [`LoadHandle`] carries its peers' events of that
//! slot, so [`LoadHandle::wait_layer`] (and `wait_layer_on`, the engine's stream) waits for
//! layer `l` on every rank, on the device, while later layers still load everywhere. Those
//! waits are issued when the engine asks, possibly after later rounds: a wait then takes a
//! later recording of the same layer, which follows the one it was for on that peer's load
//! stream (whose loads run in order), so it waits longer, never too little; and since every
//! wait takes a recording made before it is issued, no two processes can wait on each
//! other in a cycle.

use super::{ClusterError, LoadHandle, RankCache};
use crate::exec::{EventId, ExecError, Executor};
use std::sync::Arc;

/// Slots of the ring (see the module documentation for why two suffice).
pub(super) const FENCE_SLOTS: usize = 2;

/// This rank's fence events and the handles its peers open them by: the whole ring's
/// `FENCE_SLOTS`, then the per-layer ring's, slot by slot, a layer at a time.
pub(super) type OwnFences = (Vec<EventId>, Vec<Vec<u8>>);

/// This rank's interprocess events and its peers', opened here.
pub(super) struct Fences {
    exec: Arc<dyn Executor>,
    own: Vec<EventId>,
    /// `peers[r][slot]`: rank `r`'s events (none for this rank).
    peers: Vec<Vec<EventId>>,
    /// The slot the next recording takes.
    next: usize,
    /// `own_layers[slot][layer]`: the per-layer ring.
    own_layers: Vec<Vec<EventId>>,
    /// Every peer's per-layer ring, shared with the load handles that wait on it.
    peer_layers: Arc<PeerLayers>,
    /// The per-layer slot the step's layer-wise loads record.
    layer_next: usize,
}

/// The peers' per-layer fence events, opened here: `events[r][slot][layer]` (none for
/// this rank). Released when the last load handle that waits on them is gone.
pub(super) struct PeerLayers {
    exec: Arc<dyn Executor>,
    events: Vec<Vec<Vec<EventId>>>,
}

/// The per-layer fences of one step's loads, on every peer: what a [`LoadHandle`] waits
/// on besides its own layer events.
#[derive(Clone)]
pub(super) struct PeerLayerFence {
    peers: Arc<PeerLayers>,
    slot: usize,
}

impl PeerLayerFence {
    /// Makes the cache's stream (or, with `stream`, the engine's) wait on the device for
    /// every peer's layer `layer` of this fence's step. A wait the device refuses falls
    /// back to the host waiting for that peer's recording.
    pub(super) fn wait(&self, layer: u32, stream: Option<u64>) -> Result<(), ExecError> {
        let exec = &self.peers.exec;
        for ring in self.peers.events.iter().filter(|e| !e.is_empty()) {
            let Some(&event) = ring[self.slot].get(layer as usize) else {
                continue;
            };
            let waited = match stream {
                None => exec.wait_event(event),
                // SAFETY: `LoadHandle::wait_layer_on`'s caller vouches for the stream.
                Some(s) => unsafe { exec.wait_event_on(event, s) },
            };
            host_fallback(exec.as_ref(), event, waited)?;
        }
        Ok(())
    }
}

/// After a device wait on a peer's `event`: where the device refused it, the host waits.
fn host_fallback(
    exec: &dyn Executor,
    event: EventId,
    waited: Result<(), ExecError>,
) -> Result<(), ExecError> {
    match waited {
        Ok(()) => Ok(()),
        Err(e) => {
            tracing::warn!(
                "a peer's fence could not be waited for on the device ({e}); the host waits"
            );
            exec.sync_event(event)
        }
    }
}

impl Fences {
    /// This rank's events and their handles (for the start-up round; both rings, the
    /// per-layer one for `layers` layers), or `None` where the executor has no
    /// interprocess events.
    pub(super) fn create(
        exec: &Arc<dyn Executor>,
        layers: u32,
    ) -> Result<Option<OwnFences>, ExecError> {
        let n = FENCE_SLOTS * (1 + layers as usize);
        let mut own = Vec::with_capacity(n);
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
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

    /// This rank's events (`own`, as [`Fences::create`] made them), kept here so that they
    /// are released when this goes; no peer's yet ([`Fences::open_peers`]).
    pub(super) fn new(exec: &Arc<dyn Executor>, mut own: Vec<EventId>) -> Fences {
        let layers = (own.len() / FENCE_SLOTS).saturating_sub(1);
        let own_layers: Vec<Vec<EventId>> = own
            .split_off(FENCE_SLOTS.min(own.len()))
            .chunks(layers.max(1))
            .map(<[_]>::to_vec)
            .collect();
        Fences {
            exec: exec.clone(),
            own,
            peers: Vec::new(),
            next: 0,
            own_layers,
            peer_layers: Arc::new(PeerLayers {
                exec: exec.clone(),
                events: Vec::new(),
            }),
            layer_next: 0,
        }
    }

    /// Opens every peer's events from the start-up round's handles (`all[r]`, rank `r`'s;
    /// `me` this rank). `Ok(false)`, opening nothing, unless every rank offered a full ring:
    /// then every rank fences on the host alike (the caller drops this). `Err((peer, error))`
    /// names the peer whose handle would not open; what was opened stays here, released
    /// when this goes, which the caller delays until its peers are past the round in which
    /// they open this rank's events (releasing its own events before would fail their
    /// opens, and they would name this rank for a failure that is not theirs).
    pub(super) fn open_peers(
        &mut self,
        all: &[Vec<Vec<u8>>],
        me: usize,
    ) -> Result<bool, (usize, ExecError)> {
        let layers = self.own_layers.first().map_or(0, Vec::len);
        let ring = FENCE_SLOTS + self.own_layers.len() * layers;
        if all.iter().any(|h| h.len() != ring) {
            return Ok(false);
        }
        let exec = self.exec.clone();
        self.peers = vec![Vec::new(); all.len()];
        // Each event goes where it is kept as soon as it is open, so that the drops of
        // `self` and its `PeerLayers` release whatever was opened.
        let rings = Arc::get_mut(&mut self.peer_layers).expect("not shared yet");
        rings.events = vec![Vec::new(); all.len()];
        for (r, handles) in all.iter().enumerate() {
            if r == me {
                continue;
            }
            let open = |h: &Vec<u8>| exec.open_shared_event(h).map_err(|e| (r, e));
            let (whole, per_layer) = handles.split_at(FENCE_SLOTS);
            for h in whole {
                self.peers[r].push(open(h)?);
            }
            for slot in per_layer.chunks(layers.max(1)) {
                rings.events[r].push(Vec::with_capacity(slot.len()));
                for h in slot {
                    let event = open(h)?;
                    rings.events[r]
                        .last_mut()
                        .expect("pushed above")
                        .push(event);
                }
            }
        }
        Ok(true)
    }

    /// The per-layer events this step's layer-wise loads record, one per layer (the
    /// signals of [`Executor::load_layers`]).
    pub(super) fn layer_signals(&self) -> Vec<EventId> {
        self.own_layers
            .get(self.layer_next)
            .cloned()
            .unwrap_or_default()
    }

    /// Closes the per-layer slot the step's loads recorded (the next step's take the other)
    /// and returns its peers' side, for the step's load handles after the round.
    pub(super) fn close_layers(&mut self) -> PeerLayerFence {
        let slot = self.layer_next;
        self.layer_next = (slot + 1) % FENCE_SLOTS;
        PeerLayerFence {
            peers: self.peer_layers.clone(),
            slot,
        }
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
            host_fallback(self.exec.as_ref(), event, self.exec.wait_event(event))?;
        }
        Ok(())
    }
}

/// A fence made before a round, for after it.
pub(super) enum Fence {
    /// This rank's whole-ring slot: after the round, the cache's stream waits for every
    /// peer's recording of it.
    Whole(usize),
    /// The per-layer slot the step's layer-wise loads recorded: after the round, their
    /// handles wait for each peer's layer with their own.
    Layers(PeerLayerFence),
}

impl RankCache {
    /// The fence of a step's loads that recorded the per-layer ring (every one of `loads`,
    /// layer-wise, in a step whose readers wait per layer): nothing more to enqueue, their
    /// slot is closed, and after the round their handles wait for the peers' layers.
    /// `None` where they did not (or there are none): fence with
    /// [`RankCache::fence_own_work`].
    pub(super) fn fence_layers<'a>(
        &mut self,
        loads: impl IntoIterator<Item = &'a LoadHandle>,
    ) -> Option<Fence> {
        let fences = self.fences.as_mut()?;
        let mut loads = loads.into_iter().peekable();
        loads.peek()?;
        loads
            .all(|l| l.signalled)
            .then(|| Fence::Layers(fences.close_layers()))
    }

    /// The fence before a round after which peers read what this rank enqueued (only for a
    /// [`PeerAccess::Mapped`](super::PeerAccess::Mapped) group of several ranks): with
    /// interprocess events, the cache's stream waits for `loads` on the device and this
    /// rank's next whole slot is recorded after everything it enqueued (returned, for
    /// [`RankCache::after_peer_fences`] after the round); otherwise the host synchronises the
    /// executor (`None`).
    pub(super) fn fence_own_work<'a>(
        &mut self,
        loads: impl IntoIterator<Item = &'a LoadHandle>,
    ) -> Result<Option<Fence>, ExecError> {
        match self.fences.as_mut() {
            Some(fences) => {
                for load in loads {
                    load.wait_all()?;
                }
                fences.signal().map(|slot| Some(Fence::Whole(slot)))
            }
            None => self.exec.synchronize().map(|()| None),
        }
    }

    /// After the round that follows [`RankCache::fence_own_work`]'s (or
    /// [`RankCache::fence_layers`]') `fence`: for a whole
    /// slot, the cache's stream waits for every peer's fence, before anything this rank or
    /// its engine enqueues next reads their pools; for a per-layer one, each of `loads` (the
    /// same loads) waits for its peers' layers with its own. A failure here (the device
    /// refused the wait and the host could not wait either: the device is gone) is the
    /// caller's error.
    pub(super) fn after_peer_fences<'a>(
        &self,
        fence: Option<Fence>,
        loads: impl IntoIterator<Item = &'a mut LoadHandle>,
    ) -> Result<(), ClusterError> {
        match (fence, &self.fences) {
            (Some(Fence::Whole(slot)), Some(fences)) => fences.wait_peers(slot)?,
            (Some(Fence::Layers(peers)), _) => {
                for load in loads {
                    load.peers = Some(peers.clone());
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl Drop for Fences {
    fn drop(&mut self) {
        let own_layers = self.own_layers.iter().flatten();
        for &event in self
            .own
            .iter()
            .chain(self.peers.iter().flatten())
            .chain(own_layers)
        {
            self.exec.release_event(event);
        }
    }
}

impl Drop for PeerLayers {
    fn drop(&mut self) {
        for &event in self.events.iter().flatten().flatten() {
            self.exec.release_event(event);
        }
    }
}
