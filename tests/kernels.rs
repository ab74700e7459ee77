//! Kernel renders: `generated/` matches the templates, insta snapshots pin one render per
//! family, and every render is self-contained and names its entry after the spec.

use std::path::{Path, PathBuf};

use cp_hicache::kernels::{
    diff_tree, render_tree, BufferKind, Deployment, Direction, KernelSpec, SelectOutput,
    REGENERATE_COMMAND,
};

fn generated_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("generated")
}

// `generated/` must equal the render of the reference deployments, file for file.
// CP_HICACHE_BLESS_GENERATED=1 rewrites it (and deletes stale files) instead of failing.
#[test]
fn generated_tree_matches_templates() {
    let dir = generated_dir();
    let deps = Deployment::reference();
    if std::env::var_os("CP_HICACHE_BLESS_GENERATED").is_some_and(|v| v == "1") {
        render_tree(&dir, &deps).unwrap();
        for extra in diff_tree(&dir, &deps).unwrap().extra {
            std::fs::remove_file(dir.join(extra)).unwrap();
        }
    }
    let diff = diff_tree(&dir, &deps).unwrap();
    assert!(
        diff.is_clean(),
        "generated/ disagrees with templates/ (missing {:?}, changed {:?}, extra {:?}).\n\
         Regenerate with `{REGENERATE_COMMAND}` \
         (or `CP_HICACHE_BLESS_GENERATED=1 cargo test --test kernels`) and commit the result.",
        diff.missing,
        diff.changed,
        diff.extra
    );
}

#[test]
fn render_tree_rewrites_only_changed_files() {
    let tmp = tempfile::tempdir().unwrap();
    let deps = vec![Deployment::by_name("mla_ps16_cp4").unwrap()];
    let first = render_tree(tmp.path(), &deps).unwrap();
    // The kernels, the two busy kernels and the index.
    assert_eq!(first.len(), deps[0].specs().len() + 3);
    assert!(render_tree(tmp.path(), &deps).unwrap().is_empty());
    let victim = &first[0];
    std::fs::write(victim, "stale").unwrap();
    std::fs::write(tmp.path().join("mla_ps16_cp4/old.cu"), "x").unwrap();
    let diff = diff_tree(tmp.path(), &deps).unwrap();
    assert_eq!(diff.changed.len(), 1);
    assert_eq!(diff.extra, [PathBuf::from("mla_ps16_cp4/old.cu")]);
    assert!(diff.missing.is_empty());
    assert_eq!(
        render_tree(tmp.path(), &deps).unwrap(),
        std::slice::from_ref(victim)
    );
}

#[test]
fn renders_are_self_contained_and_named_by_uri() {
    for dep in Deployment::reference() {
        for spec in dep.specs().into_iter().chain(dep.busy_specs()) {
            let src = spec.render().unwrap();
            let uri = spec.uri();
            assert!(!src.contains("#include"), "{uri}");
            // Materialise also bounds the blocks per SM (a full SM: HBM-bound); transfers ask
            // for one or two (a capped grid: registers over occupancy, at most half an SM's
            // registers a block where its loop allows, TransferSpec::min_blocks).
            let bounds = match spec {
                KernelSpec::Materialise(_) | KernelSpec::TransferPages(_) => "THREADS, MIN_BLOCKS",
                _ => "THREADS",
            };
            if let KernelSpec::TransferPages(t) = spec {
                assert!(
                    src.contains(&format!("#define MIN_BLOCKS {}\n", t.min_blocks())),
                    "{uri}"
                );
            }
            assert!(
                src.contains(&format!(
                    "extern \"C\" __global__ void __launch_bounds__({bounds}) {uri}("
                )),
                "{uri}"
            );
            assert!(
                src.contains(&format!("CP_HICACHE_EMU_EXPORT({uri})")),
                "{uri}"
            );
            assert!(
                !src.contains("{{") && !src.contains("{%"),
                "{uri}: unrendered template"
            );
            assert!(
                uri.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{uri}"
            );
        }
    }
}

#[test]
fn uris_are_unique_per_render() {
    let mut seen = std::collections::BTreeMap::new();
    for dep in Deployment::reference() {
        for spec in dep.specs() {
            for cand in spec.candidates() {
                let src = cand.render().unwrap();
                if let Some(prev) = seen.insert(cand.uri(), src.clone()) {
                    assert_eq!(prev, src, "{} renders two ways", cand.uri());
                }
            }
        }
    }
}

fn snap(name: &str, spec: KernelSpec) {
    insta::assert_snapshot!(name, spec.render().unwrap());
}

#[test]
fn snapshot_select_owner_pages() {
    let nsa = Deployment::by_name("nsa_ps64_cp8").unwrap();
    snap(
        "select_owner_pages",
        nsa.select_spec(SelectOutput::PagesAndLocs),
    );
    snap(
        "select_owner_pages_nolocs",
        nsa.select_spec(SelectOutput::Pages),
    );
}

#[test]
fn snapshot_busy() {
    let [alu, hbm] = Deployment::by_name("nsa_ps64_cp8").unwrap().busy_specs();
    snap("busy", alu);
    snap("busy_hbm", hbm);
}

#[test]
fn snapshot_release_pages() {
    snap(
        "release_pages",
        Deployment::by_name("nsa_ps64_cp8").unwrap().release_spec(),
    );
}

#[test]
fn snapshot_transfer_pages() {
    let nsa = Deployment::by_name("nsa_ps64_cp8").unwrap();
    let mla = Deployment::by_name("mla_ps16_cp4").unwrap();
    snap(
        "transfer_pages_d2h_pf",
        nsa.transfer_spec(Direction::DeviceToHost),
    );
    snap(
        "transfer_pages_h2d_lf",
        mla.transfer_spec(Direction::HostToDevice),
    );
    // `tune`'s twin that stamps where it ran beside the busy kernels.
    snap(
        "transfer_pages_h2d_pf_stamped",
        nsa.transfer_spec(Direction::HostToDevice)
            .stamped()
            .unwrap(),
    );
}

#[test]
fn snapshot_materialise() {
    snap(
        "materialise",
        Deployment::by_name("nsa_ps64_cp4")
            .unwrap()
            .materialise_spec(BufferKind::NsaKv),
    );
}

#[test]
fn snapshot_synthesise_and_verify() {
    let nsa = Deployment::by_name("nsa_ps64_cp8").unwrap();
    snap("synthesise_nsa_kv", nsa.synth_spec(BufferKind::NsaKv));
    snap("synthesise_nsa_idx", nsa.synth_spec(BufferKind::NsaIndexK));
    snap("verify_nsa_kv", nsa.verify_spec(BufferKind::NsaKv));
    let mla = Deployment::by_name("mla_ps16_cp8").unwrap();
    snap("verify_mla_kv", mla.verify_spec(BufferKind::MlaKv));
}

/// Token-interleave changes only where synthesise and verify place each token.
#[test]
fn snapshot_token_interleaved_synthesise_and_verify() {
    let ti = Deployment::by_name("nsa_ps64_cp8_ti1").unwrap();
    snap("synthesise_nsa_kv_ti1", ti.synth_spec(BufferKind::NsaKv));
    snap("verify_nsa_kv_ti1", ti.verify_spec(BufferKind::NsaKv));
}

/// Every kernel family of the GQA reference deployment (8 KV heads of 128 at page 16, CP 4):
/// its synthesise and verify place a page's keys then its values (two bf16 fields,
/// page-organised), and its copies move 4096-byte tokens.
#[test]
fn snapshot_gqa_every_family() {
    let gqa = Deployment::by_name("gqa8x128_ps16_cp4").unwrap();
    let b = gqa.model.buffers()[0];
    assert_eq!(b.to_string(), "gqa8x128_kv");
    snap(
        "gqa_select_owner_pages",
        gqa.select_spec(SelectOutput::PagesAndLocs),
    );
    snap(
        "gqa_select_owner_pages_nolocs",
        gqa.select_spec(SelectOutput::Pages),
    );
    snap("gqa_release_pages", gqa.release_spec());
    snap(
        "gqa_transfer_pages_d2h",
        gqa.transfer_spec(Direction::DeviceToHost),
    );
    snap(
        "gqa_transfer_pages_h2d",
        gqa.transfer_spec(Direction::HostToDevice),
    );
    snap("gqa_materialise", gqa.materialise_spec(b));
    snap("gqa_synthesise", gqa.synth_spec(b));
    snap("gqa_verify", gqa.verify_spec(b));
    // Those are all of its kernels.
    assert_eq!(gqa.specs().len(), 8);
}
