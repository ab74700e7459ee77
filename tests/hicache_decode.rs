//! Synthesised KV respects its dtypes, and a CPU reference decode step over a loaded-back
//! (cache-hit) materialised buffer gives exactly the output of the cold prefill; under the
//! seed's bug (`PlainAllocOnLoad`) the output differs, silently: incoherent decoding.

mod hicache_support;

use cp_hicache::cluster::{Cluster, Fault};
use cp_hicache::hicache::decode::{check_dtypes, decode_step, query_len};
use cp_hicache::kernels::{BufferKind, ModelShape};
use hicache_support::{evict_all, serve_checked, tokens, Setup};

type Dense = Vec<(BufferKind, Vec<u8>)>;

/// A query small enough that every token keeps a share of the softmax. With an amplitude of
/// 4 the synthesised keys (bf16 up to 2^8) gave scores hundreds apart, so one token took all
/// the weight and whether the bug changed the decode depended on which token that was. Its
/// length is the buffer's (576 for MLA and NSA, `kv_heads × head_dim` for GQA).
fn query(b: BufferKind) -> Vec<f32> {
    (0..query_len(b).unwrap())
        .map(|i| ((i as f32) * 0.731).sin() * 0.01)
        .collect()
}

/// Per layer, the decode output over every KV buffer of `dense`.
fn decode_all(c: &Cluster, dense: &Dense, n_tokens: usize) -> Vec<Vec<f32>> {
    let ps = c.layout().page_size();
    let layers = c.config().layers;
    dense
        .iter()
        .filter(|(b, _)| *b != BufferKind::NsaIndexK)
        .flat_map(|(b, bytes)| {
            let q = query(*b);
            (0..layers).map(move |l| decode_step(*b, bytes, ps, layers, l, n_tokens, &q).unwrap())
        })
        .collect()
}

/// Every field's bytes of token `t` in layer `layer` of a dense buffer laid out
/// `[layer][seq_page][page bytes]`.
fn token_bytes(
    b: BufferKind,
    dense: &[u8],
    ps: usize,
    layers: u32,
    layer: u32,
    t: usize,
) -> Vec<u8> {
    let page_bytes = b.page_bytes(ps as u32) as usize;
    let pages = dense.len() / (layers as usize * page_bytes);
    let page = &dense[(layer as usize * pages + t / ps) * page_bytes..][..page_bytes];
    let slot = (t % ps) as u32;
    b.field_layouts(ps as u32)
        .iter()
        .flat_map(|f| {
            let at = f.offset(slot, 0);
            page[at..at + (f.count * f.dtype.size()) as usize].to_vec()
        })
        .collect()
}

/// Cold prefill, eviction, host hit: the two dense captures and their stats.
fn cold_and_reloaded(setup: &Setup, n_tokens: usize) -> (Cluster, Dense, Dense, u64) {
    let mut c = setup.build();
    c.set_capture_dense(true);
    let a = tokens(7, n_tokens);
    let s = serve_checked(&mut c, &a);
    assert_eq!(s.mismatched_tokens, 0);
    let cold = c.last_dense().to_vec();
    evict_all(&mut c);
    let s = c.serve(&a).unwrap();
    assert!(s.host_hit_tokens > 0, "{s:?}");
    // Under the seed's bug the invariants check catches the loaded pages' wrong owners.
    let checked = c.check_invariants();
    assert_eq!(
        checked.is_err(),
        setup.fault == Some(Fault::PlainAllocOnLoad),
        "{checked:?}"
    );
    let hit = c.last_dense().to_vec();
    (c, cold, hit, s.mismatched_tokens)
}

fn setups() -> Vec<Setup> {
    let mut nsa = Setup::new(ModelShape::Nsa, 64, 4);
    nsa.layers = 2;
    let mut mla = Setup::new(ModelShape::MlaBf16, 16, 2);
    mla.layers = 2;
    let mut gqa = Setup::new(
        ModelShape::Gqa {
            kv_heads: 4,
            head_dim: 32,
        },
        16,
        4,
    );
    gqa.layers = 2;
    vec![nsa, mla, gqa]
}

#[test]
fn synthesised_kv_has_legal_dtypes() {
    for setup in setups() {
        let n = 5 * setup.page_size as usize + 9;
        let (c, cold, hit, _) = cold_and_reloaded(&setup, n);
        let expect: Vec<BufferKind> = setup.model.buffers().to_vec();
        assert_eq!(cold.iter().map(|d| d.0).collect::<Vec<_>>(), expect);
        for (b, bytes) in cold.iter().chain(&hit) {
            check_dtypes(*b, bytes, c.layout().page_size(), setup.layers, n).unwrap();
        }
    }
}

#[test]
fn decode_over_a_cache_hit_equals_decode_over_the_cold_prefill() {
    for setup in setups() {
        let n = 6 * setup.page_size as usize + 1;
        let (c, cold, hit, mismatched) = cold_and_reloaded(&setup, n);
        assert_eq!(mismatched, 0);
        let ps = c.layout().page_size() as usize;
        // Byte-equal on every real token (the padding of the last page is not KV).
        assert_eq!(cold.len(), hit.len());
        for ((b, x), (hb, y)) in cold.iter().zip(&hit) {
            assert_eq!(b, hb);
            assert_eq!(x.len(), y.len(), "{b}");
            for layer in 0..setup.layers {
                for t in 0..n {
                    assert_eq!(
                        token_bytes(*b, x, ps, setup.layers, layer, t),
                        token_bytes(*b, y, ps, setup.layers, layer, t),
                        "{b} layer {layer} token {t}: the hit's KV differs from the cold prefill's"
                    );
                }
            }
        }
        let out_cold = decode_all(&c, &cold, n);
        let out_hit = decode_all(&c, &hit, n);
        assert!(!out_cold.is_empty());
        for (x, y) in out_cold.iter().zip(&out_hit) {
            assert!(x.iter().all(|v| v.is_finite()));
            let xb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
            let yb: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
            assert_eq!(xb, yb, "{} page {ps}: decode differs on a hit", setup.model);
        }
    }
}

#[test]
fn decode_under_the_seeds_bug_differs() {
    for mut setup in setups() {
        setup.fault = Some(Fault::PlainAllocOnLoad);
        let n = 6 * setup.page_size as usize + 1;
        let (c, cold, hit, mismatched) = cold_and_reloaded(&setup, n);
        assert!(mismatched > 0, "{}", setup.model);
        let out_cold = decode_all(&c, &cold, n);
        let out_hit = decode_all(&c, &hit, n);
        assert!(
            out_cold.iter().zip(&out_hit).any(|(x, y)| x != y),
            "{}: the wrong owner must change the decode",
            setup.model
        );
    }
}
