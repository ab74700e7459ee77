//! Rendering: `KernelSpec` → CUDA C through the askama templates in `templates/`, and the
//! `generated/` tree of the reference deployments (write-if-different, atomic writes, diff).
//! Rust computes every constant and expression; the templates only substitute.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use askama::Template;

use super::spec::{render_params, Direction, KernelSpec};
use super::{Deployment, KernelError};

/// The command that regenerates `generated/` (named in test failures).
pub const REGENERATE_COMMAND: &str = "cargo run --release -- render --out generated";

/// The text of every file in `templates/` (the emulation header too: it is what the host
/// executor's kernels run on), for [`sources_digest`].
const TEMPLATE_TEXTS: [&str; 17] = [
    include_str!("../../templates/prelude.cu"),
    include_str!("../../templates/epilogue.cu"),
    include_str!("../../templates/copy_page.cu"),
    include_str!("../../templates/tile_rank.cu"),
    include_str!("../../templates/synth_common.cu"),
    include_str!("../../templates/interleave.cu"),
    include_str!("../../templates/select_owner_pages.cu"),
    include_str!("../../templates/release_pages.cu"),
    include_str!("../../templates/transfer_pages.cu"),
    include_str!("../../templates/materialise.cu"),
    include_str!("../../templates/synthesise.cu"),
    include_str!("../../templates/verify.cu"),
    include_str!("../../templates/busy_common.cu"),
    include_str!("../../templates/stamps.cu"),
    include_str!("../../templates/busy.cu"),
    include_str!("../../templates/busy_hbm.cu"),
    include_str!("../../templates/cuda_emu.h"),
];

/// A short digest of the crate version, every template, and the renders of every reference
/// deployment's kernels (which also change with the Rust side of rendering): what a tuning
/// result was measured against. The JIT needs no such thing (its key hashes the rendered
/// source), but a tuning file names shapes, not sources, and a shape timed on other kernel
/// code is stale.
pub fn sources_digest() -> &'static str {
    use sha2::{Digest, Sha256};
    static DIGEST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DIGEST.get_or_init(|| {
        let mut h = Sha256::new();
        h.update(env!("CARGO_PKG_VERSION"));
        let renders = Deployment::reference()
            .iter()
            .flat_map(|d| d.specs())
            .map(|spec| {
                spec.render()
                    .unwrap_or_else(|e| format!("render error: {e}"))
            })
            .collect::<Vec<_>>();
        for text in TEMPLATE_TEXTS
            .iter()
            .copied()
            .chain(renders.iter().map(String::as_str))
        {
            h.update((text.len() as u64).to_le_bytes());
            h.update(text);
        }
        h.finalize()[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    })
}

/// Name of the per-deployment index file in the render tree.
const INDEX_FILE: &str = "index.json";

/// One `#define` of the render prelude.
struct Const {
    name: &'static str,
    value: String,
}

fn c(name: &'static str, value: impl ToString) -> Const {
    Const {
        name,
        value: value.to_string(),
    }
}

/// One synthesised field as the synthesise/verify templates consume it.
struct FieldTpl {
    id: u32,
    count: u32,
    dtype: String,
    base: u32,
    tok_stride: u32,
    /// Elements per 64-bit draw ([`Dtype::per_draw`](super::Dtype::per_draw)).
    per_draw: u32,
    /// The packer of the dtype (`chc_pack_*` in templates/synth_common.cu).
    pack: &'static str,
    /// The full draws, then the partial last one (each present only when not empty).
    segments: Vec<SegmentTpl>,
}

/// A run of a field's draws that the kernels access alike: the full draws (one `u64` each),
/// or the partial last draw (its bytes only). The threads stride over the flat pairs
/// `x -> (token x / draws, draw first_draw + x % draws)`; thread `i` takes `x = i + k *
/// THREADS`, and every `phases`-th of those has the same draw, `tok_step` tokens on.
struct SegmentTpl {
    /// For the comment: what the segment is.
    what: String,
    first_draw: u32,
    /// Draws in the segment (`D`).
    draws: u32,
    /// `D / gcd(THREADS, D)`: the distinct draws of one thread.
    phases: u32,
    /// `THREADS / gcd(THREADS, D)`: tokens between a thread's pairs of one draw.
    tok_step: u32,
    /// Each access of one draw of one token.
    accesses: Vec<AccessTpl>,
}

/// One load or store of (part of) a packed draw `r`.
struct AccessTpl {
    ctype: &'static str,
    /// Byte offset in the draw.
    off: u32,
    /// The C value of those bytes of `r`.
    value: String,
}
#[derive(Template)]
#[template(path = "select_owner_pages.cu", escape = "none")]
struct SelectTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
    /// Whether the kernel writes `out_locs` ([`SelectOutput`](super::SelectOutput)).
    locs: bool,
}

#[derive(Template)]
#[template(path = "busy.cu", escape = "none")]
struct BusyTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
}

#[derive(Template)]
#[template(path = "busy_hbm.cu", escape = "none")]
struct BusyHbmTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
}

#[derive(Template)]
#[template(path = "release_pages.cu", escape = "none")]
struct ReleaseTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
}

#[derive(Template)]
#[template(path = "transfer_pages.cu", escape = "none")]
struct TransferTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
    host_layout_doc: &'a str,
    host_off_expr: &'a str,
    direction_doc: &'a str,
    src_cap: &'a str,
    dst_cap: &'a str,
    /// The device page's pointer type (written on host → device).
    device_type: &'a str,
    host_type: &'a str,
    /// Which pair index names the device page (`dp` on host → device).
    device_page: &'a str,
    host_page: &'a str,
    /// chc_copy_page's (destination, source).
    copy_args: &'a str,
    /// How a source vector `s[j]` is read.
    src_load: &'a str,
    /// Whether a second buffer moves in the same launch (`src1`, `dst1`).
    second: bool,
    /// Whether the kernel stamps where it ran (`stamps`).
    stamps: bool,
    first_doc: String,
    second_doc: String,
}

#[derive(Template)]
#[template(path = "materialise.cu", escape = "none")]
struct MaterialiseTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
}

#[derive(Template)]
#[template(path = "synthesise.cu", escape = "none")]
struct SynthTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
    buffer: String,
    fields: Vec<FieldTpl>,
    interleaved: bool,
}

#[derive(Template)]
#[template(path = "verify.cu", escape = "none")]
struct VerifyTpl<'a> {
    uri: &'a str,
    template: &'a str,
    consts: Vec<Const>,
    params: &'a str,
    buffer: String,
    fields: Vec<FieldTpl>,
    interleaved: bool,
}

/// The constants of a token order: a token-interleaved one's run and granule (and its CP
/// degree where the kernel has none of its own).
fn order_consts(order: super::TokenOrder, page_size: u32, with_cp: bool) -> Vec<Const> {
    match order {
        super::TokenOrder::Paged => Vec::new(),
        super::TokenOrder::Interleaved { cp, run } => {
            let mut v = Vec::new();
            if with_cp {
                v.push(c("CP", cp));
            }
            v.extend([
                c("RUN", run),
                c("LOG2_RUN", run.trailing_zeros()),
                c("GRANULE_TOKENS", u64::from(page_size) * u64::from(cp)),
            ]);
            v
        }
    }
}

fn copy_consts(cp: Option<u8>, page_size: u32, bpt: u32, l: &super::CopyLaunch) -> Vec<Const> {
    let page_bytes = u64::from(page_size) * u64::from(bpt);
    let mut v = Vec::new();
    if let Some(cp) = cp {
        v.push(c("CP", cp));
    }
    v.extend([
        c("PAGE_SIZE", page_size),
        c("BYTES_PER_TOKEN", bpt),
        c("PAGE_BYTES", page_bytes),
        c("VEC_T", l.vec.c_type()),
        c("VEC_BYTES", l.vec.bytes()),
        c("PAGE_VECS", page_bytes / u64::from(l.vec.bytes())),
        c("THREADS", l.threads),
        c("PAGES_PER_BLOCK", l.pages_per_block),
        c("UNROLL", l.unroll),
        c("LAYERS_IN_BLOCK", u32::from(l.layers_in_block)),
        c("STREAM_STORES", u32::from(l.streaming_stores)),
    ]);
    v
}

fn synth_consts(
    cp: Option<u8>,
    buffer: super::BufferKind,
    page_size: u32,
    threads: u32,
) -> Vec<Const> {
    let mut v = Vec::new();
    if let Some(cp) = cp {
        v.push(c("CP", cp));
    }
    v.extend([
        c("PAGE_SIZE", page_size),
        c("LOG2_PAGE_SIZE", page_size.trailing_zeros()),
        c("PAGE_BYTES", buffer.page_bytes(page_size)),
        c("BUFFER_ID", buffer.id()),
        c("THREADS", threads),
    ]);
    v
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn segment(
    what: String,
    first_draw: u32,
    draws: u32,
    threads: u32,
    accesses: Vec<AccessTpl>,
) -> SegmentTpl {
    let g = gcd(threads, draws);
    SegmentTpl {
        what,
        first_draw,
        draws,
        phases: draws / g,
        tok_step: threads / g,
        accesses,
    }
}

/// The C type of an access of `width` bytes.
fn access_type(width: u32) -> &'static str {
    match width {
        8 => "u64",
        4 => "u32",
        2 => "u16",
        _ => "u8",
    }
}

/// The fields of `buffer` at `page_size` for a block of `threads`. Alignment is checked by
/// [`KernelSpec::validate`] before any render ([`BufferKind::check_access_alignment`](super::BufferKind::check_access_alignment)).
fn fields(buffer: super::BufferKind, page_size: u32, threads: u32) -> Vec<FieldTpl> {
    buffer
        .field_layouts(page_size)
        .into_iter()
        .map(|f| {
            let mut segments = Vec::new();
            let full = f.full_draws();
            if full > 0 {
                let word = AccessTpl {
                    ctype: "u64",
                    off: 0,
                    value: "r".to_string(),
                };
                segments.push(segment(
                    format!("Draws 0..{full}, full: one u64 each"),
                    0,
                    full,
                    threads,
                    vec![word],
                ));
            }
            let tail = f.tail_accesses();
            if !tail.is_empty() {
                let bytes: u32 = tail.iter().map(|&(_, w)| w).sum();
                let accesses = tail
                    .into_iter()
                    .map(|(off, width)| {
                        let ctype = access_type(width);
                        let value = match off {
                            0 => format!("({ctype})r"),
                            _ => format!("({ctype})(r >> {}u)", 8 * off),
                        };
                        AccessTpl { ctype, off, value }
                    })
                    .collect();
                segments.push(segment(
                    format!("Draw {full}, partial: its {bytes} bytes only"),
                    full,
                    1,
                    threads,
                    accesses,
                ));
            }
            FieldTpl {
                id: f.id,
                count: f.count,
                dtype: f.dtype.to_string(),
                base: f.base,
                tok_stride: f.tok_stride,
                per_draw: f.dtype.per_draw(),
                pack: f.dtype.packer(),
                segments,
            }
        })
        .collect()
}

// Here rather than beside the spec: specs know nothing of templates, so imports run one way
// (render uses spec).
impl KernelSpec {
    /// Renders the self-contained CUDA C source (docs/KERNELS.md), validating first.
    pub fn render(&self) -> Result<String, KernelError> {
        render_spec(self)
    }
}

/// Renders one spec (see [`KernelSpec::render`]).
pub(crate) fn render_spec(spec: &KernelSpec) -> Result<String, KernelError> {
    spec.validate()?;
    let uri = spec.uri();
    let template = spec.template();
    let params = render_params(&spec.params());
    let wrap = |source| KernelError::Template {
        uri: uri.clone(),
        source,
    };
    let out = match spec {
        KernelSpec::SelectOwnerPages(s) => SelectTpl {
            uri: &uri,
            template,
            params: &params,
            consts: vec![
                c("CP", s.cp),
                c("PAGE_SIZE", s.page_size),
                c("LOG2_PAGE_SIZE", s.page_size.trailing_zeros()),
                c("THREADS", s.threads),
                c("WARPS", s.threads / 32),
            ],
            locs: s.output.writes_locs(),
        }
        .render(),
        KernelSpec::ReleasePages(s) => ReleaseTpl {
            uri: &uri,
            template,
            params: &params,
            consts: vec![
                c("CP", s.cp),
                c("THREADS", s.threads),
                c("WARPS", s.threads / 32),
            ],
        }
        .render(),
        KernelSpec::TransferPages(s) => {
            let h2d = s.direction == Direction::HostToDevice;
            let (src_cap, dst_cap, direction_doc) = if h2d {
                ("host_pages", "device_pages", "host → device")
            } else {
                ("device_pages", "host_pages", "device → host")
            };
            let mut consts = copy_consts(None, s.page_size, s.bytes_per_token, &s.launch);
            consts.extend([
                c("GROUP_LANES", s.launch.group_lanes()),
                c("GROUPS_PER_BLOCK", s.launch.groups_per_block()),
                c("BUFFERS", s.buffer_count()),
                c("MIN_BLOCKS", s.min_blocks()),
            ]);
            if let Some(bpt) = s.second_bytes_per_token {
                let page_bytes = u64::from(s.page_size) * u64::from(bpt);
                consts.extend([
                    c("BYTES_PER_TOKEN_1", bpt),
                    c("PAGE_BYTES_1", page_bytes),
                    c("PAGE_VECS_1", page_bytes / u64::from(s.launch.vec.bytes())),
                ]);
            }
            let doc = |bpt: u32| format!("{bpt} B/token, {} B pages", s.page_size * bpt);
            TransferTpl {
                uri: &uri,
                template,
                params: &params,
                consts,
                second: s.second_bytes_per_token.is_some(),
                stamps: s.stamps,
                first_doc: doc(s.bytes_per_token),
                second_doc: s.second_bytes_per_token.map(doc).unwrap_or_default(),
                host_layout_doc: s.layout.describe(),
                host_off_expr: s.layout.offset_expr(),
                direction_doc,
                src_cap,
                dst_cap,
                device_type: if h2d { "u8*" } else { "const u8*" },
                host_type: if h2d { "const u8*" } else { "u8*" },
                device_page: if h2d { "dp" } else { "sp" },
                host_page: if h2d { "sp" } else { "dp" },
                copy_args: if h2d { "dev, h" } else { "h, dev" },
                // Device → host reads each device byte once: with L2's evict-first policy
                // (`ld.global.cs`), so a backup streaming through L2 leaves the model's
                // working set there.
                src_load: if h2d { "s[j]" } else { "__ldcs(&s[j])" },
            }
            .render()
        }
        KernelSpec::Materialise(s) => MaterialiseTpl {
            uri: &uri,
            template,
            params: &params,
            consts: {
                let mut v = copy_consts(Some(s.cp), s.page_size, s.bytes_per_token, &s.launch);
                v.push(c("MIN_BLOCKS", s.min_blocks_per_sm()));
                v
            },
        }
        .render(),
        KernelSpec::Synthesise(s) => SynthTpl {
            uri: &uri,
            template,
            params: &params,
            consts: {
                let mut c = synth_consts(Some(s.cp), s.buffer, s.page_size, s.threads);
                c.extend(order_consts(s.order, s.page_size, false));
                c
            },
            buffer: s.buffer.to_string(),
            fields: fields(s.buffer, s.page_size, s.threads),
            interleaved: s.order != super::TokenOrder::Paged,
        }
        .render(),
        KernelSpec::Verify(s) => VerifyTpl {
            uri: &uri,
            template,
            params: &params,
            consts: {
                let mut c = synth_consts(None, s.buffer, s.page_size, s.threads);
                c.push(self::c("ITEM_TOKENS", s.item_tokens()));
                c.extend(order_consts(s.order, s.page_size, true));
                c
            },
            buffer: s.buffer.to_string(),
            fields: fields(s.buffer, s.page_size, s.threads),
            interleaved: s.order != super::TokenOrder::Paged,
        }
        .render(),
        KernelSpec::Busy(s) => match s.kind {
            super::BusyKind::Alu => BusyTpl {
                uri: &uri,
                template,
                params: &params,
                consts: vec![c("THREADS", s.threads)],
            }
            .render(),
            super::BusyKind::Hbm => BusyHbmTpl {
                uri: &uri,
                template,
                params: &params,
                consts: vec![c("THREADS", s.threads)],
            }
            .render(),
        },
    };
    out.map_err(wrap)
}

/// The index file of one deployment: its parameters and its kernels, for humans and tools.
fn index_json(dep: &Deployment, specs: &[KernelSpec]) -> String {
    let kernels: Vec<serde_json::Value> = specs
        .iter()
        .map(|s| {
            serde_json::json!({
                "uri": s.uri(),
                "family": s.family().to_string(),
                "file": format!("{}.cu", s.uri()),
            })
        })
        .collect();
    let doc = serde_json::json!({
        "deployment": dep.name,
        "model": dep.model.to_string(),
        "page_size": dep.page_size,
        "cp": dep.cp,
        "arch": dep.arch.to_string(),
        "host_layout": dep.host_layout.to_string(),
        "kernels": kernels,
    });
    // serde_json's pretty printer over a `json!` value cannot fail.
    let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
    s.push('\n');
    s
}

/// Every file of the render tree of `deployments`: relative path
/// (`<deployment>/<uri>.cu`, `<deployment>/index.json`) → content. Each deployment's
/// directory has its kernels and the busy kernels `tune` runs beside its transfers.
pub fn plan_tree(deployments: &[Deployment]) -> Result<BTreeMap<PathBuf, String>, KernelError> {
    let mut files = BTreeMap::new();
    for dep in deployments {
        let dir = PathBuf::from(&dep.name);
        let mut specs = dep.specs();
        // The busy kernels `tune` runs beside transfers on a GPU, so a reviewer sees them too.
        specs.extend(dep.busy_specs());
        for spec in &specs {
            files.insert(dir.join(format!("{}.cu", spec.uri())), spec.render()?);
        }
        files.insert(dir.join(INDEX_FILE), index_json(dep, &specs));
    }
    Ok(files)
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> KernelError {
    let path = path.to_path_buf();
    move |source| KernelError::Io { op, path, source }
}

/// Writes `content` to `path` through a temporary file in the same directory and a rename, so
/// readers never see a partial file.
fn write_atomic(path: &Path, content: &str) -> Result<(), KernelError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    fs::write(&tmp, content).map_err(io("write", &tmp))?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        io("rename", path)(e)
    })
}

/// Renders every kernel of `deployments` into `out_dir/<deployment>/<uri>.cu` (plus an
/// `index.json` per deployment), rewriting only files whose content changed. Returns the
/// paths written. Stale files are reported by [`diff_tree`], never deleted here.
pub fn render_tree(
    out_dir: &Path,
    deployments: &[Deployment],
) -> Result<Vec<PathBuf>, KernelError> {
    let mut written = Vec::new();
    for (rel, content) in plan_tree(deployments)? {
        let path = out_dir.join(&rel);
        if fs::read_to_string(&path).is_ok_and(|old| old == content) {
            continue;
        }
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io("create dir", parent))?;
        }
        write_atomic(&path, &content)?;
        written.push(path);
    }
    Ok(written)
}

/// How a directory differs from the render of some deployments (relative paths).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeDiff {
    /// Files the render has and the directory lacks.
    pub missing: Vec<PathBuf>,
    /// Files whose content differs.
    pub changed: Vec<PathBuf>,
    /// Files in the deployments' directories (or unknown deployment directories) that the
    /// render does not produce.
    pub extra: Vec<PathBuf>,
}

impl TreeDiff {
    /// True when the directory equals the render.
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.changed.is_empty() && self.extra.is_empty()
    }
}

fn list_files(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<(), KernelError> {
    let dir = root.join(rel);
    for entry in fs::read_dir(&dir).map_err(io("read dir", &dir))? {
        let entry = entry.map_err(io("read dir", &dir))?;
        let rel = rel.join(entry.file_name());
        if entry
            .file_type()
            .map_err(io("stat", &entry.path()))?
            .is_dir()
        {
            list_files(root, &rel, out)?;
        } else {
            out.push(rel);
        }
    }
    Ok(())
}

/// Compares `dir` with the render of `deployments`: every file under `dir` must be one the
/// render produces, with the same content. A missing `dir` counts as every file missing.
pub fn diff_tree(dir: &Path, deployments: &[Deployment]) -> Result<TreeDiff, KernelError> {
    let plan = plan_tree(deployments)?;
    let mut present = Vec::new();
    if dir.exists() {
        list_files(dir, Path::new(""), &mut present)?;
    }
    let mut diff = TreeDiff::default();
    for rel in &present {
        match plan.get(rel) {
            None => diff.extra.push(rel.clone()),
            Some(content) => {
                let path = dir.join(rel);
                let old = fs::read(&path).map_err(io("read", &path))?;
                if old != content.as_bytes() {
                    diff.changed.push(rel.clone());
                }
            }
        }
    }
    diff.missing = plan
        .keys()
        .filter(|k| !present.contains(k))
        .cloned()
        .collect();
    diff.extra.sort();
    diff.changed.sort();
    Ok(diff)
}
