//! `cp-hicache replay --processes`: each CP rank in a process of its own, as engine processes
//! run them, with nothing but this binary. The launcher re-runs the binary once per rank
//! with the same arguments and `MEMBER_ENV` naming the rank; the ranks agree through a
//! [`FileGroup`] in a temporary folder and map each other's pools (shared memory on the CPU,
//! CUDA IPC and interprocess events on a GPU), which one process with every rank cannot
//! exercise. `python -m cp_hicache.replay` does the same over `torch.distributed`.

use super::{check_replay_args, replay_rank, ReplayArgs};
use crate::group::FileGroup;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Names a rank process's place in the group: `<rank> <size> <folder>`.
pub const MEMBER_ENV: &str = "CP_HICACHE_REPLAY_MEMBER";

/// Seconds a rank waits for its peers in any one round before the run fails.
pub const TIMEOUT_ENV: &str = "CP_HICACHE_GROUP_TIMEOUT";

/// A command every rank process is started under, split at whitespace, each `{rank}` in it
/// replaced by the rank: `numactl --cpunodebind={rank} --membind={rank}`, `taskset -c
/// {rank}`. It must run the rest of its command line in its own process (`exec`), as those
/// do, so that stopping it stops the rank.
pub const WRAPPER_ENV: &str = "CP_HICACHE_REPLAY_WRAPPER";

/// How long the launcher lets the other ranks end on their own once one has died (they
/// normally fail within a round: the dead rank's abort file, or its missing round).
const GRACE: Duration = Duration::from_secs(30);

/// This process's rank when the launcher started it as one.
pub(super) struct Member {
    rank: u8,
    size: usize,
    dir: PathBuf,
}

impl Member {
    /// The rank `MEMBER_ENV` names, if this process is a rank process.
    pub(super) fn from_env() -> Result<Option<Member>, crate::Error> {
        let Some(text) = std::env::var_os(MEMBER_ENV) else {
            return Ok(None);
        };
        let text = text.to_string_lossy();
        let bad = || crate::Error::Usage(format!("{MEMBER_ENV}={text}: not '<rank> <size> <dir>'"));
        let mut parts = text.splitn(3, ' ');
        let rank = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
        let size = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let dir = PathBuf::from(parts.next().ok_or_else(bad)?);
        Ok(Some(Member { rank, size, dir }))
    }

    /// Runs this rank's replay; only rank 0 draws a progress bar and prints the report.
    pub(super) fn run(self, args: &ReplayArgs) -> Result<ExitCode, crate::Error> {
        let group = FileGroup::new(self.dir, self.rank, self.size, group_timeout()?);
        let mut args = args.clone();
        args.quiet |= self.rank != 0;
        replay_rank(&args, Box::new(group))
    }
}

/// The words of [`WRAPPER_ENV`], if it is set.
fn wrapper() -> Result<Option<Vec<String>>, crate::Error> {
    let Some(text) = std::env::var_os(WRAPPER_ENV) else {
        return Ok(None);
    };
    let text = text.to_string_lossy();
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if words.is_empty() {
        return Err(crate::Error::Usage(format!(
            "{WRAPPER_ENV} is set but names no command"
        )));
    }
    Ok(Some(words))
}

/// The program rank `rank`'s process starts with, and the arguments before this binary's:
/// this binary itself, or the wrapper's first word with the rest of its words.
fn member_command(exe: &std::path::Path, wrapper: Option<&[String]>, rank: u8) -> Command {
    let Some(words) = wrapper else {
        return Command::new(exe);
    };
    let mut words = words.iter().map(|w| w.replace("{rank}", &rank.to_string()));
    let mut cmd = Command::new(words.next().expect("a wrapper has a word"));
    cmd.args(words).arg(exe);
    cmd
}

fn group_timeout() -> Result<Duration, crate::Error> {
    let Some(text) = std::env::var_os(TIMEOUT_ENV) else {
        return Ok(Duration::from_secs(300));
    };
    let text = text.to_string_lossy();
    text.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            crate::Error::Usage(format!(
                "{TIMEOUT_ENV}={text} is not a positive number of seconds"
            ))
        })
}

/// The launcher: checks the arguments once, starts `--cp` rank processes, waits for them
/// and returns their common exit status (1, saying which rank, when one died or they
/// ended differently). A rank whose process cannot be started fails the run naming it,
/// once the ranks started before it have ended: the group is aborted in its name, so they
/// fail their first round, release what they made and exit (those still running after
/// `GRACE` are killed).
pub(super) fn launch(args: &ReplayArgs) -> Result<ExitCode, crate::Error> {
    check_replay_args(args)?;
    group_timeout()?;
    let wrapper = wrapper()?;
    let exe = std::env::current_exe()
        .map_err(|e| io_error("cannot find this binary to start ranks", e))?;
    let dir = GroupDir::new()?;
    let argv: Vec<_> = std::env::args_os().skip(1).collect();
    let mut children: Vec<Child> = Vec::with_capacity(usize::from(args.cp));
    for r in 0..args.cp {
        let mut cmd = member_command(&exe, wrapper.as_deref(), r);
        let spawned = cmd
            .args(&argv)
            .env(MEMBER_ENV, format!("{r} {} {}", args.cp, dir.0.display()))
            .stdin(Stdio::null())
            .stdout(if r == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(e) => {
                let program = cmd.get_program().to_string_lossy().into_owned();
                let why = format!("its process ({program}) could not be started: {e}");
                if let Err(abort) = FileGroup::abort_unstarted(&dir.0, r, &why) {
                    tracing::warn!("could not abort the group for the started ranks: {abort}");
                    stop(&mut children);
                }
                let codes = wait_all(&mut children, Some(Instant::now()));
                return Err(io_error(
                    &format!(
                        "cannot start rank {r} ({program}); the {} started before it ended \
                         (exit statuses by rank: {})",
                        children.len(),
                        describe(&codes).join(", ")
                    ),
                    e,
                ));
            }
        }
    }
    let codes = wait_all(&mut children, None);
    conclude(&codes)
}

fn io_error(context: &str, source: std::io::Error) -> crate::Error {
    crate::Error::Io {
        context: context.to_string(),
        source,
    }
}

/// The group's folder, made fresh under the temporary directory and removed with what the
/// ranks left in it.
struct GroupDir(PathBuf);

impl GroupDir {
    fn new() -> Result<GroupDir, crate::Error> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!("cp-hicache-group.{}.{nanos}", std::process::id()));
        std::fs::create_dir(&path).map_err(|e| {
            io_error(
                &format!("cannot make the group's folder {}", path.display()),
                e,
            )
        })?;
        Ok(GroupDir(path))
    }
}

impl Drop for GroupDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits for every rank; once one has died by a signal (or since `died_at`, a rank that
/// never started), the others get `GRACE` to end before they are killed.
fn wait_all(children: &mut [Child], died_at: Option<Instant>) -> Vec<Option<ExitStatus>> {
    let mut codes: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut died_at = died_at;
    while codes.iter().any(Option::is_none) {
        for (child, code) in children.iter_mut().zip(codes.iter_mut()) {
            if code.is_none() {
                if let Ok(Some(status)) = child.try_wait() {
                    *code = Some(status);
                    if status.code().is_none() && died_at.is_none() {
                        died_at = Some(Instant::now());
                    }
                }
            }
        }
        if died_at.is_some_and(|t| t.elapsed() > GRACE) {
            stop(children);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    codes
}

fn stop(children: &mut [Child]) {
    for child in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The run's exit status from the ranks': theirs when they agree; 1, saying why, when a rank
/// was killed or the ranks ended differently.
fn conclude(codes: &[Option<ExitStatus>]) -> Result<ExitCode, crate::Error> {
    let statuses: Vec<Option<i32>> = codes.iter().map(|c| c.and_then(|s| s.code())).collect();
    let described = describe(codes);
    if let Some(r) = statuses.iter().position(Option::is_none) {
        eprintln!(
            "error: rank {r} was killed during the replay; the run is incomplete (exit \
             statuses by rank: {})",
            described.join(", ")
        );
        return Ok(ExitCode::FAILURE);
    }
    let first = statuses[0].expect("checked above");
    if statuses.iter().all(|&s| s == Some(first)) {
        return Ok(ExitCode::from(first.clamp(0, 255) as u8));
    }
    eprintln!(
        "error: the ranks ended differently (exit statuses by rank: {})",
        described.join(", ")
    );
    Ok(ExitCode::FAILURE)
}

/// Each rank's exit status as the launcher reports it: its code, or `killed`.
fn describe(codes: &[Option<ExitStatus>]) -> Vec<String> {
    codes
        .iter()
        .map(|c| {
            c.and_then(|s| s.code())
                .map_or("killed".to_string(), |code| code.to_string())
        })
        .collect()
}
