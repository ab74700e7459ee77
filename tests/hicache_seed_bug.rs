//! The seed's bug on purpose: load-back with plain `alloc_pages` ignores the stored page
//! owners, so ranks load their bytes into pages another rank owns and attention reads slots
//! nobody loaded. Verification must catch it at every CP degree above 1, and at CP 1 (one
//! owner) the same fault is harmless.

mod hicache_support;

use cp_hicache::cluster::Fault;
use cp_hicache::kernels::ModelShape;
use hicache_support::{evict_all, serve_checked, tokens, Setup};

fn mismatches_after_reload(model: ModelShape, ps: u32, cp: u8) -> u64 {
    let mut setup = Setup::new(model, ps, cp);
    setup.fault = Some(Fault::PlainAllocOnLoad);
    let mut c = setup.build();
    let a = tokens(1, 10 * ps as usize + 3);
    assert_eq!(serve_checked(&mut c, &a).mismatched_tokens, 0);
    evict_all(&mut c);
    let s = c.serve(&a).unwrap();
    assert!(c.replicas_agree());
    assert_eq!(s.host_hit_tokens, 10 * u64::from(ps), "{s:?}");
    // The invariants check catches the wrong owners too, wherever there are owners to lose.
    let checked = c.check_invariants();
    assert_eq!(
        checked.is_err(),
        s.mismatched_tokens > 0,
        "cp {cp}: {checked:?}"
    );
    // Only loaded tokens can be wrong, each counted once however many buffer kinds (NSA: kv
    // and index_k) differ, and the first one is named.
    assert!(s.mismatched_tokens <= s.host_hit_tokens, "{s:?}");
    match s.first_mismatched_token {
        None => assert_eq!(s.mismatched_tokens, 0),
        Some(t) => assert!(s.mismatched_tokens > 0 && t < s.host_hit_tokens, "{s:?}"),
    }
    s.mismatched_tokens
}

#[test]
fn plain_alloc_on_load_mismatches_at_cp2_4_8() {
    for cp in [2, 4, 8] {
        let m = mismatches_after_reload(ModelShape::MlaBf16, 16, cp);
        assert!(m > 0, "cp {cp}: the seed's bug must show");
    }
    let m = mismatches_after_reload(ModelShape::Nsa, 64, 8);
    assert!(m > 0, "nsa cp 8: the seed's bug must show");
    let m = mismatches_after_reload(ModelShape::GQA_DEFAULT, 16, 4);
    assert!(m > 0, "gqa cp 4: the seed's bug must show");
}

#[test]
fn plain_alloc_on_load_is_harmless_at_cp1() {
    assert_eq!(mismatches_after_reload(ModelShape::MlaBf16, 16, 1), 0);
    assert_eq!(mismatches_after_reload(ModelShape::GQA_DEFAULT, 16, 1), 0);
}
