//! Kernel conformance on the host executor: every kernel family, rendered from its template
//! and run through the CUDA-emulation header, matches the plain-Rust reference
//! (`kernels::reference`) on random inputs, for CP 1, 2, 4, 8, 16, page sizes 1, 16, 64 and
//! both block orders — plus non-power-of-two CPs (3, 5, 6, 7, 12), page size 1024 and every
//! select / release block size tuning may pick. Outputs start as poison (0xA5) and carry guard bytes, so a byte written
//! where the reference writes nothing is caught as surely as a wrong byte.
//!
//! Specs are built directly (small custom shapes, not only `Deployment`s), and compiled once
//! in one parallel JIT warm-up whose cache lives under the cargo tmp dir.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cp_hicache::allocator::{
    AllocError, KernelAllocError, KernelAllocOptions, KernelLaneAllocator,
};
use cp_hicache::exec::{BlockOrder, ExecError, Executor, KernelArg, LaunchConfig, LaunchFailure};
use cp_hicache::jit::Sanitize;
use cp_hicache::kernels::reference;
use cp_hicache::kernels::{
    transfer_regions, AllocSpec, BufferKind, CopyLaunch, Deployment, Direction, HostLayout,
    KernelSpec, MaterialiseSpec, PoolShape, ReleaseSpec, ReleaseStatus, SelectOutput, SelectStatus,
    SynthSpec, TokenOrder, TransferSpec, VecWidth, VerifySpec,
};
use cp_hicache::layout::{CpLayout, Layout, Placement};
use support::{
    cpu_copy_launch, grid, i64s, le32, le64, u32s, uri_seed, Bench, MaterialiseCase, PoolOrder,
    Rng, TransferCase, Twist, ORDERS, POISON, POOL_ORDERS,
};

const CPS: [u8; 5] = [1, 2, 4, 8, 16];
const PSS: [u32; 3] = [1, 16, 64];
/// A small GQA shard (2 KV heads of 12: 6 draws per token in each of its key and value
/// fields, page-organised) keeps the matrix cheap; the reference deployment's 8 × 128 runs
/// through the whole cache in both block orders in tests/hicache_gqa.rs.
const GQA: BufferKind = BufferKind::GqaKv {
    kv_heads: 2,
    head_dim: 12,
};
const BUFFERS: [BufferKind; 4] = [
    BufferKind::NsaKv,
    BufferKind::NsaIndexK,
    BufferKind::MlaKv,
    GQA,
];
/// Threads of the select / release block (the deployments' default).
const ALLOC_THREADS: u32 = 256;
/// Guard elements after every output array.
const GUARD: usize = 16;
/// CP degrees that are not powers of two (and the largest page size), one page size each:
/// `owner`/`local` become real divisions and moduli there.
const ODD_SHAPES: [(u8, u32); 5] = [(3, 1), (5, 16), (6, 64), (7, 1024), (12, 16)];
/// Select / release block sizes other than the default that tuning may pick, at a CP below
/// a warp and at the largest CP.
const ALLOC_THREAD_SWEEP: [u32; 4] = [32, 128, 512, 1024];
const ALLOC_SWEEP_SHAPES: [(u8, u32); 2] = [(3, 64), (16, 16)];
/// Transfer bytes per token at page size 1024 (MLA bf16: 1.1 MiB pages).
const BIG_PAGE_BPT: u32 = 1152;

fn order_id(o: BlockOrder) -> u64 {
    u64::from(o == BlockOrder::Reverse)
}

fn select_spec(cp: u8, page_size: u32, threads: u32) -> KernelSpec {
    select_spec_out(cp, page_size, threads, SelectOutput::PagesAndLocs)
}

fn select_spec_out(cp: u8, page_size: u32, threads: u32, output: SelectOutput) -> KernelSpec {
    KernelSpec::SelectOwnerPages(AllocSpec {
        cp,
        page_size,
        threads,
        output,
    })
}

fn release_spec(cp: u8, threads: u32) -> KernelSpec {
    KernelSpec::ReleasePages(ReleaseSpec { cp, threads })
}

/// Bytes per token of the transfer cases at a page size, with a second buffer's for the
/// two-buffer launches: the real buffer kinds (NSA's `kv` and `index_k` in one launch at page
/// size 64, as the deployments), plus an odd custom size at page size 1, moved together with
/// `index_k`, so the byte-wide (`v1`) copy path runs both ways.
fn transfer_bpts(ps: u32) -> &'static [(u32, Option<u32>)] {
    match ps {
        1 => &[(132, None), (33, Some(132))],
        16 => &[(1152, None)],
        _ => &[(656, Some(132))],
    }
}

/// Bytes per token of the materialise cases (nsa_idx at ps1 → v4; mla; nsa kv → v16).
fn materialise_bpt(ps: u32) -> u32 {
    match ps {
        1 => 132,
        16 => 1152,
        _ => 656,
    }
}

/// A GPU-like shape with two pages per work item that loops over the layers in the block,
/// and the CPU shape (one thread per page, each layer a work item). One of the two stores
/// with `__stcs` (non-temporal stores in the emulation), the CPU shape when `cpu_streams`:
/// callers alternate it, so both shapes run both store forms without doubling the matrix.
fn copy_launches(page_bytes: u64, cpu_streams: bool) -> [CopyLaunch; 2] {
    let vec = VecWidth::widest_for(page_bytes);
    [
        CopyLaunch {
            threads: 128,
            pages_per_block: 2,
            vec,
            unroll: 2,
            layers_in_block: true,
            streaming_stores: !cpu_streams,
            max_blocks: 0,
        },
        CopyLaunch {
            streaming_stores: cpu_streams,
            ..cpu_copy_launch(vec)
        },
    ]
}

/// Grid cap of the capped transfer shapes: fewer blocks than work items at every size, so
/// each block strides over several (page group, layer) items.
const TRANSFER_CAP: u32 = 3;

/// `launch` with a capped grid ([`TRANSFER_CAP`] blocks) in one host layout per shape: the
/// GPU-like shape (layers in the block) in the layer-first layout, the CPU shape (layers in
/// the grid, as the GPU default transfer) in the page-first one, so each shape runs both
/// capped and uncapped without growing the matrix.
fn capped_in_one_layout(launch: CopyLaunch, layout: HostLayout, shape: usize) -> CopyLaunch {
    let capped = match layout {
        HostLayout::LayerFirst => shape == 0,
        HostLayout::PageFirst => shape == 1,
    };
    CopyLaunch {
        max_blocks: if capped { TRANSFER_CAP } else { 0 },
        ..launch
    }
}

fn transfer_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for ps in PSS {
        for &(bpt, second) in transfer_bpts(ps) {
            for direction in [Direction::DeviceToHost, Direction::HostToDevice] {
                for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
                    let spec = |launch| TransferSpec {
                        direction,
                        layout,
                        page_size: ps,
                        bytes_per_token: bpt,
                        second_bytes_per_token: second,
                        stamps: false,
                        launch,
                    };
                    let page_bytes = spec(CopyLaunch::default()).common_page_bytes();
                    let cpu_streams = direction == Direction::HostToDevice;
                    for (i, launch) in copy_launches(page_bytes, cpu_streams)
                        .into_iter()
                        .enumerate()
                    {
                        v.push(KernelSpec::TransferPages(spec(capped_in_one_layout(
                            launch, layout, i,
                        ))));
                    }
                }
            }
        }
    }
    v
}

fn materialise_specs(cp: u8, ps: u32) -> [KernelSpec; 2] {
    let bpt = materialise_bpt(ps);
    let cpu_streams = cp % 2 == 0;
    copy_launches(u64::from(ps) * u64::from(bpt), cpu_streams).map(|launch| {
        KernelSpec::Materialise(MaterialiseSpec {
            cp,
            page_size: ps,
            bytes_per_token: bpt,
            launch,
        })
    })
}

/// Whether the synthesise and verify kernels take `buffer` at page size `ps`: all but nsa
/// `index_k` at page size 1, whose 132-byte pages would misalign every other page's 8-byte
/// draws (`BufferKind::check_access_alignment`; NSA deployments use page size 64).
fn synth_takes(buffer: BufferKind, ps: u32) -> bool {
    buffer.check_access_alignment(ps).is_ok()
}

/// Synthesis covers every (cp, page size) and, across CPs, every buffer kind at every page
/// size the kernels take, with one spec per (cp, page size): the kinds rotate, and a kind
/// the kernels do not take at that page size gives way to the next.
fn synth_spec(ci: usize, pi: usize) -> KernelSpec {
    let ps = PSS[pi];
    let buffer = (0..3)
        .map(|k| BUFFERS[(ci + pi + k) % BUFFERS.len()])
        .find(|&b| synth_takes(b, ps))
        .expect("nsa kv and mla kv take every page size");
    synth_spec_of(buffer, CPS[ci], ps)
}

fn synth_spec_of(buffer: BufferKind, cp: u8, page_size: u32) -> KernelSpec {
    synth_spec_threads(buffer, cp, page_size, 128)
}

fn synth_spec_threads(buffer: BufferKind, cp: u8, page_size: u32, threads: u32) -> KernelSpec {
    KernelSpec::Synthesise(SynthSpec {
        buffer,
        cp,
        page_size,
        threads,
        order: TokenOrder::Paged,
    })
}

fn verify_spec(buffer: BufferKind, ps: u32) -> KernelSpec {
    verify_spec_threads(buffer, ps, 128)
}

fn verify_spec_threads(buffer: BufferKind, ps: u32, threads: u32) -> KernelSpec {
    KernelSpec::Verify(VerifySpec {
        buffer,
        page_size: ps,
        threads,
        order: TokenOrder::Paged,
    })
}

/// The other block sizes `tune` times for synthesise and verify (`KernelSpec::candidates`),
/// each with a page size per buffer kind: the threads' pairs (token, draw) follow from the
/// block size (one draw per phase, `lcm(threads, draws)` pairs a round), so each size runs
/// its own mapping; mla's 144 draws per token make 9 phases at 32, 128 and 256 threads.
const SYNTH_THREAD_SWEEP: [u32; 3] = [1, 32, 256];
const SYNTH_SWEEP_SHAPES: [(BufferKind, u8, u32); 4] = [
    (BufferKind::NsaKv, 8, 64),
    (BufferKind::NsaIndexK, 3, 16),
    (BufferKind::MlaKv, 4, 16),
    (GQA, 5, 16),
];

fn all_specs() -> Vec<KernelSpec> {
    let mut v = transfer_specs();
    // `tune`'s stamped twins of a transfer each way: their last parameter, `stamps`, has
    // its reach and aliasing checked with the rest (their copies: the r29 test).
    let twins: Vec<KernelSpec> = [Direction::DeviceToHost, Direction::HostToDevice]
        .into_iter()
        .filter_map(|d| {
            v.iter()
                .find(|s| matches!(s, KernelSpec::TransferPages(t) if t.direction == d))
                .and_then(KernelSpec::stamped)
        })
        .collect();
    v.extend(twins);
    for (ci, &cp) in CPS.iter().enumerate() {
        v.push(release_spec(cp, ALLOC_THREADS));
        for (pi, &ps) in PSS.iter().enumerate() {
            v.push(select_spec(cp, ps, ALLOC_THREADS));
            // The cache's allocator runs this one (the allocator tests below load it too).
            v.push(select_spec_out(cp, ps, ALLOC_THREADS, SelectOutput::Pages));
            v.extend(materialise_specs(cp, ps));
            v.push(synth_spec(ci, pi));
        }
    }
    for b in BUFFERS {
        for ps in PSS {
            if synth_takes(b, ps) {
                v.push(verify_spec(b, ps));
            }
        }
    }
    v.extend(interleaved_specs().into_iter().flat_map(|(s, v)| [s, v]));
    v.sort();
    v.dedup();
    v
}

/// The specs of the odd-shape test: non-power-of-two CPs, page size 1024 and other select /
/// release block sizes (kept out of `all_specs`, whose matrix stays modest).
fn odd_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for (i, &(cp, ps)) in ODD_SHAPES.iter().enumerate() {
        v.push(select_spec(cp, ps, ALLOC_THREADS));
        v.push(release_spec(cp, ALLOC_THREADS));
        v.extend(materialise_specs(cp, ps));
        v.push(synth_spec_of(BUFFERS[i % BUFFERS.len()], cp, ps));
    }
    for (cp, ps) in ALLOC_SWEEP_SHAPES {
        for t in ALLOC_THREAD_SWEEP {
            v.push(select_spec(cp, ps, t));
            v.push(release_spec(cp, t));
        }
    }
    for (buffer, cp, ps) in SYNTH_SWEEP_SHAPES {
        for t in SYNTH_THREAD_SWEEP {
            v.push(synth_spec_threads(buffer, cp, ps, t));
            v.push(verify_spec_threads(buffer, ps, t));
        }
    }
    v.extend(big_page_transfer_specs());
    v.sort();
    v.dedup();
    v
}

fn big_page_transfer_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for direction in [Direction::DeviceToHost, Direction::HostToDevice] {
        for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
            let cpu_streams = layout == HostLayout::PageFirst;
            for launch in copy_launches(1024 * u64::from(BIG_PAGE_BPT), cpu_streams) {
                v.push(KernelSpec::TransferPages(TransferSpec {
                    direction,
                    layout,
                    page_size: 1024,
                    bytes_per_token: BIG_PAGE_BPT,
                    second_bytes_per_token: None,
                    stamps: false,
                    launch,
                }));
            }
        }
    }
    v
}

fn odd_libs() -> &'static HashMap<KernelSpec, PathBuf> {
    static LIBS: OnceLock<HashMap<KernelSpec, PathBuf>> = OnceLock::new();
    LIBS.get_or_init(|| support::compile(&odd_specs(), Sanitize::None))
}

/// Every kernel of this target, compiled once (in parallel) for all tests.
fn libs() -> &'static HashMap<KernelSpec, PathBuf> {
    static LIBS: OnceLock<HashMap<KernelSpec, PathBuf>> = OnceLock::new();
    LIBS.get_or_init(|| {
        let specs = all_specs();
        eprintln!("{} distinct kernel specs", specs.len());
        support::compile(&specs, Sanitize::None)
    })
}

#[test]
fn spec_matrix_is_modest_and_valid() {
    let specs = all_specs();
    // 15 of them are the selects without token locations the allocator tests load anyway;
    // the GQA buffer kind added its verify kernels at three page sizes and an interleaved
    // synthesise and verify (135 in all).
    assert!(specs.len() <= 136, "{} specs", specs.len());
    assert!(specs.iter().all(|s| s.validate().is_ok()));
    // Every vector width of the copy loops is compiled, and each shape with both store forms.
    for w in ["_v1_", "_v4_", "_v16_"] {
        assert!(specs.iter().any(|s| s.uri().contains(w)), "{w}");
    }
    // Both NSA buffers move in one launch, and so does a byte-wide (`v1`) pair.
    for pair in ["_b656_b132_", "_b33_b132_"] {
        assert!(specs.iter().any(|s| s.uri().contains(pair)), "{pair}");
    }
    // Each transfer shape runs with a capped grid and a full one.
    for shape in ["_t1_", "_t128_"] {
        for capped in [false, true] {
            assert!(
                specs
                    .iter()
                    .any(|s| matches!(s, KernelSpec::TransferPages(_))
                        && s.uri().contains(shape)
                        && s.uri().ends_with(&format!("_g{TRANSFER_CAP}")) == capped),
                "{shape} capped {capped}"
            );
        }
    }
    for shape in ["_t1_", "_t128_"] {
        for cs in [false, true] {
            assert!(
                specs
                    .iter()
                    .any(|s| s.uri().contains(shape) && s.uri().contains("_cs") == cs),
                "{shape} with streaming stores {cs}"
            );
        }
    }
}

/// The `(type, name)` pairs of the `extern "C"` parameter list of `uri` in a render, read
/// from the text alone (whitespace collapsed), so the check below does not trust the renderer.
fn rendered_params(src: &str, uri: &str) -> Vec<(String, String)> {
    // Materialise and transfers also bound the blocks per SM (`THREADS, MIN_BLOCKS`).
    let bounds = if uri.starts_with("materialise_") || uri.starts_with("transfer_pages_") {
        "THREADS, MIN_BLOCKS"
    } else {
        "THREADS"
    };
    let head = format!("extern \"C\" __global__ void __launch_bounds__({bounds}) {uri}(");
    assert_eq!(
        src.matches("extern \"C\"").count(),
        1,
        "{uri}: one extern \"C\" entry"
    );
    let at = src
        .find(&head)
        .unwrap_or_else(|| panic!("{uri}: no entry `{head}`"))
        + head.len();
    let list = &src[at..at + src[at..].find(')').expect("closing parenthesis")];
    if list.trim().is_empty() {
        return Vec::new();
    }
    list.split(',')
        .map(|p| {
            // `__restrict__` qualifies every pointer (render_params), not part of the type.
            let words: Vec<&str> = p
                .split_whitespace()
                .filter(|w| *w != "__restrict__")
                .collect();
            let (name, ty) = words
                .split_last()
                .unwrap_or_else(|| panic!("{uri}: {list}"));
            (ty.join(" "), name.to_string())
        })
        .collect()
}

// The render's parameter list is exactly `KernelSpec::params()` (names and C types, in order)
// for every spec of this matrix, of every reference deployment and of their tuning
// candidates: what the executors check launches against is what the kernels declare.
#[test]
fn rendered_parameter_lists_match_the_signatures() {
    let mut specs = all_specs();
    for dep in Deployment::reference() {
        for spec in dep.specs() {
            specs.extend(spec.candidates());
        }
    }
    specs.sort();
    specs.dedup();
    for spec in &specs {
        let uri = spec.uri();
        let got = rendered_params(&spec.render().unwrap(), &uri);
        let want: Vec<(String, String)> = spec
            .params()
            .iter()
            .map(|p| (p.c_type.to_string(), p.name.to_string()))
            .collect();
        assert_eq!(got, want, "{uri}");
    }
}

// A spec kernel on the host executor: a launch with one argument too few, one too many, a u32
// where a pointer belongs, a block other than the compiled threads, or (release updates the
// lane stacks from one block) two blocks is refused by the signature check before anything
// runs (the buffers keep their bytes), names what differs, and the executor then runs the
// kernel.
#[test]
fn bad_argument_lists_are_refused_by_the_signature() {
    let mut b = Bench::new(BlockOrder::Forward, libs());
    let spec = release_spec(4, ALLOC_THREADS);
    let kernel = b.kernel(&spec);
    let (lane_cap, tops) = (8u32, vec![0u32; 4]);
    let pages = [5u32, 6, 7, 9];
    let stacks = vec![0u32; 4 * lane_cap as usize];
    let pgb = b.bytes(&le32(&pages), 0);
    let sb = b.bytes(&le32(&stacks), 0);
    let tb = b.bytes(&le32(&tops), 0);
    let stb = b.bytes(&[0; 4 * 6], 0);
    let good = [
        KernelArg::Ptr(pgb, 0),
        KernelArg::U32(pages.len() as u32),
        KernelArg::Ptr(sb, 0),
        KernelArg::Ptr(tb, 0),
        KernelArg::U32(lane_cap),
        KernelArg::Ptr(stb, 0),
    ];
    let mut too_many = good.to_vec();
    too_many.push(KernelArg::U32(1));
    let mut u32_for_ptr = good.to_vec();
    u32_for_ptr[3] = KernelArg::U32(0);
    let cases: [(&[KernelArg<'_>], &str); 3] = [
        (
            &good[..4],
            "parameter 4 `lane_cap` (u32) takes 4 bytes, no argument given",
        ),
        (
            &too_many,
            "argument 6 (a u32 of 4 bytes) follows the last parameter 5 `status`",
        ),
        (
            &u32_for_ptr,
            "parameter 3 `lane_tops` (u32*) takes 8 bytes, argument 3 is a u32 of 4 bytes",
        ),
    ];
    let config = LaunchConfig::linear(1, spec.threads());
    let half_block = LaunchConfig::linear(1, spec.threads() / 2);
    let two_blocks = LaunchConfig::linear(2, spec.threads());
    let shapes = [
        (
            &half_block,
            "block [128, 1, 1], but the kernel is compiled for blocks of [256, 1, 1]",
        ),
        (
            &two_blocks,
            "grid [2, 1, 1], but the kernel updates the lane stacks from exactly one block",
        ),
    ];
    let cases = cases
        .into_iter()
        .map(|(args, want)| (&config, args, want))
        .chain(shapes.into_iter().map(|(c, want)| (c, &good[..], want)));
    for (config, args, want) in cases {
        match b.ex.launch(kernel, config, args) {
            Err(ExecError::Launch {
                kernel: name,
                cause: LaunchFailure::InvalidConfig,
                message,
            }) => {
                assert_eq!(name, spec.uri());
                assert!(message.starts_with(want), "{message}");
            }
            other => panic!("{want}: {other:?}"),
        }
        assert_eq!(u32s(&b.read(tb)), tops, "{want}: nothing ran");
        assert_eq!(u32s(&b.read(sb)), stacks, "{want}: nothing ran");
    }
    b.ex.launch(kernel, &config, &good).unwrap();
    let (mut ws, mut wt, mut wst) = (stacks.clone(), tops.clone(), vec![0u32; 6]);
    reference::release_pages(4, &pages, &mut ws, &mut wt, lane_cap, &mut wst).unwrap();
    assert_eq!(u32s(&b.read(sb)), ws);
    assert_eq!(u32s(&b.read(tb)), wt);
    assert_eq!(u32s(&b.read(stb)), wst);
}

// Every spec kernel runs with each pointer argument in a buffer of exactly its parameter's
// reach (random small arguments, random page ids, owners and tops), and a buffer one byte
// shorter, for any one parameter, is refused naming it: the check that makes
// `Executor::launch` safe. `kernel_asan` runs the same cases under AddressSanitizer, where
// one byte past an exact buffer is reported.
#[test]
fn every_kernel_takes_its_exact_reach_and_refuses_one_byte_less() {
    let mut b = Bench::new(BlockOrder::Forward, libs());
    let mut refused = HashMap::new();
    for spec in all_specs() {
        for trial in 0..3 {
            let seed = [uri_seed(&spec), trial];
            let (ok, reaching) =
                support::reach_case(&mut b, &spec, &mut Rng::new(&seed), Twist::None);
            ok.unwrap_or_else(|e| panic!("{spec}, trial {trial}: {e}"));
            for i in reaching {
                let param = spec.params()[i].name;
                let short =
                    support::reach_case(&mut b, &spec, &mut Rng::new(&seed), Twist::Short(i));
                match short.0 {
                    Err(ExecError::Launch {
                        cause: LaunchFailure::InvalidConfig,
                        message,
                        ..
                    }) => assert!(
                        message.starts_with(&format!("parameter {i} `{param}`"))
                            && message.contains("the kernel reaches"),
                        "{spec}: {message}"
                    ),
                    other => panic!("{spec}: `{param}` one byte short: {other:?}"),
                }
                *refused.entry((spec.family(), param)).or_insert(0) += 1;
            }
        }
    }
    // Every pointer parameter of every family was cut short at least once.
    let pointers: HashSet<_> = all_specs()
        .iter()
        .flat_map(|s| {
            s.params()
                .into_iter()
                .filter(|p| p.reach.is_some())
                .map(|p| (s.family(), p.name))
        })
        .collect();
    let cut: HashSet<_> = refused.keys().copied().collect();
    assert_eq!(cut, pointers);
}

/// A written parameter that shares bytes with another pointer is refused, naming both, for
/// every written parameter of every family and every other pointer beside it; the same two
/// parameters in separate buffers run (the case above).
#[test]
fn every_written_parameter_refuses_an_aliased_pointer() {
    let mut b = Bench::new(BlockOrder::Forward, libs());
    let mut refused = HashSet::new();
    // A page table's pointers are written where the table says so (the table is read).
    let writes =
        |p: &cp_hicache::kernels::KernelParam| p.writes() || p.entries.is_some_and(|t| t.writes);
    for spec in all_specs() {
        let params = spec.params();
        for (w, written) in params.iter().enumerate().filter(|(_, p)| writes(p)) {
            for (o, other) in params.iter().enumerate() {
                if o == w || other.reach.is_none() {
                    continue;
                }
                let seed = [uri_seed(&spec), (w * 16 + o) as u64];
                let (got, reaching) =
                    support::reach_case(&mut b, &spec, &mut Rng::new(&seed), Twist::Alias(w, o));
                if !(reaching.contains(&w) && reaching.contains(&o)) {
                    // One of them touches nothing in this case: nothing to alias.
                    got.unwrap_or_else(|e| panic!("{spec}: {e}"));
                    continue;
                }
                // The message names a written parameter first: the earlier one when both are.
                let (first, second) = if writes(other) && o < w {
                    (o, w)
                } else {
                    (w, o)
                };
                match got {
                    Err(ExecError::Launch {
                        cause: LaunchFailure::InvalidConfig,
                        message,
                        ..
                    }) => assert!(
                        message.starts_with(&format!(
                            "parameter {first} `{}` (written) overlaps parameter {second} `{}`",
                            params[first].name, params[second].name
                        )),
                        "{spec}: {message}"
                    ),
                    other => panic!("{spec}: `{}` aliased: {other:?}", written.name),
                }
                refused.insert((spec.family(), written.name, other.name));
            }
        }
    }
    // Every (written, other pointer) pair of every family was refused at least once.
    let pairs: HashSet<_> = all_specs()
        .iter()
        .flat_map(|s| {
            let params = s.params();
            let mut v = Vec::new();
            for w in params.iter().filter(|p| writes(p)) {
                for o in params
                    .iter()
                    .filter(|p| p.reach.is_some() && p.name != w.name)
                {
                    v.push((s.family(), w.name, o.name));
                }
            }
            v
        })
        .collect();
    assert_eq!(refused, pairs);
}

#[test]
fn select_matches_reference() {
    for order in ORDERS {
        for cp in CPS {
            for ps in PSS {
                let mut b = Bench::new(order, libs());
                check_select(&mut b, cp, ps, ALLOC_THREADS, order);
            }
        }
    }
}

/// The select without token locations (what the cache's allocator runs) against the Rust
/// reference in both block orders, on the same random cases as the select with them: the same
/// `out_pages`, granted or refused (trials 4 and 5 refuse: every page 0, no top moved, the
/// deficits and bad owners added to the status words), and nothing written past them.
#[test]
fn select_without_locations_matches_reference_and_the_select_with_them() {
    for order in ORDERS {
        for cp in CPS {
            for ps in PSS {
                let mut b = Bench::new(order, libs());
                let with = check_select_out(
                    &mut b,
                    cp,
                    ps,
                    ALLOC_THREADS,
                    order,
                    SelectOutput::PagesAndLocs,
                );
                let without =
                    check_select_out(&mut b, cp, ps, ALLOC_THREADS, order, SelectOutput::Pages);
                assert_eq!(without, with, "cp{cp} ps{ps} {order}: out_pages");
                assert!(
                    without.iter().skip(4).all(|p| p.iter().all(|&x| x == 0)),
                    "cp{cp} ps{ps} {order}: the refused trials hand out page 0"
                );
            }
        }
    }
}

/// Select on random stacks, tops (some beyond the capacity) and owner requests (empty, one
/// partial tile, several tiles) against the reference, with a status array that may already
/// hold counts: requests that fit, a lane short by a page or more (after full tiles, so
/// earlier tiles have popped pages of other lanes already), and owners out of range. The
/// lane tops and the status carry guard words, so a thread that writes the top of a lane that
/// does not exist is caught.
fn check_select(b: &mut Bench, cp: u8, ps: u32, threads: u32, order: BlockOrder) {
    check_select_out(b, cp, ps, threads, order, SelectOutput::PagesAndLocs);
}

/// [`check_select`] of the select writing `output`, returning the pages it wrote, trial by
/// trial: the cases depend on the shape and block order only, so both outputs see the same.
fn check_select_out(
    b: &mut Bench,
    cp: u8,
    ps: u32,
    threads: u32,
    order: BlockOrder,
    output: SelectOutput,
) -> Vec<Vec<u32>> {
    let spec = select_spec_out(cp, ps, threads, output);
    let mut written = Vec::new();
    let mut rng = Rng::new(&[
        1,
        u64::from(cp),
        u64::from(ps),
        order_id(order),
        u64::from(threads),
    ]);
    let t = u64::from(threads);
    let cpn = u32::from(cp);
    for trial in 0..6u64 {
        let lane_cap = rng.range(1, 900 / u64::from(cp) + 8) as u32;
        let stacks: Vec<u32> = (0..cpn * lane_cap)
            .map(|i| (rng.range(1, 4096) as u32) * cpn + i / lane_cap)
            .collect();
        let tops: Vec<u32> = (0..cpn)
            .map(|_| match trial {
                0 => lane_cap,
                _ if rng.one_in(8) => lane_cap + rng.range(1, 5) as u32,
                _ => rng.below(u64::from(lane_cap) + 1) as u32,
            })
            .collect();
        // Empty, one partial tile, and requests spanning two to four tiles.
        let n = match trial {
            0 => rng.below(2 * t + 40),
            1 => 0,
            2 => rng.below(t),
            _ => rng.range(t + 1, 3 * t + 50),
        } as usize;
        // What each lane can give (tops clamped to the capacity, as the kernel does).
        let mut room: Vec<u32> = tops.iter().map(|&x| x.min(lane_cap)).collect();
        let mut owners: Vec<u8> = (0..n)
            .map_while(|_| {
                // Trials 0-3 fit: only lanes with room left are asked.
                let open: Vec<u8> = (0..cp).filter(|&o| room[usize::from(o)] > 0).collect();
                let o = *open.get(rng.below(open.len().max(1) as u64) as usize)?;
                room[usize::from(o)] -= 1;
                Some(o)
            })
            .collect();
        match trial {
            // A lane one or more pages short, asked last (after full tiles of other lanes).
            4 => {
                let o = rng.below(u64::from(cp)) as u8;
                let extra = room[usize::from(o)] + rng.range(1, 3) as u32;
                owners.extend(std::iter::repeat_n(o, extra as usize));
            }
            // Owners out of range, anywhere, beside requests that would fit.
            5 => {
                for _ in 0..rng.range(1, 4) {
                    let at = rng.below(owners.len() as u64 + 1) as usize;
                    owners.insert(at, cp + rng.below(3) as u8);
                }
            }
            _ => {}
        }
        let n = owners.len();
        // A status that already holds counts, now and then near saturation.
        let status: Vec<u32> = (0..cpn + 2)
            .map(|_| match rng.below(4) {
                0 => u32::MAX - rng.below(2) as u32,
                1 => rng.below(1000) as u32,
                _ => 0,
            })
            .collect();
        let psz = ps as usize;
        let ob = b.bytes(&owners, GUARD);
        let sb = b.bytes(&le32(&stacks), 0);
        let tb = b.bytes(&le32(&tops), 4 * GUARD);
        let stb = b.bytes(&le32(&status), 4 * GUARD);
        let pb = b.poison(4 * (n + GUARD));
        let lb = output
            .writes_locs()
            .then(|| b.poison(8 * (n * psz + GUARD)));
        let mut args = vec![
            KernelArg::Ptr(ob, 0),
            KernelArg::U32(n as u32),
            KernelArg::Ptr(sb, 0),
            KernelArg::Ptr(tb, 0),
            KernelArg::U32(lane_cap),
            KernelArg::Ptr(pb, 0),
        ];
        args.extend(lb.map(|lb| KernelArg::Ptr(lb, 0)));
        args.push(KernelArg::Ptr(stb, 0));
        b.launch(&spec, spec.launch_dims(n as u32, 1).grid, &args);
        let (mut want_tops, mut want_status) = (tops.clone(), status.clone());
        let (want_pages, want_locs) = reference::select_owner_pages(
            cp,
            ps,
            &owners,
            &stacks,
            &mut want_tops,
            lane_cap,
            &mut want_status,
        )
        .unwrap();
        let ctx = format!("{spec} {order} trial {trial} n {n} cap {lane_cap}");
        // The cases are what they claim to be (the reference says so).
        if trial < 4 {
            assert_eq!(want_status, status, "{ctx}: the request fits");
        } else {
            assert!(want_pages.iter().all(|&p| p == 0), "{ctx}: refused");
            assert_eq!(want_tops, tops, "{ctx}: refused");
        }
        let pages = b.read(pb);
        assert_eq!(u32s(&pages[..4 * n]), want_pages, "out_pages: {ctx}");
        assert!(
            pages[4 * n..].iter().all(|&x| x == POISON),
            "out_pages guard: {ctx}"
        );
        written.push(u32s(&pages[..4 * n]));
        if let Some(lb) = lb {
            let locs = b.read(lb);
            assert_eq!(i64s(&locs[..8 * n * psz]), want_locs, "out_locs: {ctx}");
            assert!(
                locs[8 * n * psz..].iter().all(|&x| x == POISON),
                "out_locs guard: {ctx}"
            );
        }
        let got_t = b.read(tb);
        assert_eq!(
            u32s(&got_t[..4 * tops.len()]),
            want_tops,
            "lane_tops: {ctx}"
        );
        assert!(
            got_t[4 * tops.len()..].iter().all(|&x| x == POISON),
            "lane_tops guard: {ctx}"
        );
        let got_st = b.read(stb);
        assert_eq!(
            u32s(&got_st[..4 * status.len()]),
            want_status,
            "status: {ctx}"
        );
        assert!(
            got_st[4 * status.len()..].iter().all(|&x| x == POISON),
            "status guard: {ctx}"
        );
        assert_eq!(
            u32s(&b.read(sb)),
            stacks,
            "lane_stacks must not change: {ctx}"
        );
    }
    written
}

#[test]
fn release_matches_reference() {
    for order in ORDERS {
        for cp in CPS {
            let mut b = Bench::new(order, libs());
            check_release(&mut b, cp, ALLOC_THREADS, order);
        }
    }
}

/// Release of random pages against the reference, with guard words after the stacks, the
/// tops and the status words, the kernel launched directly (nothing checks the pages
/// first). Trials 0-3 fit: only lanes with room left get pages, all valid. Trial 4 overflows
/// one lane by one or two pages, asked last (after full tiles of other lanes); trial 5 puts
/// invalid pages (0, or a local index at or past `lane_cap`) anywhere, beside pages that
/// would fit. Those two are refused whole: every stack slot and top stays as it was, and the
/// status words, which may already hold counts (now and then near saturation), add the
/// overflows and the invalid pages.
fn check_release(b: &mut Bench, cp: u8, threads: u32, order: BlockOrder) {
    let spec = release_spec(cp, threads);
    let mut rng = Rng::new(&[2, u64::from(cp), order_id(order), u64::from(threads)]);
    let t = u64::from(threads);
    let cpn = u32::from(cp);
    for trial in 0..6u64 {
        // At least 2 slots, so that every lane (lane 0 too: page 0 is null) owns a page.
        let lane_cap = rng.range(2, (3 * t + 100) / u64::from(cp) + 4) as u32;
        let stacks: Vec<u32> = (0..cpn * lane_cap)
            .map(|_| rng.below(1 << 20) as u32)
            .collect();
        let tops: Vec<u32> = (0..cpn)
            .map(|_| {
                if rng.one_in(8) {
                    lane_cap + rng.range(1, 5) as u32
                } else if trial >= 2 {
                    // Room for several tiles.
                    rng.below(u64::from(lane_cap) / 4 + 1) as u32
                } else {
                    rng.below(u64::from(lane_cap) + 1) as u32
                }
            })
            .collect();
        // A valid page of lane `o`: local index below the capacity, never page 0.
        let page_of = |o: u32, rng: &mut Rng| {
            let k = rng.below(u64::from(lane_cap)) as u32;
            let k = if o == 0 && k == 0 { 1 } else { k };
            o + cpn * k
        };
        let n = match trial {
            0 => 0,
            1 => rng.below(t),
            _ => rng.range(t + 1, 3 * t + 50),
        } as usize;
        // What each lane can take (tops clamped to the capacity, as the kernel does).
        let mut room: Vec<u32> = tops.iter().map(|&x| lane_cap - x.min(lane_cap)).collect();
        let mut pages: Vec<u32> = (0..n)
            .map_while(|_| {
                let open: Vec<u32> = (0..cpn).filter(|&o| room[o as usize] > 0).collect();
                let o = *open.get(rng.below(open.len().max(1) as u64) as usize)?;
                room[o as usize] -= 1;
                Some(page_of(o, &mut rng))
            })
            .collect();
        match trial {
            4 => {
                let o = rng.below(u64::from(cpn)) as u32;
                let extra = room[o as usize] + rng.range(1, 2) as u32;
                for _ in 0..extra {
                    pages.push(page_of(o, &mut rng));
                }
            }
            5 => {
                for _ in 0..rng.range(1, 4) {
                    let at = rng.below(pages.len() as u64 + 1) as usize;
                    let bad = if rng.one_in(2) {
                        0
                    } else {
                        rng.below(u64::from(cpn)) as u32 + cpn * (lane_cap + rng.below(3) as u32)
                    };
                    pages.insert(at, bad);
                }
            }
            _ => {}
        }
        let n = pages.len();
        let status: Vec<u32> = (0..cpn + 2)
            .map(|_| match rng.below(4) {
                0 => u32::MAX - rng.below(2) as u32,
                1 => rng.below(1000) as u32,
                _ => 0,
            })
            .collect();
        let pgb = b.bytes(&le32(&pages), GUARD);
        let sb = b.bytes(&le32(&stacks), 4 * GUARD);
        let tb = b.bytes(&le32(&tops), 4 * GUARD);
        let stb = b.bytes(&le32(&status), 4 * GUARD);
        b.launch(
            &spec,
            1,
            &[
                KernelArg::Ptr(pgb, 0),
                KernelArg::U32(n as u32),
                KernelArg::Ptr(sb, 0),
                KernelArg::Ptr(tb, 0),
                KernelArg::U32(lane_cap),
                KernelArg::Ptr(stb, 0),
            ],
        );
        let (mut ws, mut wt, mut wst) = (stacks.clone(), tops.clone(), status.clone());
        reference::release_pages(cp, &pages, &mut ws, &mut wt, lane_cap, &mut wst).unwrap();
        let ctx = format!("{spec} {order} trial {trial} n {n} cap {lane_cap}");
        // The cases are what they claim to be (the reference says so).
        if trial < 4 {
            assert_eq!(wst, status, "{ctx}: the release fits");
        } else {
            assert_eq!((&ws, &wt), (&stacks, &tops), "{ctx}: refused");
            assert_eq!(wst[0], status[0].saturating_add(1), "{ctx}: refused");
        }
        let got_s = b.read(sb);
        assert_eq!(u32s(&got_s[..ws.len() * 4]), ws, "lane_stacks: {ctx}");
        assert!(
            got_s[ws.len() * 4..].iter().all(|&x| x == POISON),
            "stacks guard: {ctx}"
        );
        let got_t = b.read(tb);
        assert_eq!(u32s(&got_t[..wt.len() * 4]), wt, "lane_tops: {ctx}");
        assert!(
            got_t[wt.len() * 4..].iter().all(|&x| x == POISON),
            "tops guard: {ctx}"
        );
        let got_st = b.read(stb);
        assert_eq!(u32s(&got_st[..wst.len() * 4]), wst, "status: {ctx}");
        assert!(
            got_st[wst.len() * 4..].iter().all(|&x| x == POISON),
            "status guard: {ctx}"
        );
    }
}

// Non-power-of-two CPs, page size 1024 and every select / release block size the tuner
// may choose, through the same checks as the main matrix, in both block orders.
#[test]
fn odd_cps_big_pages_and_alloc_block_sizes_match_reference() {
    let specs = odd_specs();
    assert!(specs.iter().all(|s| s.validate().is_ok()));
    for order in ORDERS {
        let mut b = Bench::new(order, odd_libs());
        for (i, &(cp, ps)) in ODD_SHAPES.iter().enumerate() {
            check_select(&mut b, cp, ps, ALLOC_THREADS, order);
            check_release(&mut b, cp, ALLOC_THREADS, order);
            check_materialise(&mut b, cp, ps, order);
            check_synthesise(
                &mut b,
                synth_spec_of(BUFFERS[i % BUFFERS.len()], cp, ps),
                order,
            );
        }
        for (cp, ps) in ALLOC_SWEEP_SHAPES {
            for t in ALLOC_THREAD_SWEEP {
                check_select(&mut b, cp, ps, t, order);
                check_release(&mut b, cp, t, order);
            }
        }
        for (buffer, cp, ps) in SYNTH_SWEEP_SHAPES {
            for t in SYNTH_THREAD_SWEEP {
                check_synthesise(&mut b, synth_spec_threads(buffer, cp, ps, t), order);
                check_verify(&mut b, verify_spec_threads(buffer, ps, t), order);
                check_verify_field_bytes(&mut b, verify_spec_threads(buffer, ps, t), order);
            }
        }
        for spec in big_page_transfer_specs() {
            check_transfer(&mut b, spec, order);
        }
    }
}

#[test]
fn select_is_all_or_nothing_through_the_allocator() {
    let jit = support::jit();
    libs(); // compiled in the same warm-up as everything else
    for order in ORDERS {
        for cp in CPS {
            for ps in PSS {
                let ex: Arc<dyn Executor> = Arc::new(support::executor(order));
                let layout = CpLayout::new(u32::from(cp), ps, 700 + u32::from(cp)).unwrap();
                let mut a = KernelLaneAllocator::new(
                    layout,
                    Arc::clone(&ex),
                    jit,
                    KernelAllocOptions::default(),
                )
                .unwrap();
                let mut rng = Rng::new(&[3, u64::from(cp), u64::from(ps), order_id(order)]);
                // A random multi-tile request (> threads) that fits.
                let n = rng.range(u64::from(ALLOC_THREADS) + 1, 600) as usize;
                let mut counts = a.lane_free_counts();
                let owners: Vec<u8> = (0..n)
                    .filter_map(|_| {
                        let o = rng.below(u64::from(cp)) as usize;
                        (counts[o] > 0).then(|| {
                            counts[o] -= 1;
                            o as u8
                        })
                    })
                    .collect();
                let run = a.alloc_pages_with_owners(&owners).unwrap();
                let ctx = format!("cp{cp} ps{ps} {order} n {}", owners.len());
                let mut got = vec![0u8; 4 * run.run.len()];
                ex.read(run.pages.buffer, run.pages.offset, &mut got)
                    .unwrap();
                let want: Vec<u32> = run.run.pages().iter().map(|p| p.0).collect();
                assert_eq!(u32s(&got), want, "{ctx}");
                a.debug_check_device().unwrap();
                // Now one lane is short: nothing is launched and the lanes stay as they were —
                // the device tops (a partial commit by the kernel), the host's free counts (a
                // partial commit by the host) and, for good measure, the stacks.
                let snapshot = |a: &KernelLaneAllocator| {
                    let mut stacks = vec![0u8; ex.size(a.stacks_buffer()).unwrap()];
                    ex.read(a.stacks_buffer(), 0, &mut stacks).unwrap();
                    let mut tops = vec![0u8; ex.size(a.tops_buffer()).unwrap()];
                    ex.read(a.tops_buffer(), 0, &mut tops).unwrap();
                    (stacks, tops, a.lane_free_counts())
                };
                let lanes_before = snapshot(&a);
                let mut short = vec![0u8; a.lane_free_counts()[0] as usize + 1];
                short.extend(1..cp);
                let before = ex.counters();
                let err = a.alloc_pages_with_owners(&short).unwrap_err();
                let d = ex.counters().since(&before);
                assert!(err.is_shortage(), "{ctx}: {err}");
                assert!(
                    matches!(err.as_alloc(), Some(AllocError::LanesShort { deficit }) if deficit[0] == 1),
                    "{ctx}: {err}"
                );
                assert_eq!((d.launches, d.uploads, d.reads), (0, 0, 0), "{ctx}");
                let lanes_after = snapshot(&a);
                assert_eq!(lanes_before.0, lanes_after.0, "stacks: {ctx}");
                assert_eq!(lanes_before.1, lanes_after.1, "lane tops: {ctx}");
                assert_eq!(lanes_before.2, lanes_after.2, "lane free counts: {ctx}");
                a.debug_check_device().unwrap();
            }
        }
    }
}

/// The select kernel guards all or nothing itself, past the host mirror's check: the device
/// lanes are made to hold fewer pages than the mirror counts (one lane's top lowered behind
/// the mirror's back, the drift a second stream popping pages would cause), and an
/// allocation the mirror grants runs. The launch leaves every lane stack and top as it was,
/// hands out page 0 for every request, and its status words
/// record the deficit of that lane alone. The allocation neither read back nor synchronised;
/// `check_status` and `debug_check_device` report the refusal as a typed error naming the
/// lane and its deficit, and `restore` clears it.
#[test]
fn select_refuses_a_shortage_the_mirror_missed() {
    let jit = support::jit();
    libs(); // compiled in the same warm-up as everything else
    for order in ORDERS {
        for cp in CPS {
            for ps in PSS {
                let ex: Arc<dyn Executor> = Arc::new(support::executor(order));
                let layout = CpLayout::new(u32::from(cp), ps, 300 + 7 * u32::from(cp)).unwrap();
                let mut a = KernelLaneAllocator::new(
                    layout,
                    Arc::clone(&ex),
                    jit,
                    KernelAllocOptions::default(),
                )
                .unwrap();
                let mut rng = Rng::new(&[6, u64::from(cp), u64::from(ps), order_id(order)]);
                // Lanes that have served a request already.
                let warm: Vec<u8> = (0..rng.range(1, 40))
                    .map(|_| rng.below(u64::from(cp)) as u8)
                    .collect();
                a.alloc_pages_with_owners(&warm).unwrap();
                a.debug_check_device().unwrap();
                let mirror = a.mirror().clone();
                // Lane `short` loses `k` pages on the device only.
                let short = rng.below(u64::from(cp)) as u8;
                let free = a.lane_free_counts();
                let k = rng.range(1, 3).min(u64::from(free[usize::from(short)])) as u32;
                assert!(k > 0, "lane {short} has pages");
                let read32 = |b| {
                    let mut v = vec![0u8; ex.size(b).unwrap()];
                    ex.read(b, 0, &mut v).unwrap();
                    u32s(&v)
                };
                let mut tops = read32(a.tops_buffer());
                tops[usize::from(short)] -= k;
                ex.upload(a.tops_buffer(), 0, &le32(&tops)).unwrap();
                let stacks = read32(a.stacks_buffer());
                // Every free page of every lane as the mirror counts them, shuffled: more
                // than one tile, and the mirror grants it.
                let mut owners: Vec<u8> = (0..cp)
                    .flat_map(|o| std::iter::repeat_n(o, free[usize::from(o)] as usize))
                    .collect();
                assert!(
                    owners.len() > ALLOC_THREADS as usize,
                    "{} requests",
                    owners.len()
                );
                for i in (1..owners.len()).rev() {
                    owners.swap(i, rng.below(i as u64 + 1) as usize);
                }
                let ctx = format!("cp{cp} ps{ps} {order}: lane {short} short by {k}");
                let before = ex.counters();
                let run = a.alloc_pages_with_owners(&owners).unwrap();
                let d = ex.counters().since(&before);
                assert_eq!((d.stalls(), d.launches), (0, 1), "{ctx}: {d:?}");
                // Nothing moved on the device, and every request got page 0.
                assert_eq!(read32(a.stacks_buffer()), stacks, "stacks: {ctx}");
                assert_eq!(read32(a.tops_buffer()), tops, "tops: {ctx}");
                let mut got = vec![0u8; 4 * owners.len()];
                ex.read(run.pages.buffer, run.pages.offset, &mut got)
                    .unwrap();
                assert!(u32s(&got).iter().all(|&p| p == 0), "out_pages: {ctx}");
                // The status names the lane and its deficit, and nothing else.
                let mut deficits = vec![0u32; usize::from(cp)];
                deficits[usize::from(short)] = k;
                let want = SelectStatus {
                    refused: 1,
                    lane_deficits: deficits,
                    bad_owners: 0,
                };
                let mut words = vec![0u8; 4 * (usize::from(cp) + 2)];
                ex.read(a.status_buffer(), 0, &mut words).unwrap();
                assert_eq!(u32s(&words), want.to_words(), "status: {ctx}");
                for err in [a.check_status(), a.debug_check_device()] {
                    match err {
                        Err(KernelAllocError::DeviceRefused { status }) => {
                            assert_eq!(status, want, "{ctx}")
                        }
                        other => panic!("{ctx}: {other:?}"),
                    }
                }
                let shown = a.check_status().unwrap_err().to_string();
                let pages = if k == 1 { "page" } else { "pages" };
                assert!(
                    shown.contains(&format!(
                        "1 select launch refused: lane {short} short by {k} {pages}"
                    )),
                    "{ctx}: {shown}"
                );
                // A known state clears it.
                a.restore(mirror).unwrap();
                a.check_status().unwrap();
                a.debug_check_device().unwrap();
            }
        }
    }
}

/// The release kernel guards all or nothing itself, past the host mirror's check: one device
/// lane is made to hold more pages than the mirror counts (its top raised to the lane's
/// capacity behind the mirror's back, what pushes from another stream, a double free, would
/// leave), and a free the mirror accepts runs: every page taken from the other lanes (more
/// than a tile from CP 2 on), then one to three of that lane's.
/// The launch leaves every lane stack and top as it was and its status words record that
/// lane's overflow alone. The free neither read back nor synchronised; `check_status` and
/// `debug_check_device` report the refusal as a typed error naming the lane and its
/// overflow (beside a clear select status), and `restore` clears it.
#[test]
fn release_refuses_an_overflow_the_mirror_missed() {
    let jit = support::jit();
    libs(); // compiled in the same warm-up as everything else
    for order in ORDERS {
        for cp in CPS {
            let ps = 16;
            let ex: Arc<dyn Executor> = Arc::new(support::executor(order));
            let layout = CpLayout::new(u32::from(cp), ps, 300 + 7 * u32::from(cp)).unwrap();
            let mut a = KernelLaneAllocator::new(
                layout,
                Arc::clone(&ex),
                jit,
                KernelAllocOptions::default(),
            )
            .unwrap();
            let mut rng = Rng::new(&[7, u64::from(cp), order_id(order)]);
            // Most pages of every lane are taken, in a random order.
            let free = a.lane_free_counts();
            let mut owners: Vec<u8> = (0..cp)
                .flat_map(|o| std::iter::repeat_n(o, free[usize::from(o)] as usize * 9 / 10))
                .collect();
            for i in (1..owners.len()).rev() {
                owners.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let run = a.alloc_pages_with_owners(&owners).unwrap();
            a.debug_check_device().unwrap();
            let full = rng.below(u64::from(cp)) as u8;
            let read32 = |b, offset, n: usize| {
                let mut v = vec![0u8; 4 * n];
                ex.read(b, offset, &mut v).unwrap();
                u32s(&v)
            };
            let cpn = usize::from(cp);
            let mut tops = read32(a.tops_buffer(), 0, cpn);
            tops[usize::from(full)] = a.lane_cap();
            ex.upload(a.tops_buffer(), 0, &le32(&tops)).unwrap();
            let stacks = read32(a.stacks_buffer(), 0, cpn * a.lane_cap() as usize);
            // Free k pages of the full lane, after every other page taken.
            let of_full = |p: &&cp_hicache::layout::PageId| layout.owner(**p).0 == full;
            let mut freed: Vec<_> = run
                .run
                .pages()
                .iter()
                .filter(|p| !of_full(p))
                .copied()
                .collect();
            let theirs: Vec<_> = run.run.pages().iter().filter(of_full).copied().collect();
            let k = rng.range(1, 3).min(theirs.len() as u64) as usize;
            assert!(k > 0, "lane {full} gave pages");
            freed.extend(&theirs[..k]);
            let ctx = format!("cp{cp} {order}: lane {full} over by {k}");
            let before = ex.counters();
            a.free(&freed).unwrap();
            let d = ex.counters().since(&before);
            assert_eq!((d.stalls(), d.launches), (0, 1), "{ctx}: {d:?}");
            // Nothing moved on the device.
            assert_eq!(
                read32(a.stacks_buffer(), 0, stacks.len()),
                stacks,
                "stacks: {ctx}"
            );
            assert_eq!(read32(a.tops_buffer(), 0, cpn), tops, "tops: {ctx}");
            let mut overflows = vec![0u32; cpn];
            overflows[usize::from(full)] = k as u32;
            let want = ReleaseStatus {
                refused: 1,
                lane_overflows: overflows,
                bad_pages: 0,
            };
            let words = read32(a.status_buffer(), a.release_status_offset(), cpn + 2);
            assert_eq!(words, want.to_words(), "status: {ctx}");
            for err in [a.check_status(), a.debug_check_device()] {
                match err {
                    Err(KernelAllocError::DeviceRefusedRelease { status, select }) => {
                        assert_eq!(status, want, "{ctx}");
                        assert!(select.is_clear(), "{ctx}: {select}");
                    }
                    other => panic!("{ctx}: {other:?}"),
                }
            }
            let shown = a.check_status().unwrap_err().to_string();
            let pages = if k == 1 { "page" } else { "pages" };
            assert!(
                shown.contains(&format!(
                    "1 release launch refused: lane {full} over its capacity by {k} {pages}; \
                     no select launch refused"
                )),
                "{ctx}: {shown}"
            );
            // A known state clears it.
            a.restore(a.mirror().clone()).unwrap();
            a.check_status().unwrap();
            a.debug_check_device().unwrap();
        }
    }
}

#[test]
fn transfer_matches_reference() {
    for order in ORDERS {
        let mut b = Bench::new(order, libs());
        for spec in transfer_specs() {
            check_transfer(&mut b, spec, order);
        }
    }
}

/// Bytes of one transfer buffer's source pool (`descriptor` of a transfer spec) for pools of
/// `layers` × (`device_pages`, `host_pages`), and its page counts (source, destination).
fn transfer_pools(
    d: &TransferSpec,
    layers: u32,
    device_pages: u32,
    host_pages: u32,
) -> (usize, u32, u32) {
    let pb = d.page_bytes();
    match d.direction {
        Direction::DeviceToHost => (
            (u64::from(layers * device_pages) * pb) as usize,
            device_pages,
            host_pages,
        ),
        Direction::HostToDevice => (
            (u64::from(layers * host_pages) * pb) as usize,
            host_pages,
            device_pages,
        ),
    }
}

/// A transfer spec moves random pages (some out of range on either side, skipped) exactly as
/// the reference does, in every buffer of the launch, leaves its sources alone, and the DMA
/// regions of the same request move the same bytes.
fn check_transfer(b: &mut Bench, spec: KernelSpec, order: BlockOrder) {
    let (layers, device_pages, host_pages) = (2u32, 5u32, 4u32);
    let KernelSpec::TransferPages(s) = spec else {
        unreachable!()
    };
    let descriptors = s.descriptors();
    let mut rng = Rng::new(&[4, order_id(order), uri_seed(&spec)]);
    let (_, src_cap, dst_cap) = transfer_pools(&s, layers, device_pages, host_pages);
    // A trial per device pool order: the kernel reaches each through its page table.
    for (trial, pool_order) in POOL_ORDERS.into_iter().enumerate() {
        b.pool_order = pool_order;
        // Distinct destination pages, one of them possibly out of range (skipped),
        // and source pages that may be out of range too.
        let perm = rng.permutation(dst_cap + 1);
        let n = rng.range(1, u64::from(dst_cap) + 1) as usize;
        let dst_pages: Vec<u32> = perm[..n].to_vec();
        let src_pages: Vec<u32> = (0..n)
            .map(|_| rng.below(u64::from(src_cap) + 1) as u32)
            .collect();
        let srcs: Vec<Vec<u8>> = descriptors
            .iter()
            .map(|d| rng.bytes(transfer_pools(d, layers, device_pages, host_pages).0))
            .collect();
        let g = grid(&mut rng, spec.launch_dims(n as u32, layers).grid);
        let copied = b.transfer(
            &spec,
            g,
            &TransferCase {
                src: &srcs[0],
                src1: srcs.get(1).map_or(&[], |v| v),
                src_pages: &src_pages,
                dst_pages: &dst_pages,
                layers,
                first_layer: 0,
                layer_count: layers,
                device_pages,
                host_pages,
                told_host_pages: host_pages,
                guard: GUARD,
            },
        );
        assert_eq!(
            copied.len(),
            descriptors.len(),
            "{spec}: one result per buffer"
        );
        for (i, ((copied, src), d)) in copied.iter().zip(&srcs).zip(&descriptors).enumerate() {
            assert!(
                copied.got == copied.want,
                "{spec} {order} trial {trial} ({pool_order:?}) grid {g} buffer {i}: first difference at byte {:?}; src {src_pages:?} dst {dst_pages:?}",
                copied.first_difference()
            );
            assert_eq!(
                copied.src_after[..src.len()],
                src[..],
                "{spec} buffer {i}: source changed"
            );
            // The DMA path (copy regions instead of the kernel) moves the same bytes.
            let pools = PoolShape {
                layers,
                device_pages,
                host_pages,
            };
            let sbuf = b.bytes(src, GUARD);
            let dma = b.poison(copied.want.len());
            let regions = transfer_regions(d, &src_pages, &dst_pages, pools, 0..layers);
            b.ex.copy_regions(sbuf, dma, &regions).unwrap();
            assert!(
                b.read(dma) == copied.want,
                "{spec} trial {trial} buffer {i}: DMA regions {regions:?} differ from the kernel"
            );
        }
    }
}

#[test]
fn transfer_of_a_layer_range_moves_exactly_those_layers() {
    for order in ORDERS {
        let mut b = Bench::new(order, libs());
        for spec in transfer_specs() {
            check_transfer_layers(&mut b, spec, order);
        }
    }
}

/// Block sizes of [`group_transfer_specs`]: one thread (a group that walks every page in
/// order), one warp, and blocks of 2, 4 and 16 warp groups.
const GROUP_THREADS: [u32; 5] = [1, 32, 64, 128, 512];

/// Transfers under the warp-group mapping (issue 29: a warp per page item, buffers
/// interleaved, page ids loaded a pair ahead), at each of [`GROUP_THREADS`], each with two
/// buffers whose pages differ: NSA's 41,984- and 8,448-byte pages at `v16` (82 and 16.5
/// vectors per lane, 8 in flight) and byte-wide 33- and 132-byte pages at `v1` (just over a
/// warp and four warps, 3 in flight), one and three pairs per item, the layer loop in the
/// grid and in the block, both store forms, both directions and host layouts.
fn group_transfer_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for (i, &threads) in GROUP_THREADS.iter().enumerate() {
        for (j, &(page_size, bpt, second, pages_per_block, unroll)) in
            [(64, 656, 132, 1, 8), (1, 33, 132, 3, 3)]
                .iter()
                .enumerate()
        {
            let k = i + j;
            let spec = |launch| TransferSpec {
                direction: [Direction::DeviceToHost, Direction::HostToDevice][k % 2],
                layout: [HostLayout::PageFirst, HostLayout::LayerFirst][i % 2],
                page_size,
                bytes_per_token: bpt,
                second_bytes_per_token: Some(second),
                stamps: false,
                launch,
            };
            let vec = VecWidth::widest_for(spec(CopyLaunch::default()).common_page_bytes());
            v.push(KernelSpec::TransferPages(spec(CopyLaunch {
                threads,
                pages_per_block,
                vec,
                unroll,
                layers_in_block: k % 2 == 1,
                streaming_stores: i % 2 == 1,
                max_blocks: 0,
            })));
        }
    }
    // The stamped twins `tune` times beside its busy kernels: the same copy, plus stamps.
    let twins: Vec<KernelSpec> = v
        .iter()
        .filter(|s| s.threads() >= 128)
        .filter_map(KernelSpec::stamped)
        .collect();
    v.extend(twins);
    v
}

fn group_libs() -> &'static HashMap<KernelSpec, PathBuf> {
    static LIBS: OnceLock<HashMap<KernelSpec, PathBuf>> = OnceLock::new();
    LIBS.get_or_init(|| support::compile(&group_transfer_specs(), Sanitize::None))
}

/// Issue 29: a transfer's groups cover every page of every buffer exactly once at any grid:
/// one block, three, the recommended grid and more groups than items, for the whole layer
/// range and a clamped one, in both block orders. The stamped twins copy the same and stamp
/// their first block start, last block start and last block end in that order.
#[test]
fn r29_transfer_groups_copy_every_page_at_any_grid() {
    let (layers, device_pages, host_pages) = (3u32, 12u32, 10u32);
    for order in ORDERS {
        let mut b = Bench::new(order, group_libs());
        for spec in group_transfer_specs() {
            let KernelSpec::TransferPages(s) = spec else {
                unreachable!()
            };
            let mut rng = Rng::new(&[29, order_id(order), uri_seed(&spec)]);
            let (_, src_cap, dst_cap) = transfer_pools(&s, layers, device_pages, host_pages);
            // Nine pairs, one destination and some sources possibly out of range (skipped).
            let dst_pages: Vec<u32> = rng.permutation(dst_cap + 1)[..9].to_vec();
            let src_pages: Vec<u32> = (0..9)
                .map(|_| rng.below(u64::from(src_cap) + 1) as u32)
                .collect();
            let srcs: Vec<Vec<u8>> = s
                .descriptors()
                .iter()
                .map(|d| rng.bytes(transfer_pools(d, layers, device_pages, host_pages).0))
                .collect();
            // And an empty range: nothing copied, a stamped twin's early return still stamps.
            for (first_layer, layer_count) in [(0, layers), (1, u32::MAX), (0, 0)] {
                let span = layer_count.min(layers - first_layer);
                let recommended = spec.launch_dims(9, span).grid;
                // More groups than items: 9 pairs × 3 layers × 2 buffers at most.
                for g in [1, 3, recommended, 54 + 7] {
                    let copied = b.transfer(
                        &spec,
                        g,
                        &TransferCase {
                            src: &srcs[0],
                            src1: &srcs[1],
                            src_pages: &src_pages,
                            dst_pages: &dst_pages,
                            layers,
                            first_layer,
                            layer_count,
                            device_pages,
                            host_pages,
                            told_host_pages: host_pages,
                            guard: GUARD,
                        },
                    );
                    if s.stamps {
                        // First block start <= last block start <= last block end, all set.
                        let [start, end, last_start] = b.last_stamps.expect("stamped");
                        assert!(
                            start != u64::MAX && start <= last_start && last_start <= end,
                            "{spec} {order} grid {g}: stamps {start} {end} {last_start}"
                        );
                    }
                    for (i, (copied, src)) in copied.iter().zip(&srcs).enumerate() {
                        assert!(
                            copied.got == copied.want,
                            "{spec} {order} layers {first_layer}+{layer_count} grid {g} buffer {i}: first difference at byte {:?}",
                            copied.first_difference()
                        );
                        assert_eq!(
                            copied.src_after[..src.len()],
                            src[..],
                            "{spec} buffer {i}: source changed"
                        );
                    }
                }
            }
        }
    }
}

/// Layer ranges of [`check_transfer_layers`] for pools of 3 layers, as (first_layer,
/// layer_count): each single layer, two layers, then ranges partly or wholly outside the
/// pools (including sums past `u32::MAX`), which copy only their valid part or nothing.
const LAYER_RANGES: [(u32, u32); 11] = [
    (0, 1),
    (1, 1),
    (2, 1),
    (1, 2),
    (0, 0),
    (2, 5),
    (3, 1),
    (7, 2),
    (1, u32::MAX),
    (u32::MAX, 2),
    (u32::MAX, u32::MAX),
];

/// A transfer of layers `[first, first + count)` (clamped to the pools) writes exactly those
/// layers of each destination page, with the bytes the full transfer writes there, and leaves
/// every other layer (and every other page) poison; in bounds for ranges past the pools
/// (guard bytes stay poison). The kernel matches the reference, and the DMA regions of the
/// same range move the same bytes. Covers both directions, both host layouts (page-first
/// and layer-first) and both work-item shapes (per (group, layer), and `_lb`).
fn check_transfer_layers(b: &mut Bench, spec: KernelSpec, order: BlockOrder) {
    let (layers, device_pages, host_pages) = (3u32, 5u32, 4u32);
    let KernelSpec::TransferPages(s) = spec else {
        unreachable!()
    };
    let descriptors = s.descriptors();
    let mut rng = Rng::new(&[41, order_id(order), uri_seed(&spec)]);
    let (_, src_cap, dst_cap) = transfer_pools(&s, layers, device_pages, host_pages);
    // Distinct in-range destinations and in-range sources: every pair moves.
    let n = rng.range(1, u64::from(dst_cap.min(src_cap))) as usize;
    let dst_pages: Vec<u32> = rng.permutation(dst_cap)[..n].to_vec();
    let src_pages: Vec<u32> = rng.permutation(src_cap)[..n].to_vec();
    let srcs: Vec<Vec<u8>> = descriptors
        .iter()
        .map(|d| rng.bytes(transfer_pools(d, layers, device_pages, host_pages).0))
        .collect();
    let case = |first_layer, layer_count| TransferCase {
        src: &srcs[0],
        src1: srcs.get(1).map_or(&[], |v| v),
        src_pages: &src_pages,
        dst_pages: &dst_pages,
        layers,
        first_layer,
        layer_count,
        device_pages,
        host_pages,
        told_host_pages: host_pages,
        guard: GUARD,
    };
    let full_grid = spec.launch_dims(n as u32, layers).grid;
    let full: Vec<Vec<u8>> = b
        .transfer(&spec, full_grid, &case(0, layers))
        .into_iter()
        .map(|c| c.want)
        .collect();
    for (first, count) in LAYER_RANGES {
        let end = (u64::from(first) + u64::from(count)).min(u64::from(layers));
        let in_range = |l: u32| u64::from(l) >= u64::from(first) && u64::from(l) < end;
        let span = (first..layers).filter(|&l| in_range(l)).count() as u32;
        let g = grid(&mut rng, spec.launch_dims(n as u32, span).grid);
        let copied = b.transfer(&spec, g, &case(first, count));
        for (i, (((copied, src), d), full)) in copied
            .iter()
            .zip(&srcs)
            .zip(&descriptors)
            .zip(&full)
            .enumerate()
        {
            let what = format!("{spec} {order} layers {first}+{count} grid {g} buffer {i}");
            let pb = d.page_bytes();
            // Byte offset of (page, layer) in the destination pool.
            let dst_off = |p: u32, l: u32| match s.direction {
                Direction::DeviceToHost => {
                    reference::host_offset(s.layout, p, l, layers, host_pages, pb) as usize
                }
                Direction::HostToDevice => {
                    reference::device_offset(p, l, device_pages, pb) as usize
                }
            };
            assert!(
                copied.got == copied.want,
                "{what}: kernel differs from the reference at byte {:?}",
                copied.first_difference()
            );
            // Independently of the reference: the full transfer's bytes in the range, poison
            // elsewhere (pages not named, other layers, the guard).
            let mut want = vec![POISON; copied.got.len()];
            for l in (0..layers).filter(|&l| in_range(l)) {
                for &dp in &dst_pages {
                    let o = dst_off(dp, l);
                    want[o..o + pb as usize].copy_from_slice(&full[o..o + pb as usize]);
                }
            }
            assert!(
                copied.got == want,
                "{what}: first byte outside the range's layers or wrong at {:?}",
                copied.got.iter().zip(&want).position(|(a, b)| a != b)
            );
            assert_eq!(
                copied.src_after[..src.len()],
                src[..],
                "{what}: source changed"
            );
            // The DMA path of the same range.
            let pools = PoolShape {
                layers,
                device_pages,
                host_pages,
            };
            let range = first..first.saturating_add(count);
            let regions = transfer_regions(d, &src_pages, &dst_pages, pools, range);
            assert!(
                regions
                    .iter()
                    .all(|r| r.dst_offset + r.len <= u64::from(layers) * u64::from(dst_cap) * pb),
                "{what}: DMA region past the pool"
            );
            let sbuf = b.bytes(src, GUARD);
            let dma = b.poison(want.len());
            b.ex.copy_regions(sbuf, dma, &regions).unwrap();
            assert!(
                b.read(dma) == want,
                "{what}: DMA regions {regions:?} differ from the kernel"
            );
        }
    }
}

#[test]
fn materialise_matches_reference() {
    for order in ORDERS {
        for cp in CPS {
            for ps in PSS {
                let mut b = Bench::new(order, libs());
                check_materialise(&mut b, cp, ps, order);
            }
        }
    }
}

/// Both copy shapes of materialise at (cp, ps) gather random pages (some beyond the pools,
/// whose slots must stay poison) exactly as the reference does.
fn check_materialise(b: &mut Bench, cp: u8, ps: u32, order: BlockOrder) {
    let (layers, local_pages) = (2u32, 3u32);
    for spec in materialise_specs(cp, ps) {
        let KernelSpec::Materialise(s) = spec else {
            unreachable!()
        };
        let mut rng = Rng::new(&[
            5,
            u64::from(cp),
            u64::from(ps),
            order_id(order),
            u64::from(s.launch.threads),
        ]);
        let pb = u64::from(ps) * u64::from(s.bytes_per_token);
        let pool_bytes = (u64::from(layers * local_pages) * pb) as usize;
        let pools: Vec<Vec<u8>> = (0..cp).map(|_| rng.bytes(pool_bytes)).collect();
        let cpn = u32::from(cp);
        let n = rng.range(1, 7) as u32;
        // Global pages, some beyond the pools (skipped: their slots stay poison).
        let seq: Vec<u32> = (0..n)
            .map(|_| rng.below(u64::from(cpn * (local_pages + 1))) as u32)
            .collect();
        for pool_order in POOL_ORDERS {
            b.pool_order = pool_order;
            let g = grid(&mut rng, spec.launch_dims(n, layers).grid);
            let copied = b.materialise(
                &spec,
                g,
                &MaterialiseCase {
                    pools: &pools,
                    seq: &seq,
                    layers,
                    local_pages,
                    guard: GUARD,
                },
            );
            assert!(
                copied.got == copied.want,
                "{spec} {order} {pool_order:?} grid {g} pages {seq:?}: first difference at byte {:?}",
                copied.first_difference()
            );
        }
    }
    b.pool_order = PoolOrder::LayerMajor;
}

fn tokens(rng: &mut Rng, n: u32) -> Vec<u32> {
    (0..n).map(|_| rng.below(50_000) as u32).collect()
}

#[test]
fn synthesise_matches_reference() {
    for order in ORDERS {
        for ci in 0..CPS.len() {
            for pi in 0..PSS.len() {
                let mut b = Bench::new(order, libs());
                check_synthesise(&mut b, synth_spec(ci, pi), order);
            }
        }
    }
}

/// Tokens of a sequence of three pages whose last one is half full (at page size 1: three
/// full pages), for the trials that must have a partial last page and a start page past 0.
fn partial_tokens(ps: u32) -> u32 {
    3 * ps - ps / 2
}

/// Synthesis into every rank's pool of random distinct pages (some beyond the pools) from a
/// first token on matches the reference, rank by rank: the tokens before it (an extended
/// request's kept partial page) stay as they were. Several trials, each writing at least one
/// token (`first_token < n_tokens`): from token 0, from a third into page 1 of three with the
/// last one partial, and random; the combination must synthesise at least one page inside
/// the pools, so it never degenerates into checking that poison stays poison.
fn check_synthesise(b: &mut Bench, spec: KernelSpec, order: BlockOrder) {
    let (layers, local_pages) = (2u32, 4u32);
    let KernelSpec::Synthesise(s) = spec else {
        unreachable!()
    };
    let (cp, ps) = (s.cp, s.page_size);
    let mut rng = Rng::new(&[6, u64::from(cp), u64::from(ps), order_id(order)]);
    let cpn = u32::from(cp);
    let pool_bytes = (u64::from(layers * local_pages) * s.buffer.page_bytes(ps)) as usize;
    let mut synthesised = 0usize;
    for trial in 0..3 {
        let n_tokens = match trial {
            1 => partial_tokens(ps),
            _ => rng.range(1, u64::from(ps) * 4) as u32,
        };
        let n_pages = placement(s.order, ps).pages_holding(n_tokens.into()) as u32;
        // Distinct global pages (page 0 excluded), some beyond the pools (skipped).
        let perm = rng.permutation((cpn * (local_pages + 1) - 1).max(n_pages));
        let seq: Vec<u32> = perm[..n_pages as usize].iter().map(|p| p + 1).collect();
        let first_token = match trial {
            0 => 0,
            1 => ps + ps / 3,
            _ => rng.below(u64::from(n_tokens)) as u32,
        };
        let items = reference::synthesise_items(s.order, ps, n_tokens, first_token);
        // Pages of this launch that land in some rank's pool (the others are skipped).
        synthesised += seq[(n_pages - items) as usize..]
            .iter()
            .filter(|&&p| p / cpn < local_pages)
            .count();
        let hashes = reference::prefix_hashes(&tokens(&mut rng, n_tokens));
        let hb = b.bytes(&le64(&hashes), 0);
        let sb = b.bytes(&le32(&seq), 0);
        for rank in 0..cpn {
            // Each rank's pool in another order: the kernel reaches it through a page table.
            let pool_order = POOL_ORDERS[(trial as usize + rank as usize) % POOL_ORDERS.len()];
            let shape = (layers, local_pages, s.buffer.page_bytes(ps));
            let pool = b.place_pool(pool_order, &vec![POISON; pool_bytes], shape, GUARD);
            let g = grid(&mut rng, spec.launch_dims(items, layers).grid);
            b.launch(
                &spec,
                g,
                &[
                    pool.table.arg(),
                    KernelArg::Ptr(hb, 0),
                    KernelArg::Ptr(sb, 0),
                    KernelArg::U32(n_tokens),
                    KernelArg::U32(first_token),
                    KernelArg::U32(rank),
                    KernelArg::U32(layers),
                    KernelArg::U32(local_pages),
                    KernelArg::U32(pool.table.page_stride),
                ],
            );
            let mut want = vec![POISON; pool_bytes + GUARD];
            reference::synthesise(
                s.buffer,
                cp,
                ps,
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
            .unwrap();
            let got = b.read_pool(&pool);
            assert!(
                got == want,
                "{spec} {order} {pool_order:?} trial {trial} rank {rank} grid {g} tokens {n_tokens} first {first_token} pages {seq:?}: first difference at byte {:?}",
                got.iter().zip(&want).position(|(a, b)| a != b)
            );
        }
    }
    assert!(
        synthesised > 0,
        "{spec} {order}: no trial synthesised a page inside the pools (a vacuous check)"
    );
}

#[test]
fn verify_flags_exactly_the_corrupted_tokens() {
    for order in ORDERS {
        let mut b = Bench::new(order, libs());
        for buffer in BUFFERS {
            for ps in PSS {
                if synth_takes(buffer, ps) {
                    check_verify(&mut b, verify_spec(buffer, ps), order);
                }
            }
        }
    }
}

/// Every field of every buffer kind at every page size the kernels take, with one byte
/// flipped at a time, flags exactly that token (`check_verify_field_bytes`).
#[test]
fn verify_flags_a_single_flipped_byte_in_every_field() {
    for order in ORDERS {
        let mut b = Bench::new(order, libs());
        for buffer in BUFFERS {
            for ps in PSS {
                if synth_takes(buffer, ps) {
                    check_verify_field_bytes(&mut b, verify_spec(buffer, ps), order);
                }
            }
        }
    }
}

/// A correct dense buffer `[layer][page][page_bytes]` of `n_tokens` tokens: every token
/// synthesised in every layer, padding slots poison.
fn synthesised_dense(
    buffer: BufferKind,
    ps: u32,
    order: TokenOrder,
    hashes: &[u64],
    n_tokens: u32,
    layers: u32,
) -> Vec<u8> {
    let place = placement(order, ps);
    let n_pages = place.pages_holding(n_tokens.into()) as u32;
    let pb = buffer.page_bytes(ps) as usize;
    let mut dense = vec![POISON; layers as usize * n_pages as usize * pb];
    for l in 0..layers {
        for t in 0..n_tokens {
            let (page, slot) = place.place(t.into());
            let at = (l as usize * n_pages as usize + page as usize) * pb;
            reference::synth_token(
                buffer,
                ps,
                hashes[t as usize],
                l,
                slot,
                &mut dense[at..at + pb],
            )
            .unwrap();
        }
    }
    dense
}

/// The placement of a kernel's token order (the layout arithmetic the references use).
fn placement(order: TokenOrder, ps: u32) -> Placement {
    match order {
        TokenOrder::Paged => Layout::Zigzag.placement(1, ps),
        TokenOrder::Interleaved { cp, run } => {
            Layout::TokenInterleave { size: run }.placement(cp, ps)
        }
    }
}

/// Token-interleaved shapes: (buffer, cp, page size, run), runs of one token up to half a
/// page, odd and even CP degrees.
const INTERLEAVED: [(BufferKind, u8, u32, u32); 5] = [
    (GQA, 4, 16, 2),
    (BufferKind::MlaKv, 4, 16, 1),
    (BufferKind::MlaKv, 3, 16, 4),
    (BufferKind::NsaKv, 8, 64, 1),
    (BufferKind::NsaIndexK, 2, 64, 32),
];

/// The synthesise and verify specs of each [`INTERLEAVED`] shape.
fn interleaved_specs() -> Vec<(KernelSpec, KernelSpec)> {
    INTERLEAVED
        .iter()
        .map(|&(buffer, cp, ps, run)| {
            let order = TokenOrder::Interleaved { cp, run };
            (
                KernelSpec::Synthesise(SynthSpec {
                    buffer,
                    cp,
                    page_size: ps,
                    threads: 128,
                    order,
                }),
                KernelSpec::Verify(VerifySpec {
                    buffer,
                    page_size: ps,
                    threads: 32,
                    order,
                }),
            )
        })
        .collect()
}

#[test]
fn interleaved_synthesise_and_verify_match_the_reference() {
    for order in ORDERS {
        let mut b = Bench::new(order, libs());
        for (synth, verify) in interleaved_specs() {
            check_synthesise(&mut b, synth, order);
            check_verify(&mut b, verify, order);
        }
    }
}

/// Runs verify `spec` over `dense` on a cleared bitmap (as replay uploads it) followed by a
/// guard, on the recommended grid or (a third of the time) a random smaller one; checks the
/// guard and that the input is unchanged, and returns the bitmap's words.
#[allow(clippy::too_many_arguments)]
fn run_verify(
    b: &mut Bench,
    rng: &mut Rng,
    spec: &KernelSpec,
    dense: &[u8],
    hashes: &[u64],
    n_tokens: u32,
    start_page: u32,
    layers: u32,
    ctx: &str,
) -> Vec<u32> {
    let words = n_tokens.div_ceil(32) as usize;
    let db = b.bytes(dense, GUARD);
    let hb = b.bytes(&le64(hashes), 0);
    let mb = b.bytes(&le32(&vec![0; words]), GUARD);
    let g = grid(rng, spec.launch_dims(n_tokens, layers).grid);
    b.launch(
        spec,
        g,
        &[
            KernelArg::Ptr(db, 0),
            KernelArg::Ptr(hb, 0),
            KernelArg::U32(n_tokens),
            KernelArg::U32(start_page),
            KernelArg::U32(layers),
            KernelArg::Ptr(mb, 0),
        ],
    );
    let got = b.read(mb);
    assert!(
        got[4 * words..].iter().all(|&x| x == POISON),
        "bitmap guard: {ctx} grid {g}"
    );
    assert_eq!(
        b.read(db)[..dense.len()],
        dense[..],
        "verify wrote its input: {ctx} grid {g}"
    );
    u32s(&got[..4 * words])
}

/// The set bits of a bitmap.
fn set_bits(words: &[u32]) -> std::collections::BTreeSet<u32> {
    (0..32 * words.len() as u32)
        .filter(|&t| words[(t / 32) as usize] >> (t % 32) & 1 == 1)
        .collect()
}

/// Verify of a correct dense buffer with random bytes flipped (in real tokens and padding
/// slots, before and after the start page) flags exactly the flipped real tokens from the
/// start page on, as the reference does. Trials: untouched from page 0; from page 1 of three
/// with the last one partial; random lengths and start pages (the start possibly past the
/// last page).
fn check_verify(b: &mut Bench, spec: KernelSpec, order: BlockOrder) {
    let layers = 2u32;
    let KernelSpec::Verify(s) = spec else {
        unreachable!()
    };
    let (buffer, ps) = (s.buffer, s.page_size);
    let mut rng = Rng::new(&[
        7,
        u64::from(ps),
        buffer.id().into(),
        order_id(order),
        buffer.bytes_per_token().into(),
        s.threads.into(),
    ]);
    for trial in 0..3 {
        let n_tokens = match trial {
            1 => partial_tokens(ps),
            _ => rng.range(1, u64::from(ps) * 4) as u32,
        };
        let place = placement(s.order, ps);
        let n_pages = place.pages_holding(n_tokens.into()) as u32;
        let start_page = match trial {
            0 => 0,
            1 => 1,
            _ => rng.below(u64::from(n_pages) + 1) as u32,
        };
        let hashes = reference::prefix_hashes(&tokens(&mut rng, n_tokens));
        let pb = buffer.page_bytes(ps) as usize;
        let mut dense = synthesised_dense(buffer, ps, s.order, &hashes, n_tokens, layers);
        // Trial 0: untouched. Others: flip bytes of random tokens (and of padding slots,
        // which must not count).
        let fields = buffer.field_layouts(ps);
        let mut bad = std::collections::BTreeSet::new();
        let mut touched = std::collections::HashSet::new();
        if trial > 0 {
            for _ in 0..rng.range(1, 6) {
                let l = rng.below(u64::from(layers)) as u32;
                let slot_space = u64::from(n_pages * ps);
                let x = rng.below(slot_space) as u32;
                let (page, slot) = (x / ps, x % ps);
                let t = place.token(page.into(), slot) as u32;
                let f = fields[rng.below(fields.len() as u64) as usize];
                let e = rng.below(u64::from(f.count)) as u32;
                let byte = rng.below(u64::from(f.dtype.size())) as usize;
                let at = (l * n_pages + page) as usize * pb + f.offset(slot, e) + byte;
                if !touched.insert(at) {
                    continue; // a second flip of the same byte could undo the first
                }
                dense[at] ^= rng.range(1, 255) as u8;
                if t < n_tokens && t >= start_page * ps {
                    bad.insert(t);
                }
            }
        }
        let want = reference::verify(
            buffer, ps, s.order, &dense, &hashes, n_tokens, start_page, layers,
        )
        .unwrap();
        assert_eq!(
            set_bits(&want),
            bad,
            "reference disagrees with the corruption"
        );
        let ctx = format!(
            "{spec} {order} trial {trial} tokens {n_tokens} start {start_page} bad {bad:?}"
        );
        let got = run_verify(
            b, &mut rng, &spec, &dense, &hashes, n_tokens, start_page, layers, &ctx,
        );
        assert_eq!(got, want, "{ctx}");
    }
}

/// One byte flipped at a time, in every field: its first byte, its last byte (in a partial
/// last draw where the field has one: nsa `index_k`'s scale) and a random one, each in a
/// random token from the start page on and a random layer, flags exactly that token; the same
/// flips in a token before the start page, and in a padding slot of the partial last page,
/// flag nothing. Three pages, the last half full, from page 1 (page size 1: three tokens,
/// from token 1).
fn check_verify_field_bytes(b: &mut Bench, spec: KernelSpec, order: BlockOrder) {
    let layers = 3u32;
    let KernelSpec::Verify(s) = spec else {
        unreachable!()
    };
    let (buffer, ps) = (s.buffer, s.page_size);
    let mut rng = Rng::new(&[
        8,
        u64::from(ps),
        buffer.id().into(),
        order_id(order),
        s.threads.into(),
    ]);
    let n_tokens = partial_tokens(ps);
    let n_pages = n_tokens.div_ceil(ps);
    let start_page = 1u32;
    let hashes = reference::prefix_hashes(&tokens(&mut rng, n_tokens));
    let pb = buffer.page_bytes(ps) as usize;
    let correct = synthesised_dense(buffer, ps, TokenOrder::Paged, &hashes, n_tokens, layers);
    for f in buffer.field_layouts(ps) {
        let size = f.dtype.size();
        let last = f.count * size - 1;
        let random = rng.below(u64::from(f.count * size)) as u32;
        for byte in [0, last, random] {
            let (e, within) = (byte / size, (byte % size) as usize);
            // A real token to flag, one before the start page, and a padding slot.
            let flagged = rng.range(u64::from(start_page * ps), u64::from(n_tokens - 1)) as u32;
            let early = rng.below(u64::from(start_page * ps)) as u32;
            let padding = (n_tokens < n_pages * ps).then_some(n_tokens);
            for (t, flags) in [
                (Some(flagged), true),
                (Some(early), false),
                (padding, false),
            ] {
                let Some(t) = t else { continue };
                let l = rng.below(u64::from(layers)) as u32;
                let mut dense = correct.clone();
                let at = (l * n_pages + t / ps) as usize * pb + f.offset(t % ps, e) + within;
                dense[at] ^= 1 << rng.below(8);
                let want: std::collections::BTreeSet<u32> =
                    flags.then_some(t).into_iter().collect();
                let ctx = format!(
                    "{spec} {order} field {} byte {byte} (element {e}) of token {t} in layer {l}: flags {want:?}",
                    f.id
                );
                let reference = reference::verify(
                    buffer,
                    ps,
                    TokenOrder::Paged,
                    &dense,
                    &hashes,
                    n_tokens,
                    start_page,
                    layers,
                )
                .unwrap();
                assert_eq!(set_bits(&reference), want, "reference: {ctx}");
                let got = run_verify(
                    b, &mut rng, &spec, &dense, &hashes, n_tokens, start_page, layers, &ctx,
                );
                assert_eq!(set_bits(&got), want, "{ctx}");
            }
        }
    }
}

/// Select and release run as one block (their tiles share one block's counts and barriers;
/// a second block would pop or push the same stack slots). Launched with more, which the
/// host never does, each refuses itself in both block orders: one refused launch counted in
/// its status (not one per block), and nothing else touched, no lane top, no stack slot, no
/// output; the status decodes as a grid refusal.
#[test]
fn allocator_kernels_refuse_a_grid_of_more_than_one_block() {
    let (cp, ps, lane_cap) = (4u8, 16u32, 8u32);
    let cpn = u32::from(cp);
    let stacks: Vec<u32> = (0..cpn * lane_cap)
        .map(|i| (i % lane_cap + 1) * cpn + i / lane_cap)
        .collect();
    let tops = vec![5u32, 3, 8, 0];
    for order in ORDERS {
        for blocks in [2u32, 3] {
            let ctx = format!("{order} grid {blocks}");
            let mut b = Bench::new(order, libs());
            let owners = [0u8, 1, 2, 0];
            let n = owners.len();
            let (ob, sb) = (b.bytes(&owners, 0), b.bytes(&le32(&stacks), 0));
            let tb = b.bytes(&le32(&tops), 0);
            // With token locations and without them: the same guard, the same words.
            for output in [SelectOutput::PagesAndLocs, SelectOutput::Pages] {
                let spec = select_spec_out(cp, ps, ALLOC_THREADS, output);
                let ctx = format!("{spec} {ctx}");
                let stb = b.bytes(&le32(&vec![0u32; usize::from(cp) + 2]), 0);
                let pb = b.poison(4 * n);
                let lb = output.writes_locs().then(|| b.poison(8 * n * ps as usize));
                let mut args = vec![
                    KernelArg::Ptr(ob, 0),
                    KernelArg::U32(n as u32),
                    KernelArg::Ptr(sb, 0),
                    KernelArg::Ptr(tb, 0),
                    KernelArg::U32(lane_cap),
                    KernelArg::Ptr(pb, 0),
                ];
                args.extend(lb.map(|lb| KernelArg::Ptr(lb, 0)));
                args.push(KernelArg::Ptr(stb, 0));
                // The executor refuses such a grid for a signed kernel, before it runs...
                let k = b.kernel(&spec);
                let refused =
                    b.ex.launch(k, &LaunchConfig::linear(blocks, spec.threads()), &args)
                        .unwrap_err();
                assert!(
                    refused.to_string().contains("exactly one block"),
                    "{refused}"
                );
                // ...and unsigned, the kernel's own guard is what stands.
                // SAFETY: the arguments are the select kernel's, in buffers of the sizes it
                // reads and writes for `n` requests at this CP and capacity.
                unsafe { b.launch_unsigned(&spec, blocks, &args) };
                assert_eq!(u32s(&b.read(tb)), tops, "select tops: {ctx}");
                assert_eq!(u32s(&b.read(sb)), stacks, "select stacks: {ctx}");
                assert!(b.read(pb).iter().all(|&x| x == POISON), "out_pages: {ctx}");
                if let Some(lb) = lb {
                    assert!(b.read(lb).iter().all(|&x| x == POISON), "out_locs: {ctx}");
                }
                let status = SelectStatus::from_words(&u32s(&b.read(stb))).unwrap();
                assert_eq!(
                    status.to_words(),
                    vec![1, 0, 0, 0, 0, 0],
                    "select status: {ctx}"
                );
                assert!(status.is_grid_refusal(), "{ctx}");
                assert!(
                    status.to_string().contains("more than one block"),
                    "{status}"
                );
            }

            let spec = release_spec(cp, ALLOC_THREADS);
            let pages = [7u32, 13, 2];
            let rb = b.bytes(&le32(&pages), 0);
            let stb = b.bytes(&le32(&vec![0u32; usize::from(cp) + 2]), 0);
            // SAFETY: as above, for the release kernel.
            unsafe {
                b.launch_unsigned(
                    &spec,
                    blocks,
                    &[
                        KernelArg::Ptr(rb, 0),
                        KernelArg::U32(pages.len() as u32),
                        KernelArg::Ptr(sb, 0),
                        KernelArg::Ptr(tb, 0),
                        KernelArg::U32(lane_cap),
                        KernelArg::Ptr(stb, 0),
                    ],
                )
            };
            assert_eq!(u32s(&b.read(tb)), tops, "release tops: {ctx}");
            assert_eq!(u32s(&b.read(sb)), stacks, "release stacks: {ctx}");
            let status = ReleaseStatus::from_words(&u32s(&b.read(stb))).unwrap();
            assert_eq!(
                status.to_words(),
                vec![1, 0, 0, 0, 0, 0],
                "release status: {ctx}"
            );
            assert!(status.is_grid_refusal(), "{ctx}");
        }
    }
}
