//! Source → shared library with the system C++ compiler, for the CPU-emulation executor.
//!
//! The emulation header's text is an input: it is written next to the source in a private
//! temporary build directory, which is the compiler's working directory, so `-include
//! cuda_emu.h` finds it and no absolute path leaks into the flags or the cache key. The
//! produced `.so` is returned as bytes; storing it is the cache's job.

use super::options::HostCcOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long one kernel may take to compile before the compiler is killed: a hung compile
/// holds the cache entry's lock, and every process waiting for that kernel would hang with
/// it. A kernel takes about a second.
pub const DEFAULT_COMPILE_TIMEOUT: Duration = Duration::from_secs(600);

/// The environment variable that sets the limit, in whole seconds
/// ([`JitConfig::from_env`](super::JitConfig::from_env)).
pub const COMPILE_TIMEOUT_ENV: &str = "CP_HICACHE_COMPILE_TIMEOUT";

/// The most one identity probe (`--version`, `-dumpmachine`) may run: they answer at once, and
/// `info`, `replay` and `bench` wait on them before anything else.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors of the host compiler.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HostCcError {
    /// The compiler could not be started or asked for its version.
    #[error("host C++ compiler `{program}` is not usable: {reason}")]
    Unavailable {
        /// The program (`$CXX` or `c++`).
        program: String,
        /// Why.
        reason: String,
    },
    /// The source does not compile.
    #[error("host compile of `{uri}` failed ({status}): {cmd}\n{stderr}")]
    Compile {
        /// Readable kernel name.
        uri: String,
        /// The full command line.
        cmd: String,
        /// Exit status description.
        status: String,
        /// Compiler diagnostics.
        stderr: String,
    },
    /// Preparing the build directory or reading the result failed.
    #[error("host compile of `{uri}`: I/O error on {path}: {reason}")]
    Io {
        /// Readable kernel name.
        uri: String,
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        reason: String,
    },
}

/// A located host C++ compiler and its identity.
#[derive(Debug, Clone)]
pub struct HostCompiler {
    program: String,
    identity: String,
    timeout: Duration,
}

/// A temporary build directory removed on drop.
struct BuildDir(PathBuf);

impl Drop for BuildDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const BUILD_DIR_PREFIX: &str = "cp-hicache-build-";

/// Removes the build directories that processes which no longer run left behind (a build
/// interrupted by a signal skips `Drop`).
fn sweep_stale_build_dirs(tmp: &Path) {
    super::cache::sweep_dead_pid_entries(tmp, BUILD_DIR_PREFIX, "a stale build directory");
}

fn build_dir(uri: &str) -> Result<BuildDir, HostCcError> {
    use std::os::unix::fs::DirBuilderExt as _;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| sweep_stale_build_dirs(&std::env::temp_dir()));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "{BUILD_DIR_PREFIX}{}-{}-{:08x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos
    ));
    // A fresh directory only this user can enter: one that already exists under this name
    // in the shared temp folder (planted, or left by a reused pid) is refused, not reused.
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| HostCcError::Io {
            uri: uri.to_string(),
            path: dir.clone(),
            reason: e.to_string(),
        })?;
    Ok(BuildDir(dir))
}

/// A command running the compiler `program`, without the AddressSanitizer runtime in its
/// `LD_PRELOAD`: a process that preloads it to load ASan kernel builds passes the preload on
/// to its children, and the compiler, run under ASan's leak checker, then exits non-zero.
pub fn compiler_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    if let Some(preload) = std::env::var_os("LD_PRELOAD") {
        let preload = preload.to_string_lossy().into_owned();
        let kept: Vec<&str> = preload
            .split([' ', ':'])
            .filter(|lib| !lib.is_empty() && !is_asan_runtime(lib))
            .collect();
        if kept.is_empty() {
            cmd.env_remove("LD_PRELOAD");
        } else {
            cmd.env("LD_PRELOAD", kept.join(":"));
        }
    }
    cmd
}

/// Kills the process group `child` leads (the compiler and everything it started), then
/// reaps `child`. Through `kill(1)`, which keeps this module free of `unsafe`; when that
/// cannot run, the driver alone is killed. Best effort: the group may be gone already.
fn kill_group(child: &mut std::process::Child) {
    let group = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !group.is_ok_and(|s| s.success()) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// Whether an `LD_PRELOAD` entry is the ASan runtime (`libasan.so`, `libasan.so.8`, ...).
fn is_asan_runtime(lib: &str) -> bool {
    std::path::Path::new(lib)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("libasan.so") || n.starts_with("libclang_rt.asan"))
}

/// How a compiler run ended.
enum Run {
    /// It exited.
    Exited(std::process::ExitStatus),
    /// It ran past the limit, and its process group was killed.
    Killed,
}

/// Spawns `cmd` in its own process group and waits until it exits or `timeout` passes (zero:
/// no limit); then kills the whole group (the driver's children, `cc1plus`, `as`, `ld`, are
/// the ones that hang in practice). Its output must go to files or to pipes it cannot fill;
/// the child comes back for reading them.
fn run_in_group(
    cmd: &mut Command,
    timeout: Duration,
) -> std::io::Result<(Run, std::process::Child)> {
    let mut child = std::os::unix::process::CommandExt::process_group(cmd, 0).spawn()?;
    let started = Instant::now();
    loop {
        match child.try_wait()? {
            Some(status) => return Ok((Run::Exited(status), child)),
            None if !timeout.is_zero() && started.elapsed() >= timeout => {
                kill_group(&mut child);
                return Ok((Run::Killed, child));
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

impl HostCompiler {
    /// The compiler to use: `program`, else `$CXX`, else `c++`; its identity is the first line
    /// of `<program> --version` plus `<program> -dumpmachine`. Each compile is limited to
    /// [`DEFAULT_COMPILE_TIMEOUT`], each probe to [`PROBE_TIMEOUT`].
    pub fn detect(program: Option<&str>) -> Result<HostCompiler, HostCcError> {
        Self::detect_within(program, DEFAULT_COMPILE_TIMEOUT)
    }

    /// [`detect`](Self::detect) with another limit on each compile (zero: no limit). The
    /// probes get at most [`PROBE_TIMEOUT`] (less when `timeout` is less): a compiler that
    /// hangs on `--version` is reported as unavailable instead of hanging every command that
    /// needs it.
    pub fn detect_within(
        program: Option<&str>,
        timeout: Duration,
    ) -> Result<HostCompiler, HostCcError> {
        let program = program
            .map(str::to_string)
            .or_else(|| std::env::var("CXX").ok().filter(|s| !s.trim().is_empty()))
            .unwrap_or_else(|| "c++".to_string());
        let unavailable = |reason: String| HostCcError::Unavailable {
            program: program.clone(),
            reason,
        };
        let probe_timeout = match timeout.is_zero() {
            true => PROBE_TIMEOUT,
            false => timeout.min(PROBE_TIMEOUT),
        };
        // One line of output each: a pipe cannot fill, so it is read after the exit, and
        // after the group is gone (a child left holding the pipe would block the read).
        let probe = |arg: &str| -> Result<String, String> {
            let mut cmd = compiler_command(&program);
            cmd.arg(arg)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            let (run, mut child) =
                run_in_group(&mut cmd, probe_timeout).map_err(|e| e.to_string())?;
            match run {
                Run::Exited(s) if s.success() => {
                    kill_group(&mut child);
                    let mut out = String::new();
                    if let Some(mut stdout) = child.stdout.take() {
                        std::io::Read::read_to_string(&mut stdout, &mut out)
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(out)
                }
                Run::Exited(s) => Err(format!("`{arg}` exited with {s}")),
                Run::Killed => Err(format!(
                    "`{arg}` did not finish within {} s",
                    probe_timeout.as_secs_f64()
                )),
            }
        };
        let version = probe("--version").map_err(unavailable)?;
        let version = version.lines().next().unwrap_or("").trim().to_string();
        // The same `--version` line names x86-64 and aarch64 builds alike; the target triple
        // keeps a shared cache from handing one machine the other's shared objects.
        let machine = probe("-dumpmachine")
            .map(|m| m.trim().to_string())
            .unwrap_or_else(|_| std::env::consts::ARCH.to_string());
        let identity = format!("{version} [{machine}]");
        Ok(HostCompiler {
            program,
            identity,
            timeout,
        })
    }

    /// The program run.
    pub fn program(&self) -> &str {
        &self.program
    }

    /// The first line of `--version` and the target triple (e.g.
    /// `c++ (Debian 12.2.0-14) 12.2.0 [x86_64-linux-gnu]`).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The full argument vector for one build (without the program).
    pub fn command_args(options: &HostCcOptions, source: &Path, output: &Path) -> Vec<String> {
        let mut args = options.to_args();
        args.extend([
            "-x".to_string(),
            "c++".to_string(),
            source.display().to_string(),
            "-o".to_string(),
            output.display().to_string(),
        ]);
        args
    }

    /// Compiles `source` (with `header` force-included) into a shared library; returns its bytes.
    pub fn compile(
        &self,
        uri: &str,
        source: &str,
        header: &str,
        options: &HostCcOptions,
    ) -> Result<Vec<u8>, HostCcError> {
        let dir = build_dir(uri)?;
        let io = |path: &Path, e: std::io::Error| HostCcError::Io {
            uri: uri.to_string(),
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let header_path = dir.0.join(&options.header_name);
        std::fs::write(&header_path, header).map_err(|e| io(&header_path, e))?;
        let src_name = PathBuf::from(format!("{uri}.cu"));
        let so_name = PathBuf::from(format!("{uri}.so"));
        let src_path = dir.0.join(&src_name);
        std::fs::write(&src_path, source).map_err(|e| io(&src_path, e))?;
        let args = Self::command_args(options, &src_name, &so_name);
        let cmd = format!("{} {}", self.program, args.join(" "));
        let failed = |status: String, stderr: String| HostCcError::Compile {
            uri: uri.to_string(),
            cmd: cmd.clone(),
            status,
            stderr,
        };
        // Diagnostics go to a file, not a pipe: nothing has to drain it while the compiler
        // runs, and a compiler killed on timeout leaves nothing to wait for.
        let log_path = dir.0.join("compile.log");
        let log = std::fs::File::create(&log_path).map_err(|e| io(&log_path, e))?;
        let log_err = log.try_clone().map_err(|e| io(&log_path, e))?;
        let mut cmd = compiler_command(&self.program);
        cmd.args(&args)
            .current_dir(&dir.0)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let status = match run_in_group(&mut cmd, self.timeout) {
            Ok((Run::Exited(status), _)) => status,
            Ok((Run::Killed, _)) => {
                return Err(failed(
                    format!(
                        "killed after {} s ({COMPILE_TIMEOUT_ENV} sets the limit)",
                        self.timeout.as_secs_f64()
                    ),
                    read_log(),
                ))
            }
            Err(e) => return Err(failed("not started or lost".to_string(), e.to_string())),
        };
        if !status.success() {
            return Err(failed(status.to_string(), read_log()));
        }
        let so_path = dir.0.join(&so_name);
        std::fs::read(&so_path).map_err(|e| io(&so_path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compiler_that_hangs_on_its_version_probe_is_unavailable_within_the_limit() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("hung-c++");
        std::fs::write(&fake, "#!/bin/sh\nsleep 60 & wait\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let started = Instant::now();
        let err =
            HostCompiler::detect_within(Some(fake.to_str().unwrap()), Duration::from_millis(300))
                .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "it waited for the sleep"
        );
        let msg = err.to_string();
        assert!(
            matches!(err, HostCcError::Unavailable { .. })
                && msg.contains("`--version` did not finish within 0.3 s"),
            "{msg}"
        );
        // A compiler without the probe at all is unavailable too, with the OS error.
        let missing = tmp.path().join("no-such-c++");
        let err = HostCompiler::detect_within(Some(missing.to_str().unwrap()), Duration::ZERO)
            .unwrap_err();
        assert!(matches!(err, HostCcError::Unavailable { .. }), "{err}");
    }

    #[test]
    fn a_hung_compile_is_killed_after_the_timeout() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("fake-c++");
        std::fs::write(
            &fake,
            "#!/bin/sh\ncase \"$1\" in\n--version) echo 'fake c++ 1.0' ;;\n\
             -dumpmachine) echo x86_64-linux-gnu ;;\n*) echo compiling >&2; sleep 60 & \
             echo $! > \"$0.child\"; wait ;;\nesac\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cc =
            HostCompiler::detect_within(Some(fake.to_str().unwrap()), Duration::from_millis(300))
                .unwrap();
        assert_eq!(cc.identity(), "fake c++ 1.0 [x86_64-linux-gnu]");
        let started = Instant::now();
        let err = cc
            .compile("k_hung", "", "", &HostCcOptions::default())
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "it waited for the sleep"
        );
        match &err {
            HostCcError::Compile { status, stderr, .. } => {
                assert!(status.starts_with("killed after 0.3 s"), "{status}");
                assert!(status.contains(COMPILE_TIMEOUT_ENV), "{status}");
                assert_eq!(stderr.trim(), "compiling", "the log so far is kept");
            }
            other => panic!("{other}"),
        }
        // The driver's child (cc1plus, in a real compile) is killed with it.
        let child = std::fs::read_to_string(tmp.path().join("fake-c++.child")).unwrap();
        let proc = std::path::Path::new("/proc").join(child.trim());
        let gone = (0..200).any(|_| {
            let state = std::fs::read_to_string(proc.join("stat")).unwrap_or_default();
            // Gone, or a zombie waiting for init to reap it.
            let dead = state.is_empty() || state.split(' ').nth(2) == Some("Z");
            if !dead {
                std::thread::sleep(Duration::from_millis(10));
            }
            dead
        });
        assert!(
            gone,
            "the compiler's child {} outlived the timeout",
            child.trim()
        );
    }

    #[test]
    fn only_the_asan_runtime_is_recognised_in_a_preload() {
        assert!(is_asan_runtime(
            "/usr/lib/gcc/x86_64-linux-gnu/12/libasan.so"
        ));
        assert!(is_asan_runtime("libasan.so.8"));
        assert!(is_asan_runtime("/x/libclang_rt.asan-x86_64.so"));
        assert!(!is_asan_runtime("/opt/libasanity.so"));
        assert!(!is_asan_runtime("/usr/lib/libjemalloc.so"));
    }

    #[test]
    fn stale_build_dirs_of_dead_processes_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        // No process has pid u32::MAX - 1 (above Linux's pid_max); this one is alive.
        let dead = tmp
            .path()
            .join(format!("{BUILD_DIR_PREFIX}{}-0-0", u32::MAX - 1));
        let alive = tmp
            .path()
            .join(format!("{BUILD_DIR_PREFIX}{}-0-0", std::process::id()));
        let other = tmp.path().join("cp-hicache-something-else");
        for d in [&dead, &alive, &other] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("k.cu"), "x").unwrap();
        }
        sweep_stale_build_dirs(tmp.path());
        assert!(!dead.exists());
        assert!(alive.exists() && other.exists());
    }
}
