//! The on-disk, content-addressed store of compiled kernels. It only stores: it never calls a
//! compiler and never decides what to compile.
//!
//! Layout: `<root>/<target>/<readable key>/` holds the artifact, the source (`<uri>.cu`, for
//! debugging) and `manifest.json`, which is written last. An entry counts only if its manifest
//! exists and the artifact's length and SHA-256 match it. Every file is written to a temporary
//! name (pid + random suffix) in the destination directory and then renamed into place, so a
//! reader never sees a partial file. A per-entry `flock` (`<root>/<target>/.locks/<key>.lock`,
//! outside the entry so discarding an entry never deletes a held lock) lets the caller hold
//! check → compile → commit exclusively across processes.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Name of the manifest file inside an entry.
pub const MANIFEST: &str = "manifest.json";
/// Manifest format version; entries with another version are treated as corrupt.
pub const MANIFEST_FORMAT: u32 = 1;

/// Errors of the disk cache, each with the path it concerns.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A filesystem operation failed.
    #[error("cache I/O error on {path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Taking the per-entry file lock failed.
    #[error("cannot lock cache entry {path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A manifest could not be serialised.
    #[error("cannot serialise manifest for {path}: {source}")]
    Manifest {
        /// The entry directory.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// A name (target or key) is not usable as a single path component.
    #[error("invalid cache path component {name:?}")]
    InvalidName {
        /// The offending name.
        name: String,
    },
}

impl CacheError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        CacheError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What an entry records about itself; written last, as the entry's commit point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// Readable kernel name.
    pub uri: String,
    /// Full key hash (hex).
    pub key: String,
    /// Target directory name (`sm_90`, `host`, …).
    pub target: String,
    /// Artifact file name inside the entry.
    pub artifact_file: String,
    /// Artifact length in bytes.
    pub artifact_len: u64,
    /// Artifact SHA-256 (hex).
    pub artifact_sha256: String,
    /// Source file name inside the entry.
    pub source_file: String,
    /// Compiler identity and version.
    pub compiler: String,
    /// Compiler flags used.
    pub options: Vec<String>,
    /// Crate version that wrote the entry.
    pub crate_version: String,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// How long the compile took, in milliseconds.
    pub compile_ms: f64,
    /// Compiler-specific extras (for NVRTC: the resource report).
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// A committed, verified entry.
#[derive(Debug, Clone)]
pub struct CacheEntry {
    /// The entry directory.
    pub dir: PathBuf,
    /// Absolute path of the artifact file.
    pub artifact_path: PathBuf,
    /// The artifact bytes (read to verify them).
    pub artifact: Vec<u8>,
    /// The entry's manifest.
    pub manifest: Manifest,
}

/// Result of looking an entry up.
#[derive(Debug)]
pub enum Lookup {
    /// A complete entry whose artifact matches its manifest.
    Hit(Box<CacheEntry>),
    /// No committed entry (no manifest).
    Miss,
    /// An entry that must not be loaded: the caller discards it and recompiles.
    Corrupt {
        /// The entry directory.
        dir: PathBuf,
        /// What is wrong, for the log.
        reason: String,
    },
}

/// What a caller commits.
#[derive(Debug, Clone)]
pub struct NewEntry<'a> {
    /// Artifact file name (`<uri>.cubin`, `<uri>.so`).
    pub artifact_file: &'a str,
    /// Artifact bytes.
    pub artifact: &'a [u8],
    /// Source file name (`<uri>.cu`).
    pub source_file: &'a str,
    /// Source text.
    pub source: &'a str,
    /// The manifest, minus the artifact fields and timestamp, which `commit` fills in.
    pub manifest: Manifest,
}

/// An exclusive lock on one entry; released when dropped (closing the file releases the flock).
#[derive(Debug)]
pub struct EntryLock {
    _file: File,
    path: PathBuf,
}

impl EntryLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The disk cache rooted at one directory. Cheap to clone; safe to share between threads and
/// processes (all coordination is through the filesystem).
#[derive(Debug, Clone)]
pub struct DiskCache {
    root: PathBuf,
}

fn check_component(name: &str) -> Result<(), CacheError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(CacheError::InvalidName {
            name: name.to_string(),
        })
    }
}

/// A suffix unique across processes and threads (pid, time, counter).
fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mix = nanos ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    format!("{}-{:016x}", std::process::id(), mix)
}

/// Prefix of [`write_atomic`]'s temp files, followed by the writer's pid.
const TMP_PREFIX: &str = ".tmp-";
/// Entries renamed aside by [`DiskCache::discard`] before deletion: `<prefix><pid>-…`.
const DISCARD_PREFIX: &str = ".discard-";

/// Removes the entries of `dir` named `<prefix><pid>-…` whose process no longer runs: what a
/// writer killed by a signal left behind (it skipped its own clean-up). Only a pid with no
/// `/proc/<pid>` counts as gone; where `/proc` is missing, nothing is removed. Errors are
/// ignored: a leftover costs disk space, never correctness.
pub(crate) fn sweep_dead_pid_entries(dir: &Path, prefix: &str, what: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let path = entry.path();
            tracing::debug!(target: "cp_hicache::jit", path = %path.display(), "removing {what}");
            let _ = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
        }
    }
}

/// Writes `bytes` to `dir/name` atomically: a temp file unique to this process and call (pid +
/// random suffix) in `dir`, fsync, rename. Concurrent writers never share a temp file, and a
/// reader sees the old file or the new one, never part of either. Also used for tuning files.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, CacheError> {
    let dest = dir.join(name);
    let tmp = dir.join(format!("{TMP_PREFIX}{}-{}", unique_suffix(), name));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| CacheError::io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| CacheError::io(&tmp, e))?;
        f.sync_all().map_err(|e| CacheError::io(&tmp, e))?;
        fs::rename(&tmp, &dest).map_err(|e| CacheError::io(&dest, e))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| dest)
}

/// SHA-256 of bytes, lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl DiskCache {
    /// A cache rooted at `root` (created lazily).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        DiskCache { root: root.into() }
    }

    /// `$CP_HICACHE_CACHE_DIR`, else `<user cache dir>/cp-hicache`, else `<tmp>/cp-hicache`.
    pub fn default_root() -> PathBuf {
        match std::env::var_os("CP_HICACHE_CACHE_DIR") {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => dirs::cache_dir()
                .unwrap_or_else(std::env::temp_dir)
                .join("cp-hicache"),
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Directory of an entry (whether or not it exists).
    pub fn entry_dir(&self, target: &str, key: &str) -> Result<PathBuf, CacheError> {
        check_component(target)?;
        check_component(key)?;
        Ok(self.root.join(target).join(key))
    }

    /// Blocks until this process holds the entry's exclusive lock.
    pub fn lock(&self, target: &str, key: &str) -> Result<EntryLock, CacheError> {
        check_component(target)?;
        check_component(key)?;
        let dir = self.root.join(target).join(".locks");
        fs::create_dir_all(&dir).map_err(|e| CacheError::io(&dir, e))?;
        let path = dir.join(format!("{key}.lock"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| CacheError::io(&path, e))?;
        fs4::fs_std::FileExt::lock_exclusive(&file).map_err(|source| CacheError::Lock {
            path: path.clone(),
            source,
        })?;
        Ok(EntryLock { _file: file, path })
    }

    /// Reads a small auxiliary file of the cache root (for example remembered compiler
    /// identities); `None` when absent or unreadable.
    pub fn read_aux(&self, name: &str) -> Option<Vec<u8>> {
        check_component(name).ok()?;
        fs::read(self.root.join(name)).ok()
    }

    /// Writes a small auxiliary file of the cache root atomically (temp file, rename).
    pub fn write_aux(&self, name: &str, bytes: &[u8]) -> Result<(), CacheError> {
        check_component(name)?;
        fs::create_dir_all(&self.root).map_err(|e| CacheError::io(&self.root, e))?;
        write_atomic(&self.root, name, bytes).map(|_| ())
    }

    /// Looks an entry up and verifies it. Safe without the lock: files appear only by rename and
    /// the manifest appears last.
    pub fn lookup(&self, target: &str, key: &str) -> Result<Lookup, CacheError> {
        let dir = self.entry_dir(target, key)?;
        let manifest_path = dir.join(MANIFEST);
        let corrupt = |reason: String| Lookup::Corrupt {
            dir: dir.clone(),
            reason,
        };
        // Any other read failure (a directory in a file's place, an I/O error) makes the
        // entry unusable, not the request: it is rebuilt, or named when compiling is off.
        let text = match fs::read(&manifest_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Lookup::Miss),
            Err(e) => return Ok(corrupt(format!("manifest unreadable: {e}"))),
        };
        let manifest: Manifest = match serde_json::from_slice(&text) {
            Ok(m) => m,
            Err(e) => return Ok(corrupt(format!("unreadable manifest: {e}"))),
        };
        if manifest.format != MANIFEST_FORMAT {
            return Ok(corrupt(format!("manifest format {}", manifest.format)));
        }
        if check_component(&manifest.artifact_file).is_err() {
            return Ok(corrupt(format!(
                "bad artifact name {:?}",
                manifest.artifact_file
            )));
        }
        let artifact_path = dir.join(&manifest.artifact_file);
        let artifact = match fs::read(&artifact_path) {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(corrupt("artifact missing".to_string()))
            }
            Err(e) => return Ok(corrupt(format!("artifact unreadable: {e}"))),
        };
        if artifact.len() as u64 != manifest.artifact_len {
            return Ok(corrupt(format!(
                "artifact length {} != manifest {}",
                artifact.len(),
                manifest.artifact_len
            )));
        }
        let sha = sha256_hex(&artifact);
        if sha != manifest.artifact_sha256 {
            return Ok(corrupt(format!(
                "artifact sha256 {} != manifest {}",
                &sha[..16],
                manifest.artifact_sha256.get(..16).unwrap_or("")
            )));
        }
        Ok(Lookup::Hit(Box::new(CacheEntry {
            dir,
            artifact_path,
            artifact,
            manifest,
        })))
    }

    /// Removes an entry (call with its lock held). It is first renamed aside, so a concurrent
    /// reader sees either the whole old entry or nothing. Once it is aside, failing to delete
    /// it is only logged (the entry is already out of the way); what a killed process left
    /// aside is removed by the next discard in the same target.
    pub fn discard(&self, target: &str, key: &str) -> Result<(), CacheError> {
        let dir = self.entry_dir(target, key)?;
        let target_dir = self.root.join(target);
        sweep_dead_pid_entries(
            &target_dir,
            DISCARD_PREFIX,
            "a killed process's discarded entry",
        );
        let aside = target_dir.join(format!("{DISCARD_PREFIX}{}-{key}", unique_suffix()));
        match fs::rename(&dir, &aside) {
            Ok(()) => {
                if let Err(e) = fs::remove_dir_all(&aside) {
                    tracing::warn!(
                        target: "cp_hicache::jit",
                        path = %aside.display(),
                        error = %e,
                        "discarded cache entry not deleted"
                    );
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CacheError::io(&dir, e)),
        }
    }

    /// Writes an entry: source, then artifact, then the manifest (the commit point). Call with
    /// the entry's lock held.
    pub fn commit(
        &self,
        target: &str,
        key: &str,
        entry: NewEntry<'_>,
    ) -> Result<CacheEntry, CacheError> {
        check_component(entry.artifact_file)?;
        check_component(entry.source_file)?;
        let dir = self.entry_dir(target, key)?;
        fs::create_dir_all(&dir).map_err(|e| CacheError::io(&dir, e))?;
        // Temp files of writers killed mid-commit (the lock is ours, so no live writer's).
        sweep_dead_pid_entries(&dir, TMP_PREFIX, "a killed writer's temp file");
        // A stale manifest from an earlier, discarded attempt must not vouch for new files.
        let manifest_path = dir.join(MANIFEST);
        match fs::remove_file(&manifest_path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CacheError::io(&manifest_path, e)),
        }
        write_atomic(&dir, entry.source_file, entry.source.as_bytes())?;
        let artifact_path = write_atomic(&dir, entry.artifact_file, entry.artifact)?;
        let mut manifest = entry.manifest;
        manifest.format = MANIFEST_FORMAT;
        manifest.artifact_file = entry.artifact_file.to_string();
        manifest.source_file = entry.source_file.to_string();
        manifest.artifact_len = entry.artifact.len() as u64;
        manifest.artifact_sha256 = sha256_hex(entry.artifact);
        manifest.created_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let text = serde_json::to_vec_pretty(&manifest).map_err(|source| CacheError::Manifest {
            path: dir.clone(),
            source,
        })?;
        write_atomic(&dir, MANIFEST, &text)?;
        Ok(CacheEntry {
            dir,
            artifact_path,
            artifact: entry.artifact.to_vec(),
            manifest,
        })
    }
}

impl Manifest {
    /// A manifest with the descriptive fields set; `commit` fills in the artifact fields.
    pub fn describe(
        uri: &str,
        key: &str,
        target: &str,
        compiler: &str,
        options: Vec<String>,
        compile_ms: f64,
        extra: serde_json::Value,
    ) -> Self {
        Manifest {
            format: MANIFEST_FORMAT,
            uri: uri.to_string(),
            key: key.to_string(),
            target: target.to_string(),
            artifact_file: String::new(),
            artifact_len: 0,
            artifact_sha256: String::new(),
            source_file: String::new(),
            compiler: compiler.to_string(),
            options,
            crate_version: env!("CARGO_PKG_VERSION").to_string(),
            created_unix_ms: 0,
            compile_ms,
            extra,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("cp-hicache-cache-test-{tag}-{}", unique_suffix()));
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn entry<'a>(bytes: &'a [u8]) -> NewEntry<'a> {
        NewEntry {
            artifact_file: "k.cubin",
            artifact: bytes,
            source_file: "k.cu",
            source: "src",
            manifest: Manifest::describe(
                "k",
                "abc",
                "sm_90",
                "nvrtc 12.9",
                vec![],
                1.0,
                serde_json::Value::Null,
            ),
        }
    }

    #[test]
    fn round_trip_and_corruption() {
        let root = tmpdir("rt");
        let c = DiskCache::new(&root);
        assert!(matches!(c.lookup("sm_90", "k-1").unwrap(), Lookup::Miss));
        let _l = c.lock("sm_90", "k-1").unwrap();
        c.commit("sm_90", "k-1", entry(b"hello")).unwrap();
        match c.lookup("sm_90", "k-1").unwrap() {
            Lookup::Hit(e) => assert_eq!(e.artifact, b"hello"),
            other => panic!("{other:?}"),
        }
        fs::write(root.join("sm_90/k-1/k.cubin"), b"hellO").unwrap();
        assert!(matches!(
            c.lookup("sm_90", "k-1").unwrap(),
            Lookup::Corrupt { .. }
        ));
        c.discard("sm_90", "k-1").unwrap();
        assert!(matches!(c.lookup("sm_90", "k-1").unwrap(), Lookup::Miss));
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn rejects_path_components() {
        let c = DiskCache::new("/nonexistent");
        assert!(c.entry_dir("sm_90", "../x").is_err());
        assert!(c.entry_dir("", "x").is_err());
        assert!(c.entry_dir("sm_90", ".locks").is_err());
    }

    #[test]
    fn a_commit_removes_the_temp_files_of_dead_writers_only() {
        let root = tmpdir("sweep");
        let c = DiskCache::new(&root);
        let dir = c.entry_dir("sm_90", "k-2").unwrap();
        fs::create_dir_all(&dir).unwrap();
        // No process has the largest u32 as its pid (Linux caps pids at 2^22).
        let dead = dir.join(format!("{TMP_PREFIX}4294967295-00ff-k.cubin"));
        let live = dir.join(format!("{TMP_PREFIX}{}-00ff-k.cubin", std::process::id()));
        let other = dir.join("notes.txt");
        for f in [&dead, &live, &other] {
            fs::write(f, b"x").unwrap();
        }
        let _l = c.lock("sm_90", "k-2").unwrap();
        c.commit("sm_90", "k-2", entry(b"hello")).unwrap();
        if Path::new("/proc/self").exists() {
            assert!(!dead.exists(), "a dead writer's temp file stays");
        }
        assert!(live.exists(), "a running writer's temp file was removed");
        assert!(other.exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
