//! The `cp-hicache` command line: argument types (parsed without side effects) and the
//! dispatch to each command. `main` only maps the result to an exit status.

/// `print!` through [`write_stdout`]: a write error is returned instead of a panic, and a
/// reader that closed the pipe early (`cp-hicache replay | head`) only stops the printing.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*), false)?
    };
}

/// `println!` through [`write_stdout`]; see `out!`.
macro_rules! outln {
    () => {
        $crate::cli::write_stdout(format_args!(""), true)?
    };
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*), true)?
    };
}

mod bench;
mod common;
mod compile;
mod info;
mod render;
mod replay;
mod tune;

pub use replay::{
    check_rank_memory, check_replay_args, replay_rank, replay_rank_with, ModelArg,
    ObjectStoreOpener, ReplayArgs, OBJECT_STORE_SCHEME,
};

/// Set once standard output's reader has gone away: later output is dropped.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes to standard output. A closed pipe is not the command's failure: the output is
/// dropped from then on and the command runs to its end, so its files (`--json`) are still
/// written and its exit status is still its verdict (a mismatch stays 1 under
/// `| head`). Any other write error is returned.
fn write_stdout(args: std::fmt::Arguments<'_>, newline: bool) -> Result<(), crate::Error> {
    use std::io::Write as _;
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    let written = out.write_fmt(args).and_then(|()| {
        if newline {
            out.write_all(b"\n")
        } else {
            Ok(())
        }
    });
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(source) => Err(crate::Error::Io {
            context: "writing to standard output".into(),
            source,
        }),
        Ok(()) => Ok(()),
    }
}

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// Context-parallel aware hierarchical KV cache: replay, render, compile, bench, tune, info.
#[derive(Debug, Parser)]
#[command(
    name = "cp-hicache",
    version,
    about,
    long_about = LONG_ABOUT,
    after_long_help = ENVIRONMENT,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Replay's options, for a command line without a command: replay is the default, so
    /// `cp-hicache --conversations 4` must mean what `cp-hicache replay --conversations 4`
    /// does rather than be rejected.
    #[command(flatten, next_help_heading = "Replay options (without a command)")]
    pub replay: ReplayArgs,
}

const LONG_ABOUT: &str = "\
cp-hicache is the KV-cache layer for context-parallel (CP) serving: a hierarchical cache \
(device pages backed up to host memory, loaded back on a prefix hit) in which every page keeps \
the CP rank that owns it. Its data paths are CUDA kernels rendered from templates, compiled \
with NVRTC, and run on the CPU through an emulation executor when no GPU is present.

Without a command, cp-hicache runs `replay`, and replay's options (below) may be given \
without the word `replay`; they cannot be combined with another command.

Set RUST_LOG=cp_hicache=info to see every JIT event.";

/// The environment variables, for `--help` (docs/CLI.md has the details).
const ENVIRONMENT: &str = "\
Environment:
  CP_HICACHE_CACHE_DIR        JIT cache directory (default: the user cache dir)
  CP_HICACHE_JIT=off          a kernel missing from the cache is an error, not compiled
  CP_HICACHE_NVRTC            path of libnvrtc.so.12 (or its folder)
  CUDA_HOME, CUDA_PATH        CUDA toolkits searched for NVRTC after CP_HICACHE_NVRTC
  CXX                         host C++ compiler for the CPU executor (default: c++)
  CP_HICACHE_COMPILE_TIMEOUT  seconds a host kernel compile may run (default 600)
  CP_HICACHE_EMU_ORDER        forward or reverse: the CPU executor's block and thread order
  CP_HICACHE_EMU_SANITIZE     none or address: emulated kernels built with AddressSanitizer
  CP_HICACHE_DEBUG_ALLOC=1    check allocator invariants on every operation
  CP_HICACHE_GROUP_TIMEOUT    seconds one collective call among the ranks may wait (300)
  RUST_LOG                    log filter, e.g. cp_hicache=info for every JIT event
A misspelt JIT, compile-timeout, group-timeout or emulator value is an input error (exit\nstatus 2).";

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a prefix-sharing workload through the CP cluster, verifying every request
    /// byte for byte (the default command).
    Replay(ReplayArgs),
    /// Show the version, the default layout, and what was found on this machine (C++
    /// compiler, NVRTC, CUDA driver, cache directory).
    Info(info::InfoArgs),
    /// Render the kernels of reference deployments to CUDA C files (the `generated/` tree), or
    /// check that a directory holds exactly that render.
    Render(render::RenderArgs),
    /// Compile every kernel of a deployment (NVRTC or the host compiler) through the JIT cache
    /// and print a resource table: registers, spills, stack, shared memory, time, cache hit.
    Compile(compile::CompileArgs),
    /// Time every launch-shape candidate of a deployment's kernels on this executor and merge
    /// the fastest into a tuning file keyed by device and compiler.
    Tune(tune::TuneArgs),
    /// Time transfer, materialise, select and release (default and tuned shapes) against
    /// baselines measured in the same run; `--check` compares every family with the references.
    Bench(bench::BenchArgs),
}

/// Runs a parsed command line. Errors are returned, not printed, so `main` owns the exit
/// status.
pub fn run(cli: Cli) -> Result<ExitCode, crate::Error> {
    match cli.command {
        Some(Command::Replay(args)) => replay::run(&args),
        Some(Command::Info(args)) => info::run(&args),
        Some(Command::Render(args)) => render::run(&args),
        Some(Command::Compile(args)) => compile::run(&args),
        Some(Command::Tune(args)) => tune::run(&args),
        Some(Command::Bench(args)) => bench::run(&args),
        None => replay::run(&cli.replay),
    }
}
