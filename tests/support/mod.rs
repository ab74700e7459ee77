//! Shared helpers of the kernel test targets: one JIT with a cache under the cargo tmp dir (so
//! reruns and other targets hit it), host executors with an explicit block order, a small
//! deterministic RNG, typed buffer helpers, and one launch-and-reference run of each page-copy
//! kernel (transfer, materialise).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use cp_hicache::exec::{
    BlockOrder, BufferId, Executor, HostExecutor, HostOptions, KernelArg, KernelArtifact, KernelId,
    LaunchConfig, MemKind,
};
use cp_hicache::jit::{Artifact, Jit, JitConfig, JitRequest, Sanitize, Target};
use cp_hicache::kernels::reference;
use cp_hicache::kernels::{
    page_stride, transfer_args, CopyLaunch, Direction, KernelSpec, PageTable, PoolShape, VecWidth,
    TRANSFER_STAMP_BYTES,
};

/// Poison byte of every output buffer: bytes a kernel should not write stay 0xA5.
pub const POISON: u8 = 0xA5;

/// Both block orders, so kernels relying on uninitialised shared memory are caught.
pub const ORDERS: [BlockOrder; 2] = [BlockOrder::Forward, BlockOrder::Reverse];

/// The process-wide JIT; its disk cache is shared with the other test targets.
pub fn jit() -> &'static Jit {
    static JIT: OnceLock<Jit> = OnceLock::new();
    JIT.get_or_init(|| {
        Jit::new(JitConfig::new(concat!(
            env!("CARGO_TARGET_TMPDIR"),
            "/jit-cache"
        )))
    })
}

/// A host executor with an explicit block order (the env var is not consulted).
pub fn executor(order: BlockOrder) -> HostExecutor {
    HostExecutor::new(HostOptions {
        block_order: order,
        ..HostOptions::default()
    })
}

/// Renders and compiles every spec in one parallel warm-up; panics with the compiler's
/// message on failure. Returns the `.so` of each spec.
pub fn compile(specs: &[KernelSpec], sanitize: Sanitize) -> HashMap<KernelSpec, PathBuf> {
    let requests: Vec<JitRequest> = specs
        .iter()
        .map(|s| JitRequest {
            uri: s.uri(),
            source: s.render().unwrap_or_else(|e| panic!("render {s}: {e}")),
            target: Target::Host { sanitize },
        })
        .collect();
    let t = std::time::Instant::now();
    let results = jit().warm_up(&requests);
    let misses = results
        .iter()
        .filter(|r| matches!(r, Ok(k) if !k.cache_hit.is_hit()))
        .count();
    eprintln!(
        "compiled {} kernels ({misses} cache misses) in {:.1} s",
        specs.len(),
        t.elapsed().as_secs_f64()
    );
    specs
        .iter()
        .zip(results)
        .map(|(s, r)| {
            let k = r.unwrap_or_else(|e| panic!("compile {s}: {e}"));
            match k.artifact {
                Artifact::SharedObject(p) => (*s, p),
                Artifact::Cubin(_) => panic!("host target produced a CUBIN"),
            }
        })
        .collect()
}

/// An executor plus the kernels loaded into it so far.
pub struct Bench {
    /// The executor.
    pub ex: HostExecutor,
    libs: &'static HashMap<KernelSpec, PathBuf>,
    /// Kernels by spec and whether they were loaded with the spec's signature.
    loaded: HashMap<(KernelSpec, bool), KernelId>,
    /// How [`Bench::transfer`] and [`Bench::materialise`] lay out device pools.
    pub pool_order: PoolOrder,
    /// What the last stamped transfer ([`TransferSpec::stamps`](cp_hicache::kernels::TransferSpec::stamps))
    /// wrote to its `stamps`: first block start, last block end, last block start.
    pub last_stamps: Option<[u64; 3]>,
}

/// How a test lays out a device pool of `layers × pages` pages. The kernels reach each
/// through a page table; the references read the layer-major bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolOrder {
    /// `[layer][page][page_bytes]` in one buffer (the cache's own pools).
    LayerMajor,
    /// One `[page][page_bytes]` buffer per layer (SGLang's per-layer tensors).
    PerLayer,
    /// `[page][layer][page_bytes]` in one buffer, `gap` poison bytes after each page's
    /// layers (vLLM's cross-layer tensor; a gap is a page stride wider than the page).
    PageMajor {
        /// Bytes after each page's layers, a multiple of 16.
        gap: u64,
    },
}

/// Every pool order the tests cycle through.
pub const POOL_ORDERS: [PoolOrder; 3] = [
    PoolOrder::LayerMajor,
    PoolOrder::PerLayer,
    PoolOrder::PageMajor { gap: 32 },
];

/// A device pool placed in a [`PoolOrder`]: its page table and what to check on read-back.
pub struct PlacedPool {
    /// The pool as a kernel argument.
    pub table: PageTable,
    order: PoolOrder,
    layers: u32,
    pages: u32,
    page_bytes: u64,
    guard: usize,
    /// The one buffer of a layer-major or page-major pool.
    pool: BufferId,
}

impl Bench {
    /// A bench over compiled libraries `libs`, with block order `order`.
    pub fn new(order: BlockOrder, libs: &'static HashMap<KernelSpec, PathBuf>) -> Bench {
        Bench {
            ex: executor(order),
            libs,
            loaded: HashMap::new(),
            pool_order: PoolOrder::LayerMajor,
            last_stamps: None,
        }
    }

    /// Places layer-major pool bytes (`layers × pages × page_bytes`, each buffer followed by
    /// `guard` poison bytes) in `order`, with a page table of every layer.
    pub fn place_pool(
        &self,
        order: PoolOrder,
        layer_major: &[u8],
        (layers, pages, page_bytes): (u32, u32, u64),
        guard: usize,
    ) -> PlacedPool {
        let pb = page_bytes as usize;
        let layer_bytes = pages as usize * pb;
        assert_eq!(layer_major.len(), layers as usize * layer_bytes);
        let at = (self.poison(8 * layers.max(1) as usize), 0);
        let mut one = at.0;
        let table = match order {
            PoolOrder::LayerMajor => {
                one = self.bytes(layer_major, guard);
                PageTable::layer_major(at, one, layers, pages, page_bytes)
            }
            PoolOrder::PerLayer => PageTable {
                at,
                entries: layer_major
                    .chunks(layer_bytes.max(1))
                    .take(layers as usize)
                    .map(|l| (self.bytes(l, guard), 0))
                    .chain(
                        // Layers of no pages still need a pointer each.
                        (0..if layer_bytes == 0 { layers } else { 0 })
                            .map(|_| (self.poison(guard), 0)),
                    )
                    .collect(),
                page_stride: page_stride(page_bytes),
            },
            PoolOrder::PageMajor { gap } => {
                let stride = layers as usize * pb + gap as usize;
                let mut bytes = vec![POISON; pages as usize * stride];
                for l in 0..layers as usize {
                    for p in 0..pages as usize {
                        let from = l * layer_bytes + p * pb;
                        bytes[p * stride + l * pb..][..pb]
                            .copy_from_slice(&layer_major[from..from + pb]);
                    }
                }
                one = self.bytes(&bytes, guard);
                PageTable {
                    at,
                    entries: (0..u64::from(layers))
                        .map(|l| (one, l * page_bytes))
                        .collect(),
                    page_stride: stride as u32,
                }
            }
        };
        PlacedPool {
            table,
            order,
            layers,
            pages,
            page_bytes,
            guard,
            pool: one,
        }
    }

    /// A placed pool's bytes, layer-major, then the guard bytes after it: every other byte a
    /// placement adds (per-layer guards, page gaps) must still be poison, or this panics.
    pub fn read_pool(&self, p: &PlacedPool) -> Vec<u8> {
        let pb = p.page_bytes as usize;
        let layer_bytes = p.pages as usize * pb;
        let untouched = |bytes: &[u8], what: &str| {
            assert!(
                bytes.iter().all(|&b| b == POISON),
                "{:?} pool: a kernel wrote {what}",
                p.order
            );
        };
        match p.order {
            PoolOrder::LayerMajor => self.read(p.pool),
            PoolOrder::PerLayer => {
                let mut out = Vec::new();
                let mut guard = Vec::new();
                for &(id, _) in &p.table.entries {
                    let all = self.read(id);
                    out.extend_from_slice(&all[..layer_bytes]);
                    untouched(
                        &all[layer_bytes..layer_bytes + p.guard],
                        "past a layer's pages",
                    );
                    guard = all[layer_bytes..].to_vec();
                }
                out.extend(guard);
                out
            }
            PoolOrder::PageMajor { gap } => {
                let stride = p.layers as usize * pb + gap as usize;
                let all = self.read(p.pool);
                let mut out = vec![0u8; p.layers as usize * layer_bytes];
                for page in 0..p.pages as usize {
                    for l in 0..p.layers as usize {
                        out[l * layer_bytes + page * pb..][..pb]
                            .copy_from_slice(&all[page * stride + l * pb..][..pb]);
                    }
                    untouched(
                        &all[page * stride + p.layers as usize * pb..][..gap as usize],
                        "in a page gap",
                    );
                }
                out.extend_from_slice(&all[p.pages as usize * stride..]);
                out
            }
        }
    }

    /// The kernel of `spec`, loaded with its signature on first use.
    pub fn kernel(&mut self, spec: &KernelSpec) -> KernelId {
        self.load(spec, true)
    }

    /// The kernel of `spec`, loaded on first use, with its signature or (for launches that
    /// break it on purpose, under ASan) without.
    fn load(&mut self, spec: &KernelSpec, signed: bool) -> KernelId {
        if let Some(&k) = self.loaded.get(&(*spec, signed)) {
            return k;
        }
        let path = self
            .libs
            .get(spec)
            .unwrap_or_else(|| panic!("{spec} was not compiled"));
        let entry = spec.entry_name();
        let signature = spec.signature();
        // SAFETY: `path` is the JIT's host build of `spec`'s render (from `compile`).
        let k = unsafe {
            self.ex.load_kernel(&KernelArtifact::HostLibrary {
                path,
                entry: &entry,
                signature: signed.then_some(&signature),
            })
        }
        .unwrap_or_else(|e| panic!("load {spec}: {e}"));
        self.loaded.insert((*spec, signed), k);
        k
    }

    /// Launches `spec` loaded without its signature, so the executor does not check the
    /// launch shape (the kernel's own guards are what is tested); panics with the diagnostic.
    ///
    /// # Safety
    /// As [`Executor::launch_unchecked`]: the arguments must be what `spec`'s kernel takes.
    pub unsafe fn launch_unsigned(&mut self, spec: &KernelSpec, grid: u32, args: &[KernelArg<'_>]) {
        let k = self.load(spec, false);
        let config = LaunchConfig::linear(grid, spec.threads());
        // SAFETY: the caller's contract.
        unsafe { self.ex.launch_unchecked(k, &config, args) }
            .unwrap_or_else(|e| panic!("launch {spec} grid {grid}: {e}"));
    }

    /// Launches `spec` on a `grid` of its own block size; panics with the diagnostic.
    pub fn launch(&mut self, spec: &KernelSpec, grid: u32, args: &[KernelArg<'_>]) {
        let k = self.kernel(spec);
        self.ex
            .launch(k, &LaunchConfig::linear(grid, spec.threads()), args)
            .unwrap_or_else(|e| panic!("launch {spec} grid {grid}: {e}"));
    }

    /// A buffer holding `data` (plus `guard` poison bytes after it).
    pub fn bytes(&self, data: &[u8], guard: usize) -> BufferId {
        let b = self
            .ex
            .alloc(MemKind::Device, data.len() + guard, POISON)
            .unwrap();
        if !data.is_empty() {
            self.ex.upload(b, 0, data).unwrap();
        }
        b
    }

    /// A buffer of `n` poison bytes.
    pub fn poison(&self, n: usize) -> BufferId {
        self.ex.alloc(MemKind::Device, n, POISON).unwrap()
    }

    /// The whole content of a buffer.
    pub fn read(&self, b: BufferId) -> Vec<u8> {
        let mut out = vec![0u8; self.ex.size(b).unwrap()];
        self.ex.read(b, 0, &mut out).unwrap();
        out
    }

    /// Launches transfer `spec` on `grid` blocks over the pairs of `case` (every destination
    /// starts as poison) and runs the reference on the same inputs, per buffer of the launch
    /// (one [`Copied`] each, in descriptor order: `case.src`, then `case.src1`); panics if
    /// `spec` is not a transfer or the reference rejects the inputs.
    pub fn transfer(
        &mut self,
        spec: &KernelSpec,
        grid: u32,
        case: &TransferCase<'_>,
    ) -> Vec<Copied> {
        let KernelSpec::TransferPages(s) = *spec else {
            panic!("{spec} is not a transfer kernel")
        };
        let n = case.dst_pages.len() as u32;
        let spb = self.bytes(&le32(case.src_pages), 0);
        let dpb = self.bytes(&le32(case.dst_pages), 0);
        let descriptors = s.descriptors();
        let mut bufs = Vec::new();
        let mut wants = Vec::new();
        for (i, d) in descriptors.iter().enumerate() {
            let src = if i == 0 { case.src } else { case.src1 };
            let pb = d.page_bytes();
            let pool_bytes = |pages: u32| (u64::from(case.layers * pages) * pb) as usize;
            let dst_bytes = match s.direction {
                Direction::DeviceToHost => pool_bytes(case.host_pages),
                Direction::HostToDevice => pool_bytes(case.device_pages),
            };
            // The reference first: it checks the page lists and pools against the sizes.
            let mut want = vec![POISON; dst_bytes + case.guard];
            reference::transfer_pages(
                d.direction,
                d.layout,
                pb,
                src,
                &mut want,
                case.src_pages,
                case.dst_pages,
                n,
                case.layers,
                case.first_layer,
                case.layer_count,
                case.device_pages,
                case.host_pages,
            )
            .unwrap();
            // The device side placed in the bench's pool order, the host side as it is.
            let shape = (case.layers, case.device_pages, pb);
            bufs.push(match s.direction {
                Direction::DeviceToHost => (
                    self.place_pool(self.pool_order, src, shape, case.guard),
                    self.poison(dst_bytes + case.guard),
                ),
                Direction::HostToDevice => (
                    self.place_pool(self.pool_order, &vec![POISON; dst_bytes], shape, case.guard),
                    self.bytes(src, case.guard),
                ),
            });
            wants.push(want);
        }
        let told = PoolShape {
            layers: case.layers,
            device_pages: case.device_pages,
            host_pages: case.told_host_pages,
        };
        let ends: Vec<(&PageTable, (BufferId, u64))> = bufs
            .iter()
            .map(|(dev, host)| (&dev.table, (*host, 0)))
            .collect();
        let mut args = transfer_args(
            &ends,
            (spb, dpb),
            n,
            told,
            (case.first_layer, case.layer_count),
        );
        // A stamped transfer's stamps start as no block started (~0) or ended (0).
        let stamps = s.stamps.then(|| {
            let mut reset = u64::MAX.to_le_bytes().to_vec();
            reset.resize(TRANSFER_STAMP_BYTES as usize, 0);
            self.bytes(&reset, 0)
        });
        args.extend(stamps.map(|b| KernelArg::Ptr(b, 0)));
        if case.told_host_pages == case.host_pages {
            self.launch(spec, grid, &args);
        } else {
            // A signed launch would be refused (the host pool is shorter than its reach), so
            // the kernel is loaded without its signature.
            let k = self.load(spec, false);
            let config = LaunchConfig::linear(grid, spec.threads());
            // SAFETY: none: `kernel_asan` tells a larger host pool than it allocates on
            // purpose, only in a child process whose kernels are built with AddressSanitizer,
            // which aborts at the first byte out of bounds.
            unsafe { self.ex.launch_unchecked(k, &config, &args) }
                .unwrap_or_else(|e| panic!("launch {spec} grid {grid}: {e}"));
        }
        self.last_stamps = stamps.map(|b| {
            let words = self.read(b);
            std::array::from_fn(|i| u64::from_le_bytes(words[8 * i..8 * i + 8].try_into().unwrap()))
        });
        bufs.iter()
            .zip(wants)
            .map(|((dev, host), want)| {
                let (dev, host) = (self.read_pool(dev), self.read(*host));
                let (got, src_after) = match s.direction {
                    Direction::DeviceToHost => (host, dev),
                    Direction::HostToDevice => (dev, host),
                };
                Copied {
                    got,
                    want,
                    src_after,
                }
            })
            .collect()
    }

    /// Launches materialise `spec` on `grid` blocks over the pools and page sequence of
    /// `case` (the dense output starts as poison) and runs the reference on the same inputs;
    /// panics if `spec` is not a materialise kernel or the reference rejects the inputs.
    pub fn materialise(
        &mut self,
        spec: &KernelSpec,
        grid: u32,
        case: &MaterialiseCase<'_>,
    ) -> Copied {
        let KernelSpec::Materialise(s) = *spec else {
            panic!("{spec} is not a materialise kernel")
        };
        let pb = u64::from(s.page_size) * u64::from(s.bytes_per_token);
        let n = case.seq.len() as u32;
        // Every owner's pool placed in the bench's pool order, in one owner-major table.
        let at = self.poison(8 * case.pools.len() * case.layers.max(1) as usize);
        let mut table = PageTable {
            at: (at, 0),
            entries: Vec::new(),
            page_stride: 0,
        };
        let layer_major = (u64::from(case.layers * case.local_pages) * pb) as usize;
        for p in case.pools {
            // The reference's pools may be longer than the layers it reads.
            let bytes = &p[..layer_major.min(p.len())];
            let mut bytes = bytes.to_vec();
            bytes.resize(layer_major, POISON);
            let shape = (case.layers, case.local_pages, pb);
            let placed = self.place_pool(self.pool_order, &bytes, shape, case.guard);
            table.entries.extend(placed.table.entries);
            table.page_stride = placed.table.page_stride;
        }
        let dense_bytes = (u64::from(case.layers * n) * pb) as usize;
        let dense = self.poison(dense_bytes + case.guard);
        let seqb = self.bytes(&le32(case.seq), 0);
        // The reference first: it checks the pools and sequence against the sizes.
        let views: Vec<&[u8]> = case.pools.iter().map(Vec::as_slice).collect();
        let mut want = vec![POISON; dense_bytes + case.guard];
        reference::materialise(
            s.cp,
            pb,
            &views,
            case.seq,
            n,
            case.layers,
            case.local_pages,
            &mut want,
        )
        .unwrap();
        self.launch(
            spec,
            grid,
            &[
                table.arg(),
                KernelArg::Ptr(seqb, 0),
                KernelArg::U32(n),
                KernelArg::U32(case.layers),
                KernelArg::U32(case.local_pages),
                KernelArg::U32(table.page_stride),
                KernelArg::Ptr(dense, 0),
            ],
        );
        Copied {
            got: self.read(dense),
            want,
            src_after: Vec::new(),
        }
    }
}

/// How [`reach_case`] departs from exact, separate buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Twist {
    /// Every pointer in a buffer of its own, of exactly its reach.
    None,
    /// This parameter's buffer is one byte shorter than its reach.
    Short(usize),
    /// The second parameter (for the pool struct: its first pointer) points at the start of
    /// the first one's buffer, which holds the larger of the two reaches.
    Alias(usize, usize),
}

/// One launch of `spec` with small random scalar arguments, every pointer argument in a
/// buffer of exactly its parameter's reach, filled with small random words (page ids, owners,
/// lane tops and counts mostly out of range, some at the edges), changed as `twist` says.
/// Returns the launch result and the indices of the pointer parameters whose reach is
/// nonzero in this case.
///
/// Whatever the values, a kernel must stay inside its reach: under AddressSanitizer, exact
/// buffers have red zones right after them, so one byte past the reach is reported.
pub fn reach_case(
    b: &mut Bench,
    spec: &KernelSpec,
    rng: &mut Rng,
    twist: Twist,
) -> (Result<(), cp_hicache::exec::ExecError>, Vec<usize>) {
    let sig = spec.signature();
    // Scalars first: pointer reaches depend on them.
    let scalar = |name: &str, rng: &mut Rng| -> u32 {
        let page = match spec {
            KernelSpec::Synthesise(s) => s.page_size,
            KernelSpec::Verify(s) => s.page_size,
            _ => 1,
        };
        match name {
            "layers" => rng.range(1, 3) as u32,
            // A few pages, and more than one 32-token word of the mismatch bitmap.
            "n_tokens" => rng.range(0, u64::from((3 * page).max(80) + 1)) as u32,
            "start_page" | "rank" => rng.range(0, 3) as u32,
            "first_token" => rng.range(0, u64::from(3 * page)) as u32,
            // Layer ranges in, partly past and wholly past the pools, and sums past 2^32.
            "first_layer" | "layer_count" => [0, 1, 2, 3, u32::MAX][rng.below(5) as usize],
            _ => rng.range(0, 6) as u32,
        }
    };
    let mut values: Vec<Option<u32>> = sig
        .params
        .iter()
        .map(|p| p.reach.is_none().then(|| scalar(p.name, rng)))
        .collect();
    // A page table's stride: a page, or a few vectors more (pages with gaps between them).
    for t in sig.params.iter().filter_map(|p| p.entries) {
        let i = sig.params.iter().position(|p| p.name == t.pages.stride);
        let gap = 16 * rng.below(3);
        values[i.expect("the stride is a parameter")] = Some((t.pages.unit + gap) as u32);
        // At least a page, so a table's pointers reach something (aliasing them can overlap).
        let c = sig.params.iter().position(|p| p.name == t.pages.count);
        let count = &mut values[c.expect("the page count is a parameter")];
        *count = count.map(|v| v.max(1));
    }
    let value = |name: &str| {
        let i = sig.params.iter().position(|p| p.name == name)?;
        values[i]
    };
    // Page ids and other contents up to twice the largest size (the layer range, which may
    // be near 2^32, is no size).
    let bound = sig
        .params
        .iter()
        .zip(&values)
        .filter(|(p, _)| !matches!(p.name, "first_layer" | "layer_count"))
        .filter(|(p, _)| !p.name.starts_with("page_stride"))
        .filter_map(|(_, v)| *v)
        .max()
        .unwrap_or(1)
        .max(1);
    let mut reaching = Vec::new();
    let fill = |bytes: usize, rng: &mut Rng| -> BufferId {
        let words: Vec<u32> = (0..bytes.div_ceil(4))
            .map(|_| rng.below(u64::from(2 * bound) + 1) as u32)
            .collect();
        let mut data = le32(&words);
        data.truncate(bytes);
        b.bytes(&data, 0)
    };
    // Each parameter's argument: a scalar, a buffer, or a page table and its pointers.
    enum Arg {
        Scalar(u32),
        Buffer(BufferId),
        Table(BufferId, Vec<(BufferId, u64)>),
    }
    let reach_bytes = |i: usize| {
        sig.params[i]
            .reach
            .map(|r| r.bytes(value).expect("small arguments") as usize)
    };
    // What one pointer of a page table reaches.
    let entry_bytes = |i: usize| {
        sig.params[i]
            .entries
            .map(|t| t.pages.bytes(value).expect("small arguments").0 as usize)
    };
    // What an aliased parameter's pointer reaches (a table's: its first pointer's).
    let alias_bytes = |i: usize| entry_bytes(i).or(reach_bytes(i));
    // The buffer both aliased parameters point at.
    let shared = match twist {
        Twist::Alias(w, o) => {
            let bytes = alias_bytes(w).max(alias_bytes(o)).expect("two pointers");
            Some(fill(bytes, rng))
        }
        _ => None,
    };
    let mut owned = Vec::new();
    for (i, value) in values.iter().enumerate() {
        let Some(mut bytes) = reach_bytes(i) else {
            owned.push(Arg::Scalar(value.expect("a scalar")));
            continue;
        };
        let entry = entry_bytes(i);
        if bytes > 0 || entry.is_some_and(|e| e > 0) {
            reaching.push(i);
        }
        let short = twist == Twist::Short(i);
        let aliased = matches!(twist, Twist::Alias(w, o) if w == i || o == i);
        owned.push(match entry {
            Some(mut each) => {
                // One byte short: the first pointer's buffer, or the table when its pointers
                // reach nothing.
                if short && each > 0 {
                    each -= 1;
                } else if short {
                    bytes -= 1;
                }
                let count = reach_bytes(i).unwrap_or_default() / 8;
                let mut entries: Vec<_> = (0..count).map(|_| (fill(each, rng), 0)).collect();
                if let (true, Some(s), Some(first)) = (aliased, shared, entries.first_mut()) {
                    first.0 = s;
                }
                Arg::Table(fill(bytes, rng), entries)
            }
            None => {
                if short {
                    bytes = bytes
                        .checked_sub(1)
                        .expect("a parameter with a nonzero reach");
                }
                match (aliased, shared) {
                    (true, Some(s)) => Arg::Buffer(s),
                    _ => Arg::Buffer(fill(bytes, rng)),
                }
            }
        });
    }
    let args: Vec<KernelArg<'_>> = owned
        .iter()
        .map(|a| match a {
            Arg::Scalar(v) => KernelArg::U32(*v),
            Arg::Buffer(id) => KernelArg::Ptr(*id, 0),
            Arg::Table(at, entries) => KernelArg::Table(*at, 0, entries),
        })
        .collect();
    let items = bound;
    let dims = spec.launch_dims(items, value("layers").unwrap_or(1));
    let k = b.kernel(spec);
    let result =
        b.ex.launch(k, &LaunchConfig::linear(dims.grid, dims.block), &args);
    (result, reaching)
}

/// The inputs of one transfer launch. Page lists may hold out-of-range pages (the kernel and
/// the reference skip them); the launch covers `dst_pages.len()` pairs.
pub struct TransferCase<'a> {
    /// Bytes of the source pool (the device pool for device-to-host, else the host pool).
    pub src: &'a [u8],
    /// Bytes of the second buffer's source pool, for a two-buffer transfer (else unused).
    pub src1: &'a [u8],
    /// Source page of each pair.
    pub src_pages: &'a [u32],
    /// Destination page of each pair.
    pub dst_pages: &'a [u32],
    /// Layers of both pools.
    pub layers: u32,
    /// First layer to copy (the kernel's `first_layer`; 0 for all of them).
    pub first_layer: u32,
    /// Layers to copy from `first_layer` (the kernel's `layer_count`, clamped by it to
    /// `layers`; `layers` for all of them).
    pub layer_count: u32,
    /// Pages per layer of the device pool.
    pub device_pages: u32,
    /// Pages per layer of the host pool.
    pub host_pages: u32,
    /// Host pages the kernel is told of: `host_pages`, or more to provoke an out-of-bounds
    /// access (the reference always gets `host_pages`).
    pub told_host_pages: u32,
    /// Poison bytes after the source and the destination buffers.
    pub guard: usize,
}

/// The inputs of one materialise launch: one pool per CP rank and a global page sequence
/// (pages beyond the pools are skipped, their slots stay poison).
pub struct MaterialiseCase<'a> {
    /// Each rank's pool, `[layer][local page][page bytes]`.
    pub pools: &'a [Vec<u8>],
    /// Global pages to gather, in order.
    pub seq: &'a [u32],
    /// Layers of every pool.
    pub layers: u32,
    /// Local pages per layer of every pool.
    pub local_pages: u32,
    /// Poison bytes after every pool and the dense output.
    pub guard: usize,
}

/// What one copy launch wrote next to what the reference writes.
pub struct Copied {
    /// The destination buffer after the launch, guard bytes included.
    pub got: Vec<u8>,
    /// The reference's destination, from poison, guard bytes included.
    pub want: Vec<u8>,
    /// The source buffer after the launch, guard bytes included (transfers; empty for
    /// materialise).
    pub src_after: Vec<u8>,
}

impl Copied {
    /// The first byte where the launch and the reference differ.
    pub fn first_difference(&self) -> Option<usize> {
        self.got.iter().zip(&self.want).position(|(a, b)| a != b)
    }
}

/// The CPU copy shape: one thread per page, one page per block, no unrolling, with vector
/// width `vec`, each layer a work item of its own.
pub fn cpu_copy_launch(vec: VecWidth) -> CopyLaunch {
    CopyLaunch {
        threads: 1,
        pages_per_block: 1,
        vec,
        unroll: 1,
        layers_in_block: false,
        streaming_stores: false,
        max_blocks: 0,
    }
}

/// A seed drawn from a spec's uri, so that every kernel gets its own random inputs.
pub fn uri_seed(spec: &KernelSpec) -> u64 {
    spec.uri()
        .bytes()
        .fold(0u64, |h, c| reference::mix64(h ^ u64::from(c)))
}

/// Little-endian bytes of `u32`s.
pub fn le32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes of `u64`s.
pub fn le64(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `u32`s of little-endian bytes (a trailing partial word is dropped).
pub fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `i64`s of little-endian bytes.
pub fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A deterministic splitmix64 generator (tests must not depend on OS randomness).
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from any words.
    pub fn new(seed: &[u64]) -> Rng {
        let mut s = 0x243f_6a88_85a3_08d3u64;
        for &w in seed {
            s = cp_hicache::kernels::reference::mix64(s ^ w);
        }
        Rng(s)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        cp_hicache::kernels::reference::mix64(self.0)
    }

    /// Uniform in `[0, n)` (0 when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }

    /// A random permutation of `0..n`.
    pub fn permutation(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// A grid for a striding kernel: usually the recommended one, sometimes fewer blocks, so the
/// grid-stride loops are exercised too.
pub fn grid(rng: &mut Rng, recommended: u32) -> u32 {
    if rng.one_in(3) {
        rng.range(1, u64::from(recommended)) as u32
    } else {
        recommended
    }
}

/// Runs `cmd` with its standard output closed before the first write, so that every write
/// fails with EPIPE, as under `| head` once head has exited.
pub fn output_with_closed_stdout(cmd: &mut std::process::Command) -> std::process::Output {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

/// Runs `cp-hicache replay` on a small deployment (two conversations, MLA, CP 2, one layer)
/// with its JIT cache at `cache`; each `env` entry is set, or removed when `None`.
pub fn small_replay(cache: &std::path::Path, env: &[(&str, Option<&str>)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    cmd.args([
        "replay",
        "--conversations",
        "2",
        "--cp",
        "2",
        "--layers",
        "1",
        "--model",
        "mla",
    ])
    .env("CP_HICACHE_CACHE_DIR", cache);
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.output().unwrap()
}
