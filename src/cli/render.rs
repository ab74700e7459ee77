//! `cp-hicache render`: writes the renders of reference deployments (`generated/` is exactly
//! `render --out generated`), or with `--check` compares a directory with them.

use crate::kernels::{diff_tree, render_tree, Deployment, REGENERATE_COMMAND};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Options of `render`.
#[derive(Debug, clap::Args)]
pub struct RenderArgs {
    /// Directory to write (or check) the render tree in: `<DIR>/<deployment>/<uri>.cu`.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A reference deployment name, or `all`.
    #[arg(long, value_name = "NAME|all", default_value = "all")]
    pub deployment: String,
    /// Compare DIR with the render instead of writing; exit 1 listing every difference.
    #[arg(long)]
    pub check: bool,
}

/// The reference deployments a `--deployment` value selects; an unknown name is a usage error
/// that lists the valid names.
pub(super) fn select_deployments(name: &str) -> Result<Vec<Deployment>, crate::Error> {
    if name == "all" {
        return Ok(Deployment::reference());
    }
    Deployment::by_name(name)
        .map(|d| vec![d])
        .map_err(|e| crate::Error::Usage(format!("{e} (or all)")))
}

pub(super) fn run(args: &RenderArgs) -> Result<ExitCode, crate::Error> {
    let deps = select_deployments(&args.deployment)?;
    let out = args.out.as_path();
    if args.check {
        return check(out, &deps, args.deployment == "all");
    }
    let written = render_tree(out, &deps)?;
    let total: usize = deps.iter().map(|d| d.specs().len() + 1).sum();
    println!(
        "rendered {} deployment(s) into {}: {} file(s) written, {} unchanged",
        deps.len(),
        out.display(),
        written.len(),
        total.saturating_sub(written.len())
    );
    let extra = relevant_extra(out, &deps, args.deployment == "all")?;
    for rel in &extra {
        eprintln!(
            "warning: stale file not produced by the render: {}",
            rel.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Files under `out` the render does not produce; for a single deployment only those inside its
/// own directory count (other deployments' directories are not its business).
fn relevant_extra(
    out: &Path,
    deps: &[Deployment],
    all: bool,
) -> Result<Vec<PathBuf>, crate::Error> {
    let diff = diff_tree(out, deps)?;
    Ok(filter_extra(diff.extra, deps, all))
}

fn filter_extra(extra: Vec<PathBuf>, deps: &[Deployment], all: bool) -> Vec<PathBuf> {
    if all {
        return extra;
    }
    extra
        .into_iter()
        .filter(|rel| {
            deps.iter().any(|d| {
                rel.components()
                    .next()
                    .is_some_and(|c| c.as_os_str() == d.name.as_str())
            })
        })
        .collect()
}

fn check(out: &Path, deps: &[Deployment], all: bool) -> Result<ExitCode, crate::Error> {
    let mut diff = diff_tree(out, deps)?;
    diff.extra = filter_extra(std::mem::take(&mut diff.extra), deps, all);
    if diff.is_clean() {
        println!(
            "{} matches the render of {} deployment(s)",
            out.display(),
            deps.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("{} differs from the render:", out.display());
    for rel in &diff.missing {
        println!("  missing  {}", rel.display());
    }
    for rel in &diff.changed {
        println!("  changed  {}", rel.display());
    }
    for rel in &diff.extra {
        println!("  extra    {}", rel.display());
    }
    println!(
        "{} missing, {} changed, {} extra; regenerate with: {REGENERATE_COMMAND}",
        diff.missing.len(),
        diff.changed.len(),
        diff.extra.len()
    );
    Ok(ExitCode::FAILURE)
}
