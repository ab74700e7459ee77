//! Transfers refused outside the pools or with a destination twice, the mismatch bitmap,
//! and the one-rank cache other tests of the module build on.

use super::*;
use crate::kernels::TransferPath;

#[test]
fn transfers_outside_the_pools_are_refused() {
    let (d2h, h2d) = (Direction::DeviceToHost, Direction::HostToDevice);
    // 8 device pages per rank, 16 host pages.
    let pools = PoolShape {
        layers: 1,
        device_pages: 8,
        host_pages: 16,
    };
    let ok = |dir, src: &[u32], dst: &[u32]| check_transfer_pages(dir, 1, src, dst, &pools);
    ok(d2h, &[0, 7], &[15, 3]).unwrap();
    ok(h2d, &[15, 3], &[0, 7]).unwrap();
    for (dir, src, dst, want) in [
        (
            d2h,
            &[8u32][..],
            &[0u32][..],
            "d2h transfer names device page 8, outside the device pool of 8 pages",
        ),
        (d2h, &[0], &[16], "host page 16"),
        (h2d, &[u32::MAX], &[0], "host page 4294967295"),
        (h2d, &[0], &[8], "device page 8"),
        (
            h2d,
            &[0, 1],
            &[0],
            "h2d transfer of 2 source pages to 1 destination pages",
        ),
        (
            d2h,
            &[0, 1, 2],
            &[3, 5, 3],
            "d2h transfer: pairs 0 and 2 both write destination page 3",
        ),
        (
            h2d,
            &[4, 9],
            &[7, 7],
            "pairs 0 and 1 both write destination page 7",
        ),
    ] {
        let err = ok(dir, src, dst).unwrap_err();
        let shown = err.to_string();
        assert!(
            shown.starts_with("rank 1: ") && shown.contains(want),
            "{shown}"
        );
    }
}

/// A one-rank cache on a fresh host executor (the integration tests' JIT cache, so the
/// kernels are usually compiled already).
pub(super) fn one_rank(path: TransferPath) -> RankCache {
    let jit = Jit::new(crate::jit::JitConfig::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/tmp/jit-cache"
    )));
    let mut deployment =
        crate::kernels::Deployment::new(crate::kernels::ModelShape::MlaBf16, 16, 1).unwrap();
    deployment.transfer_path = path;
    let config = ClusterConfig {
        deployment,
        layers: 1,
        device_pages: 9,
        host_pages: 4,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: crate::jit::Sanitize::None,
    };
    let exec = Arc::new(crate::exec::HostExecutor::new(
        crate::exec::HostOptions::default(),
    ));
    let member = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
        .pop()
        .unwrap();
    RankCache::new(config, exec, &jit, Box::new(member), PeerAccess::Mapped).unwrap()
}

/// Two pairs with one destination page are refused before anything is uploaded,
/// launched or copied, on the kernel path and on the DMA path.
#[test]
fn a_transfer_naming_one_destination_twice_moves_nothing() {
    for path in [
        TransferPath::Kernel,
        TransferPath::Dma,
        TransferPath::DmaEach,
    ] {
        let mut r = one_rank(path);
        let before = r.exec.counters();
        let err = r
            .transfer(
                Direction::HostToDevice,
                &[0, 1],
                &[2, 2],
                0..1,
                On::Cache(None),
            )
            .unwrap_err();
        assert!(
            matches!(&err, ClusterError::BadTransfer { rank: 0, what }
                if what.contains("pairs 0 and 1 both write destination page 2")),
            "{path}: {err}"
        );
        let d = r.exec.counters().since(&before);
        assert_eq!((d.uploads, d.launches, d.copies), (0, 0, 0), "{path}");
        // Distinct pages move.
        r.transfer(
            Direction::HostToDevice,
            &[0, 1],
            &[2, 3],
            0..1,
            On::Cache(None),
        )
        .unwrap();
    }
}

#[test]
fn mismatches_count_bits_once_and_find_the_first() {
    let words: [u32; 3] = [0, 0b1010_0000, 1 << 31];
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(
        Mismatches::from_bitmap(&bytes),
        Mismatches {
            count: 3,
            first: Some(32 + 5)
        }
    );
    assert_eq!(Mismatches::from_bitmap(&[0; 8]), Mismatches::default());
}

/// An engine's device memory for a test: 16-byte aligned, poisoned differently than the
/// cache poisons, so adopting has to write the cache's poison.
struct EngineMemory(Vec<u128>);

impl EngineMemory {
    fn new(bytes: u64) -> EngineMemory {
        EngineMemory(vec![
            0x5a5a_5a5a_5a5a_5a5a_5a5a_5a5a_5a5a_5a5a;
            bytes.div_ceil(16) as usize
        ])
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: u128s are plain bytes; the length is the vector's.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 16) }
    }

    fn region(&mut self, at: u64, bytes: u64) -> crate::ops::Region {
        crate::ops::Region {
            addr: self.0.as_mut_ptr() as u64 + at,
            bytes,
        }
    }
}

/// How an engine lays out its device KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EngineOrder {
    /// SGLang: one `[pages, page]` tensor per layer.
    PerLayer,
    /// One `[layers, pages, page]` tensor.
    LayerMajor,
    /// vLLM: one `[pages, layers, page]` tensor.
    PageMajor,
}

/// `layers × pages` pages of `pb` bytes in `order`, as memory and the tensors over it.
fn engine_pool(
    order: EngineOrder,
    layers: u32,
    pages: u32,
    pb: u64,
) -> (Vec<EngineMemory>, crate::ops::Tensors) {
    use crate::ops::Tensors;
    let all = u64::from(layers * pages) * pb;
    match order {
        EngineOrder::PerLayer => {
            let mut mems: Vec<EngineMemory> = (0..layers)
                .map(|_| EngineMemory::new(u64::from(pages) * pb))
                .collect();
            let regions = mems
                .iter_mut()
                .map(|m| m.region(0, u64::from(pages) * pb))
                .collect();
            (mems, Tensors::PerLayer(regions))
        }
        EngineOrder::LayerMajor | EngineOrder::PageMajor => {
            let mut m = EngineMemory::new(all);
            let r = m.region(0, all);
            let t = if order == EngineOrder::LayerMajor {
                Tensors::CrossLayer(r)
            } else {
                Tensors::PageMajor(r)
            };
            (vec![m], t)
        }
    }
}

/// The engine's bytes of local page `p`, layer `l`.
fn engine_page(
    mems: &[EngineMemory],
    order: EngineOrder,
    layers: u32,
    pages: u32,
    pb: u64,
    l: u32,
    p: u32,
) -> Vec<u8> {
    let pb = pb as usize;
    let (mem, at) = match order {
        EngineOrder::PerLayer => (&mems[l as usize], p as usize * pb),
        EngineOrder::LayerMajor => (&mems[0], (l * pages + p) as usize * pb),
        EngineOrder::PageMajor => (&mems[0], (p * layers + l) as usize * pb),
    };
    mem.bytes()[at..at + pb].to_vec()
}

fn adopting_config(cp: u8, layers: u32) -> ClusterConfig {
    ClusterConfig {
        deployment: crate::kernels::Deployment::new(crate::kernels::ModelShape::MlaBf16, 16, cp)
            .unwrap(),
        layers,
        device_pages: 9 * u32::from(cp),
        host_pages: 4,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: crate::jit::Sanitize::None,
    }
}

fn test_jit() -> Jit {
    Jit::new(crate::jit::JitConfig::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/tmp/jit-cache"
    )))
}

/// A cache over an engine's memory, in each order the engines use and on each transfer path
/// (the kernel, and DMA layer by layer through the engine's page table), serves exactly as a
/// cache over its own pools (the same statistics and state, 0 mismatches, host hits after an
/// eviction), and the engine's tensors hold byte for byte what the cache's own pool holds:
/// the engine reads the KV the cache loaded where it keeps it.
#[test]
fn a_cache_over_an_engines_tensors_serves_like_one_over_its_own_pools() {
    use crate::kernels::TransferPath;
    let (layers, pages) = (2u32, 9u32);
    let pb = crate::kernels::BufferKind::MlaKv.page_bytes(16);
    let prompt = |n: u32, s: u32| -> Vec<u32> { (0..n * 16).map(|t| t * 7 + s).collect() };
    for (order, path) in [
        (EngineOrder::PerLayer, TransferPath::Kernel),
        (EngineOrder::LayerMajor, TransferPath::Kernel),
        (EngineOrder::PageMajor, TransferPath::Kernel),
        (EngineOrder::PerLayer, TransferPath::Dma),
        (EngineOrder::PageMajor, TransferPath::Dma),
        (EngineOrder::LayerMajor, TransferPath::DmaEach),
    ] {
        let order_path = format!("{order:?} {path}");
        let (mems, tensors) = engine_pool(order, layers, pages, pb);
        let start = |device: Option<&[crate::ops::Tensors]>| {
            let exec = Arc::new(crate::exec::HostExecutor::new(Default::default()));
            let m = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
                .pop()
                .unwrap();
            let (mut config, jit) = (adopting_config(1, layers), test_jit());
            config.deployment.transfer_path = path;
            match device {
                None => RankCache::new(config, exec, &jit, Box::new(m), PeerAccess::Direct),
                // SAFETY: `mems` outlives the cache, and nothing else touches it.
                Some(d) => unsafe {
                    RankCache::adopting(config, exec, &jit, Box::new(m), PeerAccess::Direct, d)
                },
            }
            .unwrap()
        };
        let mut own = start(None);
        let mut engine = start(Some(std::slice::from_ref(&tensors)));
        assert!(engine.pools().adopted() && !own.pools().adopted());
        let mut host_hits = 0;
        for round in 0..3 {
            for p in [prompt(3, 1), prompt(5, 2), prompt(2, 1)] {
                let (a, b) = (own.serve(&p).unwrap(), engine.serve(&p).unwrap());
                assert_eq!(a, b, "{order_path} round {round}");
                assert_eq!(b.mismatched_tokens, 0, "{order_path}");
                host_hits += b.host_hit_tokens;
            }
            assert_eq!(own.digest(), engine.digest(), "{order_path}");
            own.evict_device_lru(usize::MAX).unwrap();
            engine.evict_device_lru(usize::MAX).unwrap();
        }
        assert!(host_hits > 0, "{order_path}: nothing was loaded back");
        // Byte for byte: the cache's own pool and the engine's tensors.
        let id = own
            .pools()
            .device(crate::kernels::BufferKind::MlaKv)
            .unwrap();
        let mut mine = vec![0u8; own.executor().size(id).unwrap()];
        own.executor().read(id, 0, &mut mine).unwrap();
        for l in 0..layers {
            for p in 0..pages {
                let at = ((l * pages + p) as u64 * pb) as usize;
                let theirs = engine_page(&mems, order, layers, pages, pb, l, p);
                assert!(
                    mine[at..at + pb as usize] == theirs[..],
                    "{order_path}: layer {l} page {p} differs"
                );
            }
        }
        drop(engine);
    }
}

/// Two ranks, each over its own engine tensors (page-major, vLLM's), verify every page of
/// its owner: sharing one executor, through each other's tables ([`PeerAccess::Direct`]);
/// with executors of their own, as processes, through the group
/// ([`PeerAccess::Gathered`]). 0 mismatches; then rank 1 overwrites its engine's pages and
/// both ranks see the tokens on them wrong. A peer whose pages are laid out with another
/// stride is refused at start-up, naming it.
#[test]
fn two_ranks_over_engine_tensors_verify_each_others_pages() {
    let (layers, pages) = (2u32, 9u32);
    let pb = crate::kernels::BufferKind::MlaKv.page_bytes(16);
    let shared: Arc<dyn Executor> = Arc::new(crate::exec::HostExecutor::new(Default::default()));
    let prompt = |n: u32| -> Vec<u32> { (0..n * 16).map(|t| t * 5 + 1).collect() };
    // Per rank: mismatches before the overwrite, each rank's count after it, bytes gathered.
    type Seen = (u64, Vec<u64>, u64);
    let run = |orders: [EngineOrder; 2], access: PeerAccess| {
        let pools: Vec<_> = orders
            .iter()
            .map(|&o| engine_pool(o, layers, pages, pb))
            .collect();
        let members = crate::group::LocalGroup::members(2, std::time::Duration::from_secs(60));
        let jit = test_jit();
        std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .zip(&pools)
                .enumerate()
                .map(|(r, (m, (_, t)))| {
                    let (shared, jit) = (shared.clone(), &jit);
                    s.spawn(move || {
                        let exec: Arc<dyn Executor> = match access {
                            PeerAccess::Direct => shared,
                            _ => Arc::new(crate::exec::HostExecutor::new(Default::default())),
                        };
                        // SAFETY: `pools` outlives the scope, and only the cache touches it
                        // (but for the overwrite below, between steps).
                        let rc = unsafe {
                            RankCache::adopting(
                                adopting_config(2, layers),
                                exec,
                                jit,
                                Box::new(m),
                                access,
                                std::slice::from_ref(t),
                            )
                        };
                        let mut rc = rc?;
                        let mut before = 0;
                        let mut gathered = 0;
                        for n in [3u32, 6, 3] {
                            let st = rc.serve(&prompt(n))?;
                            before += st.mismatched_tokens;
                            gathered += st.bytes_gathered;
                            rc.evict_device_lru(usize::MAX)?;
                        }
                        rc.serve(&prompt(4))?;
                        if r == 1 {
                            for g in t.regions() {
                                // SAFETY: this rank's engine memory, between two steps.
                                unsafe {
                                    std::ptr::write_bytes(g.addr as *mut u8, 0, g.bytes as usize)
                                };
                            }
                        }
                        let after = rc.serve(&prompt(4))?;
                        assert_eq!(after.device_hit_tokens, 4 * 16);
                        Ok::<Seen, ClusterError>((
                            before,
                            rc.last_verdict().by_rank.clone(),
                            gathered,
                        ))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    };
    for access in [PeerAccess::Direct, PeerAccess::Gathered] {
        let seen: Vec<Seen> = run([EngineOrder::PageMajor; 2], access)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for (r, (before, after, _)) in seen.iter().enumerate() {
            assert_eq!(*before, 0, "{access:?} rank {r}");
            // Half the 4 pages are rank 1's: 32 tokens, seen by both ranks.
            assert_eq!(after, &[32, 32], "{access:?} rank {r}");
        }
        // Each of the 12 pages served went through the group once (2 layers each).
        let gathered: u64 = seen.iter().map(|s| s.2).sum();
        let want = if access == PeerAccess::Gathered {
            12 * 2 * pb
        } else {
            0
        };
        assert_eq!(gathered, want, "{access:?}");
        let mixed = run([EngineOrder::PageMajor, EngineOrder::PerLayer], access);
        let shown: Vec<String> = mixed
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect();
        assert!(
            shown
                .iter()
                .any(|e| e.contains("pages 18432 bytes apart, this rank's 36864")
                    || e.contains("pages 36864 bytes apart, this rank's 18432")),
            "{access:?}: {shown:?}"
        );
    }
}

/// Buffers the cache cannot adopt are refused before anything is adopted, naming the
/// buffer, the layer and the rule.
#[test]
fn engine_buffers_that_break_a_rule_are_refused_naming_it() {
    use crate::ops::Tensors;
    let (layers, pages) = (2u32, 9u32);
    let pb = crate::kernels::BufferKind::MlaKv.page_bytes(16);
    let mut m = EngineMemory::new(u64::from(layers * pages) * pb + 64);
    let try_adopt = |device: &[Tensors], path: crate::kernels::TransferPath, access| {
        let exec = Arc::new(crate::exec::HostExecutor::new(Default::default()));
        let m = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
            .pop()
            .unwrap();
        let mut config = adopting_config(1, layers);
        config.deployment.transfer_path = path;
        // SAFETY: `m` outlives the attempt; refusals adopt nothing.
        unsafe { RankCache::adopting(config, exec, &test_jit(), Box::new(m), access, device) }
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let kernel = crate::kernels::TransferPath::Kernel;
    let layer = u64::from(pages) * pb;
    let cases = [
        (
            vec![Tensors::PerLayer(vec![m.region(0, layer)])],
            kernel,
            "engine buffer device[mla_kv]: 1 per-layer tensors for 2 layers",
        ),
        (
            vec![Tensors::PerLayer(vec![
                m.region(8, layer),
                m.region(layer + 16, layer),
            ])],
            kernel,
            "engine buffer device[mla_kv] layer 0: starts at",
        ),
        (
            vec![Tensors::PerLayer(vec![
                m.region(0, layer),
                m.region(layer, layer - pb),
            ])],
            kernel,
            "engine buffer device[mla_kv] layer 1: 8 pages, but layer 0 has 9",
        ),
        (
            vec![Tensors::CrossLayer(m.region(0, 2 * 8 * pb))],
            kernel,
            "engine buffer device[mla_kv]: 8 pages per layer, fewer than the 9 local pages",
        ),
        (
            vec![Tensors::CrossLayer(m.region(0, 2 * layer)); 2],
            kernel,
            "engine buffer device: 2 buffers given, the mla model has 1",
        ),
    ];
    for (device, path, want) in cases {
        let got = try_adopt(&device, path, PeerAccess::Direct);
        assert!(got.contains(want), "want {want:?}, got {got:?}");
    }
    // The memory is untouched by every refusal.
    assert!(m.bytes().iter().all(|&b| b == 0x5a));
}

/// Ranks with executors of their own (processes) cannot map an engine's memory: adopting
/// with mapped peer pools is refused on every rank, naming the access that works, rather
/// than leaving verification without the pages.
#[test]
fn ranks_that_map_each_others_pools_refuse_engine_buffers() {
    let (layers, pages) = (2u32, 9u32);
    let pb = crate::kernels::BufferKind::MlaKv.page_bytes(16);
    let pools: Vec<_> = (0..2)
        .map(|_| engine_pool(EngineOrder::LayerMajor, layers, pages, pb))
        .collect();
    let members = crate::group::LocalGroup::members(2, std::time::Duration::from_secs(60));
    let jit = test_jit();
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = members
            .into_iter()
            .zip(&pools)
            .map(|(m, (_, t))| {
                let jit = &jit;
                s.spawn(move || {
                    let exec = Arc::new(crate::exec::HostExecutor::new(Default::default()));
                    // SAFETY: `pools` outlives the scope; the refusal adopts nothing.
                    unsafe {
                        RankCache::adopting(
                            adopting_config(2, layers),
                            exec,
                            jit,
                            Box::new(m),
                            PeerAccess::Mapped,
                            std::slice::from_ref(t),
                        )
                    }
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors {
        assert!(
            e.contains(
                "peers in other processes cannot map an engine's memory: adopt it with \
                        peer access `gathered`"
            ),
            "{errors:?}"
        );
    }
}

/// Under `on-host-evict`, a device eviction that removes a node never backed up also drops
/// its host-only subtree: those host copies are stored first, as any the host tier lets go.
#[test]
fn host_copies_a_device_eviction_drops_are_stored_under_on_host_evict() {
    use crate::storage::PageStore as _;
    let dir = tempfile::tempdir().unwrap();
    let exec = Arc::new(crate::exec::HostExecutor::new(Default::default()));
    let m = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
        .pop()
        .unwrap();
    // Two host pages: a 3-page prompt's backup does not fit, its 1-page extension's does.
    let mut config = adopting_config(1, 2);
    config.host_pages = 2;
    let mut rank = RankCache::new(
        config.clone(),
        exec,
        &test_jit(),
        Box::new(m),
        PeerAccess::Direct,
    )
    .unwrap();
    let store = Arc::new(
        crate::storage::DirStore::for_deployment(
            dir.path(),
            &config.deployment,
            config.layers,
            1 << 30,
        )
        .unwrap(),
    );
    rank.attach_storage(store.clone(), StoragePolicy::OnHostEvict)
        .unwrap();
    let prompt: Vec<u32> = (0..4 * 16).map(|t| t * 3 + 1).collect();
    let first = rank.serve(&prompt[..3 * 16]).unwrap();
    assert_eq!(first.backups_skipped, 1, "{first:?}");
    let second = rank.serve(&prompt).unwrap();
    assert_eq!(second.device_hit_tokens, 48, "{second:?}");
    assert_eq!(store.stats().records_written, 0);
    // The extension (backed up) leaves the device first and stays as a host copy; then its
    // parent (never backed up) goes with its subtree, and the host copy with it.
    rank.evict_device_lru(usize::MAX).unwrap();
    assert_eq!(store.stats().records_written, 1);
    rank.check_invariants().unwrap();
}

/// An object store with batch calls, as Mooncake Store's client has: it records each call
/// (`(method, objects)`), and the objects named in `failing` fail their puts and gets.
#[derive(Default)]
struct BatchingObjects {
    objects: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
    calls: std::sync::Mutex<Vec<(&'static str, usize)>>,
    failing: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl BatchingObjects {
    fn call(&self, method: &'static str, n: usize) {
        self.calls.lock().unwrap().push((method, n));
    }
    fn fails(&self, name: &str) -> Result<(), crate::storage::StorageError> {
        match self.failing.lock().unwrap().contains(name) {
            true => Err(crate::storage::StorageError::Backend(format!(
                "{name}: injected"
            ))),
            false => Ok(()),
        }
    }
    fn take_calls(&self) -> Vec<(&'static str, usize)> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl crate::storage::ObjectBackend for BatchingObjects {
    fn put_if_absent(
        &self,
        name: &str,
        bytes: &[u8],
    ) -> Result<bool, crate::storage::StorageError> {
        self.call("put", 1);
        self.fails(name)?;
        let mut m = self.objects.lock().unwrap();
        Ok(m.insert(name.to_string(), bytes.to_vec()).is_none())
    }
    fn get(&self, name: &str) -> Result<Option<Vec<u8>>, crate::storage::StorageError> {
        self.call("get", 1);
        self.fails(name)?;
        Ok(self.objects.lock().unwrap().get(name).cloned())
    }
    fn exist(&self, names: &[String]) -> Result<Vec<bool>, crate::storage::StorageError> {
        self.call("exist", names.len());
        let m = self.objects.lock().unwrap();
        Ok(names.iter().map(|n| m.contains_key(n)).collect())
    }
    fn remove(&self, name: &str) -> Result<bool, crate::storage::StorageError> {
        Ok(self.objects.lock().unwrap().remove(name).is_some())
    }
    fn batches(&self) -> bool {
        true
    }
    fn put_many(
        &self,
        items: &[(String, Vec<&[u8]>)],
    ) -> Vec<Result<bool, crate::storage::StorageError>> {
        self.call("put_many", items.len());
        items
            .iter()
            .map(|(name, slices)| {
                self.fails(name)?;
                let mut m = self.objects.lock().unwrap();
                if m.contains_key(name) {
                    return Ok(false);
                }
                m.insert(name.clone(), slices.concat());
                Ok(true)
            })
            .collect()
    }
    fn get_many_into(
        &self,
        names: &[String],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<Option<usize>, crate::storage::StorageError>> {
        self.call("get_many", names.len());
        names
            .iter()
            .zip(dsts.iter_mut())
            .map(|(name, dst)| {
                self.fails(name)?;
                let m = self.objects.lock().unwrap();
                let Some(bytes) = m.get(name) else {
                    return Ok(None);
                };
                if bytes.len() <= dst.iter().map(|d| d.len()).sum::<usize>() {
                    crate::storage::scatter(bytes, dst);
                }
                Ok(Some(bytes.len()))
            })
            .collect()
    }
}

/// Over a store that batches (Mooncake Store's shape), a rank hands a request's records to
/// it in one call each way; a record refused or failing in a batch is counted alone, the
/// records before it still serve, and what follows is recomputed and verified.
#[test]
fn a_request_s_records_go_to_a_batching_store_in_one_call_each_way() {
    use crate::storage::{object_name, Lookup, ObjectStore, PageStore as _, RecordKey};
    let exec = Arc::new(crate::exec::HostExecutor::new(Default::default()));
    let mut config = adopting_config(1, 2);
    config.host_pages = 32;
    config.device_pages = 32;
    let dep = config.deployment.clone();
    let store = Arc::new(
        ObjectStore::new(
            BatchingObjects::default(),
            crate::storage::Fingerprint::of(&dep, config.layers),
            crate::storage::payload_bytes(&dep, config.layers),
        )
        .unwrap(),
    );
    let objects = store.backend();
    let fresh = || {
        let m = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
            .pop()
            .unwrap();
        let mut rank = RankCache::new(
            config.clone(),
            exec.clone(),
            &test_jit(),
            Box::new(m),
            PeerAccess::Direct,
        )
        .unwrap();
        rank.attach_storage(store.clone(), StoragePolicy::WithHost)
            .unwrap();
        rank
    };
    let prompt: Vec<u32> = (0..8 * 16).map(|t| t * 7 + 3).collect();
    let names: Vec<String> = RecordKey::chain(store.fingerprint(), &prompt, 16)
        .iter()
        .map(object_name)
        .collect();

    // Probed in one batch (all missing), written in one batch; record 3's put fails alone
    // (counted), the others are written. Its read failed in the probe too: past the first
    // miss, but a failed read is counted wherever it is in its batch.
    objects.failing.lock().unwrap().insert(names[3].clone());
    let w = fresh().serve(&prompt).unwrap();
    assert_eq!(objects.take_calls(), [("get_many", 8), ("put_many", 8)]);
    assert_eq!(
        (w.storage_records_written, w.storage_io_errors),
        (7, 2),
        "{w:?}"
    );
    objects.failing.lock().unwrap().clear();

    // Read in one batch: up to the missing record 3; pages 3.. recomputed and their
    // records written in one batch (only record 3 is new).
    let r = fresh().serve(&prompt).unwrap();
    assert_eq!(objects.take_calls(), [("get_many", 8), ("put_many", 5)]);
    assert_eq!(
        (r.storage_records_read, r.storage_hit_tokens),
        (3, 48),
        "{r:?}"
    );
    assert_eq!((r.computed_tokens, r.mismatched_tokens), (80, 0), "{r:?}");
    assert_eq!(r.storage_records_written, 1, "{r:?}");

    // A damaged record 5 in the batch: refused and counted, 0..5 served.
    let mut bytes = objects.objects.lock().unwrap()[&names[5]].clone();
    bytes[100] ^= 1;
    objects
        .objects
        .lock()
        .unwrap()
        .insert(names[5].clone(), bytes);
    let r = fresh().serve(&prompt).unwrap();
    assert_eq!(objects.take_calls(), [("get_many", 8), ("put_many", 3)]);
    assert_eq!(
        (r.storage_records_read, r.storage_refused_checksum),
        (5, 1),
        "{r:?}"
    );
    assert_eq!((r.computed_tokens, r.mismatched_tokens), (48, 0), "{r:?}");

    // Record 2's read fails in the batch: counted alone; a failed batch call (every
    // record failing) counts each of its records.
    objects.failing.lock().unwrap().insert(names[2].clone());
    let r = fresh().serve(&prompt).unwrap();
    assert_eq!(
        (r.storage_records_read, r.storage_io_errors),
        (2, 2),
        "{r:?}"
    );
    assert_eq!(r.mismatched_tokens, 0, "{r:?}");
    objects
        .failing
        .lock()
        .unwrap()
        .extend(names.iter().cloned());
    let r = fresh().serve(&prompt).unwrap();
    assert_eq!(
        (r.storage_records_read, r.storage_io_errors),
        (0, 16),
        "{r:?}"
    );
    assert_eq!((r.computed_tokens, r.mismatched_tokens), (128, 0), "{r:?}");
    objects.failing.lock().unwrap().clear();
    objects.take_calls();

    // Read ahead: one batch too, taken whole by the request (no read of its own).
    let mut rank = fresh();
    assert_eq!(rank.prefetch(&prompt, 0).unwrap(), 8);
    let r = rank.serve(&prompt).unwrap();
    assert_eq!(objects.take_calls(), [("get_many", 8)]);
    assert_eq!(
        (r.storage_records_read, r.storage_records_prefetched),
        (8, 8),
        "{r:?}"
    );
    assert_eq!(r.mismatched_tokens, 0, "{r:?}");

    // Read ahead past a miss: record 3 gone, record 5 damaged. The read-ahead's batch
    // refuses 5 (the store counts it and removes it) past the miss, where the request
    // takes nothing; the rank counts it as it counts a refusal past the first miss of its
    // own batch.
    let miss_3_damage_5 = || {
        let mut objs = objects.objects.lock().unwrap();
        objs.remove(&names[3]);
        let mut bytes = objs[&names[5]].clone();
        bytes[100] ^= 1;
        objs.insert(names[5].clone(), bytes);
    };
    miss_3_damage_5();
    let before = store.stats().refused_checksum;
    let mut rank = fresh();
    assert_eq!(rank.prefetch(&prompt, 0).unwrap(), 8);
    let r = rank.serve(&prompt).unwrap();
    assert_eq!(store.stats().refused_checksum, before + 1);
    assert_eq!(
        (r.storage_records_read, r.storage_refused_checksum),
        (3, 1),
        "{r:?}"
    );
    assert_eq!((r.computed_tokens, r.mismatched_tokens), (80, 0), "{r:?}");

    // A refusal of the read-ahead is counted by the request during which it happened,
    // at its end, even one that reads nothing from the store (here: a prompt the device
    // holds), not left for the next request that reads the store.
    let other: Vec<u32> = (0..4 * 16).map(|t| t * 5 + 1).collect();
    let mut rank = fresh();
    rank.serve(&other).unwrap();
    miss_3_damage_5();
    let before = store.stats().refused_checksum;
    assert_eq!(rank.prefetch(&prompt, 0).unwrap(), 8);
    // The read-ahead's one batch is done once its first record is (taken here).
    let first = RecordKey::chain(store.fingerprint(), &prompt, 16)[0];
    let ahead = rank.prefetcher.as_ref().unwrap().take(&first);
    assert!(matches!(ahead, Some(Ok(Lookup::Hit(_)))), "{ahead:?}");
    assert_eq!(store.stats().refused_checksum, before + 1);
    objects.take_calls();
    let r = rank.serve(&other).unwrap();
    assert_eq!(objects.take_calls(), [], "a device hit reads no store");
    assert_eq!(r.device_hit_tokens, 64, "{r:?}");
    assert_eq!(r.storage_refused_checksum, 1, "{r:?}");
}
