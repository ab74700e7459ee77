//! Criterion benches of the host-side hot paths that run per request: owner-preserving page
//! allocation (2,048 pages, then free), node metadata split/concat/encode, a radix-tree match
//! over a 128k-token path, planning a DMA transfer's copy regions, and building a 1 MiB
//! storage record (copy and checksum: two passes, and one). Goals (BENCHMARKS.md):
//! alloc < 20 µs, match < 50 µs.
//!
//! `cargo bench --bench host_paths -- --quick` for a short run; `cargo test` runs each once.

use std::hint::black_box;
use std::time::Duration;

use cp_hicache::allocator::OwnerLaneAllocator;
use cp_hicache::hicache::tree::RadixTree;
use cp_hicache::kernels::{transfer_regions, Deployment, Direction, PoolShape};
use cp_hicache::layout::{zigzag_owners, CpLayout, Rank};
use cp_hicache::metadata::{HostPage, NodeMetadata};
use criterion::{criterion_group, criterion_main, Criterion};

const CP: u32 = 8;
const PAGE_SIZE: u32 = 64;

fn alloc(c: &mut Criterion) {
    let layout = CpLayout::new(CP, PAGE_SIZE, 16 * 2048).expect("layout");
    let owners = zigzag_owners(CP as u8, 2048);
    let mut alloc = OwnerLaneAllocator::new(layout);
    c.bench_function("alloc_pages_with_owners 2048 + free", |b| {
        b.iter(|| {
            let run = alloc
                .alloc_pages_with_owners(black_box(&owners))
                .expect("enough pages");
            alloc.free(run.pages()).expect("free");
        })
    });
}

fn metadata(c: &mut Criterion) {
    let layout = CpLayout::new(CP, PAGE_SIZE, 16 * 2048).expect("layout");
    let rank = Rank(3);
    let owners = zigzag_owners(CP as u8, 2048);
    let owned = owners.iter().filter(|&&o| o == rank.0).count() as u32;
    let meta = NodeMetadata::new(&layout, rank, owners, (0..owned).map(HostPage).collect())
        .expect("metadata");
    let at = u64::from(PAGE_SIZE) * 1000;
    c.bench_function("metadata split 2048 pages", |b| {
        b.iter(|| black_box(meta.split(black_box(at)).expect("split")))
    });
    let (left, right) = meta.split(at).expect("split");
    c.bench_function("metadata concat 2 nodes", |b| {
        b.iter(|| black_box(NodeMetadata::concat([&left, &right]).expect("concat")))
    });
    c.bench_function("metadata encode 2048 pages", |b| {
        b.iter(|| black_box(meta.encode()))
    });
    let bytes = meta.encode();
    c.bench_function("metadata decode 2048 pages", |b| {
        b.iter(|| black_box(NodeMetadata::decode(black_box(&bytes), &layout).expect("decode")))
    });
}

fn radix_match(c: &mut Criterion) {
    let tokens_n = 128 * 1024;
    let pages_n = tokens_n / PAGE_SIZE as usize;
    let layout = CpLayout::new(CP, PAGE_SIZE, 2 * pages_n as u32 + 64).expect("layout");
    let mut alloc = OwnerLaneAllocator::new(layout);
    let mut tree = RadixTree::new(layout, Rank(0)).expect("tree");
    let tokens: Vec<u32> = (0..tokens_n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 100_000)
        .collect();
    let run = alloc.alloc_pages(pages_n).expect("pages");
    let pages = run.pages().to_vec();
    // A realistic path: the 128k-token sequence was inserted as growing turns of a chat, so
    // the path has several nodes.
    for turns in [8usize, 4, 2, 1] {
        let n = pages_n / turns;
        let ins = tree
            .insert(&tokens[..n * PAGE_SIZE as usize], &pages[..n])
            .expect("insert");
        black_box(ins);
    }
    c.bench_function("radix match 128k-token path", |b| {
        b.iter(|| black_box(tree.match_prefix(black_box(&tokens)).expect("match")))
    });
}

/// The host work of a DMA load-back: copy regions for 2,048 scattered page pairs × 4 layers
/// (NSA `kv`, page-first host pool, so no two pages merge: the most regions).
fn dma_regions(c: &mut Criterion) {
    let dep = Deployment::by_name("nsa_ps64_cp8").expect("deployment");
    // The first descriptor of the h2d transfer: NSA `kv`.
    let spec = dep.transfer(Direction::HostToDevice).descriptors()[0];
    let n = 2048u32;
    let src: Vec<u32> = (0..n).map(|i| (i * 7919) % (2 * n)).collect();
    let dst: Vec<u32> = (0..n).map(|i| (i * 104_729) % (2 * n)).collect();
    let pools = PoolShape {
        layers: 4,
        device_pages: 2 * n,
        host_pages: 2 * n,
    };
    c.bench_function("dma regions 2048 pages x 4 layers", |b| {
        b.iter(|| {
            black_box(transfer_regions(
                &spec,
                black_box(&src),
                black_box(&dst),
                pools,
                0..pools.layers,
            ))
        })
    });
}

/// Storage records of 1 MiB payloads built as an object store puts a batch of them: each
/// payload copied behind its header, the checksum taken in a pass of its own
/// (`record::header`, then the copy), or in the same pass (`record::encode_into`). 64
/// payloads into 64 kept buffers in turn (128 MiB, past the caches), as in a batch.
fn record_encode(c: &mut Criterion) {
    use cp_hicache::storage::{record, Fingerprint, RecordKey};
    const N: usize = 64;
    let fp = Fingerprint::named("bench");
    let key = RecordKey::of_name(&fp, "page");
    let payloads: Vec<Vec<u8>> = (0..N)
        .map(|p| {
            (0..1u32 << 20)
                .map(|i| (i * 31 % 251) as u8 ^ p as u8)
                .collect()
        })
        .collect();
    let mut outs: Vec<Vec<u8>> = (0..N)
        .map(|_| vec![0u8; (1 << 20) + record::HEADER_BYTES])
        .collect();
    let mut at = 0;
    c.bench_function("record of 1 MiB, cold: header (checksum), then copy", |b| {
        b.iter(|| {
            at = (at + 1) % N;
            let (out, payload) = (&mut outs[at], &payloads[at]);
            out.clear();
            out.extend_from_slice(&record::header(&fp, &key, black_box(payload)));
            out.extend_from_slice(payload);
            black_box(out.len())
        })
    });
    c.bench_function("record of 1 MiB, cold: encode_into (one pass)", |b| {
        b.iter(|| {
            at = (at + 1) % N;
            record::encode_into(&fp, &key, black_box(&payloads[at]), &mut outs[at]);
            black_box(outs[at].len())
        })
    });
    c.bench_function("record of 1 MiB, cold: copy alone", |b| {
        b.iter(|| {
            at = (at + 1) % N;
            let (out, payload) = (&mut outs[at], &payloads[at]);
            out.clear();
            out.extend_from_slice(black_box(payload));
            black_box(out.len())
        })
    });
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
}

criterion_group! {
    name = host_paths;
    config = config();
    targets = alloc, metadata, radix_match, dma_regions, record_encode
}
criterion_main!(host_paths);
