//! `cp-hicache render`: writes the renders of reference deployments (`generated/` is exactly
//! `render --out generated`), or with `--check` compares a directory with them.

use crate::kernels::{diff_tree, render_tree, Deployment};
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
        return check(out, &deps, &args.deployment);
    }
    let written = render_tree(out, &deps)?;
    let total: usize = deps.iter().map(|d| d.specs().len() + 1).sum();
    outln!(
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

/// The command that renders `deployment` (a name or `all`) into `out`: the fix a failed
/// `--check` suggests, for the folder the user checked.
fn regenerate_command(out: &Path, deployment: &str) -> String {
    let dir = out.display().to_string();
    let safe = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-./+:@%=,".contains(c))
    };
    let dir = if safe(&dir) {
        dir
    } else {
        format!("'{}'", dir.replace('\'', r"'\''"))
    };
    let mut cmd = format!("cp-hicache render --out {dir}");
    if deployment != "all" {
        cmd.push_str(&format!(" --deployment {deployment}"));
    }
    cmd
}

fn check(out: &Path, deps: &[Deployment], deployment: &str) -> Result<ExitCode, crate::Error> {
    // A mistyped folder is the user's input, not a render with every file missing.
    if !out.is_dir() {
        let what = if out.exists() {
            "is not a directory"
        } else {
            "does not exist"
        };
        return Err(crate::Error::Usage(format!(
            "render --check: {} {what}; to render into it: {}",
            out.display(),
            regenerate_command(out, deployment)
        )));
    }
    let mut diff = diff_tree(out, deps)?;
    diff.extra = filter_extra(std::mem::take(&mut diff.extra), deps, deployment == "all");
    if diff.is_clean() {
        outln!(
            "{} matches the render of {} deployment(s)",
            out.display(),
            deps.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{} differs from the render:", out.display());
    for rel in &diff.missing {
        outln!("  missing  {}", rel.display());
    }
    for rel in &diff.changed {
        outln!("  changed  {}", rel.display());
    }
    for rel in &diff.extra {
        outln!("  extra    {}", rel.display());
    }
    outln!(
        "{} missing, {} changed, {} extra; regenerate with: {}",
        diff.missing.len(),
        diff.changed.len(),
        diff.extra.len(),
        regenerate_command(out, deployment)
    );
    Ok(ExitCode::FAILURE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fix_hint_names_the_folder_and_deployment() {
        assert_eq!(
            regenerate_command(Path::new("generated"), "all"),
            "cp-hicache render --out generated"
        );
        assert_eq!(
            regenerate_command(Path::new("/tmp/my dir"), "nsa_ps64_cp8"),
            "cp-hicache render --out '/tmp/my dir' --deployment nsa_ps64_cp8"
        );
    }
}
