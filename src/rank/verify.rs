//! Compute, materialise and verify: a rank synthesises the pages it owns, then reads the
//! whole sequence from every owner's pool through its own views and checks every token.

use super::*;
use crate::kernels::PageTable;

/// The mismatched tokens one rank's verify found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mismatches {
    /// Tokens mismatched in any buffer kind (each counted once).
    pub count: u64,
    /// The first of them.
    pub first: Option<u64>,
}

impl Mismatches {
    /// Counts the set bits of a little-endian `u32` bitmap (bit `t % 32` of word `t / 32`).
    pub(super) fn from_bitmap(bytes: &[u8]) -> Mismatches {
        let mut m = Mismatches::default();
        for (i, c) in bytes.chunks_exact(4).enumerate() {
            let w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if w != 0 && m.first.is_none() {
                m.first = Some(32 * i as u64 + u64::from(w.trailing_zeros()));
            }
            m.count += u64::from(w.count_ones());
        }
        m
    }
}

/// What a request's verification found on every rank: the union of their bitmaps (each
/// mismatched token counted once, whichever rank saw it) and each rank's own count.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Over all ranks.
    pub all: Mismatches,
    /// Per rank, in rank order.
    pub by_rank: Vec<u64>,
    /// Bytes of its own pages this rank sent through the group for its peers to verify
    /// ([`PeerAccess::Gathered`]; 0 otherwise).
    pub bytes_gathered: u64,
}

impl RankCache {
    /// Synthesises this rank's share of tokens `[first_token, ..)` of the sequence whose
    /// prefix hashes are `hashes` into its pool (the stand-in for the model's forward): only
    /// those tokens, so an extended request's kept partial page keeps what earlier steps
    /// wrote. No group round.
    pub(super) fn synthesise_tokens(
        &mut self,
        hashes: &[u64],
        pages: &[PageId],
        first_token: usize,
    ) -> Result<(), ClusterError> {
        if first_token >= hashes.len() {
            return Ok(());
        }
        let g = self.pools.geometry();
        let n_tokens = hashes.len() as u32;
        let order = self.config.deployment.token_order();
        let items = reference::synthesise_items(
            order,
            self.layout.page_size(),
            n_tokens,
            first_token as u32,
        );
        // Where the launch starts reading the page list (not `pages.len() - items`: a
        // request's pages are whole granules, which may be more than the kernel visits).
        let first_page =
            reference::synthesise_first_page(order, self.layout.page_size(), first_token as u32)
                as usize;
        let page_ids: Vec<u32> = pages.iter().map(|p| p.0).collect();
        let (hash_buf, page_buf) =
            self.pools
                .upload_sequence_tail(hashes, &page_ids, first_token, first_page)?;
        for b in self.config.deployment.model.buffers() {
            let synth = self.kernels.synthesise(b);
            let table = self.pools.device_table(b);
            self.exec.launch(
                synth.id,
                &synth.launch(items, g.layers),
                &[
                    table.arg(),
                    KernelArg::Ptr(hash_buf, 0),
                    KernelArg::Ptr(page_buf, 0),
                    KernelArg::U32(n_tokens),
                    KernelArg::U32(first_token as u32),
                    KernelArg::U32(u32::from(self.rank.0)),
                    KernelArg::U32(g.layers),
                    KernelArg::U32(g.local_pages),
                    KernelArg::U32(table.page_stride),
                ],
            )?;
        }
        Ok(())
    }

    /// Synthesises tokens `[first_token, ..)` this rank owns ([`RankCache::synthesise_tokens`]),
    /// then verifies the whole sequence ([`RankCache::verify_sequence`]).
    pub(super) fn compute_and_verify(
        &mut self,
        hashes: &[u64],
        pages: &[PageId],
        first_token: usize,
        n: usize,
        load: Option<&LoadHandle>,
    ) -> Result<Verdict, ClusterError> {
        self.synthesise_tokens(hashes, pages, first_token)?;
        self.verify_sequence(hashes, pages, n, load)
    }

    /// Once every rank has written its pages, materialises the whole sequence from the
    /// owners' pools over this rank's view and verifies every token (a kept partial page's
    /// included): the verify kernels of every buffer kind set bits in one token bitmap, so a
    /// token wrong in several counts once. The ranks' bitmaps are all-gathered: the verdict
    /// counts each token once over all ranks and says what each rank saw. Two group rounds.
    pub(super) fn verify_sequence(
        &mut self,
        hashes: &[u64],
        pages: &[PageId],
        n: usize,
        load: Option<&LoadHandle>,
    ) -> Result<Verdict, ClusterError> {
        let page_ids: Vec<u32> = pages.iter().map(|p| p.0).collect();
        let (hash_buf, page_buf) = self.pools.upload_sequence(hashes, &page_ids)?;
        let n_tokens = hashes.len();
        let words = n_tokens.div_ceil(32);
        let mut bytes_gathered = 0;
        if let (Some(load), true) = (load, self.group.size() > 1) {
            // Peers read this rank's loaded pages (or it reads them back for them) after
            // waiting for their own loads' layers only: the whole load first (a wait on the
            // device; with peers of their own executors, the synchronisation below).
            load.wait_all()?;
        }
        let mine = if self.peer_access == PeerAccess::Gathered && self.group.size() > 1 {
            // No rank reaches a peer's pool: each reads back the pages it owns and the
            // group carries them to every rank. The round is the *written* barrier too.
            let n_pages = self.pages_holding(n_tokens as u32);
            let owners = self.share_positions(&page_ids[..n_pages as usize]);
            let mine: Vec<u32> = owners[usize::from(self.rank.0)]
                .iter()
                .map(|&i| page_ids[i])
                .collect();
            let share = self.read_own_share(&mine, load)?;
            bytes_gathered = share.len() as u64;
            let round = format!("request {n} written");
            let all = self.group.all_gather(&round, &share)?;
            let want = |r: usize| self.share_bytes(owners[r].len());
            self.check_round(&round, &all, |r, b| {
                (b.len() as u64 != want(r)).then(|| {
                    format!(
                        "{} bytes of its {} pages of the sequence, not {}",
                        b.len(),
                        owners[r].len(),
                        want(r)
                    )
                })
            })?;
            if self.verifies {
                self.verify_gathered(n_tokens as u32, hash_buf, words, &owners, &all)?
            } else {
                vec![0u8; 4 * words]
            }
        } else {
            // Peers read this rank's pool through their own executors (other processes, on
            // CUDA), which cannot wait on this one's ordinary events: what it enqueued (its
            // loads included) must have run before they read. With interprocess events the
            // cache's stream waits for the load and records this rank's fence; after the
            // barrier each rank's stream waits for its peers' (on the device). Otherwise
            // the host synchronises, after the load path, so not counted in
            // `load_path_syncs` (module documentation); removing both makes the
            // multi-process test of the stand-in driver read stale pools.
            let mut fence = None;
            if self.peer_access == PeerAccess::Mapped && self.group.size() > 1 {
                fence = self.fence_own_work(load)?;
            }
            // Every rank's loaded and computed pages are in its pool before any peer reads
            // them.
            self.group.barrier(&format!("request {n} written"))?;
            self.after_peer_fences(fence, None)?;
            if self.verifies {
                self.materialise_and_verify(n_tokens as u32, (hash_buf, page_buf), words, load)?
            } else {
                vec![0u8; 4 * words]
            }
        };
        // The read-back waited for this rank's reads of its peers' pools; once every rank's
        // has, no rank frees, poisons or reuses a page of this sequence too early.
        let round = format!("request {n} verified");
        let all = self.group.all_gather(&round, &mine)?;
        self.check_round(&round, &all, |_, b| {
            (b.len() != 4 * words)
                .then(|| format!("a {}-byte bitmap for {n_tokens} tokens", b.len()))
        })?;
        let mut union = vec![0u8; 4 * words];
        let mut by_rank = Vec::with_capacity(all.len());
        for bitmap in &all {
            by_rank.push(Mismatches::from_bitmap(bitmap).count);
            for (u, b) in union.iter_mut().zip(bitmap) {
                *u |= b;
            }
        }
        Ok(Verdict {
            all: Mismatches::from_bitmap(&union),
            by_rank,
            bytes_gathered,
        })
    }

    /// Gathers the `n` pages listed in `pages` of buffer kind `b` into `dense`
    /// (`[layer][page][bytes]`), one one-layer launch per layer over that layer's page table
    /// (`table`), each after waiting for that layer of the load-back (the way attention
    /// would).
    fn materialise_layers(
        &self,
        b: BufferKind,
        (pages, n): (crate::exec::BufferId, u32),
        dense: crate::exec::BufferId,
        load: Option<&LoadHandle>,
        table: impl Fn(&Pools, u32) -> Result<PageTable, ClusterError>,
    ) -> Result<(), ClusterError> {
        let g = self.pools.geometry();
        let mat = self.kernels.materialise(b);
        let page_bytes = b.page_bytes(self.layout.page_size());
        for layer in 0..g.layers {
            if let Some(load) = load {
                load.wait_layer(layer)?;
            }
            let pools = table(&self.pools, layer)?;
            self.exec.launch(
                mat.id,
                &mat.launch(n, 1),
                &[
                    pools.arg(),
                    KernelArg::Ptr(pages, 0),
                    KernelArg::U32(n),
                    KernelArg::U32(1),
                    KernelArg::U32(g.local_pages),
                    KernelArg::U32(pools.page_stride),
                    KernelArg::Ptr(dense, u64::from(layer) * u64::from(n) * page_bytes),
                ],
            )?;
        }
        Ok(())
    }

    /// Reads back this rank's mismatch bitmap of `words` words once every buffer kind is
    /// verified, keeping the dense buffers captured (dense capture).
    fn verified(
        &mut self,
        bad_tokens: crate::exec::BufferId,
        words: usize,
        captured: Vec<(BufferKind, Vec<u8>)>,
    ) -> Result<Vec<u8>, ClusterError> {
        if self.capture_dense {
            self.last_dense = captured;
        }
        let mut mine = vec![0u8; 4 * words];
        self.exec.read(bad_tokens, 0, &mut mine)?;
        Ok(mine)
    }

    /// Verifies the dense sequence of buffer kind `b` in `dense` (every layer), setting the
    /// bits of mismatched tokens in `bad_tokens`.
    fn launch_verify(
        &self,
        b: BufferKind,
        dense: crate::exec::BufferId,
        hash_buf: crate::exec::BufferId,
        n_tokens: u32,
        bad_tokens: crate::exec::BufferId,
    ) -> Result<(), ClusterError> {
        let ver = self.kernels.verify(b);
        self.exec.launch(
            ver.id,
            &ver.launch(n_tokens, self.pools.geometry().layers),
            &[
                KernelArg::Ptr(dense, 0),
                KernelArg::Ptr(hash_buf, 0),
                KernelArg::U32(n_tokens),
                KernelArg::U32(0),
                KernelArg::U32(self.pools.geometry().layers),
                KernelArg::Ptr(bad_tokens, 0),
            ],
        )?;
        Ok(())
    }

    /// The pages holding a sequence's `n_tokens` tokens: whole granules when tokens are
    /// interleaved.
    fn pages_holding(&self, n_tokens: u32) -> u32 {
        self.config
            .deployment
            .layout
            .placement(self.layout.cp(), self.layout.page_size())
            .pages_holding(u64::from(n_tokens)) as u32
    }

    /// Per owner, in rank order, the positions in the sequence of the pages it owns (global
    /// page `p` is rank `p % cp`'s, as the kernels read it).
    fn share_positions(&self, page_ids: &[u32]) -> Vec<Vec<usize>> {
        let cp = self.group.size();
        let mut owners = vec![Vec::new(); cp];
        for (i, &p) in page_ids.iter().enumerate() {
            owners[p as usize % cp].push(i);
        }
        owners
    }

    /// Bytes of `pages` pages in every layer of every buffer kind: one rank's share.
    fn share_bytes(&self, pages: usize) -> u64 {
        let per_page: u64 = self
            .config
            .deployment
            .model
            .buffers()
            .iter()
            .map(|b| b.page_bytes(self.layout.page_size()))
            .sum();
        per_page * u64::from(self.pools.geometry().layers) * pages as u64
    }

    /// Under [`PeerAccess::Gathered`]: the sequence's pages this rank owns (`share`, global
    /// page ids in sequence order), read from its own pool by the materialise kernel (each
    /// layer after its load-back) and read back; per buffer kind in the model's order,
    /// `[layer][page][bytes]`.
    fn read_own_share(
        &mut self,
        share: &[u32],
        load: Option<&LoadHandle>,
    ) -> Result<Vec<u8>, ClusterError> {
        let g = self.pools.geometry();
        let mut out = Vec::with_capacity(self.share_bytes(share.len()) as usize);
        if share.is_empty() {
            return Ok(out);
        }
        let k = share.len() as u32;
        let list = self.pools.upload_share(share)?;
        let owners = self.group.size();
        for b in self.config.deployment.model.buffers() {
            let compact = self.pools.dense(b, k, false)?;
            let page_bytes = b.page_bytes(self.layout.page_size());
            self.materialise_layers(b, (list, k), compact, load, |pools, layer| {
                Ok(pools.own_table(b, layer, owners))
            })?;
            let at = out.len();
            out.resize(at + (page_bytes * u64::from(k * g.layers)) as usize, 0);
            self.exec.read(compact, 0, &mut out[at..])?;
        }
        Ok(out)
    }

    /// Under [`PeerAccess::Gathered`]: lays every owner's share (`shares[r]`, its pages at
    /// `owners[r]`) out as the dense sequence, uploads it and verifies every token; returns
    /// this rank's mismatch bitmap.
    fn verify_gathered(
        &mut self,
        n_tokens: u32,
        hash_buf: crate::exec::BufferId,
        words: usize,
        owners: &[Vec<usize>],
        shares: &[Vec<u8>],
    ) -> Result<Vec<u8>, ClusterError> {
        let g = self.pools.geometry();
        let layers = g.layers as usize;
        let n_pages = owners.iter().map(Vec::len).sum::<usize>();
        let bad_tokens = self.pools.zeroed_words(words)?;
        let mut captured = Vec::new();
        // Where each owner's share of the current buffer kind starts.
        let mut at = vec![0usize; owners.len()];
        for b in self.config.deployment.model.buffers() {
            let pb = b.page_bytes(self.layout.page_size()) as usize;
            let mut dense = vec![0u8; pb * n_pages * layers];
            for (r, positions) in owners.iter().enumerate() {
                let k = positions.len();
                for layer in 0..layers {
                    for (j, &i) in positions.iter().enumerate() {
                        let from = at[r] + (layer * k + j) * pb;
                        let to = (layer * n_pages + i) * pb;
                        dense[to..to + pb].copy_from_slice(&shares[r][from..from + pb]);
                    }
                }
                at[r] += k * layers * pb;
            }
            let buf = self.pools.dense(b, n_pages as u32, false)?;
            self.exec.upload(buf, 0, &dense)?;
            self.launch_verify(b, buf, hash_buf, n_tokens, bad_tokens)?;
            if self.capture_dense {
                captured.push((b, dense));
            }
        }
        self.verified(bad_tokens, words, captured)
    }

    /// Materialises the sequence from every owner's pool through this rank's views, layer
    /// by layer, each after waiting for that layer of this request's load-back (the way
    /// attention would), and verifies it; returns this rank's mismatch bitmap.
    pub(super) fn materialise_and_verify(
        &mut self,
        n_tokens: u32,
        (hash_buf, page_buf): (crate::exec::BufferId, crate::exec::BufferId),
        words: usize,
        load: Option<&LoadHandle>,
    ) -> Result<Vec<u8>, ClusterError> {
        let g = self.pools.geometry();
        let n_pages = self.pages_holding(n_tokens);
        let bad_tokens = self.pools.zeroed_words(words)?;
        let mut captured = Vec::new();
        for b in self.config.deployment.model.buffers() {
            let dense = self.pools.dense(b, n_pages, self.repoison)?;
            let rank = self.rank.0;
            self.materialise_layers(b, (page_buf, n_pages), dense, load, |pools, layer| {
                pools.views_table(b, layer).ok_or_else(|| {
                    ClusterError::Config(format!(
                        "rank {rank}: a peer's {b} pool is out of this rank's reach"
                    ))
                })
            })?;
            self.launch_verify(b, dense, hash_buf, n_tokens, bad_tokens)?;
            if self.capture_dense {
                let bytes = b.page_bytes(self.layout.page_size()) as usize
                    * n_pages as usize
                    * g.layers as usize;
                let mut out = vec![0u8; bytes];
                self.exec.read(dense, 0, &mut out)?;
                captured.push((b, out));
            }
        }
        self.verified(bad_tokens, words, captured)
    }
}
