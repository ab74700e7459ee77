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
    if out.exists() && !out.is_dir() {
        return Err(crate::Error::Usage(format!(
            "render --out {} is not a directory; name the folder to render into \
             (it is created if missing)",
            out.display()
        )));
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
    if !extra.is_empty() {
        eprintln!(
            "warning: render never deletes files, and render --check fails until the stale \
             ones are gone: {}",
            delete_command(out, &extra)
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

/// `s` as one shell word: as it is when it holds only characters no shell treats specially,
/// else in single quotes.
fn shell_word(s: &str) -> String {
    let safe = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./+:@%=,".contains(c));
    if safe {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The command that renders `deployment` (a name or `all`) into `out`: the fix a failed
/// `--check` suggests, for the folder the user checked.
fn regenerate_command(out: &Path, deployment: &str) -> String {
    let mut cmd = format!(
        "cp-hicache render --out {}",
        shell_word(&out.display().to_string())
    );
    if deployment != "all" {
        cmd.push_str(&format!(" --deployment {deployment}"));
    }
    cmd
}

/// The command that deletes the stale files `extra` (relative to `out`). Render itself never
/// deletes anything: it cannot tell a stale render from a file someone put there, and `--out`
/// may name a folder that holds other work.
fn delete_command(out: &Path, extra: &[PathBuf]) -> String {
    let mut cmd = "rm --".to_string();
    for rel in extra {
        cmd.push(' ');
        cmd.push_str(&shell_word(&out.join(rel).display().to_string()));
    }
    cmd
}

fn check(out: &Path, deps: &[Deployment], deployment: &str) -> Result<ExitCode, crate::Error> {
    // A mistyped folder is the user's input, not a render with every file missing.
    if !out.is_dir() {
        // Rendering into an existing file fails: the file has to move first.
        let (what, how) = if out.exists() {
            (
                "is not a directory",
                "check the folder render wrote, or move the file away and render there",
            )
        } else {
            ("does not exist", "to render into it")
        };
        return Err(crate::Error::Usage(format!(
            "render --check: {} {what}; {how}: {}",
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
    // Rendering fixes missing and changed files; it never deletes the extra ones, so they are
    // named for deletion instead.
    let counts = format!(
        "{} missing, {} changed, {} extra",
        diff.missing.len(),
        diff.changed.len(),
        diff.extra.len()
    );
    let delete = "delete the extra files, which the render does not produce (render never \
                  deletes files)";
    match (
        diff.missing.is_empty() && diff.changed.is_empty(),
        diff.extra.is_empty(),
    ) {
        (false, true) => outln!(
            "{counts}; regenerate with: {}",
            regenerate_command(out, deployment)
        ),
        (true, _) => outln!("{counts}; {delete}: {}", delete_command(out, &diff.extra)),
        (false, false) => outln!(
            "{counts}; regenerate with: {}\nand {delete}: {}",
            regenerate_command(out, deployment),
            delete_command(out, &diff.extra)
        ),
    }
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

    #[test]
    fn the_delete_hint_names_every_stale_file_under_the_folder() {
        assert_eq!(
            delete_command(
                Path::new("gen"),
                &[PathBuf::from("a/old.cu"), PathBuf::from("b/it's.cu")]
            ),
            r"rm -- gen/a/old.cu 'gen/b/it'\''s.cu'"
        );
    }
}
