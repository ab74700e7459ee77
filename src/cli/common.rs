//! Options shared by several commands, defined once and flattened into each command's
//! arguments: the executor choice and the measurement sizes of `tune` and `bench`.

use std::path::Path;

use crate::exec::Backend;
use crate::tuning::Sizes;

/// Checks, before the work starts, that an output file named on the command line (`--json`,
/// `--plot`) can be written, so a long run never ends in "cannot write" with its results
/// lost. An existing file is left as it is (opened for append, not truncated); a file this
/// check creates is removed again.
pub fn check_output(path: &Path) -> Result<(), crate::Error> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|source| crate::Error::Io {
            context: format!("cannot write {}", path.display()),
            source,
        })?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
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

/// `--pages`, `--layers`, `--repeats`: overrides of the quick/full measurement sizes. A
/// command whose wording differs keeps its own help text with `mut_arg`; the meaning is the
/// same everywhere (see [`SizeArgs::apply`]).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SizeArgs {
    /// Pages per copy launch (overrides the quick/full default).
    #[arg(long, value_name = "N")]
    pub pages: Option<u32>,
    /// Layers per copy launch (overrides the quick/full default).
    #[arg(long, value_name = "N")]
    pub layers: Option<u32>,
    /// Timed repeats per candidate; the median is kept.
    #[arg(long, value_name = "N")]
    pub repeats: Option<u32>,
}

impl SizeArgs {
    /// Overrides the sizes that were given; zero counts as one.
    pub fn apply(&self, sizes: &mut Sizes) {
        if let Some(p) = self.pages {
            sizes.pages = p.max(1);
        }
        if let Some(l) = self.layers {
            sizes.layers = l.max(1);
        }
        if let Some(r) = self.repeats {
            sizes.repeats = r.max(1);
        }
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
        assert!(
            check_output(dir.path()).is_err(),
            "a directory is not an output file"
        );
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
                "Pages per copy launch (overrides the quick/full default)"
            );
        }
        assert_eq!(
            help("tune", "layers"),
            "Layers per copy launch (overrides the quick/full default)"
        );
        assert_eq!(
            help("tune", "repeats"),
            "Timed repeats per candidate; the median is kept"
        );
        assert_eq!(help("bench", "layers"), "Layers per copy launch");
        assert_eq!(
            help("bench", "repeats"),
            "Timed repeats; the median is reported"
        );
    }

    #[test]
    fn size_args_override_only_what_was_given_and_at_least_one() {
        let mut s = Sizes::quick();
        let before = s;
        SizeArgs::default().apply(&mut s);
        assert_eq!(s, before);
        SizeArgs {
            pages: Some(0),
            layers: None,
            repeats: Some(5),
        }
        .apply(&mut s);
        assert_eq!(s.pages, 1);
        assert_eq!(s.layers, before.layers);
        assert_eq!(s.repeats, 5);
        assert_eq!(s.warmup, before.warmup);
    }
}
