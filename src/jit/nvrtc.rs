//! Source → CUBIN through NVRTC (cudarc, loaded dynamically). This file never touches the
//! filesystem beyond locating the library and hashing it (once per process, for its identity),
//! and it is the only place in the JIT with `unsafe`.
//!
//! cudarc panics when it cannot find libnvrtc, so every path here first makes sure the library
//! is loaded and that `cudarc::nvrtc::sys::is_culib_present()` agrees, and otherwise returns
//! [`NvrtcError::Unavailable`] listing the places searched.
//!
//! Discovery order: `CP_HICACHE_NVRTC` (a file, or a directory searched like a prefix or a
//! site-packages dir), `CUDA_HOME` / `CUDA_PATH` (`lib64/`, `lib/`), `/usr/local/cuda/lib64`,
//! the `nvidia-cuda-nvrtc-cu12` wheel in the Python site dirs (`~/.local`, virtualenv/conda,
//! system dirs, then what `python3` itself reports), and finally the dynamic linker's own
//! search by soname. A library found by path is opened with `RTLD_NOW | RTLD_GLOBAL` and its
//! handle is kept for the life of the process, so cudarc's later `dlopen("libnvrtc.so.12")`
//! resolves to the already-loaded object.

use super::options::NvrtcOptions;
use cudarc::nvrtc::sys;
use serde::{Deserialize, Serialize};
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The message printed by tests and tools when NVRTC is missing (and `CP_HICACHE_NVRTC` is
/// not set; see [`unavailable_hint`]).
pub const NOT_FOUND_HINT: &str =
    "NVRTC not found: run scripts/install-nvrtc.sh or set CP_HICACHE_NVRTC";

/// The variable naming the libnvrtc to use (a file, or a folder searched like a prefix).
pub const NVRTC_ENV: &str = "CP_HICACHE_NVRTC";

/// The first line of an "NVRTC unavailable" error: [`NOT_FOUND_HINT`], or when
/// `CP_HICACHE_NVRTC` names a library that could not be used (`requested`, from
/// [`NvrtcError::Unavailable`]), that path and why, e.g. the `dlopen` error.
pub fn unavailable_hint(requested: Option<&str>) -> String {
    match requested {
        None => NOT_FOUND_HINT.to_string(),
        Some(r) if r.contains(CONFLICT) => format!("NVRTC unavailable: {r}"),
        Some(r) => format!(
            "NVRTC unavailable: {r}; point {NVRTC_ENV} at libnvrtc.so.12 or its folder \
             (scripts/install-nvrtc.sh installs one and prints its path)"
        ),
    }
}

const SONAMES: &[&str] = &["libnvrtc.so.12", "libnvrtc.so"];
const WHEEL_SUBDIR: &str = "nvidia/cuda_nvrtc/lib";

/// Errors of the NVRTC compiler.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NvrtcError {
    /// No usable libnvrtc was found.
    #[error("{} (searched: {})", unavailable_hint(requested.as_deref()), searched.join(", "))]
    Unavailable {
        /// Every place looked at, in order.
        searched: Vec<String>,
        /// When `CP_HICACHE_NVRTC` is set: that it could not be used, with its value and why
        /// (`CP_HICACHE_NVRTC=/etc/passwd cannot be used: dlopen failed: …`).
        requested: Option<String>,
    },
    /// The source does not compile; `log` is NVRTC's full program log.
    #[error("NVRTC failed to compile `{uri}` with {options:?}:\n{log}")]
    Compile {
        /// Readable kernel name.
        uri: String,
        /// Options used.
        options: Vec<String>,
        /// The full compiler log.
        log: String,
    },
    /// An NVRTC API call failed outside compilation proper.
    #[error("NVRTC call {call} failed for `{uri}`: {code}")]
    Api {
        /// Readable kernel name (empty for global calls).
        uri: String,
        /// The NVRTC function.
        call: &'static str,
        /// The NVRTC result code.
        code: String,
    },
    /// The source or an option holds an interior NUL byte.
    #[error("`{uri}`: source or option contains a NUL byte")]
    Nul {
        /// Readable kernel name.
        uri: String,
    },
}

/// Per-kernel resources reported by ptxas `-v`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceReport {
    /// Registers per thread.
    pub registers: u32,
    /// Spill stores + spill loads, in bytes.
    pub spill_bytes: u32,
    /// Stack frame, in bytes.
    pub stack_bytes: u32,
    /// Static shared memory, in bytes.
    pub shared_bytes: u32,
    /// Constant bank 0 usage, in bytes, when reported.
    pub const_bytes: Option<u32>,
}

/// What one successful compile produced.
#[derive(Debug, Clone)]
pub struct NvrtcOutput {
    /// The CUBIN.
    pub cubin: Vec<u8>,
    /// NVRTC's program log (ptxas info and warnings).
    pub log: String,
    /// The parsed resource report of the entry point, when ptxas printed one.
    pub report: Option<ResourceReport>,
}

/// A loaded NVRTC library. Cheap to copy; the library itself stays loaded for the process.
#[derive(Debug, Clone)]
pub struct NvrtcCompiler {
    library: Option<PathBuf>,
    version: (i32, i32),
    digest: Option<String>,
}

/// Hex digits of the library's SHA-256 kept in its identity.
const DIGEST_HEX: usize = 16;

/// The short SHA-256 of a library file's bytes, or `None` when it cannot be read. Two builds
/// with the same `major.minor` (a patch release, a vendor rebuild) differ here, and may emit
/// different CUBINs.
pub fn library_digest(path: &Path) -> Option<String> {
    use sha2::{Digest, Sha256};
    let mut file = std::fs::File::open(path).ok()?;
    let mut h = Sha256::new();
    std::io::copy(&mut file, &mut h).ok()?;
    let mut hex = hex::encode(h.finalize());
    hex.truncate(DIGEST_HEX);
    Some(hex)
}

/// The identity string of an NVRTC of `version` whose library file hashes to `digest`
/// (`nvrtc 12.9 (sha256 0123456789abcdef)`; without a digest, `nvrtc 12.9`).
pub fn identity_string(version: (i32, i32), digest: Option<&str>) -> String {
    match digest {
        Some(d) => format!("nvrtc {}.{} (sha256 {d})", version.0, version.1),
        None => format!("nvrtc {}.{}", version.0, version.1),
    }
}

/// The libnvrtc files this process mapped, from `/proc/self/maps`, in map order, each once.
fn mapped_libraries() -> Vec<PathBuf> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5).map(Path::new) else {
            continue;
        };
        let is_nvrtc = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libnvrtc.so"));
        if is_nvrtc && !out.iter().any(|p| p == path) {
            out.push(path.to_path_buf());
        }
    }
    out
}

/// The libnvrtc file this process mapped (for a library the dynamic linker found by soname).
fn mapped_library() -> Option<PathBuf> {
    mapped_libraries().into_iter().next()
}

/// A libnvrtc mapped besides `chosen` whose bytes differ from it: cudarc's lookup by name
/// resolved another build (a patch release, a vendor rebuild), possibly of the same version,
/// and the cache key would describe `chosen` while that one compiles. A byte-identical copy
/// is harmless and not reported. Files are hashed only when there is another mapping.
fn other_mapped_build(chosen: &Path) -> Option<(PathBuf, String, String)> {
    let real = chosen.canonicalize().ok()?;
    let others: Vec<PathBuf> = mapped_libraries()
        .into_iter()
        .filter(|m| m.canonicalize().ok().as_ref() != Some(&real))
        .collect();
    if others.is_empty() {
        return None;
    }
    let ours = library_digest(chosen)?;
    others.into_iter().find_map(|m| {
        let theirs = library_digest(&m)?;
        (theirs != ours).then(|| (m, ours.clone(), theirs))
    })
}

/// The digest of the loaded library, computed once per process.
fn loaded_digest(path: Option<&Path>) -> Option<String> {
    static DIGEST: OnceLock<Option<String>> = OnceLock::new();
    DIGEST
        .get_or_init(|| match path {
            Some(p) => library_digest(p),
            None => mapped_library().and_then(|p| library_digest(&p)),
        })
        .clone()
}

struct Loaded {
    path: Option<PathBuf>,
    _lib: Option<libloading::os::unix::Library>,
}

/// Why no library was loaded: the places searched, and the `CP_HICACHE_NVRTC` note.
struct Missing {
    searched: Vec<String>,
    requested: Option<String>,
}

static LOADED: OnceLock<Result<Loaded, Missing>> = OnceLock::new();

/// `CP_HICACHE_NVRTC` when set (and not empty), with the library files it names: itself, or
/// for a folder the sonames in it and in its `lib64/`, `lib/` and wheel subfolders.
fn requested_candidates() -> Option<(PathBuf, Vec<PathBuf>)> {
    let p = PathBuf::from(std::env::var_os(NVRTC_ENV).filter(|v| !v.is_empty())?);
    let mut files = Vec::new();
    if p.is_dir() {
        for sub in ["", "lib64", "lib", WHEEL_SUBDIR] {
            for so in SONAMES {
                let base = if sub.is_empty() {
                    p.clone()
                } else {
                    p.join(sub)
                };
                files.push(base.join(so));
            }
        }
    } else {
        files.push(p.clone());
    }
    Some((p, files))
}

/// Why the library `CP_HICACHE_NVRTC` names was not used, from the failures of the search
/// (`(file, why)`); `None` when the variable is not set.
fn requested_failure(failures: &[(PathBuf, String)]) -> Option<String> {
    let (var, files) = requested_candidates()?;
    let why = match failures.iter().find(|(p, _)| files.contains(p)) {
        Some((_, why)) => format!("cannot be used: {why}"),
        None if var.is_dir() => format!(
            "is a folder holding no {} (looked in it and in its lib64/, lib/ and {WHEEL_SUBDIR}/)",
            SONAMES.join(" or ")
        ),
        None if var.exists() => "is not a library file".to_string(),
        None => "does not exist".to_string(),
    };
    Some(format!("{NVRTC_ENV}={} {why}", var.display()))
}

/// Candidate library files, in search order (not filtered by existence).
pub fn candidate_paths() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = requested_candidates().map_or_else(Vec::new, |(_, f)| f);
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let p = PathBuf::from(v);
            for sub in ["lib64", "lib"] {
                for so in SONAMES {
                    out.push(p.join(sub).join(so));
                }
            }
        }
    }
    for so in SONAMES {
        out.push(Path::new("/usr/local/cuda/lib64").join(so));
    }
    for site in site_dirs() {
        out.push(site.join(WHEEL_SUBDIR).join(SONAMES[0]));
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// The library file discovery would load first, found without loading anything (the first
/// existing candidate of [`candidate_paths`]); `None` when only the dynamic linker's search or
/// the `python3` query could find one.
pub fn locate() -> Option<PathBuf> {
    candidate_paths().into_iter().find(|p| p.is_file())
}

/// Python site-packages directories that may hold the NVRTC wheel.
fn site_dirs() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(home) = dirs::home_dir() {
        prefixes.push(home.join(".local"));
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            prefixes.push(PathBuf::from(v));
        }
    }
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    let mut out = Vec::new();
    for prefix in prefixes {
        let lib = prefix.join("lib");
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pys.sort();
        for py in pys {
            out.push(py.join("site-packages"));
            out.push(py.join("dist-packages"));
        }
    }
    out.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    out
}

/// Site dirs as reported by `python3` itself (only asked when nothing else was found).
fn python_site_dirs() -> Vec<PathBuf> {
    let script = "import site,sys\nfor p in site.getsitepackages()+[site.getusersitepackages()]+sys.path: print(p)";
    match std::process::Command::new("python3")
        .args(["-c", script])
        .stderr(std::process::Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

fn open_global(path: &Path) -> Result<libloading::os::unix::Library, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading libnvrtc runs its initialisers, which have no preconditions on our side;
    // the handle is kept in a process-wide static and never unloaded, so no symbol outlives it.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
        // libloading's message is only "dlopen failed"; the reason (dlerror) is its source.
        match std::error::Error::source(&e) {
            Some(why) => format!("{e}: {why}"),
            None => e.to_string(),
        }
    })
}

/// Marks a search note saying cudarc would use another libnvrtc than the one chosen.
const CONFLICT: &str = "cudarc resolved another libnvrtc";

/// `nvrtcVersion` through our own handle of the chosen file.
fn own_version(lib: &libloading::os::unix::Library) -> Option<(i32, i32)> {
    type VersionFn =
        unsafe extern "C" fn(*mut std::ffi::c_int, *mut std::ffi::c_int) -> std::ffi::c_int;
    // SAFETY: `nvrtcVersion` has exactly this C signature in every NVRTC release; both
    // pointers are valid for writes and the library stays loaded (the handle outlives the call).
    unsafe {
        let f = lib.get::<VersionFn>(b"nvrtcVersion\0").ok()?;
        let (mut major, mut minor) = (0, 0);
        (f(&mut major, &mut minor) == 0).then_some((major, minor))
    }
}

/// `nvrtcVersion` through cudarc, i.e. of the library cudarc's own `dlopen` resolved.
fn cudarc_version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: only called after `is_culib_present`; both pointers are valid for writes.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().ok().map(|_| (major, minor))
}

fn culib_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen candidate names and drops the handles.
    unsafe { sys::is_culib_present() }
}

fn load() -> &'static Result<Loaded, Missing> {
    LOADED.get_or_init(|| {
        let mut searched = Vec::new();
        // Each library file that exists but could not be used, and why.
        let mut failures: Vec<(PathBuf, String)> = Vec::new();
        let try_paths = |paths: Vec<PathBuf>,
                         searched: &mut Vec<String>,
                         failures: &mut Vec<(PathBuf, String)>| {
            for p in paths {
                searched.push(p.display().to_string());
                if p.is_file() {
                    match open_global(&p) {
                        Ok(lib) if culib_present() => {
                            // cudarc dlopens by name (`libnvrtc.so` first), which can resolve
                            // to another installation than the file chosen here; compiling
                            // with one and keying the cache by the other must not happen.
                            if let (Some(ours), Some(theirs)) = (own_version(&lib), cudarc_version()) {
                                if ours != theirs {
                                    let why = format!(
                                        "{} is nvrtc {}.{}, but {CONFLICT} (nvrtc {}.{}) on the library search path first: remove it from LD_LIBRARY_PATH or point CP_HICACHE_NVRTC at it",
                                        p.display(), ours.0, ours.1, theirs.0, theirs.1
                                    );
                                    searched.push(why.clone());
                                    failures.push((p, why));
                                    return None;
                                }
                            }
                            // The same version can still be another build: compare bytes.
                            if let Some((other, ours, theirs)) = other_mapped_build(&p) {
                                let why = format!(
                                    "{} (sha256 {ours}) was chosen, but {CONFLICT} ({}: the same version, another build, sha256 {theirs}) on the library search path first: remove it from LD_LIBRARY_PATH or point CP_HICACHE_NVRTC at it",
                                    p.display(), other.display()
                                );
                                searched.push(why.clone());
                                failures.push((p, why));
                                return None;
                            }
                            return Some(Loaded {
                                path: Some(p),
                                _lib: Some(lib),
                            });
                        }
                        Ok(_) => {
                            searched.push(format!("{} (loaded, but not usable)", p.display()));
                            let why = format!("{} loaded, but cudarc cannot use it", p.display());
                            failures.push((p, why));
                        }
                        Err(e) => {
                            searched.push(format!("{} ({e})", p.display()));
                            failures.push((p, e));
                        }
                    }
                }
            }
            None
        };
        // A library found elsewhere after CP_HICACHE_NVRTC failed is used, with a warning
        // naming the variable and why.
        let found = |l: Loaded, failures: &[(PathBuf, String)]| {
            let from_var = requested_candidates()
                .is_some_and(|(_, files)| l.path.as_ref().is_some_and(|p| files.contains(p)));
            if let (false, Some(note)) = (from_var, requested_failure(failures)) {
                let used = l.path.as_ref().map_or_else(
                    || "the library the dynamic linker finds".to_string(),
                    |p| p.display().to_string(),
                );
                tracing::warn!(target: "cp_hicache::jit", "{note}; using {used} instead");
            }
            Ok(l)
        };
        if let Some(l) = try_paths(candidate_paths(), &mut searched, &mut failures) {
            return found(l, &failures);
        }
        let missing = |searched: Vec<String>, failures: &[(PathBuf, String)]| Missing {
            searched,
            requested: requested_failure(failures),
        };
        if searched.iter().any(|s| s.contains(CONFLICT)) {
            return Err(missing(searched, &failures));
        }
        searched.push("dynamic linker search path (libnvrtc.so.12)".to_string());
        if culib_present() {
            let l = Loaded {
                path: None,
                _lib: None,
            };
            return found(l, &failures);
        }
        let mut py: Vec<PathBuf> = Vec::new();
        for p in python_site_dirs() {
            let p = p.join(WHEEL_SUBDIR).join(SONAMES[0]);
            if !py.contains(&p) && !searched.contains(&p.display().to_string()) {
                py.push(p);
            }
        }
        if let Some(l) = try_paths(py, &mut searched, &mut failures) {
            return found(l, &failures);
        }
        Err(missing(searched, &failures))
    })
}

fn api(uri: &str, call: &'static str, r: sys::nvrtcResult) -> Result<(), NvrtcError> {
    r.result().map_err(|e| NvrtcError::Api {
        uri: uri.to_string(),
        call,
        code: format!("{:?}", e.0),
    })
}

/// Owns an `nvrtcProgram`; destroys it on drop (null-swapped first).
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        let mut prog = std::mem::replace(&mut self.0, std::ptr::null_mut());
        if !prog.is_null() {
            // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed exactly once,
            // here, after the handle was swapped for null.
            let _ = unsafe { sys::nvrtcDestroyProgram(&mut prog) };
        }
    }
}

impl NvrtcCompiler {
    /// Finds and loads libnvrtc (once per process) and reads its version.
    pub fn load() -> Result<NvrtcCompiler, NvrtcError> {
        match load() {
            Err(missing) => Err(NvrtcError::Unavailable {
                searched: missing.searched.clone(),
                requested: missing.requested.clone(),
            }),
            Ok(loaded) => {
                let (mut major, mut minor) = (0, 0);
                // SAFETY: the library is loaded (checked by `is_culib_present` in `load`), and
                // both pointers are valid for writes.
                let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
                api("", "nvrtcVersion", r)?;
                Ok(NvrtcCompiler {
                    library: loaded.path.clone(),
                    version: (major, minor),
                    digest: loaded_digest(loaded.path.as_deref()),
                })
            }
        }
    }

    /// `(major, minor)` NVRTC version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Compiler identity for cache keys, tuning keys and logs: the version and a short SHA-256
    /// of the library file (`nvrtc 12.9 (sha256 0123456789abcdef)`), so that a patch release or
    /// rebuild with the same `major.minor` does not reuse another build's CUBINs.
    pub fn identity(&self) -> String {
        identity_string(self.version, self.digest.as_deref())
    }

    /// The library file that was loaded, or `None` if the dynamic linker found it by soname.
    pub fn library(&self) -> Option<&Path> {
        self.library.as_deref()
    }

    /// Compiles `source` to a CUBIN for `options.arch`, with `uri` as the program name.
    pub fn compile(
        &self,
        uri: &str,
        source: &str,
        options: &NvrtcOptions,
    ) -> Result<NvrtcOutput, NvrtcError> {
        let args = options.to_args();
        let nul = || NvrtcError::Nul {
            uri: uri.to_string(),
        };
        let c_src = CString::new(source).map_err(|_| nul())?;
        let c_name = CString::new(format!("{uri}.cu")).map_err(|_| nul())?;
        let c_args: Vec<CString> = args
            .iter()
            .map(|a| CString::new(a.as_str()))
            .collect::<Result<_, _>>()
            .map_err(|_| nul())?;
        let c_ptrs: Vec<*const c_char> = c_args.iter().map(|a| a.as_ptr()).collect();

        let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: the library is loaded (this compiler exists only after `load` succeeded);
        // `c_src` and `c_name` are NUL-terminated and outlive the program; zero headers.
        let r = unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        api(uri, "nvrtcCreateProgram", r)?;
        let prog = Program(raw);

        let n = c_ptrs.len() as i32;
        // SAFETY: `prog.0` is a live program; `c_ptrs` holds `n` valid C strings that outlive
        // the call.
        let compiled = unsafe { sys::nvrtcCompileProgram(prog.0, n, c_ptrs.as_ptr()) };
        let log = self.log(uri, &prog)?;
        if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(NvrtcError::Compile {
                uri: uri.to_string(),
                options: args,
                log: if log.trim().is_empty() {
                    format!("{compiled:?}")
                } else {
                    log
                },
            });
        }

        let mut size = 0usize;
        // SAFETY: live, successfully compiled program; `size` is valid for writes.
        api(uri, "nvrtcGetCUBINSize", unsafe {
            sys::nvrtcGetCUBINSize(prog.0, &mut size)
        })?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has exactly the `size` bytes NVRTC asked for.
        api(uri, "nvrtcGetCUBIN", unsafe {
            sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast::<c_char>())
        })?;
        let report = parse_ptxas_info(&log, uri);
        Ok(NvrtcOutput { cubin, log, report })
    }

    fn log(&self, uri: &str, prog: &Program) -> Result<String, NvrtcError> {
        let mut size = 0usize;
        // SAFETY: live program; `size` is valid for writes.
        api(uri, "nvrtcGetProgramLogSize", unsafe {
            sys::nvrtcGetProgramLogSize(prog.0, &mut size)
        })?;
        if size == 0 {
            return Ok(String::new());
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has the `size` bytes NVRTC asked for (including the NUL).
        api(uri, "nvrtcGetProgramLog", unsafe {
            sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr().cast::<c_char>())
        })?;
        if let Some(end) = buf.iter().position(|&b| b == 0) {
            buf.truncate(end);
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// Number right before `unit` in `text` (`"24 bytes stack frame"`, `"bytes stack frame"` → 24).
fn number_before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// Parses ptxas `-v` output for one entry function (or the first function when `entry` does not
/// appear). Returns `None` when the log has no "Used N registers" line for it.
pub fn parse_ptxas_info(log: &str, entry: &str) -> Option<ResourceReport> {
    // Split into per-function sections, starting at "Compiling entry function" or
    // "Function properties for" lines.
    let mut sections: Vec<(String, Vec<&str>)> = Vec::new();
    for line in log.lines() {
        let name = line
            .split_once("Compiling entry function '")
            .or_else(|| line.split_once("Function properties for "))
            .map(|(_, rest)| rest.split(['\'', ' ']).next().unwrap_or("").to_string());
        match name {
            Some(n) if sections.last().is_none_or(|(prev, _)| *prev != n) => {
                sections.push((n, vec![line]));
            }
            _ => match sections.last_mut() {
                Some((_, lines)) => lines.push(line),
                None => continue,
            },
        }
    }
    let mut report: Option<ResourceReport> = None;
    let chosen: Vec<&(String, Vec<&str>)> = {
        let exact: Vec<_> = sections.iter().filter(|(n, _)| n == entry).collect();
        if exact.is_empty() {
            sections.iter().take(1).collect()
        } else {
            exact
        }
    };
    for (_, lines) in chosen {
        for line in lines {
            let r = report.get_or_insert_with(ResourceReport::default);
            if line.contains("stack frame") {
                r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_bytes = number_before(line, "bytes spill stores").unwrap_or(0)
                    + number_before(line, "bytes spill loads").unwrap_or(0);
            }
            if let Some(regs) = number_before(line, "registers") {
                r.registers = regs;
                r.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
                r.const_bytes = number_before(line, "bytes cmem[0]");
            }
        }
    }
    report.filter(|r| r.registers > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'other' for 'sm_90'
ptxas info    : Function properties for other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'copy_k' for 'sm_90'
ptxas info    : Function properties for copy_k
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 2048 bytes smem, 384 bytes cmem[0]
";

    #[test]
    fn identity_names_the_library_bytes() {
        let dir = std::env::temp_dir().join(format!("cp-hicache-nvrtc-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b, c) = (dir.join("a.so"), dir.join("b.so"), dir.join("c.so"));
        std::fs::write(&a, b"libnvrtc build 1").unwrap();
        std::fs::write(&b, b"libnvrtc build 1").unwrap();
        std::fs::write(&c, b"libnvrtc build 2").unwrap();
        let id = |p: &Path| identity_string((12, 9), library_digest(p).as_deref());
        assert_eq!(
            id(&a),
            id(&b),
            "same bytes, same identity wherever they live"
        );
        assert_ne!(id(&a), id(&c), "same version, other bytes");
        assert!(id(&a).starts_with("nvrtc 12.9 (sha256 "), "{}", id(&a));
        assert_eq!(library_digest(&a).unwrap().len(), DIGEST_HEX);
        assert_eq!(library_digest(&dir.join("missing.so")), None);
        assert_eq!(identity_string((12, 9), None), "nvrtc 12.9");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parses_named_entry() {
        let r = parse_ptxas_info(LOG, "copy_k").unwrap();
        assert_eq!(
            r,
            ResourceReport {
                registers: 32,
                spill_bytes: 12,
                stack_bytes: 16,
                shared_bytes: 2048,
                const_bytes: Some(384),
            }
        );
    }

    #[test]
    fn falls_back_to_first_entry() {
        let r = parse_ptxas_info(LOG, "missing").unwrap();
        assert_eq!(r.registers, 4);
        assert_eq!(r.const_bytes, Some(360));
    }

    #[test]
    fn no_info_is_none() {
        assert_eq!(parse_ptxas_info("", "k"), None);
        assert_eq!(parse_ptxas_info("warning: something", "k"), None);
    }

    #[test]
    fn number_before_unit() {
        assert_eq!(
            number_before("  24 bytes stack frame", "bytes stack frame"),
            Some(24)
        );
        assert_eq!(number_before("Used 8 registers", "registers"), Some(8));
    }
}
