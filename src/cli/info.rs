//! `cp-hicache info`: what this build is and what it found on this machine.

use crate::kernels::{BufferKind, ModelShape};
use crate::layout::CpLayout;
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `info`.
#[derive(Debug, Default, clap::Args)]
pub struct InfoArgs {
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    version: &'static str,
    default_layout: LayoutReport,
    cxx: Found,
    nvrtc: Found,
    cuda: Found,
    emulator: Found,
    jit: Found,
    backend_auto: String,
    cache_dir: PathBuf,
    env: Vec<(String, String)>,
}

#[derive(Debug, Serialize)]
struct LayoutReport {
    cp: u8,
    page_size: u32,
    pages: u32,
    local_pages_per_rank: u32,
    host_pages_per_rank: u32,
    layers: u32,
    model: String,
    bytes_per_token: Vec<(&'static str, u32)>,
}

/// How `info` words a model, and its buffers' bytes per token by buffer name.
fn describe(model: ModelShape) -> (String, Vec<(&'static str, u32)>) {
    let name = match model {
        ModelShape::Nsa => "DeepSeek-V3.2 NSA".to_string(),
        ModelShape::MlaBf16 => "MLA bf16".to_string(),
        ModelShape::Gqa { kv_heads, head_dim } => {
            format!("GQA bf16, {kv_heads} KV heads of {head_dim} per rank")
        }
    };
    let buffers = model
        .buffers()
        .iter()
        .map(|b| {
            let label = match b {
                BufferKind::NsaIndexK => "index_k",
                BufferKind::NsaKv | BufferKind::MlaKv | BufferKind::GqaKv { .. } => "kv",
            };
            (label, b.bytes_per_token())
        })
        .collect();
    (name, buffers)
}

#[derive(Debug)]
struct Found {
    what: String,
    detail: Result<String, String>,
    /// How the text report words a failed probe.
    failed: &'static str,
}

/// `{"what", "ok", "detail"}`: what was found, or why not (a derived `Result` would put
/// Rust's `{"Ok": ...}` into the JSON).
impl Serialize for Found {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Found", 3)?;
        st.serialize_field("what", &self.what)?;
        st.serialize_field("ok", &self.detail.is_ok())?;
        st.serialize_field(
            "detail",
            match &self.detail {
                Ok(d) | Err(d) => d,
            },
        )?;
        st.end()
    }
}

pub(super) fn run(args: &InfoArgs) -> Result<ExitCode, crate::Error> {
    // The deployment plain `cargo run --release` replays.
    let d = super::ReplayArgs::default();
    let layout = CpLayout::new(u32::from(d.cp), d.page_size, d.device_pages)?;
    let report = Report {
        version: env!("CARGO_PKG_VERSION"),
        default_layout: LayoutReport {
            cp: layout.cp(),
            page_size: layout.page_size(),
            pages: layout.pages(),
            local_pages_per_rank: layout.local_pages_per_rank(),
            host_pages_per_rank: d.host_pages,
            layers: d.layers,
            model: describe(d.model_shape()).0,
            bytes_per_token: describe(d.model_shape()).1,
        },
        cxx: probe_cxx(),
        nvrtc: probe_nvrtc(),
        cuda: Found {
            what: "CUDA driver".into(),
            detail: crate::exec::cuda::CudaExecutor::probe().map(cuda_detail),
            failed: NOT_FOUND,
        },
        emulator: probe_emulator(),
        jit: probe_jit(),
        backend_auto: crate::exec::Backend::Auto.resolve().to_string(),
        cache_dir: cache_dir(),
        env: [
            "CP_HICACHE_CACHE_DIR",
            crate::jit::JIT_ENV,
            "CP_HICACHE_NVRTC",
            crate::exec::host::ORDER_ENV,
            crate::jit::SANITIZE_ENV,
            crate::allocator::DEBUG_ENV,
            "CXX",
        ]
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
        .collect(),
    };
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| crate::Error::Io {
            context: "serialising the info report".into(),
            source: e.into(),
        })?;
        outln!("{text}");
    } else {
        print_text(&report)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_text(r: &Report) -> Result<(), crate::Error> {
    let l = &r.default_layout;
    outln!("cp-hicache {}", r.version);
    outln!();
    outln!("default deployment (what `cp-hicache replay` runs)");
    outln!("  model              {}", l.model);
    outln!("  CP degree          {}", l.cp);
    outln!("  page size          {} tokens", l.page_size);
    outln!(
        "  pages              {} ({} local pages per rank)",
        l.pages,
        l.local_pages_per_rank
    );
    outln!("  host pages         {} per rank", l.host_pages_per_rank);
    outln!("  layers             {}", l.layers);
    for (name, bytes) in &l.bytes_per_token {
        outln!("  buffer {name:<11} {bytes} B/token");
    }
    outln!();
    outln!("found");
    print_found(&r.cxx)?;
    print_found(&r.nvrtc)?;
    print_found(&r.cuda)?;
    print_found(&r.emulator)?;
    print_found(&r.jit)?;
    outln!("  {:<18} {}", "backend auto", r.backend_auto);
    outln!("  {:<18} {}", "cache dir", r.cache_dir.display());
    if !r.env.is_empty() {
        outln!();
        outln!("environment");
        let width = r.env.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in &r.env {
            outln!("  {k:<width$} {v:?}");
        }
    }
    Ok(())
}

const NOT_FOUND: &str = "not found";

fn print_found(f: &Found) -> Result<(), crate::Error> {
    match &f.detail {
        Ok(d) => outln!("  {:<18} {d}", f.what),
        Err(e) => outln!("  {:<18} {}: {e}", f.what, f.failed),
    }
    Ok(())
}

/// The C++ compiler the host executor would use: `$CXX`, else `c++`.
/// The device count, and device 0's name, compute capability and kernel target.
fn cuda_detail(devices: usize) -> String {
    use crate::exec::Executor;
    let first = match crate::exec::cuda::CudaExecutor::new(0) {
        Ok(gpu) => match gpu.compute_capability() {
            Some((major, minor)) => format!(
                "; device 0: {}, compute capability {major}.{minor}, {}, kernels for {}",
                gpu.device_name(),
                match gpu.host_numa() {
                    (Some(bus), Some(node)) => {
                        format!("PCI {bus}, pinned host memory on NUMA node {node}")
                    }
                    (Some(bus), None) => {
                        format!("PCI {bus}, no NUMA node known (host memory not bound)")
                    }
                    _ => "no PCI bus id (host memory not bound)".to_string(),
                },
                match crate::jit::target_for(&gpu, crate::jit::Arch::default(), Default::default())
                {
                    Err(_) => "no supported target".into(),
                    // The tests' stand-in driver: the device passed the architecture check.
                    Ok(_) if gpu.runs_emulated_kernels() => format!(
                        "{}, run as host libraries by the stand-in driver",
                        crate::jit::Arch::for_device(major, minor)
                            .map_or("?".to_string(), |a| a.to_string())
                    ),
                    Ok(target) => target.to_string(),
                }
            ),
            None => format!("; device 0: {}", gpu.device_name()),
        },
        Err(e) if devices > 0 => format!("; device 0: {e}"),
        Err(_) => String::new(),
    };
    format!("{devices} device(s){first}")
}

fn probe_cxx() -> Found {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let detail = match crate::jit::hostcc::compiler_command(&cxx)
        .arg("--version")
        .output()
    {
        Ok(out) if out.status.success() => Ok(format!(
            "{cxx}: {}",
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .unwrap_or("")
        )),
        Ok(out) => Err(format!("`{cxx} --version` exited with {}", out.status)),
        Err(e) => Err(format!("`{cxx}`: {e}")),
    };
    Found {
        what: "C++ compiler".into(),
        detail,
        failed: NOT_FOUND,
    }
}

/// How the CPU emulation executor would run kernels here: the block order and the sanitizer
/// mode the environment selects (a misspelt value is shown as the error replay would stop with).
fn probe_emulator() -> Found {
    let order = crate::exec::HostOptions::from_env()
        .map(|o| o.block_order)
        .map_err(|e| e.to_string());
    let sanitize = crate::jit::Sanitize::from_env().map_err(|e| e.to_string());
    Found {
        what: "CPU emulator".into(),
        detail: order
            .and_then(|o| sanitize.map(|s| format!("blocks and threads run {o}, sanitizer {s}"))),
        failed: "misconfigured",
    }
}

/// Whether the JIT may compile a kernel missing from the cache (`CP_HICACHE_JIT`); a
/// misspelt value is shown as the error replay and compile would stop with.
fn probe_jit() -> Found {
    let detail = crate::jit::JitMode::from_env()
        .map(|mode| match mode {
            crate::jit::JitMode::On => "on: kernels missing from the cache are compiled".into(),
            crate::jit::JitMode::Off => {
                "off: only kernels already in the cache load, nothing is compiled".into()
            }
        })
        .map_err(|e| e.to_string());
    Found {
        what: "JIT".into(),
        detail,
        failed: "misconfigured",
    }
}

/// NVRTC, loaded the way the JIT loads it (so the version is the one kernels compile with).
/// When `CP_HICACHE_NVRTC` names a library that cannot be used, the line names that path and
/// why (the `dlopen` error), not the generic "set CP_HICACHE_NVRTC" hint.
fn probe_nvrtc() -> Found {
    let mut failed = NOT_FOUND;
    let detail = crate::jit::NvrtcCompiler::load()
        .map(|c| {
            let lib = c.library().map_or_else(
                || "found by the dynamic linker".into(),
                |p| p.display().to_string(),
            );
            format!("{} ({lib})", c.identity())
        })
        .map_err(|e| {
            // A library that was named or found but cannot be used says why; otherwise the
            // hint.
            if let crate::jit::NvrtcError::Unavailable {
                searched,
                requested,
            } = &e
            {
                if requested.is_some() {
                    failed = "not usable";
                    let hint = crate::jit::nvrtc::unavailable_hint(requested.as_deref());
                    return hint
                        .strip_prefix("NVRTC unavailable: ")
                        .unwrap_or(&hint)
                        .to_string();
                }
                if let Some(why) = searched.iter().find(|s| s.contains(" but ")) {
                    return why.clone();
                }
            }
            let hint = crate::jit::nvrtc::NOT_FOUND_HINT;
            hint.strip_prefix("NVRTC not found: ")
                .unwrap_or(hint)
                .to_string()
        });
    Found {
        what: "NVRTC".into(),
        detail,
        failed,
    }
}

/// The cache directory the JIT would use (an empty `CP_HICACHE_CACHE_DIR` counts as unset).
fn cache_dir() -> PathBuf {
    crate::jit::DiskCache::default_root()
}
