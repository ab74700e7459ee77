//! The synthesise and verify bench: a few pages of a pool or dense buffer and random prefix
//! hashes, verify running over correctly synthesised bytes (the cache-hit path).

use super::timing::{time_sized, Sizes, Timing};
use super::workload::{u32_bytes, Owned, SplitMix};
use crate::exec::{BufferId, ExecError, Executor, KernelArg, KernelId, LaunchConfig, MemKind};
use crate::kernels::{BufferKind, KernelSpec, PageTable, SynthSpec, TokenOrder, VerifySpec};
use crate::tuning::TuningError;

/// Pages a synthesise or verify timing covers: those kernels compute a splitmix64 draw for
/// every 8 bytes, so far fewer pages than a copy give a stable timing.
const SYNTH_PAGES: u32 = 8;

/// The pages a synthesise or verify bench of `sizes` really runs (a few: see [`SynthBench`]).
pub fn synth_pages(sizes: &Sizes) -> u32 {
    SYNTH_PAGES.min(sizes.pages.max(1))
}

/// Buffers of one synthesise or verify kernel: a pool (or dense buffer) of
/// a few (`SYNTH_PAGES`) pages, all owned by rank 0, and random prefix hashes. Verify runs over
/// the correctly synthesised bytes ([`SynthBench::for_verify`]), the path of every cache hit:
/// a mismatch costs the kernel an atomic that a match does not, so timing it over poison
/// would time the failure path.
pub struct SynthBench<'e> {
    mem: Owned<'e>,
    target: BufferId,
    /// `target` as synthesise's page table (a layer-major pool).
    table: PageTable,
    hashes: BufferId,
    seq_pages: BufferId,
    /// Verify's bitmap of mismatched tokens (one bit per token).
    bad_tokens: BufferId,
    n_pages: u32,
    n_tokens: u32,
    layers: u32,
}

impl<'e> SynthBench<'e> {
    /// Allocates the buffers for the synthesise kernel `spec` (a pool of one of its `cp`
    /// ranks), poisoned.
    pub fn new(
        exec: &'e dyn Executor,
        spec: &SynthSpec,
        sizes: &Sizes,
        seed: u64,
    ) -> Result<SynthBench<'e>, TuningError> {
        let shape = (spec.buffer, spec.cp, spec.page_size, spec.order);
        Self::build(exec, shape, sizes, seed, false)
    }

    /// Allocates the buffers for a verify kernel of `buffer` at `page_size`: a dense buffer
    /// that holds the synthesised bytes of every token (`reference::synthesise`), so the
    /// kernel finds no mismatch.
    pub fn for_verify(
        exec: &'e dyn Executor,
        spec: &VerifySpec,
        sizes: &Sizes,
        seed: u64,
    ) -> Result<SynthBench<'e>, TuningError> {
        let shape = (spec.buffer, 1, spec.page_size, spec.order);
        Self::build(exec, shape, sizes, seed, true)
    }

    /// The buffers for (buffer kind, CP, page size, token order).
    fn build(
        exec: &'e dyn Executor,
        (buffer, cp, page_size, order): (BufferKind, u8, u32, TokenOrder),
        sizes: &Sizes,
        seed: u64,
        synthesised: bool,
    ) -> Result<SynthBench<'e>, TuningError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        // Token-interleaved sequences are whole granules of `cp` pages.
        let granule = match order {
            TokenOrder::Paged => 1,
            TokenOrder::Interleaved { cp, .. } => u32::from(cp),
        };
        let n_pages = synth_pages(sizes).div_ceil(granule) * granule;
        let layers = sizes.layers.max(1);
        let n_tokens = n_pages * page_size;
        // Page `(i + 1) * cp` is owned by rank 0 and sits at local page `i + 1`.
        let pages: Vec<u32> = (0..n_pages).map(|i| (i + 1) * u32::from(cp)).collect();
        let local_pages = n_pages + 1;
        let bytes = u64::from(layers) * u64::from(local_pages) * buffer.page_bytes(page_size);
        let target = mem.alloc(MemKind::Device, bytes, 0xA5)?;
        let at = mem.alloc(MemKind::Device, 8 * u64::from(layers), 0)?;
        let page_bytes = buffer.page_bytes(page_size);
        let table = PageTable::layer_major((at, 0), target, layers, local_pages, page_bytes);
        let hashes = mem.alloc(MemKind::Device, 8 * u64::from(n_tokens), 0)?;
        let seq_pages = mem.alloc(MemKind::Device, 4 * u64::from(n_pages), 0)?;
        let bad_tokens = mem.alloc(MemKind::Device, 4 * u64::from(n_tokens.div_ceil(32)), 0)?;
        let mut rng = SplitMix(seed);
        let words: Vec<u64> = (0..n_tokens).map(|_| rng.next_u64()).collect();
        let h: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        exec.upload(hashes, 0, &h)?;
        exec.upload(seq_pages, 0, &u32_bytes(&pages))?;
        if synthesised {
            // Verify reads `target` as the dense [layer][n_pages][page bytes] from its start,
            // holding every token's bytes where the token order places it.
            let dense = crate::kernels::reference::dense(
                buffer, page_size, order, &words, n_tokens, layers,
            )
            .map_err(|e| TuningError::Reference {
                what: "synthesise",
                message: e.to_string(),
            })?;
            exec.upload(target, 0, &dense)?;
        }
        Ok(SynthBench {
            mem,
            target,
            table,
            hashes,
            seq_pages,
            bad_tokens,
            n_pages,
            n_tokens,
            layers,
        })
    }

    /// Launches `kernel` (a candidate of this bench's spec key) without synchronising.
    pub fn launch(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let d = spec.launch_dims(
            match spec {
                KernelSpec::Verify(_) => self.n_tokens,
                _ => self.n_pages,
            },
            self.layers,
        );
        let cfg = LaunchConfig::linear(d.grid, d.block);
        let args: Vec<KernelArg<'_>> = match spec {
            KernelSpec::Verify(_) => vec![
                KernelArg::Ptr(self.target, 0),
                KernelArg::Ptr(self.hashes, 0),
                KernelArg::U32(self.n_tokens),
                KernelArg::U32(0),
                KernelArg::U32(self.layers),
                KernelArg::Ptr(self.bad_tokens, 0),
            ],
            _ => vec![
                self.table.arg(),
                KernelArg::Ptr(self.hashes, 0),
                KernelArg::Ptr(self.seq_pages, 0),
                KernelArg::U32(self.n_tokens),
                KernelArg::U32(0),
                KernelArg::U32(0),
                KernelArg::U32(self.layers),
                KernelArg::U32(self.n_pages + 1),
                KernelArg::U32(self.table.page_stride),
            ],
        };
        self.mem.exec.launch(kernel, &cfg, &args)
    }

    /// Times `kernel`: launch and synchronise, median of the repeats.
    pub fn time(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
    ) -> Result<Timing, ExecError> {
        time_sized(self.mem.exec, sizes, || self.launch(kernel, spec))
    }
}
