//! The tuning file: JSON, one entry per (device, kernel family, shape-independent spec key),
//! written atomically (the JIT cache's [`write_atomic`]), merged under a lock on a sibling
//! `.<name>.lock` file (removed after the merge) so concurrent `tune` runs do not lose each
//! other's results, and applied
//! to a [`Deployment`] only where the device key matches.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use super::candidate::LaunchChoice;
use super::key::{spec_key, DeviceKey, KeyMatch};
use super::TuningError;
use crate::jit::cache::write_atomic;
use crate::jit::{CacheError, DiskCache};
use crate::kernels::{Deployment, KernelSpec, TransferPath};

/// Version of the file layout; a file with another version is refused, never guessed at.
pub const TUNING_FORMAT: u32 = 1;

/// File name of the default tuning file inside the cache directory.
pub const TUNING_FILE_NAME: &str = "tuning.json";

/// The default tuning file: `<cache dir>/tuning.json` (`CP_HICACHE_CACHE_DIR` respected).
pub fn default_path() -> PathBuf {
    DiskCache::default_root().join(TUNING_FILE_NAME)
}

/// What one candidate measured (or why it was not measured).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateResult {
    /// The launch choice timed.
    pub choice: LaunchChoice,
    /// Median seconds per launch, when it ran.
    pub seconds: Option<f64>,
    /// Throughput in GB/s of the bytes the kernel moves, when meaningful.
    pub gbps: Option<f64>,
    /// Why it was dropped (compile failure, spills, unsupported), when it was.
    pub dropped: Option<String>,
    /// For a transfer tuned on a GPU: `seconds` and `gbps` were measured while the busy
    /// kernel occupied the SMs (docs/KERNELS.md "busy"), and this says what the transfer took
    /// alone and what it cost the busy kernel. Absent otherwise, and in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beside_busy: Option<BesideBusy>,
}

/// A transfer candidate timed beside the busy kernels ([`CandidateResult::beside_busy`]):
/// the ALU one, whose time is the candidate's, and the HBM one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BesideBusy {
    /// Median seconds per launch with the GPU to itself.
    pub alone_seconds: f64,
    /// The ALU busy kernel's seconds beside the transfers over its seconds alone.
    pub busy_slowdown: f64,
    /// Where the ALU busy kernel ran against the transfers. Absent in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alu_overlap: Option<Overlap>,
    /// The transfers beside the HBM busy kernel. Absent where it could not run (its buffer
    /// did not fit), and in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbm: Option<BesideCompanion>,
}

/// Transfers timed beside one busy kernel other than the one that sets their time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BesideCompanion {
    /// Median seconds per launch of the transfer beside it.
    pub seconds: f64,
    /// The busy kernel's seconds beside the transfers over its seconds alone.
    pub slowdown: f64,
    /// Where it ran against the transfers.
    pub overlap: Overlap,
}

/// Where a busy kernel ran against the transfers timed beside it, by the device's clock
/// (`%globaltimer` stamps at block start and end; docs/KERNELS.md "busy"): whether "beside"
/// was beside, or one after the other.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Overlap {
    /// The busy kernel's first block start minus the transfers' start, in ns (positive: the
    /// transfers started first, as `tune` orders them).
    pub start_lag_ns: i64,
    /// The share of the transfers' span the busy kernel ran beside (0 to 1).
    pub covered: f64,
    /// The busy kernel's first block start minus the transfers' last block start, in ns, in
    /// their first run: positive when every transfer block had started before any busy
    /// block did (the transfer was resident, not queued behind the busy kernel). Measured
    /// where the transfer kernel stamps its own blocks (`tune`'s stamped twin); absent for
    /// DMA, which has no blocks, and in older files. With it, `start_lag_ns` counts from the
    /// transfers' first block start rather than from a marker launched just before them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_lead_ns: Option<i64>,
}

/// The tuning result of one kernel on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuningEntry {
    /// Where it was measured.
    pub device: DeviceKey,
    /// Kernel family (`transfer_pages`, ...).
    pub family: String,
    /// Shape-independent spec key ([`spec_key`]).
    pub spec_key: String,
    /// The fastest candidate.
    pub best: LaunchChoice,
    /// Its median seconds per launch.
    pub best_seconds: f64,
    /// The workload timed (`pages=256 layers=4 repeats=5`).
    pub workload: String,
    /// Every candidate, in the order timed.
    pub results: Vec<CandidateResult>,
}

impl TuningEntry {
    /// Median seconds of `choice` in this entry, when it ran.
    pub fn seconds_of(&self, choice: &LaunchChoice) -> Option<f64> {
        self.results
            .iter()
            .find(|r| &r.choice == choice)
            .and_then(|r| r.seconds)
    }
}

/// A whole tuning file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuningFile {
    /// [`TUNING_FORMAT`].
    pub format: u32,
    /// Every entry; at most one per (device, family, spec key).
    pub entries: Vec<TuningEntry>,
}

/// What kind of file system entry `t` is, for an error that refuses it.
fn file_kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "device"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// The largest tuning file read: thousands of entries take a few hundred KiB.
pub const MAX_TUNING_BYTES: u64 = 16 << 20;

impl Default for TuningFile {
    fn default() -> Self {
        TuningFile {
            format: TUNING_FORMAT,
            entries: Vec::new(),
        }
    }
}

impl TuningFile {
    /// Reads and checks a tuning file: a regular file of at most [`MAX_TUNING_BYTES`] (a
    /// FIFO would block the reader, and `/dev/zero` never ends).
    pub fn load(path: &Path) -> Result<TuningFile, TuningError> {
        use std::io::Read as _;
        let refuse = |source: std::io::Error| TuningError::Read {
            path: path.to_path_buf(),
            source,
        };
        let invalid =
            |what: String| refuse(std::io::Error::new(std::io::ErrorKind::InvalidInput, what));
        let meta = std::fs::metadata(path).map_err(refuse)?;
        if !meta.is_file() {
            return Err(invalid(format!(
                "not a regular file (a {})",
                file_kind(&meta.file_type())
            )));
        }
        if meta.len() > MAX_TUNING_BYTES {
            return Err(invalid(format!(
                "{} bytes, more than the {MAX_TUNING_BYTES} a tuning file may have",
                meta.len()
            )));
        }
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_TUNING_BYTES + 1).read_to_string(&mut text))
            .map_err(refuse)?;
        if text.len() as u64 > MAX_TUNING_BYTES {
            return Err(invalid(format!(
                "grew past the {MAX_TUNING_BYTES} bytes a tuning file may have while read"
            )));
        }
        TuningFile::parse(&text, path)
    }

    /// Parses a tuning file's text (`path` only names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<TuningFile, TuningError> {
        #[derive(Deserialize)]
        struct Header {
            format: u32,
        }
        let header: Header = serde_json::from_str(text).map_err(|source| TuningError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        if header.format != TUNING_FORMAT {
            return Err(TuningError::Format {
                path: path.to_path_buf(),
                found: header.format,
                expected: TUNING_FORMAT,
            });
        }
        serde_json::from_str(text).map_err(|source| TuningError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Loads `path` when it exists, else an empty file (for merging new results into it).
    pub fn load_or_default(path: &Path) -> Result<TuningFile, TuningError> {
        if path.exists() {
            TuningFile::load(path)
        } else {
            Ok(TuningFile::default())
        }
    }

    /// The file a reader uses: `explicit` when given (any failure to read it is an error),
    /// else `default` when it exists. A default file that cannot be read or parsed does not
    /// stop the caller: it yields no file and a [`WarningKind::UnreadableFile`] warning (also
    /// logged), so one corrupt `<cache>/tuning.json` cannot make every replay fail.
    pub fn load_selected(
        explicit: Option<&Path>,
        default: &Path,
    ) -> Result<(Option<TuningFile>, Vec<TuningWarning>), TuningError> {
        if let Some(p) = explicit {
            return Ok((Some(TuningFile::load(p)?), Vec::new()));
        }
        if !default.exists() {
            tracing::debug!(target: "cp_hicache::tuning", path = %default.display(), "no tuning file");
            return Ok((None, Vec::new()));
        }
        match TuningFile::load(default) {
            Ok(f) => Ok((Some(f), Vec::new())),
            Err(e) => {
                let w = TuningWarning {
                    kind: WarningKind::UnreadableFile,
                    spec_key: String::new(),
                    message: format!(
                        "{e}; default launch shapes are used (fix or delete it, or pass a file)"
                    ),
                };
                tracing::debug!(target: "cp_hicache::tuning", "{w}");
                Ok((None, vec![w]))
            }
        }
    }

    /// Writes the file atomically (a temporary file unique to this call in the same directory,
    /// fsynced, then renamed), so a reader never sees half a file.
    pub fn save(&self, path: &Path) -> Result<(), TuningError> {
        let (dir, name) = split_path(path);
        std::fs::create_dir_all(&dir).map_err(|source| TuningError::Io {
            op: "create dir",
            path: dir.clone(),
            source,
        })?;
        let mut text = serde_json::to_string_pretty(self).map_err(|e| TuningError::Io {
            op: "serialise",
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        text.push('\n');
        write_atomic(&dir, &name, text.as_bytes())
            .map(drop)
            .map_err(|e| match e {
                CacheError::Io { path, source } => TuningError::Io {
                    op: "write",
                    path,
                    source,
                },
                other => TuningError::Io {
                    op: "write",
                    path: path.to_path_buf(),
                    source: std::io::Error::other(other.to_string()),
                },
            })
    }

    /// Merges `entries` into the file at `path` ([`TuningFile::upsert`]) and saves it, holding
    /// an exclusive lock on `<dir>/.<name>.lock` from the load to the rename, so two `tune`
    /// runs writing the same file both keep their results. A file that exists but cannot be
    /// read is an error (it is not overwritten). Returns the merged file.
    ///
    /// The lock file is removed again while the lock is still held, so no empty file stays
    /// beside the tuning file. That is safe because a run that locked the file meanwhile
    /// checks, once it holds the lock, that the path still names the file it locked, and
    /// otherwise opens the path again (`lock_file`).
    pub fn merge_into(path: &Path, entries: Vec<TuningEntry>) -> Result<TuningFile, TuningError> {
        let (dir, name) = split_path(path);
        std::fs::create_dir_all(&dir).map_err(|source| TuningError::Io {
            op: "create dir",
            path: dir.clone(),
            source,
        })?;
        let lock_path = dir.join(format!(".{name}.lock"));
        let lock = lock_file(&lock_path)?;
        let merged = (|| -> Result<TuningFile, TuningError> {
            let mut file = TuningFile::load_or_default(path)?;
            for e in entries {
                file.upsert(e);
            }
            file.save(path)?;
            Ok(file)
        })();
        if cfg!(unix) {
            let _ = std::fs::remove_file(&lock_path);
        }
        // Closing the lock file releases the lock, after the rename and the removal.
        drop(lock);
        merged
    }

    /// Adds `entry`, replacing an entry for the same device, family and spec key.
    pub fn upsert(&mut self, entry: TuningEntry) {
        self.entries.retain(|e| {
            !(e.device == entry.device && e.family == entry.family && e.spec_key == entry.spec_key)
        });
        self.entries.push(entry);
    }

    /// The entries for `spec` (any device).
    pub fn entries_for<'a>(
        &'a self,
        spec: &'a KernelSpec,
    ) -> impl Iterator<Item = &'a TuningEntry> + 'a {
        let key = spec_key(spec);
        let family = spec.family().to_string();
        self.entries
            .iter()
            .filter(move |e| e.spec_key == key && e.family == family)
    }
}

/// Opens (creating it if needed) and exclusively locks the lock file at `path`. A holder
/// removes the file before it unlocks, so a run that opened the old file and then got its
/// lock holds a lock nobody else sees: it opens the path again until the file it locked is
/// the one the path names. Without a way to compare files (not unix) the lock file is never
/// removed, so the first lock always counts.
fn lock_file(path: &Path) -> Result<std::fs::File, TuningError> {
    loop {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|source| TuningError::Io {
                op: "open lock",
                path: path.to_path_buf(),
                source,
            })?;
        fs4::fs_std::FileExt::lock_exclusive(&lock).map_err(|source| TuningError::Io {
            op: "lock",
            path: path.to_path_buf(),
            source,
        })?;
        if names_file(path, &lock) {
            return Ok(lock);
        }
    }
}

/// Whether `path` still names the open file `file` (same device and inode).
#[cfg(unix)]
fn names_file(path: &Path, file: &std::fs::File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Lock files are never removed where files cannot be compared, so the path always names it.
#[cfg(not(unix))]
fn names_file(_path: &Path, _file: &std::fs::File) -> bool {
    true
}

/// The directory (`.` for a bare name) and file name of a tuning file path.
fn split_path(path: &Path) -> (PathBuf, String) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| TUNING_FILE_NAME.to_string());
    (dir, name)
}

/// Why a tuning entry (or the whole default file) was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WarningKind {
    /// The default tuning file could not be read or parsed; nothing in it was applied.
    UnreadableFile,
    /// Measured on another device or backend.
    Foreign,
    /// Measured on this device with another compiler.
    Stale,
    /// Its choice does not fit the deployment (no common candidate, invalid shape).
    Unusable,
}

/// A tuning entry that was ignored, and why. It is returned for the caller to show
/// ([`warning_lines`]); the library logs it only at `debug`, so nobody sees it twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuningWarning {
    /// The reason class.
    pub kind: WarningKind,
    /// The spec key concerned (empty for [`WarningKind::UnreadableFile`]).
    pub spec_key: String,
    /// A readable explanation naming both devices where relevant.
    pub message: String,
}

impl fmt::Display for TuningWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            WarningKind::UnreadableFile => {
                write!(f, "default tuning file ignored: {}", self.message)
            }
            _ => write!(f, "tuning for {} ignored: {}", self.spec_key, self.message),
        }
    }
}

/// The warnings as lines for a person, in order: entries ignored for the same reason (every
/// entry of a file measured on another machine, say) share one line that counts them.
pub fn warning_lines(warnings: &[TuningWarning]) -> Vec<String> {
    let mut groups: Vec<(&TuningWarning, usize)> = Vec::new();
    for w in warnings {
        match groups
            .iter_mut()
            .find(|(g, _)| g.kind == w.kind && g.message == w.message)
        {
            Some((_, n)) => *n += 1,
            None => groups.push((w, 1)),
        }
    }
    groups
        .into_iter()
        .map(|(w, n)| match n {
            1 => w.to_string(),
            _ => format!(
                "tuning for {} and {} more kernels ignored: {}",
                w.spec_key,
                n - 1,
                w.message
            ),
        })
        .collect()
}

/// The deployment fields a tuning file can set, each fed by a group of kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Alloc,
    Copy,
    Synth,
}

/// Which fields of `dep` were changed by [`Deployment::with_tuning`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// `alloc_threads`, when set from the file.
    pub alloc_threads: Option<u32>,
    /// `copy`, when set from the file.
    pub copy: Option<LaunchChoice>,
    /// `transfer_copy`, decided with `copy`.
    pub transfer_copy: Option<LaunchChoice>,
    /// `transfer_path`, decided with `copy`.
    pub transfer_path: Option<TransferPath>,
    /// `synth_threads`, when set from the file.
    pub synth_threads: Option<u32>,
}

impl Deployment {
    /// This deployment with the launch shapes that `file` records as fastest on `device`,
    /// plus a warning (also logged) for every entry ignored because it was measured on another
    /// device or compiler, or does not fit. Entries for kernels the deployment does not use
    /// are silently irrelevant. A field fed by several kernels (`copy` by both transfer
    /// directions and materialise of every buffer) is set only when every one of them has an
    /// entry for this device (otherwise a warning, and the default stays: the shape would run
    /// kernels it was never timed or checked on), and takes the candidate with the smallest
    /// total time among those measured for all of them. DMA results are not a kernel shape; they
    /// decide `transfer_path` first, and when transfers take DMA the shape serves materialise
    /// alone (see `copy_choice`).
    pub fn with_tuning(
        &self,
        file: &TuningFile,
        device: &DeviceKey,
    ) -> (Deployment, Vec<TuningWarning>, Applied) {
        let mut out = self.clone();
        let mut warnings = Vec::new();
        let mut applied = Applied::default();
        let specs = self.specs();
        for field in [Field::Alloc, Field::Copy, Field::Synth] {
            let group: Vec<&KernelSpec> = specs
                .iter()
                .filter(|s| field_of(s) == Some(field))
                .collect();
            let mut matched: Vec<&TuningEntry> = Vec::new();
            let mut transfers: Vec<&TuningEntry> = Vec::new();
            // Kernels of the group that no entry for this device covers.
            let mut uncovered: Vec<String> = Vec::new();
            for spec in &group {
                let before = matched.len();
                for e in file.entries_for(spec) {
                    match e.device.compare(device) {
                        KeyMatch::Same => {
                            matched.push(e);
                            if matches!(spec, KernelSpec::TransferPages(_)) {
                                transfers.push(e);
                            }
                        }
                        kind => {
                            let (kind, why) = if kind == KeyMatch::Stale {
                                let why = if e.device.compiler != device.compiler {
                                    "stale: this device, another compiler"
                                } else {
                                    "stale: this device, other kernel sources (another \
                                     cp-hicache build; run `cp-hicache tune` again)"
                                };
                                (WarningKind::Stale, why)
                            } else {
                                (WarningKind::Foreign, "foreign: another device or CPU")
                            };
                            warnings.push(TuningWarning {
                                kind,
                                spec_key: e.spec_key.clone(),
                                message: format!(
                                    "{why}; measured on [{}], this is [{}]",
                                    e.device, device
                                ),
                            })
                        }
                    }
                }
                if matched.len() == before {
                    uncovered.push(spec_key(spec));
                }
            }
            if matched.is_empty() {
                continue;
            }
            if !uncovered.is_empty() {
                // The shape is shared: applying it would run kernels it was never timed or
                // checked on (keys of different kernels cover different fields, e.g. transfer
                // keys have no CP degree, so another deployment's file covers part of a group).
                warnings.push(TuningWarning {
                    kind: WarningKind::Unusable,
                    spec_key: uncovered[0].clone(),
                    message: format!(
                        "the tuned shape is shared with kernels never tuned on this device ({}); \
                         default shapes kept: run `cp-hicache tune --deployment {}`",
                        uncovered.join(", "),
                        self.name
                    ),
                });
                continue;
            }
            let (best, path) = match field {
                Field::Copy => copy_choice(&matched, &transfers),
                _ => (best_common(&matched), TransferPath::Kernel),
            };
            let transfer_best = match field {
                Field::Copy => transfer_shape(&transfers).or(best),
                _ => None,
            };
            let Some(choice) = best else {
                warnings.push(TuningWarning {
                    kind: WarningKind::Unusable,
                    spec_key: matched[0].spec_key.clone(),
                    message: "no launch shape was measured for every kernel sharing it".into(),
                });
                continue;
            };
            let mut next = out.clone();
            match (field, choice) {
                (Field::Alloc, LaunchChoice::Threads { threads }) => next.alloc_threads = threads,
                (Field::Synth, LaunchChoice::Threads { threads }) => next.synth_threads = threads,
                (Field::Copy, c) => match (c.copy_launch(), transfer_best) {
                    (Some(l), Some(t)) => {
                        let Some(t) = t.copy_launch() else { continue };
                        next.copy = l;
                        next.transfer_copy = t;
                        next.transfer_path = path;
                    }
                    _ => continue,
                },
                _ => continue,
            }
            if let Err(e) = next.validate() {
                warnings.push(TuningWarning {
                    kind: WarningKind::Unusable,
                    spec_key: matched[0].spec_key.clone(),
                    message: format!("{choice} is invalid for {}: {e}", self.name),
                });
                continue;
            }
            out = next;
            match field {
                Field::Alloc => applied.alloc_threads = Some(out.alloc_threads),
                Field::Copy => {
                    applied.copy = Some(choice);
                    applied.transfer_copy = transfer_best;
                    applied.transfer_path = Some(out.transfer_path);
                }
                Field::Synth => applied.synth_threads = Some(out.synth_threads),
            }
        }
        for w in &warnings {
            tracing::debug!(target: "cp_hicache::tuning", deployment = %self.name, "{w}");
        }
        (out, warnings, applied)
    }
}

/// The deployment field a kernel's shape feeds; none for the busy kernel (not a deployment
/// kernel: `tune` only runs it beside transfers).
fn field_of(spec: &KernelSpec) -> Option<Field> {
    match spec {
        KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => Some(Field::Alloc),
        KernelSpec::TransferPages(_) | KernelSpec::Materialise(_) => Some(Field::Copy),
        KernelSpec::Synthesise(_) | KernelSpec::Verify(_) => Some(Field::Synth),
        KernelSpec::Busy(_) => None,
    }
}

/// The copy launch shape and the transfer path, decided in that order: transfers take DMA
/// when it beats the best kernel shape for the transfers alone ([`transfer_path`]); the shape
/// then only serves materialise and is its own best, otherwise the best over every kernel
/// sharing it.
fn copy_choice(
    matched: &[&TuningEntry],
    transfers: &[&TuningEntry],
) -> (Option<LaunchChoice>, TransferPath) {
    let path = best_common(transfers).map_or(TransferPath::Kernel, |kernel| {
        transfer_path(transfers, &kernel)
    });
    let rest: Vec<&TuningEntry> = matched
        .iter()
        .filter(|e| !transfers.iter().any(|t| std::ptr::eq(*t, **e)))
        .copied()
        .collect();
    let best = match path {
        TransferPath::Dma | TransferPath::DmaEach if !rest.is_empty() => best_common(&rest),
        _ => best_common(matched),
    };
    (best, path)
}

/// How much slower than the fastest transfer shape (in summed slowdowns) a shape with
/// fewer blocks may be and still be chosen: 5 %.
pub const FEWER_BLOCKS_TOLERANCE: f64 = 0.05;

/// The transfer kernels' own shape: among the kernel choices every transfer entry measured,
/// the one with the fewest blocks ([`LaunchChoice::max_blocks`]; an uncapped grid counts as
/// the most) whose cost is within [`FEWER_BLOCKS_TOLERANCE`] of the cheapest, the cheaper on
/// a tie. On a GPU `tune` times transfers while a compute kernel runs beside them
/// (docs/KERNELS.md "busy"), so this keeps the fewest blocks that hold the bandwidth.
fn transfer_shape(transfers: &[&TuningEntry]) -> Option<LaunchChoice> {
    let choices: BTreeSet<LaunchChoice> = transfers
        .iter()
        .flat_map(|e| e.results.iter())
        .filter(|r| r.seconds.is_some() && !r.choice.is_dma())
        .map(|r| r.choice)
        .collect();
    let costed: Vec<(LaunchChoice, f64)> = choices
        .into_iter()
        .filter_map(|c| relative_cost(transfers, &c).map(|t| (c, t)))
        .collect();
    let cheapest = costed.iter().map(|c| c.1).min_by(f64::total_cmp)?;
    let blocks = |c: &LaunchChoice| match c.max_blocks() {
        0 => u32::MAX,
        n => n,
    };
    costed
        .into_iter()
        .filter(|(_, t)| *t <= cheapest * (1.0 + FEWER_BLOCKS_TOLERANCE))
        .min_by(|a, b| blocks(&a.0).cmp(&blocks(&b.0)).then(a.1.total_cmp(&b.1)))
        .map(|(c, _)| c)
}

/// The cheaper DMA candidate ([`relative_cost`]), `dma` (one batch call) before `dma-each`
/// (one call per merged region) on a tie, when every transfer entry measured it and it beats
/// the given kernel shape's cost over the same entries; the kernel otherwise (also when no
/// DMA candidate was measured for every entry, e.g. a file tuned on the host executor).
/// `dma-each` is a candidate like the others: taken only when it is the fastest.
fn transfer_path(transfers: &[&TuningEntry], kernel: &LaunchChoice) -> TransferPath {
    let cost = |c: &LaunchChoice| relative_cost(transfers, c);
    let dma = [
        (TransferPath::Dma, LaunchChoice::Dma),
        (TransferPath::DmaEach, LaunchChoice::DmaEach),
    ]
    .into_iter()
    .filter_map(|(path, c)| cost(&c).map(|t| (path, t)))
    .min_by(|a, b| a.1.total_cmp(&b.1));
    match (dma, cost(kernel)) {
        (Some((path, dma)), Some(k)) if !transfers.is_empty() && dma < k => path,
        _ => TransferPath::Kernel,
    }
}

/// The cost of running `choice` for every kernel of `entries`: the sum of its slowdowns, each
/// entry's time over that entry's fastest kernel shape (DMA, which is no shape, excluded:
/// an entry whose DMA time is far below its shapes' would otherwise weigh more in the choice
/// of the shape). Ratios, not seconds: entries may
/// come from different `tune` runs (a file grows one deployment at a time, and transfer keys
/// are shared across CP degrees) on a machine whose load moved in between, and a kernel that
/// moves more bytes should not outvote the others. `None` when some entry did not measure it.
fn relative_cost(entries: &[&TuningEntry], choice: &LaunchChoice) -> Option<f64> {
    entries
        .iter()
        .map(|e| {
            let fastest = e
                .results
                .iter()
                .filter(|r| !r.choice.is_dma())
                .filter_map(|r| r.seconds)
                .filter(|s| *s > 0.0)
                .min_by(f64::total_cmp)?;
            Some(e.seconds_of(choice)? / fastest)
        })
        .sum()
}

/// The kernel choice with the smallest [`relative_cost`] over `entries`, among the choices
/// every entry measured (DMA excluded).
fn best_common(entries: &[&TuningEntry]) -> Option<LaunchChoice> {
    let choices: BTreeSet<LaunchChoice> = entries
        .iter()
        .flat_map(|e| e.results.iter())
        .filter(|r| r.seconds.is_some() && !r.choice.is_dma())
        .map(|r| r.choice)
        .collect();
    choices
        .into_iter()
        .filter_map(|c| relative_cost(entries, &c).map(|t| (c, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(c, _)| c)
}

/// The one-call API for engines and `replay --tuning`: applies the tuning file at `path` (or,
/// when `None`, the default `<cache>/tuning.json` if it exists) to `dep` for `device`, and
/// returns the warnings for every entry ignored. An explicit path that cannot be read or parsed
/// is an error; a missing default file is not, and an unreadable default file is a warning
/// ([`TuningFile::load_selected`]).
pub fn apply(
    dep: &mut Deployment,
    path: Option<&Path>,
    device: &DeviceKey,
) -> Result<Vec<TuningWarning>, TuningError> {
    let (file, unreadable) = TuningFile::load_selected(path, &default_path())?;
    let Some(file) = file else {
        return Ok(unreadable);
    };
    let (tuned, warnings, applied) = dep.with_tuning(&file, device);
    tracing::info!(
        target: "cp_hicache::tuning",
        deployment = %dep.name,
        alloc_threads = ?applied.alloc_threads,
        copy = ?applied.copy.map(|c| c.to_string()),
        transfer_path = ?applied.transfer_path.map(|p| p.to_string()),
        synth_threads = ?applied.synth_threads,
        ignored = warnings.len(),
        "tuning applied"
    );
    *dep = tuned;
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(spec_key: &str) -> TuningEntry {
        TuningEntry {
            device: DeviceKey {
                backend: "host".into(),
                device: "test".into(),
                capability: "cpu".into(),
                compiler: "c++".into(),
                kernels: crate::kernels::sources_digest().into(),
            },
            family: "select_owner_pages".into(),
            spec_key: spec_key.into(),
            best: LaunchChoice::Threads { threads: 64 },
            best_seconds: 1e-3,
            workload: "test".into(),
            results: Vec::new(),
        }
    }

    /// A FIFO, a device or an oversized file is refused before anything is read from it (a
    /// FIFO would block the reader; `/dev/zero` never ends).
    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.json");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (path, want) in [
            (fifo.as_path(), "not a regular file (a FIFO)"),
            (Path::new("/dev/zero"), "not a regular file (a device)"),
            (dir.path(), "not a regular file (a directory)"),
        ] {
            let e = TuningFile::load(path).unwrap_err();
            assert!(e.is_usage() && e.to_string().contains(want), "{e}");
        }
        let big = dir.path().join("big.json");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(MAX_TUNING_BYTES + 1)
            .unwrap();
        let e = TuningFile::load(&big).unwrap_err().to_string();
        assert!(
            e.contains("more than the 16777216 a tuning file may have"),
            "{e}"
        );
    }

    #[test]
    fn unreadable_default_file_is_a_warning_but_an_explicit_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("absent.json");
        let (f, w) = TuningFile::load_selected(None, &absent).unwrap();
        assert!(f.is_none() && w.is_empty());

        // Each bad file fails with its own variant, so the format check is proven apart
        // from the JSON parse.
        for (name, text, future) in [
            ("garbage.json", "{not json", false),
            ("future.json", r#"{"format": 99, "entries": []}"#, true),
        ] {
            let bad = dir.path().join(name);
            std::fs::write(&bad, text).unwrap();
            let (f, w) = TuningFile::load_selected(None, &bad).unwrap();
            assert!(f.is_none());
            assert_eq!(w.len(), 1);
            assert_eq!(w[0].kind, WarningKind::UnreadableFile);
            let shown = w[0].to_string();
            assert!(shown.contains(&*bad.to_string_lossy()), "{shown}");
            let err = TuningFile::load_selected(Some(&bad), &absent).unwrap_err();
            let right = if future {
                matches!(err, TuningError::Format { found: 99, .. })
            } else {
                matches!(err, TuningError::Parse { .. })
            };
            assert!(right, "{name}: {err}");
        }

        let good = dir.path().join("good.json");
        TuningFile::default().save(&good).unwrap();
        let (f, w) = TuningFile::load_selected(None, &good).unwrap();
        assert_eq!((f, w), (Some(TuningFile::default()), Vec::new()));
    }

    #[test]
    fn a_shared_shape_is_chosen_by_slowdowns_not_by_seconds() {
        let t = |threads| LaunchChoice::Threads { threads };
        let timed = |key: &str, times: &[(u32, f64)]| {
            let mut e = entry(key);
            e.results = times
                .iter()
                .map(|&(threads, s)| CandidateResult {
                    choice: t(threads),
                    seconds: Some(s),
                    gbps: None,
                    dropped: None,
                    beside_busy: None,
                })
                .collect();
            e
        };
        // The slow kernel (a run on a loaded machine, or more bytes) barely prefers 32
        // threads; the fast one is 3x slower with them. Summed seconds pick 32 (10.0 + 0.3
        // against 10.5 + 0.1); summed slowdowns pick 64 (1 + 3 against 1.05 + 1).
        let slow = timed("slow", &[(32, 10.0), (64, 10.5)]);
        let fast = timed("fast", &[(32, 0.3), (64, 0.1)]);
        assert_eq!(best_common(&[&slow, &fast]), Some(t(64)));
        // A fast DMA time does not make its entry weigh more: against the best shape, A's
        // 32 -> 64 costs 0.2 and B's 64 -> 32 costs 0.5, so 64 wins (against DMA, 32 would).
        let mut a = timed("a", &[(32, 1.0), (64, 1.2)]);
        a.results.push(CandidateResult {
            choice: LaunchChoice::Dma,
            seconds: Some(0.1),
            gbps: None,
            dropped: None,
            beside_busy: None,
        });
        let b = timed("b", &[(32, 1.5), (64, 1.0)]);
        assert_eq!(best_common(&[&a, &b]), Some(t(64)));
        // A choice one entry never measured is not a candidate.
        let partial = timed("partial", &[(32, 1.0)]);
        assert_eq!(best_common(&[&slow, &partial]), Some(t(32)));
        assert_eq!(relative_cost(&[&slow, &partial], &t(64)), None);
    }

    /// `dma-each` is a candidate like the others: the path takes it only when it beats both
    /// the batched `dma` (a tie goes to `dma`) and the kernel shape; a dropped `dma` (a
    /// driver without the batch call) leaves `dma-each` to compete with the kernel alone.
    #[test]
    fn dma_each_is_taken_only_when_it_is_the_fastest() {
        let shape = LaunchChoice::Threads { threads: 64 };
        let result = |choice, seconds: Option<f64>| CandidateResult {
            choice,
            seconds,
            gbps: None,
            dropped: seconds.is_none().then(|| "not timed".into()),
            beside_busy: None,
        };
        let path = |kernel: f64, dma: Option<f64>, each: Option<f64>| {
            let mut e = entry("t");
            e.results = vec![
                result(shape, Some(kernel)),
                result(LaunchChoice::Dma, dma),
                result(LaunchChoice::DmaEach, each),
            ];
            transfer_path(&[&e], &shape)
        };
        assert_eq!(path(1.0, Some(0.5), Some(0.6)), TransferPath::Dma);
        assert_eq!(path(1.0, Some(0.5), Some(0.5)), TransferPath::Dma);
        assert_eq!(path(1.0, Some(0.5), Some(0.4)), TransferPath::DmaEach);
        assert_eq!(path(0.3, Some(0.5), Some(0.4)), TransferPath::Kernel);
        assert_eq!(path(1.0, None, Some(0.4)), TransferPath::DmaEach);
        assert_eq!(path(1.0, None, Some(1.0)), TransferPath::Kernel);
        assert_eq!(path(1.0, Some(0.9), None), TransferPath::Dma);
        assert_eq!(path(1.0, None, None), TransferPath::Kernel);
    }

    #[test]
    fn concurrent_merges_keep_every_result() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning.json");
        std::thread::scope(|s| {
            let merges: Vec<_> = (0..8)
                .map(|i| {
                    let path = &path;
                    s.spawn(move || TuningFile::merge_into(path, vec![entry(&format!("k{i}"))]))
                })
                .collect();
            for m in merges {
                m.join().unwrap().unwrap();
            }
        });
        let mut keys: Vec<String> = TuningFile::load(&path)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.spec_key)
            .collect();
        keys.sort();
        assert_eq!(keys, (0..8).map(|i| format!("k{i}")).collect::<Vec<_>>());
        // Only the file remains: no temporary file, no lock file is left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["tuning.json"]);
    }

    #[test]
    fn merge_refuses_to_overwrite_an_unreadable_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning.json");
        std::fs::write(&path, "{not json").unwrap();
        let err = TuningFile::merge_into(&path, vec![entry("k")]).unwrap_err();
        assert!(matches!(err, TuningError::Parse { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{not json");
        assert!(!dir.path().join(".tuning.json.lock").exists());
    }
}
