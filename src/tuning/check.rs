//! `bench --check`: runs every kernel family of a deployment on the executor at hand on random
//! inputs with poisoned outputs and compares the bytes with the Rust references of
//! `kernels::reference` (the oracle the host executor is tested against), so a GPU run proves
//! the CUDA executor computes exactly what the host does.

use serde::Serialize;
use std::ops::Range;

use super::candidate::LaunchChoice;
use super::measure::{
    compile_and_load, u32_bytes, AllocBench, BusyBench, CopyBench, Sizes, SourceHook, SplitMix,
};
use super::TuningError;
use crate::exec::{BufferId, DmaMode, Executor, KernelArg, KernelId, LaunchConfig, MemKind};
use crate::jit::Jit;
use crate::kernels::{reference, Deployment, KernelSpec, PageTable};

/// The outcome of one kernel's check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckRow {
    /// Kernel uri.
    pub kernel: String,
    /// Family name.
    pub family: String,
    /// Whether the output equals the reference.
    pub ok: bool,
    /// Bytes compared, or the failure.
    pub detail: String,
}

fn reference_err(what: &'static str) -> impl Fn(reference::ReferenceError) -> TuningError {
    move |e| TuningError::Reference {
        what,
        message: e.to_string(),
    }
}

fn read_all(exec: &dyn Executor, b: BufferId) -> Result<Vec<u8>, TuningError> {
    let mut out = vec![0u8; exec.size(b)?];
    exec.read(b, 0, &mut out)?;
    Ok(out)
}

fn compare(got: &[u8], want: &[u8]) -> Result<String, String> {
    if got.len() != want.len() {
        return Err(format!("length {} vs {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(format!("{} bytes equal", got.len())),
        Some(i) => Err(format!(
            "first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        )),
    }
}

/// Checks every kernel of `dep` on `exec`; one row per kernel, plus one `dma(<uri>)` row per
/// transfer for its DMA path on the same inputs. Errors are harness failures
/// (allocation, compile); a wrong output is a row with `ok: false`.
pub fn check_deployment(
    exec: &dyn Executor,
    jit: &Jit,
    dep: &Deployment,
) -> Result<Vec<CheckRow>, TuningError> {
    // SAFETY: no hook, so every kernel is the JIT's build of its spec.
    unsafe { check_deployment_with(exec, jit, dep, None) }
}

/// [`check_deployment`] with `hook` editing kernel sources before they are compiled (fault
/// injection: a kernel whose source no longer compiles is a failed row, the others run).
///
/// # Safety
///
/// The edited kernels are launched: `hook` must keep every kernel within its spec's
/// signature, each parameter's [`Reach`](crate::kernels::Reach), as the rendered source does
/// (breaking the compile, or changing the values written, is fine; an edit that indexes
/// further is not).
pub unsafe fn check_deployment_with(
    exec: &dyn Executor,
    jit: &Jit,
    dep: &Deployment,
    hook: Option<SourceHook<'_>>,
) -> Result<Vec<CheckRow>, TuningError> {
    // SAFETY: the caller vouches for `hook`.
    unsafe { check_specs(exec, jit, &dep.specs(), hook, true) }
}

/// Checks `specs` (e.g. the launch shapes a benchmark times besides a deployment's defaults)
/// like [`check_deployment_with`], without the DMA rows (the DMA path has no launch shape).
///
/// # Safety
///
/// As for [`check_deployment_with`]: `hook` keeps every kernel's accesses in bounds.
pub unsafe fn check_specs_with(
    exec: &dyn Executor,
    jit: &Jit,
    specs: &[KernelSpec],
    hook: Option<SourceHook<'_>>,
) -> Result<Vec<CheckRow>, TuningError> {
    // SAFETY: the caller vouches for `hook`.
    unsafe { check_specs(exec, jit, specs, hook, false) }
}

/// # Safety
///
/// `hook` keeps every kernel's accesses in bounds ([`check_deployment_with`]).
unsafe fn check_specs(
    exec: &dyn Executor,
    jit: &Jit,
    specs: &[KernelSpec],
    hook: Option<SourceHook<'_>>,
    with_dma: bool,
) -> Result<Vec<CheckRow>, TuningError> {
    // SAFETY: the caller vouches for `hook`.
    let loaded = unsafe { compile_and_load(exec, jit, specs, false, hook, &|| {}) };
    let mut rows = Vec::with_capacity(specs.len());
    let row = |kernel: String, family: String, outcome: Result<String, String>| CheckRow {
        kernel,
        family,
        ok: outcome.is_ok(),
        detail: match outcome {
            Ok(d) | Err(d) => d,
        },
    };
    let flatten =
        |r: Result<Result<String, String>, TuningError>| r.unwrap_or_else(|e| Err(e.to_string()));
    for (i, (spec, k)) in specs.iter().zip(loaded).enumerate() {
        let seed = 0xC0FFEE + i as u64;
        let outcome = match &k {
            Err(e) => Err(format!("compile/load: {e}")),
            Ok(kernel) => flatten(check_one(exec, spec, *kernel, seed)),
        };
        rows.push(row(spec.uri(), spec.family().to_string(), outcome));
        if let (KernelSpec::TransferPages(_), true) = (spec, with_dma) {
            // The DMA path of the same transfer, on the same random inputs; where a batch is
            // one call (cuMemcpyBatchAsync), one call per merged region as well (`dma-each`,
            // which tune weighs too). Elsewhere the two are the same calls: checked once.
            let mut modes = vec![DmaMode::Batched];
            if exec.batched_copies() {
                modes.push(DmaMode::PerRegion);
            }
            for mode in modes {
                let name = LaunchChoice::of_dma(mode);
                rows.push(row(
                    format!("{name}({})", spec.uri()),
                    format!("{} ({name})", spec.family()),
                    flatten(check_transfer(exec, spec, seed, |b| b.copy_dma_with(mode))),
                ));
            }
            // The staged path: the same kernel between the device pools and a staging
            // buffer, the host's pages copied to or from it as contiguous runs.
            if let Ok(kernel) = &k {
                let kernel = *kernel;
                rows.push(row(
                    format!("dma-staged({})", spec.uri()),
                    format!("{} (dma-staged)", spec.family()),
                    flatten(check_transfer(exec, spec, seed, |b| {
                        b.copy_staged(kernel, spec, DmaMode::Batched)
                    })),
                ));
            }
        }
    }
    Ok(rows)
}

/// Workload of every check: odd sizes, so partial groups and tails are exercised.
const CHECK_SIZES: Sizes = Sizes {
    pages: 37,
    layers: 3,
    warmup: 0,
    repeats: 1,
};

/// Output words of the busy kernel's check.
const BUSY_CHECK_WORDS: u32 = 1001;

/// Requests of the select and release checks, at least.
const CHECK_REQUESTS: u32 = 300;

/// The check workload of a copy spec: [`CHECK_SIZES`], grown so that at least two full page
/// groups and a partial one run (a candidate of 64 pages per block is timed on several full
/// blocks; checking it on one partial block would leave that path unchecked).
fn copy_check_sizes(launch: &crate::kernels::CopyLaunch) -> Sizes {
    Sizes {
        pages: CHECK_SIZES.pages.max(2 * launch.pages_per_block + 5),
        ..CHECK_SIZES
    }
}

/// Requests of an allocator check with `threads` per block: at least two full tiles and a
/// partial one, so the carry between tiles runs.
fn alloc_check_requests(threads: u32) -> u32 {
    CHECK_REQUESTS.max(2 * threads + 37)
}

/// The layer ranges every transfer check runs, each on fresh poisoned pools: every layer,
/// one middle layer (the others must keep their poison), and a range running far past the
/// pools' layers (only its valid part moves).
const CHECK_LAYER_RANGES: [Range<u32>; 3] = [0..u32::MAX, 1..2, 2..u32::MAX];

/// Checks a transfer spec's page pairs moved by `run` (its kernel, or the DMA path) against
/// the reference, on random source bytes, once per range of [`CHECK_LAYER_RANGES`]: every
/// layer, then partial layer ranges (a failure of those names its range).
pub(super) fn check_transfer(
    exec: &dyn Executor,
    spec: &KernelSpec,
    seed: u64,
    run: impl Fn(&CopyBench<'_>) -> Result<(), crate::exec::ExecError>,
) -> Result<Result<String, String>, TuningError> {
    let mut detail = String::new();
    for (i, range) in CHECK_LAYER_RANGES.into_iter().enumerate() {
        let outcome = check_transfer_layers(exec, spec, seed, range.clone(), &run)?;
        match (i, outcome) {
            (0, Ok(d)) => detail = d,
            (0, Err(d)) => return Ok(Err(d)),
            (_, Ok(_)) => {}
            (_, Err(d)) => return Ok(Err(format!("layer range {range:?}: {d}"))),
        }
    }
    Ok(Ok(format!(
        "{detail}; layer ranges {:?} and {:?} too",
        CHECK_LAYER_RANGES[1], CHECK_LAYER_RANGES[2]
    )))
}

/// [`check_transfer`] of one layer range.
fn check_transfer_layers(
    exec: &dyn Executor,
    spec: &KernelSpec,
    seed: u64,
    layer_range: Range<u32>,
    run: impl Fn(&CopyBench<'_>) -> Result<(), crate::exec::ExecError>,
) -> Result<Result<String, String>, TuningError> {
    let KernelSpec::TransferPages(s) = spec else {
        return Err(TuningError::Reference {
            what: "transfer_pages",
            message: format!("{} is not a transfer", spec.uri()),
        });
    };
    let sizes = copy_check_sizes(&s.launch);
    let mut rng = SplitMix(seed);
    let (b, pages) = CopyBench::new_in_layers(exec, spec, &sizes, seed, layer_range.clone())?;
    let mut srcs = Vec::new();
    for t in b.transfer_buffers() {
        let src = rng.bytes(exec.size(t.src)?);
        exec.upload(t.src, 0, &src)?;
        srcs.push(src);
    }
    run(&b)?;
    // Every buffer of the launch against the reference of its own descriptor.
    let descriptors = s.descriptors();
    let mut details = Vec::new();
    for (i, ((t, src), d)) in b
        .transfer_buffers()
        .iter()
        .zip(&srcs)
        .zip(&descriptors)
        .enumerate()
    {
        let got = read_all(exec, t.dst)?;
        let mut want = vec![0xA5u8; got.len()];
        reference::transfer_pages(
            d.direction,
            d.layout,
            d.page_bytes(),
            src,
            &mut want,
            &pages.first,
            &pages.second,
            sizes.pages,
            sizes.layers,
            layer_range.start,
            layer_range.end.saturating_sub(layer_range.start),
            b.device_pages,
            b.host_pages,
        )
        .map_err(reference_err("transfer_pages"))?;
        match compare(&got, &want) {
            Ok(detail) => details.push(detail),
            Err(diff) if descriptors.len() > 1 => {
                return Ok(Err(format!(
                    "buffer {i} ({} B/token): {diff}",
                    d.bytes_per_token
                )))
            }
            Err(diff) => return Ok(Err(diff)),
        }
    }
    Ok(Ok(details.join("; ")))
}

/// Runs `kernel` (compiled from `spec`) once on random inputs seeded by `seed` and compares
/// its output with the reference: `Ok(Err(difference))` for a wrong output, `Err` when the
/// harness itself failed.
pub(super) fn check_one(
    exec: &dyn Executor,
    spec: &KernelSpec,
    kernel: KernelId,
    seed: u64,
) -> Result<Result<String, String>, TuningError> {
    let mut rng = SplitMix(seed);
    match spec {
        KernelSpec::Busy(_) => {
            // An odd word count, so the grid's last block is partial.
            let b = BusyBench::new(exec, BUSY_CHECK_WORDS)?;
            let (rounds, seed) = (37, rng.next_u64() as u32);
            b.launch(kernel, spec, rounds, seed)?;
            let got = read_all(exec, b.out())?;
            let stamps = b.stamps()?;
            if !stamps.is_sane() {
                return Ok(Err(format!("block stamps not written: {stamps:?}")));
            }
            // ALU and HBM compute the same words, in registers or through memory.
            Ok(compare(
                &got,
                &u32_bytes(&reference::busy(b.n, rounds, seed)),
            ))
        }
        KernelSpec::TransferPages(_) => {
            check_transfer(exec, spec, seed, |b| b.launch(kernel, spec))
        }
        KernelSpec::Materialise(s) => {
            let sizes = copy_check_sizes(&s.launch);
            let (b, pages) = CopyBench::new(exec, spec, &sizes, seed)?;
            let (srcs, dst) = b.buffers();
            let mut pools = Vec::with_capacity(srcs.len());
            for &p in &srcs {
                let bytes = rng.bytes(exec.size(p)?);
                exec.upload(p, 0, &bytes)?;
                pools.push(bytes);
            }
            b.launch(kernel, spec)?;
            let got = read_all(exec, dst)?;
            let mut want = vec![0xA5u8; got.len()];
            let views: Vec<&[u8]> = pools.iter().map(|p| p.as_slice()).collect();
            reference::materialise(
                s.cp,
                s.page_bytes(),
                &views,
                &pages.first,
                sizes.pages,
                sizes.layers,
                b.device_pages,
                &mut want,
            )
            .map_err(reference_err("materialise"))?;
            Ok(compare(&got, &want))
        }
        KernelSpec::SelectOwnerPages(s) => {
            let b = AllocBench::new(
                exec,
                s.cp,
                AllocBench::locs_page_size(spec),
                alloc_check_requests(s.threads),
                seed,
            )?;
            let h = &b.host;
            // Granted (full lanes), then refused: the first request's lane holds one page
            // less than asked of it, so the kernel must change no top, hand out page 0 for
            // every request and record the deficit in its status words.
            let first = h.owners[0];
            let demand = h.owners.iter().filter(|&&o| o == first).count() as u32;
            let mut short = h.tops_full.clone();
            short[usize::from(first)] = demand - 1;
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for tops0 in [&h.tops_full, &short] {
                b.reset_for_select()?;
                exec.upload(b.tops, 0, &u32_bytes(tops0))?;
                b.run_select(kernel, spec)?;
                // `out_locs` only where the kernel writes it.
                for buffer in [Some(b.pages), b.locs, Some(b.tops), Some(b.status)]
                    .into_iter()
                    .flatten()
                {
                    got.extend(read_all(exec, buffer)?);
                }
                let mut tops = tops0.clone();
                let mut status = vec![0u32; s.status_words()];
                let pages = reference::select_pages(
                    s.cp,
                    &h.owners,
                    &h.stacks,
                    &mut tops,
                    h.lane_cap,
                    &mut status,
                )
                .map_err(reference_err("select_owner_pages"))?;
                want.extend(u32_bytes(&pages));
                if s.output.writes_locs() {
                    let locs = reference::page_locs(s.page_size, &pages)
                        .map_err(reference_err("select_owner_pages"))?;
                    want.extend(locs.iter().flat_map(|l| l.to_le_bytes()));
                }
                want.extend(u32_bytes(&tops));
                want.extend(u32_bytes(&status));
            }
            Ok(compare(&got, &want))
        }
        KernelSpec::ReleasePages(s) => {
            let b = AllocBench::new(exec, s.cp, None, alloc_check_requests(s.threads), seed)?;
            let h = &b.host;
            // Accepted (the pages select took), then refused: pushed onto full lanes, every
            // lane they belong to overflows, so the kernel must change no top and no stack
            // slot and record the overflows in its status words.
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for tops0 in [&h.tops_after, &h.tops_full] {
                b.reset_for_select()?;
                b.reset_for_release()?;
                exec.upload(b.tops, 0, &u32_bytes(tops0))?;
                b.run_release(kernel, spec)?;
                for buffer in [b.stacks, b.tops, b.release_status] {
                    got.extend(read_all(exec, buffer)?);
                }
                let mut stacks = h.stacks.clone();
                let mut tops = tops0.clone();
                let mut status = vec![0u32; s.status_words()];
                reference::release_pages(
                    s.cp,
                    &h.selected,
                    &mut stacks,
                    &mut tops,
                    h.lane_cap,
                    &mut status,
                )
                .map_err(reference_err("release_pages"))?;
                want.extend(u32_bytes(&stacks));
                want.extend(u32_bytes(&tops));
                want.extend(u32_bytes(&status));
            }
            Ok(compare(&got, &want))
        }
        KernelSpec::Synthesise(s) => {
            let cp = u32::from(s.cp);
            // Whole granules when tokens are interleaved (the seq_pages the kernel reads).
            let n_pages = match s.order {
                crate::kernels::TokenOrder::Paged => 6u32,
                crate::kernels::TokenOrder::Interleaved { .. } => 2 * cp.max(2),
            };
            let n_tokens = n_pages * s.page_size - 3;
            let local_pages = n_pages + 2;
            let layers = 2;
            let tokens: Vec<u32> = (0..n_tokens).map(|_| rng.below(50_000) as u32).collect();
            let hashes = reference::prefix_hashes(&tokens);
            let seq: Vec<u32> = rng.sample(cp * local_pages, n_pages);
            let rank = cp - 1;
            // Mid-way through the second page: an extended request's kept partial page.
            let first_token = s.page_size + s.page_size / 3;
            let page_bytes = s.buffer.page_bytes(s.page_size);
            let pool_len = u64::from(layers) * u64::from(local_pages) * page_bytes;
            let pool = exec.alloc(MemKind::Device, pool_len as usize, 0xA5)?;
            let at = exec.alloc(MemKind::Device, 8 * layers as usize, 0)?;
            let table = PageTable::layer_major((at, 0), pool, layers, local_pages, page_bytes);
            let hb = upload_new(
                exec,
                &hashes
                    .iter()
                    .flat_map(|h| h.to_le_bytes())
                    .collect::<Vec<_>>(),
            )?;
            let sb = upload_new(exec, &u32_bytes(&seq))?;
            let items = reference::synthesise_items(s.order, s.page_size, n_tokens, first_token);
            let d = spec.launch_dims(items, layers);
            let run = exec.launch(
                kernel,
                &LaunchConfig::linear(d.grid, d.block),
                &[
                    table.arg(),
                    KernelArg::Ptr(hb, 0),
                    KernelArg::Ptr(sb, 0),
                    KernelArg::U32(n_tokens),
                    KernelArg::U32(first_token),
                    KernelArg::U32(rank),
                    KernelArg::U32(layers),
                    KernelArg::U32(local_pages),
                    KernelArg::U32(table.page_stride),
                ],
            );
            let got = run
                .map_err(TuningError::from)
                .and_then(|()| read_all(exec, pool));
            for b in [pool, at, hb, sb] {
                let _ = exec.free(b);
            }
            let got = got?;
            let mut want = vec![0xA5u8; got.len()];
            reference::synthesise(
                s.buffer,
                s.cp,
                s.page_size,
                s.order,
                &mut want,
                &hashes,
                &seq,
                n_tokens,
                first_token,
                rank,
                layers,
                local_pages,
            )
            .map_err(reference_err("synthesise"))?;
            Ok(compare(&got, &want))
        }
        KernelSpec::Verify(s) => {
            let n_pages = 5u32;
            let n_tokens = verify_tokens(n_pages, s.page_size);
            let layers = 2;
            let tokens: Vec<u32> = (0..n_tokens).map(|_| rng.below(50_000) as u32).collect();
            let hashes = reference::prefix_hashes(&tokens);
            let page_bytes = s.buffer.page_bytes(s.page_size);
            let mut dense =
                reference::dense(s.buffer, s.page_size, s.order, &hashes, n_tokens, layers)
                    .map_err(reference_err("synthesise"))?;
            let n_pages = (dense.len() as u64 / page_bytes / u64::from(layers)) as u32;
            // One flipped byte in each of three distinct tokens past page 0 (which verify
            // skips here), in a random layer, field and element: three known mismatches.
            let fields = s.buffer.field_layouts(s.page_size);
            let first = s.page_size;
            for i in rng.sample(n_tokens - first, 3) {
                let t = first + i;
                let f = &fields[rng.below(fields.len() as u64) as usize];
                let e = rng.below(u64::from(f.count)) as u32;
                let byte = rng.below(u64::from(f.dtype.size())) as usize;
                let layer = rng.below(u64::from(layers)) as u32;
                let (seq_page, slot) = reference::place(s.order, s.page_size, u64::from(t));
                let page = u64::from(layer * n_pages) + seq_page;
                let at = (page * page_bytes) as usize + f.offset(slot, e) + byte;
                dense[at] ^= 0x40;
            }
            let want = reference::verify(
                s.buffer,
                s.page_size,
                s.order,
                &dense,
                &hashes,
                n_tokens,
                1,
                layers,
            )
            .map_err(reference_err("verify"))?;
            let planted: u32 = want.iter().map(|w| w.count_ones()).sum();
            if planted != 3 {
                return Err(TuningError::Reference {
                    what: "verify",
                    message: format!("the check planted {planted} mismatches, not 3"),
                });
            }
            let db = upload_new(exec, &dense)?;
            let hb = upload_new(
                exec,
                &hashes
                    .iter()
                    .flat_map(|h| h.to_le_bytes())
                    .collect::<Vec<_>>(),
            )?;
            let mb = exec.alloc(MemKind::Device, 4 * want.len(), 0)?;
            let d = spec.launch_dims(n_tokens, layers);
            let run = exec.launch(
                kernel,
                &LaunchConfig::linear(d.grid, d.block),
                &[
                    KernelArg::Ptr(db, 0),
                    KernelArg::Ptr(hb, 0),
                    KernelArg::U32(n_tokens),
                    KernelArg::U32(1),
                    KernelArg::U32(layers),
                    KernelArg::Ptr(mb, 0),
                ],
            );
            let got = run
                .map_err(TuningError::from)
                .and_then(|()| read_all(exec, mb));
            for b in [db, hb, mb] {
                let _ = exec.free(b);
            }
            let got = got?;
            let bad: u32 = want.iter().map(|w| w.count_ones()).sum();
            Ok(compare(&got, &u32_bytes(&want))
                .map(|_| format!("found the {bad} planted mismatches")))
        }
    }
}

/// Tokens of the verify check over `n_pages`: the last page partial (by up to five tokens)
/// where the page size allows one, never fewer tokens than pages, so page size 1 checks
/// tokens too.
fn verify_tokens(n_pages: u32, page_size: u32) -> u32 {
    n_pages * page_size - 5.min(page_size - 1)
}

fn upload_new(exec: &dyn Executor, bytes: &[u8]) -> Result<BufferId, TuningError> {
    let b = exec.alloc(MemKind::Device, bytes.len().max(1), 0)?;
    exec.upload(b, 0, bytes)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::verify_tokens;

    #[test]
    fn the_verify_check_spans_every_page_at_every_page_size() {
        for ps in [1u32, 2, 4, 16, 64, 1024] {
            let n = verify_tokens(5, ps);
            assert!(n > 4 * ps && n <= 5 * ps, "page size {ps}: {n} tokens");
        }
        assert_eq!(verify_tokens(5, 64), 315, "a partial last page");
    }
}
