//! `cp-hicache info`: what this build is and what it found on this machine.

use crate::layout::CpLayout;
use serde::Serialize;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

/// Options of `info`.
#[derive(Debug, Default, clap::Args)]
pub struct InfoArgs {
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Default deployment shown by `info`: DeepSeek-V3.2 NSA at CP 8, page 64.
const DEFAULT_CP: u32 = 8;
const DEFAULT_PAGE_SIZE: u32 = 64;
const DEFAULT_PAGES: u32 = 4097;

#[derive(Debug, Serialize)]
struct Report {
    version: &'static str,
    default_layout: LayoutReport,
    cxx: Found,
    cache_dir: Option<PathBuf>,
    env: Vec<(String, String)>,
}

#[derive(Debug, Serialize)]
struct LayoutReport {
    cp: u8,
    page_size: u32,
    pages: u32,
    local_pages_per_rank: u32,
    model: &'static str,
    bytes_per_token: Vec<(&'static str, u32)>,
}

#[derive(Debug, Serialize)]
struct Found {
    what: String,
    detail: Result<String, String>,
}

pub(super) fn run(args: &InfoArgs) -> Result<ExitCode, crate::Error> {
    let layout = CpLayout::new(DEFAULT_CP, DEFAULT_PAGE_SIZE, DEFAULT_PAGES)?;
    let report = Report {
        version: env!("CARGO_PKG_VERSION"),
        default_layout: LayoutReport {
            cp: layout.cp(),
            page_size: layout.page_size(),
            pages: layout.pages(),
            local_pages_per_rank: layout.local_pages_per_rank(),
            model: "DeepSeek-V3.2 NSA",
            bytes_per_token: vec![("kv", 656), ("index_k", 132)],
        },
        cxx: probe_cxx(),
        cache_dir: cache_dir(),
        env: [
            "CP_HICACHE_CACHE_DIR",
            "CP_HICACHE_JIT",
            "CP_HICACHE_NVRTC",
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
        println!("{text}");
    } else {
        print_text(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_text(r: &Report) {
    let l = &r.default_layout;
    println!("cp-hicache {}", r.version);
    println!();
    println!("default deployment");
    println!("  model              {}", l.model);
    println!("  CP degree          {}", l.cp);
    println!("  page size          {} tokens", l.page_size);
    println!(
        "  pages              {} ({} local pages per rank)",
        l.pages, l.local_pages_per_rank
    );
    for (name, bytes) in &l.bytes_per_token {
        println!("  buffer {name:<11} {bytes} B/token");
    }
    println!();
    println!("found");
    print_found(&r.cxx);
    match &r.cache_dir {
        Some(d) => println!("  {:<18} {}", "cache dir", d.display()),
        None => println!("  {:<18} none (set CP_HICACHE_CACHE_DIR)", "cache dir"),
    }
    for (k, v) in &r.env {
        println!("  {k:<18} {v}");
    }
}

fn print_found(f: &Found) {
    match &f.detail {
        Ok(d) => println!("  {:<18} {d}", f.what),
        Err(e) => println!("  {:<18} not found: {e}", f.what),
    }
}

/// The C++ compiler the host executor would use: `$CXX`, else `c++`.
fn probe_cxx() -> Found {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let detail = match Command::new(&cxx).arg("--version").output() {
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
    }
}

fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("CP_HICACHE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("cp-hicache")))
}
