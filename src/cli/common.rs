//! Options shared by several commands, defined once and flattened into each command's
//! arguments: the executor choice and the measurement sizes of `tune` and `bench`.

use crate::exec::Backend;
use crate::tuning::Sizes;

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
