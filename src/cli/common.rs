//! Options shared by several commands, defined once and flattened into each command's
//! arguments: the executor choice and the measurement sizes of `tune` and `bench`.

use std::path::Path;

use crate::exec::Backend;
use crate::kernels::Deployment;
use crate::tuning::Sizes;

/// Checks, before the work starts, that an output file named on the command line (`--json`,
/// `--plot`) can be written, so a long run never ends in "cannot write" with its results
/// lost. An existing file is left as it is (opened for append, not truncated; a read-only
/// report is refused rather than replaced); a file this check creates is removed again. The
/// file is written through a temporary file beside it ([`write_output`]), so its folder must
/// take new files too. The path is the user's input, so a failure is a usage error (exit
/// status 2).
pub fn check_output(path: &Path) -> Result<(), crate::Error> {
    let target = resolve_link(path);
    if !replaced_atomically(&target) {
        // A device or a pipe (`/dev/null`, `/dev/stdout`) is written in place.
        return open_for_append(path);
    }
    if target.file_name().and_then(|n| n.to_str()).is_none() {
        return Err(crate::Error::Usage(format!(
            "cannot write {}: not a UTF-8 file name",
            path.display()
        )));
    }
    open_for_append(path)?;
    probe_folder(folder_of(&target), path)
}

/// Opens `path` for append (creating it, and removing it again if it did not exist).
fn open_for_append(path: &Path) -> Result<(), crate::Error> {
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

/// Whether an output at `target` (links resolved) is written as a new file renamed over it:
/// a regular file or nothing yet. Anything else (a device such as `/dev/null`, a pipe) must
/// be written in place, never replaced.
fn replaced_atomically(target: &Path) -> bool {
    std::fs::metadata(target).map_or(true, |m| m.is_file())
}

/// [`check_output`] for every output given, after refusing an output that is the same file
/// as one of the command's inputs (which it would overwrite: `replay --trace t.jsonl --json
/// t.jsonl`) or as another output (one report would replace the other: `bench --json x --plot
/// x`). Each entry is the flag and its path, if given. Paths are compared as files: by their
/// canonical paths, or for a file that does not exist yet by its folder's canonical path and
/// its name, so `x.json`, `./x.json` and a link to it are all the same file. A collision is a
/// usage error (exit status 2) naming both flags and the path.
pub fn check_outputs(
    outputs: &[(&str, Option<&Path>)],
    inputs: &[(&str, Option<&Path>)],
) -> Result<(), crate::Error> {
    let outputs = given_files(outputs);
    let inputs = given_files(inputs);
    for (i, (flag, path, id)) in outputs.iter().enumerate() {
        if let Some((input, ..)) = inputs.iter().find(|(_, _, other)| other == id) {
            return Err(crate::Error::Usage(format!(
                "{flag} {} is the {input} input: writing it would overwrite that file; \
                 name another file for {flag}",
                path.display()
            )));
        }
        if let Some((other, ..)) = outputs[..i].iter().find(|(_, _, other)| other == id) {
            return Err(crate::Error::Usage(format!(
                "{other} and {flag} both name {}: one output would overwrite the other; \
                 give each its own file",
                path.display()
            )));
        }
    }
    for (_, path, _) in &outputs {
        check_output(path)?;
    }
    Ok(())
}

/// The files given among `list`, each with its flag and identity.
fn given_files<'a>(list: &[(&str, Option<&'a Path>)]) -> Vec<(String, &'a Path, FileIdentity)> {
    list.iter()
        .filter_map(|&(flag, p)| p.map(|p| (flag.to_string(), p, FileIdentity::of(p))))
        .collect()
}

/// What identifies a file for [`check_outputs`]: its canonical path (links and `..`
/// resolved) when it exists, else its folder's canonical path joined with its name, else the
/// path made absolute; and for an existing file its device and inode, so two hard links to
/// one file are the same file too. A device or a pipe (`/dev/null`) is never the same file
/// as another path: writing it twice, or reading and writing it, replaces nothing.
#[derive(Debug)]
struct FileIdentity {
    path: std::path::PathBuf,
    inode: Option<(u64, u64)>,
    special: bool,
}

impl FileIdentity {
    fn of(path: &Path) -> FileIdentity {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok();
        let inode = meta.as_ref().map(|m| (m.dev(), m.ino()));
        let special = meta.is_some_and(|m| !m.is_file());
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| {
            match (path.file_name(), std::fs::canonicalize(folder_of(path))) {
                (Some(name), Ok(dir)) => dir.join(name),
                _ => std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
            }
        });
        FileIdentity {
            path,
            inode,
            special,
        }
    }
}

impl PartialEq for FileIdentity {
    fn eq(&self, other: &FileIdentity) -> bool {
        if self.special || other.special {
            return false;
        }
        match (self.inode, other.inode) {
            (Some(a), Some(b)) => a == b,
            _ => self.path == other.path,
        }
    }
}

/// `path`, or where it points when it is a symbolic link: the file an output replaces.
fn resolve_link(path: &Path) -> std::path::PathBuf {
    if path.is_symlink() {
        std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
    } else {
        path.to_path_buf()
    }
}

/// The folder a file at `path` is written in (`.` for a bare file name).
fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Checks that `dir` takes new files (the temporary file of an atomic write of `file`), by
/// creating and removing a probe file.
fn probe_folder(dir: &Path, file: &Path) -> Result<(), crate::Error> {
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
                file.display(),
                dir.display()
            ))
        })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Checks, before a tuning run, the tuning file it will merge into: it must be a file that
/// exists and parses (its entries are kept), or not exist yet; a directory is refused. Its
/// folder must take new files (the merge's lock and temporary file), as for `--json`: with
/// `explicit` (`tune --out`) that folder must exist; the default file's folder (the cache
/// directory) is created when the merge writes it, so only one that exists already is probed.
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
    // The merge writes a temporary file beside the target and renames it: probe the folder.
    let dir = folder_of(path);
    if explicit {
        return probe_folder(dir, path);
    }
    if !dir.exists() {
        return Ok(());
    }
    probe_folder(dir, path).map_err(|e| {
        crate::Error::Usage(format!(
            "{e}; it is the default tuning file tune merges its results into: \
             pass --out FILE or set CP_HICACHE_CACHE_DIR to a writable folder"
        ))
    })
}

/// Writes `text` to an output file named on the command line, atomically (the JIT cache's
/// [`write_atomic`](crate::jit::cache::write_atomic): a temporary file beside it, fsynced, then
/// renamed): a failed write (a full disk) leaves an earlier report whole and no partial file.
/// A symbolic link is followed, so the file it points to is replaced, as a plain write would;
/// a device or a pipe (`/dev/null`, `/dev/stdout`) is written in place.
pub fn write_output(path: &Path, text: &str) -> Result<(), crate::Error> {
    let io_error = |source| crate::Error::Io {
        context: format!("writing {}", path.display()),
        source,
    };
    let target = resolve_link(path);
    if !replaced_atomically(&target) {
        return std::fs::write(path, text).map_err(io_error);
    }
    let Some(name) = target.file_name().and_then(|n| n.to_str()) else {
        return Err(crate::Error::Usage(format!(
            "cannot write {}: not a UTF-8 file name",
            path.display()
        )));
    };
    crate::jit::cache::write_atomic(folder_of(&target), name, text.as_bytes())
        .map(drop)
        .map_err(|e| {
            io_error(match e {
                crate::jit::cache::CacheError::Io { source, .. } => source,
                other => std::io::Error::other(other.to_string()),
            })
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

    /// `--storage` works under every layout (records in parts where a page is split).
    #[test]
    fn storage_help_refuses_no_layout() {
        let h = help("replay", "storage");
        assert!(h.contains("token-interleave"), "{h}");
        for stale in ["Not with --layout", "not built yet"] {
            assert!(!h.contains(stale), "{stale:?} in {h}");
        }
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

    /// Names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn outputs_are_replaced_whole_through_a_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let report = dir.path().join("report.json");
        std::fs::write(&report, "an earlier, longer report\n").unwrap();
        let before = std::fs::metadata(&report).unwrap();
        write_output(&report, "new\n").unwrap();
        assert_eq!(std::fs::read_to_string(&report).unwrap(), "new\n");
        // Replaced by a rename (a new inode), not truncated and rewritten in place.
        use std::os::unix::fs::MetadataExt;
        assert_ne!(std::fs::metadata(&report).unwrap().ino(), before.ino());
        assert_eq!(
            names(dir.path()),
            ["report.json"],
            "a temporary file was left"
        );
        // A link is followed: the file it points to gets the report, the link stays.
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink("report.json", &link).unwrap();
        check_output(&link).unwrap();
        write_output(&link, "via the link\n").unwrap();
        assert!(link.is_symlink());
        assert_eq!(std::fs::read_to_string(&report).unwrap(), "via the link\n");
        // A device is written in place, never replaced by a file.
        check_output(Path::new("/dev/null")).unwrap();
        write_output(Path::new("/dev/null"), "discarded").unwrap();
        assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
        // A failed write is an I/O error naming the file; nothing is left behind.
        let err = write_output(&dir.path().join("missing/r.json"), "x").unwrap_err();
        assert!(err.to_string().contains("missing/r.json"), "{err}");
        assert_eq!(names(dir.path()), ["link.json", "report.json"]);
    }

    #[test]
    fn an_output_may_not_be_an_input_or_another_output() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.jsonl");
        std::fs::write(&trace, "{}\n").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let linked = dir.path().join("hard.jsonl");
        std::fs::hard_link(&trace, &linked).unwrap();
        let fresh = dir.path().join("x.json");
        let fresh_again = dir.path().join("sub/../x.json");
        let input = |p| [("--trace", Some(trace.as_path())), ("--tuning", p)];
        for (outputs, inputs, needles) in [
            (
                vec![("--json", Some(trace.as_path()))],
                input(None),
                ["--json", "--trace input"],
            ),
            (
                vec![("--json", Some(linked.as_path()))],
                input(None),
                ["--json", "--trace input"],
            ),
            (
                vec![("--json", Some(fresh.as_path()))],
                input(Some(fresh_again.as_path())),
                ["--json", "--tuning input"],
            ),
            (
                vec![
                    ("--json", Some(fresh.as_path())),
                    ("--plot", Some(fresh_again.as_path())),
                ],
                input(None),
                ["--json and --plot both name", "sub/../x.json"],
            ),
        ] {
            let err = check_outputs(&outputs, &inputs).unwrap_err();
            assert!(err.is_usage(), "{err}");
            for n in needles {
                assert!(err.to_string().contains(n), "{n:?} not in: {err}");
            }
        }
        assert_eq!(std::fs::read_to_string(&trace).unwrap(), "{}\n");
        assert!(!fresh.exists());
        // Distinct files, absent options and a device given twice are fine.
        let other = dir.path().join("y.svg");
        check_outputs(
            &[("--json", Some(&fresh)), ("--plot", Some(&other))],
            &input(None),
        )
        .unwrap();
        check_outputs(&[("--json", None), ("--plot", None)], &input(None)).unwrap();
        let null = Path::new("/dev/null");
        check_outputs(&[("--json", Some(null)), ("--plot", Some(null))], &[]).unwrap();
        assert_eq!(names(dir.path()), ["hard.jsonl", "sub", "t.jsonl"]);
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

    /// The default tuning file's folder, when it exists, must take new files too: tune would
    /// otherwise run to the end and then lose its results.
    #[test]
    fn an_unwritable_default_tuning_folder_is_refused_up_front() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let ro = dir.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        let privileged = std::fs::write(ro.join("probe"), "").is_ok();
        let result = check_merge_target(&ro.join("tuning.json"), false);
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
        if privileged {
            eprintln!("running as a user whom chmod does not restrict (root): not checked");
            return;
        }
        let err = result.unwrap_err();
        assert!(err.is_usage(), "{err}");
        for needle in [
            "cannot write",
            "ro/tuning.json",
            "CP_HICACHE_CACHE_DIR",
            "--out",
        ] {
            assert!(err.to_string().contains(needle), "{needle:?} not in: {err}");
        }
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
