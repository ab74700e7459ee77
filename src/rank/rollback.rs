//! All or nothing across the group: a rank's snapshot before an operation, the agreement
//! on its outcome, and the rollback every rank makes when any rank failed.

use super::*;

/// Bytes of a decision digest ([`RankCache::decision`]).
pub(super) const DIGEST: usize = 32;

/// This rank's state as it was before an operation, to roll back to on error.
pub(super) struct Snapshot {
    tree: RadixTree,
    mirror: OwnerLaneAllocator,
    host: HostPagePool,
}

/// What the operation in progress freed on this rank: device pages (identical on every
/// rank) and host pages (this rank's). Their bytes may since have been overwritten by the
/// same operation, so a rollback must not bring back nodes that still point at them.
#[derive(Default)]
pub(super) struct Freed {
    pub(super) device: BTreeSet<PageId>,
    pub(super) host: BTreeSet<HostPage>,
}

impl RankCache {
    /// Runs `step` as one operation every rank makes, all or nothing across the group: it
    /// succeeds on every rank, or every rank restores its state from before it. A rank
    /// whose step failed tells the group (its failure ends the round its peers are in); a
    /// rank that learns of a peer's failure stops there. The outcome round carries each
    /// rank's decision digest ([`RankCache::decision`] over `inputs` and the state the step
    /// left): ranks that decided differently all undo the step and fail with
    /// [`ClusterError::Diverged`] naming the ranks. An error that broke the group is
    /// returned without a rollback: no agreement on one is possible.
    pub(super) fn agreed<T>(
        &mut self,
        what: &str,
        inputs: &[u8],
        step: impl FnOnce(&mut Self) -> Result<T, ClusterError>,
    ) -> Result<T, ClusterError> {
        self.agreed_with(what, inputs, true, step)
    }

    /// [`RankCache::agreed`], taking the snapshot up front only with `snapshot`. Without,
    /// the caller promises that `step` changes no replicated state (tree, allocator, host
    /// pool), so the state at a rollback is the state before the step: it is cloned then, and
    /// only then. This spares a clone of the whole tree per step where most steps change
    /// nothing (a decoded token that fits the kept partial page). Ranks that disagree on
    /// whether a step is trivial still make the same rollback rounds.
    pub(super) fn agreed_with<T>(
        &mut self,
        what: &str,
        inputs: &[u8],
        snapshot: bool,
        step: impl FnOnce(&mut Self) -> Result<T, ClusterError>,
    ) -> Result<T, ClusterError> {
        self.check_connected()?;
        let snapshot = if snapshot {
            Some(self.snapshot())
        } else {
            self.start_step();
            None
        };
        let err = match step(self) {
            Ok(v) => {
                let mut mine = self.decision(what, inputs);
                let note = std::mem::take(&mut self.outcome_note);
                mine.extend(note);
                let round = format!("{what} outcome");
                let gathered = self.group.all_gather(&round, &mine);
                // Whatever the outcome, the roundless steps before it were compared.
                self.unagreed.clear();
                match gathered {
                    Ok(mut all) => {
                        self.check_round(&round, &all, |_, b| {
                            (b.len() < DIGEST || (b.len() - DIGEST) % 8 != 0).then(|| {
                                format!("{} bytes, not a decision digest and counts", b.len())
                            })
                        })?;
                        let notes: Vec<Vec<u8>> = all
                            .iter_mut()
                            .map(|b| b.split_off(b.len().min(DIGEST)))
                            .collect();
                        match self.check_agreement(what, &all) {
                            Ok(()) => {
                                self.outcome_notes = notes;
                                return Ok(v);
                            }
                            Err(e) => e,
                        }
                    }
                    Err(e) => ClusterError::from(e),
                }
            }
            Err(e) if e.is_peer_failure() || e.is_group_broken() => e,
            Err(e) => match self.group.fail(what, &e.to_string()) {
                Ok(_) => e,
                Err(broken) => broken.into(),
            },
        };
        if err.is_group_broken() {
            return Err(err);
        }
        let snapshot = snapshot.unwrap_or_else(|| self.state_now());
        self.roll_back(snapshot, what)?;
        Err(err)
    }

    /// Checks every rank's contribution to `round` with `valid` (`Some(what is wrong)`): a
    /// malformed one aborts the group, naming the rank and the round, since a replica that
    /// believed it could differ from its peers.
    pub(super) fn check_round(
        &self,
        round: &str,
        all: &[Vec<u8>],
        valid: impl Fn(usize, &[u8]) -> Option<String>,
    ) -> Result<(), ClusterError> {
        if let Some((peer, what)) = all
            .iter()
            .enumerate()
            .find_map(|(r, b)| Some((r, valid(r, b)?)))
        {
            let e = ClusterError::Malformed {
                rank: self.rank.0,
                round: round.to_string(),
                peer: peer as u8,
                what,
            };
            self.group.abort(&e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// Restores `snapshot` after a failed step. A rollback that stops half-way (its tree,
    /// allocator mirror or host pool could not be put back) leaves this replica in an unknown
    /// state, so it aborts the group, naming this rank and the step. One that put the state
    /// back but whose executor work failed (re-uploading the lanes, which leaves the
    /// allocator refusing until a later rollback heals it; poisoning) returns its error, and
    /// the group goes on.
    pub(super) fn roll_back(&mut self, snapshot: Snapshot, what: &str) -> Result<(), ClusterError> {
        self.restore(snapshot, what).map_err(|e| {
            let state_restored = matches!(e, ClusterError::KernelAlloc(_) | ClusterError::Exec(_));
            if e.is_group_broken() || state_restored {
                return e;
            }
            let why = format!(
                "rank {} could not roll {what} back ({e}): its replica may differ from its \
                 peers', so the group cannot serve any more",
                self.rank.0
            );
            self.group.abort(&why);
            ClusterError::Group(GroupError::Aborted {
                by: self.rank.0,
                what: what.to_string(),
                why,
            })
        })
    }

    /// A digest of what this rank decided in step `what`: its inputs (a prompt, a request's
    /// pages) and a summary of the replicated state the step left: each owner lane's free
    /// count and the next few pages it would hand out, and the tree's clock, node, slot and
    /// device-page counts. O(CP) beside the inputs: the full digests
    /// ([`RankCache::digest`]) read every page and key, too much for every step.
    pub(super) fn decision(&self, what: &str, inputs: &[u8]) -> Vec<u8> {
        /// Pages of each lane's top compared.
        const TOP: usize = 4;
        let mut h = Sha256::new();
        h.update(what.as_bytes());
        h.update((inputs.len() as u64).to_le_bytes());
        h.update(inputs);
        let mirror = self.alloc.mirror();
        for r in 0..self.layout.cp() {
            let lane = mirror.lane_stack(Rank(r));
            h.update((lane.len() as u64).to_le_bytes());
            for p in lane.iter().rev().take(TOP) {
                h.update(p.0.to_le_bytes());
            }
        }
        h.update(self.tree.summary_digest().0);
        // Steps decided without a round since the last one ride on this one.
        h.update(&self.unagreed);
        h.finalize().to_vec()
    }

    /// Compares the decision digests of one round (every rank's, in rank order). Every rank
    /// sees the same digests, so every rank comes to the same verdict.
    pub(super) fn check_agreement(&self, what: &str, all: &[Vec<u8>]) -> Result<(), ClusterError> {
        let mut groups: Vec<(&[u8], Vec<u8>)> = Vec::new();
        for (r, d) in all.iter().enumerate() {
            match groups.iter_mut().find(|(g, _)| *g == d.as_slice()) {
                Some((_, ranks)) => ranks.push(r as u8),
                None => groups.push((d, vec![r as u8])),
            }
        }
        if groups.len() <= 1 {
            return Ok(());
        }
        // The largest group first; ties in rank order.
        groups.sort_by_key(|(_, ranks)| std::cmp::Reverse(ranks.len()));
        Err(ClusterError::Diverged {
            rank: self.rank.0,
            step: what.to_string(),
            groups: groups.into_iter().map(|(_, r)| r).collect(),
        })
    }

    /// The bytes a step's decision digest covers for a request: its tokens and pages.
    pub(super) fn request_inputs(tokens: &[u32], pages: &[PageId], cached: usize) -> Vec<u8> {
        let mut h = Sha256::new();
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        h.update((cached as u64).to_le_bytes());
        for p in pages {
            h.update(p.0.to_le_bytes());
        }
        h.finalize().to_vec()
    }

    pub(super) fn snapshot(&mut self) -> Snapshot {
        self.start_step();
        self.state_now()
    }

    /// Forgets what the last operation freed and noted: a new one starts.
    fn start_step(&mut self) {
        self.freed = Freed::default();
        self.outcome_note.clear();
        self.outcome_notes.clear();
        self.last_rollback = RollbackDrops::default();
    }

    /// A copy of the replicated state as it is now.
    fn state_now(&self) -> Snapshot {
        Snapshot {
            tree: self.tree.clone(),
            mirror: self.alloc.mirror().clone(),
            host: self.host.clone(),
        }
    }

    /// Puts this rank back to `snapshot` (every rank does, for the same operation), except
    /// that nodes whose pages the failed operation had freed stay dropped: those pages may
    /// have been handed out again and overwritten before the failure, so bringing the nodes
    /// back would serve foreign bytes. What each rank freed is all-gathered, so every replica
    /// drops the same nodes: host pages differ per rank, and a rank that failed early freed
    /// fewer device pages than its peers, which went on until they learnt of the failure.
    pub(super) fn restore(&mut self, snapshot: Snapshot, what: &str) -> Result<(), ClusterError> {
        let mut freed = std::mem::take(&mut self.freed);
        let mine: Vec<u8> = freed
            .device
            .iter()
            .flat_map(|p| p.0.to_le_bytes())
            .collect();
        let round = format!("{what} rollback: freed device pages");
        let all = self.group.all_gather(&round, &mine)?;
        self.check_round(&round, &all, |_, b| {
            (b.len() % 4 != 0).then(|| format!("{} bytes, not a list of u32 pages", b.len()))
        })?;
        for v in all {
            freed.device.extend(
                v.chunks_exact(4)
                    .map(|c| PageId(u32::from_le_bytes(c.try_into().expect("4 bytes")))),
            );
        }
        let Snapshot {
            mut tree,
            mut mirror,
            mut host,
        } = snapshot;
        let mine: Vec<u8> = tree
            .nodes_holding_host(&freed.host)
            .into_iter()
            .flat_map(|id| id.to_bits().to_le_bytes())
            .collect();
        let round = format!("{what} rollback: stale host copies");
        let all = self.group.all_gather(&round, &mine)?;
        self.check_round(&round, &all, |_, b| {
            (b.len() % 8 != 0).then(|| format!("{} bytes, not a list of u64 nodes", b.len()))
        })?;
        let host_nodes: BTreeSet<NodeId> = all
            .iter()
            .flat_map(|v| {
                v.chunks_exact(8)
                    .map(|c| NodeId::from_bits(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
            })
            .collect();
        let (pages, metas) = tree.drop_stale(&freed.device, &host_nodes)?;
        let drops = RollbackDrops {
            device_pages: pages.len() as u64,
            host_copies: metas.len() as u64,
        };
        mirror.free(&pages)?;
        for m in &metas {
            host.free(m.host_pages())?;
        }
        // Pages the failed operation allocated (or the rollback drops) become free: they may
        // hold bytes it wrote. So do the pages it evicted: an eviction that failed part-way
        // had not poisoned them yet.
        let mut released: BTreeSet<PageId> = (1..self.layout.pages())
            .map(PageId)
            .filter(|&p| self.alloc.mirror().is_allocated(p) && !mirror.is_allocated(p))
            .collect();
        released.extend(
            freed
                .device
                .iter()
                .copied()
                .filter(|&p| !mirror.is_allocated(p)),
        );
        // Host pages the failed operation allocated (a backup it wrote) become free too.
        let released_host: Vec<HostPage> = (0..self.host.capacity())
            .map(HostPage)
            .filter(|&p| self.host.is_allocated(p) && !host.is_allocated(p))
            .collect();
        // Pages the rollback frees may be read by a backup the failed operation started (of a
        // node it inserted): every pending backup finishes first (rare: a device-side wait).
        let waited = self.after_backups(None);
        self.tree = tree;
        self.host = host;
        let restored = self.alloc.restore(mirror);
        self.last_rollback = drops;
        let poisoned = self
            .poison_freed(released)
            .and_then(|()| self.poison_freed_host(released_host));
        restored?;
        waited?;
        poisoned
    }
}
