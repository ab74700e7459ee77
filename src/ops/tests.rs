//! The ops on caller-owned memory give exactly the reference kernels' bytes, per-layer and
//! cross-layer alike, and refuse bad arguments before launching anything.

use super::*;
use crate::exec::HostExecutor;
use crate::kernels::{reference, ModelShape};

/// 16-byte-aligned memory the test owns, like an engine's tensor.
struct Mem(Vec<u128>);

impl Mem {
    fn new(bytes: u64, seed: u64) -> Mem {
        let mut m = Mem(vec![0u128; bytes.div_ceil(16) as usize]);
        for (i, b) in m.bytes_mut().iter_mut().enumerate() {
            *b = (reference::mix64(seed ^ i as u64) & 0xff) as u8;
        }
        m
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: u128s are plain bytes; the length is the vector's.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 16) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.0.len() * 16) }
    }
    fn region(&mut self, at: u64, bytes: u64) -> Region {
        Region {
            addr: self.bytes_mut().as_mut_ptr() as u64 + at,
            bytes,
        }
    }
}

fn ops(model: ModelShape, ps: u32, cp: u8, layers: u32) -> Ops {
    let jit = Jit::new(crate::jit::JitConfig::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/tmp/jit-cache"
    )));
    let exec: Arc<dyn Executor> = Arc::new(HostExecutor::new(Default::default()));
    let dep = Deployment::new(model, ps, cp).unwrap();
    Ops::warm_up(dep, layers, exec, &jit, Sanitize::None).unwrap()
}

/// Tensors over `mem` for `pages` pages: cross-layer, or split into per-layer regions.
fn tensors(mem: &mut Mem, per_layer: bool, layers: u32, pages: u32, pb: u64) -> Tensors {
    let layer = u64::from(pages) * pb;
    if per_layer {
        Tensors::PerLayer(
            (0..layers)
                .map(|l| mem.region(u64::from(l) * layer, layer))
                .collect(),
        )
    } else {
        Tensors::CrossLayer(mem.region(0, u64::from(layers) * layer))
    }
}

#[test]
fn transfers_equal_the_reference_per_layer_and_cross_layer() {
    // MLA's host pool is layer-first, so per-layer tensors work on both sides; NSA's is
    // page-first, so it takes cross-layer tensors.
    for (model, per_layer_ok) in [(ModelShape::MlaBf16, true), (ModelShape::Nsa, false)] {
        let ps = if model == ModelShape::Nsa { 64 } else { 16 };
        let ops = ops(model, ps, 2, 3);
        let dep = ops.deployment().clone();
        let (dev_pages, host_pages) = (6u32, 9u32);
        for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
            for per_layer in [false, true] {
                if per_layer && !per_layer_ok {
                    continue;
                }
                let buffers = dep.model.buffers();
                let mut dev: Vec<Mem> = Vec::new();
                let mut host: Vec<Mem> = Vec::new();
                for (i, &b) in buffers.iter().enumerate() {
                    let pb = b.page_bytes(ps);
                    dev.push(Mem::new(3 * u64::from(dev_pages) * pb, 1 + i as u64));
                    host.push(Mem::new(3 * u64::from(host_pages) * pb, 7 + i as u64));
                }
                let want_dev: Vec<Vec<u8>> = dev.iter().map(|m| m.bytes().to_vec()).collect();
                let want_host: Vec<Vec<u8>> = host.iter().map(|m| m.bytes().to_vec()).collect();
                let dts: Vec<Tensors> = buffers
                    .iter()
                    .zip(&mut dev)
                    .map(|(&b, m)| tensors(m, per_layer, 3, dev_pages, b.page_bytes(ps)))
                    .collect();
                let hts: Vec<Tensors> = buffers
                    .iter()
                    .zip(&mut host)
                    .map(|(&b, m)| tensors(m, per_layer, 3, host_pages, b.page_bytes(ps)))
                    .collect();
                let (src, dst) = match dir {
                    Direction::HostToDevice => (vec![8u32, 0, 3], vec![5u32, 1, 2]),
                    Direction::DeviceToHost => (vec![5u32, 1, 2], vec![8u32, 0, 3]),
                };
                // SAFETY: the memory lives across the call and nothing else touches it.
                let moved = unsafe { ops.transfer(dir, &dts, &hts, &src, &dst, 1..3) }.unwrap();
                let spec = dep.transfer(dir);
                assert_eq!(moved, 3 * 2 * spec.total_page_bytes());
                for (i, &b) in buffers.iter().enumerate() {
                    let pb = b.page_bytes(ps);
                    let (mut want_d, mut want_h) = (want_dev[i].clone(), want_host[i].clone());
                    let (s, d) = match dir {
                        Direction::HostToDevice => (want_h.clone(), &mut want_d),
                        Direction::DeviceToHost => (want_d.clone(), &mut want_h),
                    };
                    reference::transfer_pages(
                        dir,
                        dep.host_layout,
                        pb,
                        &s,
                        d,
                        &src,
                        &dst,
                        3,
                        3,
                        1,
                        2,
                        dev_pages,
                        host_pages,
                    )
                    .unwrap();
                    let what = format!("{model} {dir:?} per_layer {per_layer} {b}");
                    assert!(dev[i].bytes() == want_d.as_slice(), "{what}: device");
                    assert!(host[i].bytes() == want_h.as_slice(), "{what}: host");
                }
            }
        }
    }
}

#[test]
fn materialise_equals_the_reference_per_layer_and_cross_layer() {
    let (cp, layers, local) = (4u8, 2u32, 5u32);
    let ops = ops(ModelShape::MlaBf16, 16, cp, layers);
    let b = BufferKind::MlaKv;
    let pb = b.page_bytes(16);
    let seq = [4u32, 1, 18, 7, 10];
    for per_layer in [false, true] {
        let mut pools: Vec<Mem> = (0..cp)
            .map(|r| Mem::new(u64::from(layers * local) * pb, 40 + u64::from(r)))
            .collect();
        let want_in: Vec<Vec<u8>> = pools.iter().map(|m| m.bytes().to_vec()).collect();
        let pts: Vec<Tensors> = pools
            .iter_mut()
            .map(|m| tensors(m, per_layer, layers, local, pb))
            .collect();
        let mut dense = Mem::new(u64::from(layers) * seq.len() as u64 * pb, 99);
        let dt = tensors(&mut dense, per_layer, layers, seq.len() as u32, pb);
        // SAFETY: as above.
        unsafe { ops.materialise(b, &pts, &seq, &dt) }.unwrap();
        let mut want = vec![0u8; dense.bytes().len()];
        let refs: Vec<&[u8]> = want_in.iter().map(Vec::as_slice).collect();
        reference::materialise(
            cp,
            pb,
            &refs,
            &seq,
            seq.len() as u32,
            layers,
            local,
            &mut want,
        )
        .unwrap();
        assert!(dense.bytes() == want.as_slice(), "per_layer {per_layer}");
    }
}

#[test]
fn bad_arguments_are_refused_naming_the_argument_and_the_rule() {
    let ops = ops(ModelShape::MlaBf16, 16, 2, 2);
    let pb = BufferKind::MlaKv.page_bytes(16);
    let mut dev = Mem::new(2 * 4 * pb + 16, 1);
    let mut host = Mem::new(2 * 4 * pb, 2);
    let h = vec![tensors(&mut host, false, 2, 4, pb)];
    let good = vec![tensors(&mut dev, false, 2, 4, pb)];
    let t = |d: &[Tensors], src: &[u32], dst: &[u32], l: Range<u32>| {
        // SAFETY: as above; refusals launch nothing.
        unsafe { ops.transfer(Direction::HostToDevice, d, &h, src, dst, l) }
            .unwrap_err()
            .to_string()
    };
    let cases = [
        (t(&good, &[0, 1], &[2, 2], 0..2), "dst_pages"),
        (
            t(&good, &[0], &[4], 0..2),
            "dst_pages[0]: page 4 is outside the 4 pages",
        ),
        (
            t(&good, &[0, 1], &[2], 0..2),
            "2 source pages but 1 destinations",
        ),
        (
            t(&good, &[0], &[1], 1..3),
            "not a non-empty range of the 2 layers",
        ),
        (
            t(&[], &[0], &[1], 0..2),
            "device: 0 buffers given, the mla model has 1",
        ),
        (
            t(
                &[Tensors::CrossLayer(dev.region(8, 2 * 4 * pb))],
                &[0],
                &[1],
                0..2,
            ),
            "not 16-byte aligned",
        ),
        (
            t(
                &[Tensors::CrossLayer(dev.region(0, 2 * 4 * pb + 16))],
                &[0],
                &[1],
                0..2,
            ),
            "are not 2 layers of whole",
        ),
        (
            t(
                &[Tensors::PerLayer(vec![
                    dev.region(0, 4 * pb),
                    dev.region(4 * pb, 3 * pb),
                ])],
                &[0],
                &[1],
                0..2,
            ),
            "device[mla_kv] layer 1: 3 pages, but layer 0 has 4",
        ),
        (
            t(
                &[Tensors::PerLayer(vec![dev.region(0, 4 * pb)])],
                &[0],
                &[1],
                0..2,
            ),
            "1 per-layer tensors for 2 layers",
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains(want), "{got:?} should say {want:?}");
    }
    let before = dev.bytes().to_vec();
    assert_eq!(dev.bytes(), &before[..], "nothing was launched");
    let dense = Tensors::CrossLayer(host.region(0, 2 * 2 * pb));
    // SAFETY: as above.
    let e = unsafe { ops.materialise(BufferKind::MlaKv, &good, &[0, 1], &dense) }.unwrap_err();
    assert!(e.to_string().contains("1 pools given for 2 ranks"), "{e}");
    let pools = [good[0].clone(), good[0].clone()];
    // SAFETY: as above.
    let e = unsafe { ops.materialise(BufferKind::MlaKv, &pools, &[0, 9], &dense) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("seq_pages[1]: page 9 is local page 4 of rank 1"),
        "{e}"
    );
    // SAFETY: as above.
    let e = unsafe { ops.materialise(BufferKind::NsaIndexK, &pools, &[0, 1], &dense) }.unwrap_err();
    assert!(
        e.to_string().contains("no nsa_idx buffer") || e.to_string().contains("has no"),
        "{e}"
    );
}

/// u32 words the test owns.
fn words(w: &[u32]) -> Mem {
    let mut m = Mem::new(4 * w.len() as u64, 0);
    for (c, v) in m.bytes_mut().chunks_exact_mut(4).zip(w) {
        c.copy_from_slice(&v.to_le_bytes());
    }
    m
}

fn read_words(m: &Mem, n: usize) -> Vec<u32> {
    m.bytes()[..4 * n]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn select_and_release_on_the_engines_lanes_equal_the_reference_all_or_nothing() {
    let ops = ops(ModelShape::MlaBf16, 16, 2, 1);
    let cap = 4u32;
    // Lane 0 holds pages 2, 4, 6 (top last); lane 1 holds 1, 3.
    let (stacks0, tops0) = (vec![2u32, 4, 6, 0, 1, 3, 0, 0], vec![3u32, 2]);
    let (mut st, mut tp, mut ss) = (words(&stacks0), words(&tops0), words(&[0; 4]));
    let lanes = Lanes {
        stacks: st.region(0, 32),
        tops: tp.region(0, 8),
        status: ss.region(0, 16),
    };
    let owners = [0u8, 1, 0];
    let (mut pages, mut locs) = (Mem::new(12, 0), Mem::new(8 * 3 * 16, 0));
    let (pr, lr) = (pages.region(0, 12), locs.region(0, 8 * 3 * 16));
    // SAFETY: the memory lives across the calls.
    unsafe { ops.select(&lanes, &owners, pr, Some(lr)) }.unwrap();
    let (mut rs, mut rt, mut rstat) = (stacks0.clone(), tops0.clone(), vec![0u32; 4]);
    let (want_pages, want_locs) =
        reference::select_owner_pages(2, 16, &owners, &rs, &mut rt, cap, &mut rstat).unwrap();
    assert_eq!(read_words(&pages, 3), want_pages);
    assert_eq!(want_pages, [6, 3, 4]);
    let got_locs: Vec<i64> = locs.bytes()[..8 * 48]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got_locs, want_locs);
    assert_eq!(read_words(&tp, 2), rt);
    // Lane 1 is now 2 short of three more: refused, nothing changes.
    let e = unsafe { ops.select(&lanes, &[1, 1, 1], pr, Some(lr)) }.unwrap_err();
    assert!(e.to_string().contains("lane 1 is 2 short"), "{e}");
    assert_eq!(read_words(&tp, 2), rt);
    // Release them back in the reference's order.
    unsafe { ops.release(&lanes, &[6, 3]) }.unwrap();
    reference::release_pages(2, &[6, 3], &mut rs, &mut rt, cap, &mut rstat).unwrap();
    assert_eq!((read_words(&st, 8), read_words(&tp, 2)), (rs, rt));
    for (bad_pages, want) in [(&[0u32][..], "null page"), (&[9u32][..], "past the lanes")] {
        let e = unsafe { ops.release(&lanes, bad_pages) }.unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
    let e = unsafe { ops.select(&lanes, &[2], pr, Some(lr)) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("owners[0]: rank 2 is not below cp 2"),
        "{e}"
    );
}

/// Without `out_locs` the select runs the kernel that writes pages only: the same pages,
/// tops and status words as the reference (granted, then refused with every page 0), and
/// nothing beyond `out_pages` written; a wrong `out_locs` is refused before any launch.
#[test]
fn select_without_out_locs_writes_the_same_pages_and_nothing_else() {
    let ops = ops(ModelShape::MlaBf16, 16, 2, 1);
    let cap = 4u32;
    let (stacks0, tops0) = (vec![2u32, 4, 6, 0, 1, 3, 0, 0], vec![3u32, 2]);
    let (mut st, mut tp, mut ss) = (words(&stacks0), words(&tops0), words(&[0; 4]));
    let lanes = Lanes {
        stacks: st.region(0, 32),
        tops: tp.region(0, 8),
        status: ss.region(0, 16),
    };
    let (mut rs, mut rt, mut rstat) = (stacks0.clone(), tops0.clone(), vec![0u32; 4]);
    // Four words of poison: the select may write the first three only.
    let mut pages = words(&[0xA5A5_A5A5; 4]);
    let pr = pages.region(0, 12);
    let owners = [0u8, 1, 0];
    // SAFETY: the memory lives across the calls.
    unsafe { ops.select(&lanes, &owners, pr, None) }.unwrap();
    let want = reference::select_pages(2, &owners, &rs, &mut rt, cap, &mut rstat).unwrap();
    assert_eq!(want, [6, 3, 4]);
    assert_eq!(read_words(&pages, 4), [6, 3, 4, 0xA5A5_A5A5]);
    assert_eq!(read_words(&tp, 2), rt);
    // Lane 1 holds one page: three more are refused, every page is 0, nothing changes.
    // SAFETY: as above.
    let e = unsafe { ops.select(&lanes, &[1, 1, 1], pr, None) }.unwrap_err();
    assert!(e.to_string().contains("lane 1 is 2 short"), "{e}");
    reference::select_pages(2, &[1, 1, 1], &rs, &mut rt, cap, &mut rstat).unwrap();
    assert_eq!(read_words(&pages, 4), [0, 0, 0, 0xA5A5_A5A5]);
    assert_eq!(read_words(&tp, 2), rt);
    assert_eq!(read_words(&ss, 4), rstat);
    // Locations one page short, or misaligned, name `out_locs`; nothing runs.
    let mut locs = Mem::new(8 * 3 * 16 + 8, 0);
    for bad in [locs.region(0, 8 * 2 * 16), locs.region(4, 8 * 3 * 16)] {
        // SAFETY: as above.
        let e = unsafe { ops.select(&lanes, &owners, pr, Some(bad)) }.unwrap_err();
        assert!(e.to_string().contains("out_locs"), "{e}");
    }
    assert_eq!(read_words(&tp, 2), rt);
    // Released back, the lanes are the reference's again.
    // SAFETY: as above.
    unsafe { ops.release(&lanes, &[4, 3, 6]) }.unwrap();
    reference::release_pages(2, &[4, 3, 6], &mut rs, &mut rt, cap, &mut rstat).unwrap();
    assert_eq!((read_words(&st, 8), read_words(&tp, 2)), (rs, rt));
}

/// `[layers][pages][pb]` bytes as `[pages][layers][pb]`, or back with `back`.
fn reorder(bytes: &[u8], layers: u32, pages: u32, pb: u64, back: bool) -> Vec<u8> {
    let (layers, pages, pb) = (layers as usize, pages as usize, pb as usize);
    let mut out = bytes.to_vec();
    for l in 0..layers {
        for p in 0..pages {
            let lm = (l * pages + p) * pb;
            let pm = (p * layers + l) * pb;
            let (from, to) = if back { (pm, lm) } else { (lm, pm) };
            out[to..to + pb].copy_from_slice(&bytes[from..from + pb]);
        }
    }
    out
}

/// vLLM's cross-layer device tensor (`[blocks, layers, page]`) and SGLang's per-layer
/// device tensors beside a page-first host pool (NSA) take one launch each and move exactly
/// the reference's bytes, read back in layer-major order.
#[test]
fn page_major_and_per_layer_device_tensors_transfer_like_the_reference() {
    let (layers, dev_pages, host_pages) = (3u32, 6u32, 9u32);
    for model in [ModelShape::Nsa, ModelShape::MlaBf16] {
        let ps = if model == ModelShape::Nsa { 64 } else { 16 };
        let ops = ops(model, ps, 2, layers);
        let dep = ops.deployment().clone();
        let buffers = dep.model.buffers();
        for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
            for page_major in [true, false] {
                let mut dev: Vec<Mem> = Vec::new();
                let mut host: Vec<Mem> = Vec::new();
                for (i, &b) in buffers.iter().enumerate() {
                    let pb = b.page_bytes(ps);
                    dev.push(Mem::new(u64::from(layers * dev_pages) * pb, 3 + i as u64));
                    host.push(Mem::new(u64::from(layers * host_pages) * pb, 9 + i as u64));
                }
                // The device bytes as the reference sees them (layer-major).
                let layer_major = |m: &Mem, pb: u64| {
                    if page_major {
                        reorder(m.bytes(), layers, dev_pages, pb, true)
                    } else {
                        m.bytes().to_vec()
                    }
                };
                let want_dev: Vec<Vec<u8>> = dev
                    .iter()
                    .zip(buffers)
                    .map(|(m, b)| layer_major(m, b.page_bytes(ps)))
                    .collect();
                let want_host: Vec<Vec<u8>> = host.iter().map(|m| m.bytes().to_vec()).collect();
                let dts: Vec<Tensors> = buffers
                    .iter()
                    .zip(&mut dev)
                    .map(|(&b, m)| {
                        let pb = b.page_bytes(ps);
                        if page_major {
                            Tensors::PageMajor(m.region(0, u64::from(layers * dev_pages) * pb))
                        } else {
                            tensors(m, true, layers, dev_pages, pb)
                        }
                    })
                    .collect();
                let hts: Vec<Tensors> = buffers
                    .iter()
                    .zip(&mut host)
                    .map(|(&b, m)| tensors(m, false, layers, host_pages, b.page_bytes(ps)))
                    .collect();
                let (src, dst) = match dir {
                    Direction::HostToDevice => (vec![8u32, 0, 3], vec![5u32, 1, 2]),
                    Direction::DeviceToHost => (vec![5u32, 1, 2], vec![8u32, 0, 3]),
                };
                let before = ops.executor().counters().launches;
                // SAFETY: the memory lives across the call and nothing else touches it.
                unsafe { ops.transfer(dir, &dts, &hts, &src, &dst, 0..layers) }.unwrap();
                assert_eq!(ops.executor().counters().launches - before, 1, "one launch");
                for (i, &b) in buffers.iter().enumerate() {
                    let pb = b.page_bytes(ps);
                    let (mut want_d, mut want_h) = (want_dev[i].clone(), want_host[i].clone());
                    let (s, d) = match dir {
                        Direction::HostToDevice => (want_h.clone(), &mut want_d),
                        Direction::DeviceToHost => (want_d.clone(), &mut want_h),
                    };
                    reference::transfer_pages(
                        dir,
                        dep.host_layout,
                        pb,
                        &s,
                        d,
                        &src,
                        &dst,
                        3,
                        layers,
                        0,
                        layers,
                        dev_pages,
                        host_pages,
                    )
                    .unwrap();
                    let what = format!("{model} {dir:?} page_major {page_major} {b}");
                    assert!(layer_major(&dev[i], pb) == want_d, "{what}: device");
                    assert!(host[i].bytes() == want_h.as_slice(), "{what}: host");
                }
            }
        }
    }
}

#[test]
fn page_major_pools_materialise_like_the_reference_and_misuse_is_refused() {
    let (cp, layers, local) = (4u8, 3u32, 5u32);
    let ops = ops(ModelShape::MlaBf16, 16, cp, layers);
    let b = BufferKind::MlaKv;
    let pb = b.page_bytes(16);
    let seq = [4u32, 1, 18, 7, 10, 3];
    let mut pools: Vec<Mem> = (0..cp)
        .map(|r| Mem::new(u64::from(layers * local) * pb, 60 + u64::from(r)))
        .collect();
    let refs: Vec<Vec<u8>> = pools
        .iter()
        .map(|m| reorder(m.bytes(), layers, local, pb, true))
        .collect();
    let pts: Vec<Tensors> = pools
        .iter_mut()
        .map(|m| Tensors::PageMajor(m.region(0, u64::from(layers * local) * pb)))
        .collect();
    let mut dense = Mem::new(u64::from(layers) * seq.len() as u64 * pb, 98);
    let dt = tensors(&mut dense, false, layers, seq.len() as u32, pb);
    // SAFETY: the memory lives across the calls and nothing else touches it.
    unsafe { ops.materialise(b, &pts, &seq, &dt) }.unwrap();
    let mut want = vec![0u8; dense.bytes().len()];
    let views: Vec<&[u8]> = refs.iter().map(Vec::as_slice).collect();
    let n = seq.len() as u32;
    reference::materialise(cp, pb, &views, &seq, n, layers, local, &mut want).unwrap();
    assert!(dense.bytes() == want.as_slice());

    // Pools laid out unlike each other, a page-major dense output, a page-major host pool.
    let mut other = Mem::new(u64::from(layers * local) * pb, 5);
    let mut mixed = pts.clone();
    mixed[2] = tensors(&mut other, false, layers, local, pb);
    // SAFETY: refusals launch nothing.
    let e = unsafe { ops.materialise(b, &mixed, &seq, &dt) }.unwrap_err();
    assert!(
        e.to_string()
            .starts_with("pools[2]: ordered unlike pools[0]"),
        "{e}"
    );
    let pm_dense = Tensors::PageMajor(dense.region(0, u64::from(layers) * u64::from(n) * pb));
    // SAFETY: as above.
    let e = unsafe { ops.materialise(b, &pts, &seq, &pm_dense) }.unwrap_err();
    assert!(
        e.to_string()
            .starts_with("dense: the dense output is layer-major"),
        "{e}"
    );
    let d = [Tensors::PageMajor(
        pools[0].region(0, u64::from(layers * local) * pb),
    )];
    let h = [Tensors::PageMajor(
        other.region(0, u64::from(layers * local) * pb),
    )];
    // SAFETY: as above.
    let e = unsafe { ops.transfer(Direction::HostToDevice, &d, &h, &[0], &[1], 0..layers) }
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("host[mla_kv]: a page-major tensor is a device pool"),
        "{e}"
    );
}

/// An engine calls the ops with the same tensors over and over: a warm call allocates and
/// frees nothing but the adoption of the caller's regions (each a bookkeeping entry, counted
/// in `allocs` and `frees`), keeping its page table and scratch from the calls before; other
/// tensors get a table of their own, and a call with more pages grows its scratch once.
/// Every call moves what the reference moves.
#[test]
fn warm_calls_keep_their_tables_and_scratch() {
    let ps = 16;
    let ops = ops(ModelShape::MlaBf16, ps, 2, 3);
    let dep = ops.deployment().clone();
    let pb = BufferKind::MlaKv.page_bytes(ps);
    let (dev_pages, host_pages) = (6u32, 40u32);
    let mut host = Mem::new(3 * u64::from(host_pages) * pb, 3);
    let hts = [tensors(&mut host, false, 3, host_pages, pb)];
    let mut devs = [1, 2].map(|seed| Mem::new(3 * u64::from(dev_pages) * pb, seed));
    let calls: [(usize, Vec<u32>, Vec<u32>); 5] = [
        (0, vec![8, 0, 3], vec![5, 1, 2]),
        (0, vec![9, 4], vec![0, 3]),
        (1, vec![1, 2, 3], vec![4, 5, 0]),
        (0, vec![30, 31, 32, 33, 34, 35], vec![0, 1, 2, 3, 4, 5]),
        (0, vec![7], vec![2]),
    ];
    let mut kept_allocs = Vec::new();
    for (i, (d, src, dst)) in calls.iter().enumerate() {
        let mut want = devs[*d].bytes().to_vec();
        reference::transfer_pages(
            Direction::HostToDevice,
            dep.host_layout,
            pb,
            host.bytes(),
            &mut want,
            src,
            dst,
            src.len() as u32,
            3,
            0,
            3,
            dev_pages,
            host_pages,
        )
        .unwrap();
        let dts = [tensors(&mut devs[*d], false, 3, dev_pages, pb)];
        let before = ops.executor().counters();
        // SAFETY: the memory lives across the call and nothing else touches it.
        unsafe { ops.transfer(Direction::HostToDevice, &dts, &hts, src, dst, 0..3) }.unwrap();
        let c = ops.executor().counters().since(&before);
        assert!(
            devs[*d].bytes() == want.as_slice(),
            "call {i}: device bytes"
        );
        // Two regions adopted (device and host) and let go; the rest is kept.
        assert_eq!(c.frees, 2, "call {i}: {c:?}");
        kept_allocs.push(c.allocs - 2);
    }
    // A table and two scratch places, then nothing; a table for the other tensors; then
    // nothing (six pages fit the scratch kept).
    assert_eq!(kept_allocs, vec![3, 0, 1, 0, 0]);
    // More pages than the scratch holds (256 bytes: 64 ids): both places grow once.
    let n = 100u32;
    let mut src_host = Mem::new(3 * u64::from(n) * pb, 5);
    let sts = [tensors(&mut src_host, false, 3, n, pb)];
    let mut big = Mem::new(3 * u64::from(n) * pb, 4);
    let bts = [tensors(&mut big, false, 3, n, pb)];
    let all: Vec<u32> = (0..n).collect();
    for round in 0..2 {
        let before = ops.executor().counters();
        // SAFETY: as above.
        unsafe { ops.transfer(Direction::HostToDevice, &bts, &sts, &all, &all, 0..3) }.unwrap();
        let c = ops.executor().counters().since(&before);
        assert!(
            big.bytes() == src_host.bytes(),
            "round {round}: every page, every layer"
        );
        // Adopted 2 and let go; then a table and two grown scratch places (the old ones
        // freed) the first time, nothing the second.
        let want = if round == 0 { (5, 4) } else { (2, 2) };
        assert_eq!((c.allocs, c.frees), want, "round {round}: {c:?}");
    }
}
