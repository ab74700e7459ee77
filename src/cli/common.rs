//! Options shared by several commands, defined once and flattened into each command's
//! arguments: the executor choice and the measurement sizes of `tune` and `bench`.

use std::path::Path;

use crate::exec::Backend;
use crate::kernels::Deployment;
use crate::tuning::Sizes;

/// Checks, before the work starts, that an output file named on the command line (`--json`,
/// `--plot`) can be written, so a long run never ends in "cannot write" with its results
/// lost. An existing file is left as it is (opened for append, not truncated); a file this
/// check creates is removed again. The path is the user's input, so a failure is a usage
/// error (exit status 2).
pub fn check_output(path: &Path) -> Result<(), crate::Error> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| crate::Error::Usage(format!("cannot write {}: {e}", path.display())))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Checks, before a tuning run, the tuning file it will merge into: it must be a file that
/// exists and parses (its entries are kept), or not exist yet; a directory is refused. With
/// `explicit` (`tune --out`) its folder must exist and take new files, as for `--json`; the
/// default file's folder (the cache directory) is created when the merge writes it.
pub fn check_merge_target(path: &Path, explicit: bool) -> Result<(), crate::Error> {
    let what = if explicit { "--out" } else { "tuning file" };
    if path.is_dir() {
        return Err(crate::Error::Usage(format!(
            "{what} {} is a directory; name a tuning file, e.g. {}",
            path.display(),
            path.join(crate::tuning::file::TUNING_FILE_NAME).display()
        )));
    }
    if path.exists() {
        crate::tuning::TuningFile::load(path).map_err(|e| {
            crate::Error::Usage(format!(
                "{e}; tune merges into this file: fix or delete it, or pass another --out"
            ))
        })?;
    }
    if !explicit {
        return Ok(());
    }
    // The merge writes a temporary file beside the target and renames it: probe the folder.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let probe = dir.join(format!(".cp-hicache-probe.{}.{nanos}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| {
            crate::Error::Usage(format!(
                "cannot write {}: {e} (folder {})",
                path.display(),
                dir.display()
            ))
        })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes `text` to an output file named on the command line.
pub fn write_output(path: &Path, text: &str) -> Result<(), crate::Error> {
    std::fs::write(path, text).map_err(|source| crate::Error::Io {
        context: format!("writing {}", path.display()),
        source,
    })
}

/// Writes `value` as pretty JSON (with a final newline) to an output file.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<(), crate::Error> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| crate::Error::Io {
        context: format!("serialising {}", path.display()),
        source: e.into(),
    })?;
    text.push('\n');
    write_output(path, &text)
}

/// `--backend`: which executor runs the kernels.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArg {
    /// Executor: auto (CUDA when a device is usable), host or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub backend: Backend,
}

/// Most pages per copy launch: 16× the full size, far past where copy bandwidth levels off.
pub const MAX_PAGES: u32 = 4096;
/// Most layers per copy launch.
pub const MAX_LAYERS: u32 = 64;
/// Most timed repeats per measurement.
pub const MAX_REPEATS: u32 = 1000;
/// Most bytes of pages one copy workload may span (`pages × layers × page bytes` of the
/// largest buffer): the pools are allocated once more with slack and, for transfers, on both
/// sides, so this keeps a bench or tune run within a few GiB of memory.
pub const MAX_COPY_BYTES: u64 = 2 << 30;

/// `--pages`, `--layers`, `--repeats`: overrides of the quick/full measurement sizes. A
/// command whose wording differs keeps its own help text with `mut_arg`; the meaning is the
/// same everywhere (see [`SizeArgs::apply`]). Zero is refused by clap rather than rounded up,
/// so a typo cannot silently measure something else.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SizeArgs {
    /// Pages per copy launch, 1-4096 (overrides the quick/full default of 128/256).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=MAX_PAGES as i64))]
    pub pages: Option<u32>,
    /// Layers per copy launch, 1-64 (overrides the quick/full default of 2/4).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=MAX_LAYERS as i64))]
    pub layers: Option<u32>,
    /// Timed repeats per candidate, 1-1000; the median is kept.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=MAX_REPEATS as i64))]
    pub repeats: Option<u32>,
}

impl SizeArgs {
    /// Overrides the sizes that were given (clap has already checked their ranges), then
    /// refuses a copy workload larger than [`MAX_COPY_BYTES`] for any of `deps`: pages and
    /// layers are each in range, but their product on a large page would not fit in memory.
    pub fn apply(&self, sizes: &mut Sizes, deps: &[Deployment]) -> Result<(), crate::Error> {
        if let Some(p) = self.pages {
            sizes.pages = p;
        }
        if let Some(l) = self.layers {
            sizes.layers = l;
        }
        if let Some(r) = self.repeats {
            sizes.repeats = r;
        }
        for dep in deps {
            let page_bytes = dep
                .model
                .buffers()
                .iter()
                .map(|b| b.page_bytes(dep.page_size))
                .max()
                .unwrap_or(0);
            let bytes = u64::from(sizes.pages) * u64::from(sizes.layers) * page_bytes;
            if bytes > MAX_COPY_BYTES {
                return Err(crate::Error::Usage(format!(
                    "{} pages × {} layers of {page_bytes}-byte pages ({}) is {:.1} GiB per pool; \
                     the most is {} GiB: lower --pages or --layers",
                    sizes.pages,
                    sizes.layers,
                    dep.name,
                    bytes as f64 / f64::from(1u32 << 30),
                    MAX_COPY_BYTES >> 30
                )));
            }
        }
        Ok(())
    }
}

/// Parses `--backend` (clap value parser).
pub(super) fn parse_backend(s: &str) -> Result<Backend, String> {
    s.parse().map_err(|e: crate::exec::ExecError| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The help line of `--name` under subcommand `sub`.
    fn help(sub: &str, name: &str) -> String {
        let cli = crate::cli::Cli::command();
        let cmd = cli.find_subcommand(sub).expect("subcommand");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == name)
            .expect("argument");
        arg.get_help().map(ToString::to_string).unwrap_or_default()
    }

    #[test]
    fn output_checks_leave_files_as_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("new.json");
        check_output(&fresh).unwrap();
        assert!(!fresh.exists(), "the check created a file and left it");
        let old = dir.path().join("old.json");
        std::fs::write(&old, "earlier report").unwrap();
        check_output(&old).unwrap();
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "earlier report");
        let err = check_output(&dir.path().join("missing/x.json")).unwrap_err();
        assert!(err.to_string().contains("cannot write"), "{err}");
        assert!(err.is_usage(), "{err}");
        assert!(
            check_output(dir.path()).is_err(),
            "a directory is not an output file"
        );
    }

    #[test]
    fn merge_targets_must_be_a_tuning_file_or_absent() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("t.json");
        check_merge_target(&fresh, true).unwrap();
        let names = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(names, 0, "the probe was left behind");
        crate::tuning::TuningFile::default().save(&fresh).unwrap();
        check_merge_target(&fresh, true).unwrap();
        let corrupt = dir.path().join("corrupt.json");
        std::fs::write(&corrupt, "{not json").unwrap();
        let missing_dir = dir.path().join("missing/t.json");
        for (path, needle) in [
            (dir.path(), "is a directory"),
            (corrupt.as_path(), "fix or delete it"),
            (missing_dir.as_path(), "cannot write"),
        ] {
            let err = check_merge_target(path, true).unwrap_err();
            assert!(err.is_usage() && err.to_string().contains(needle), "{err}");
        }
        // The default file's folder is created by the merge itself.
        check_merge_target(&missing_dir, false).unwrap();
    }

    #[test]
    fn the_command_line_is_consistent() {
        crate::cli::Cli::command().debug_assert();
    }

    #[test]
    fn shared_options_keep_each_commands_wording() {
        for sub in ["tune", "bench"] {
            assert_eq!(
                help(sub, "backend"),
                "Executor: auto (CUDA when a device is usable), host or cuda"
            );
            assert_eq!(
                help(sub, "pages"),
                "Pages per copy launch, 1-4096 (overrides the quick/full default of 128/256)"
            );
        }
        assert_eq!(
            help("tune", "layers"),
            "Layers per copy launch, 1-64 (overrides the quick/full default of 2/4)"
        );
        assert_eq!(
            help("tune", "repeats"),
            "Timed repeats per candidate, 1-1000; the median is kept"
        );
        assert_eq!(help("bench", "layers"), "Layers per copy launch, 1-64");
        assert_eq!(
            help("bench", "repeats"),
            "Timed repeats, 1-1000; the median is reported"
        );
    }

    #[test]
    fn size_args_override_only_what_was_given() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let mut s = Sizes::quick();
        let before = s;
        SizeArgs::default()
            .apply(&mut s, std::slice::from_ref(&dep))
            .unwrap();
        assert_eq!(s, before);
        SizeArgs {
            pages: Some(7),
            layers: None,
            repeats: Some(5),
        }
        .apply(&mut s, &[dep])
        .unwrap();
        assert_eq!(s.pages, 7);
        assert_eq!(s.layers, before.layers);
        assert_eq!(s.repeats, 5);
        assert_eq!(s.warmup, before.warmup);
    }

    #[test]
    fn a_copy_workload_past_the_memory_budget_is_a_usage_error() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let mut s = Sizes::quick();
        let err = SizeArgs {
            pages: Some(MAX_PAGES),
            layers: Some(MAX_LAYERS),
            repeats: None,
        }
        .apply(&mut s, &[dep])
        .unwrap_err();
        assert!(err.is_usage(), "{err}");
        assert!(
            err.to_string().contains("lower --pages or --layers"),
            "{err}"
        );
    }

    #[test]
    fn zero_and_oversized_sizes_are_refused_by_clap() {
        use clap::Parser;
        for args in [
            ["bench", "--pages", "0"],
            ["tune", "--layers", "0"],
            ["bench", "--repeats", "0"],
            ["tune", "--pages", "4097"],
            ["bench", "--alloc-pages", "0"],
            ["bench", "--alloc-pages", "65537"],
        ] {
            let err = crate::cli::Cli::try_parse_from(std::iter::once("cp-hicache").chain(args))
                .unwrap_err();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{args:?}"
            );
        }
    }
}
