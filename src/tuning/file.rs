//! The tuning file: JSON, one entry per (device, kernel family, shape-independent spec key),
//! written atomically, and applied to a [`Deployment`] only where the device key matches.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use super::candidate::LaunchChoice;
use super::key::{spec_key, DeviceKey, KeyMatch};
use super::TuningError;
use crate::jit::DiskCache;
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

impl Default for TuningFile {
    fn default() -> Self {
        TuningFile {
            format: TUNING_FORMAT,
            entries: Vec::new(),
        }
    }
}

impl TuningFile {
    /// Reads and checks a tuning file.
    pub fn load(path: &Path) -> Result<TuningFile, TuningError> {
        let text = std::fs::read_to_string(path).map_err(|source| TuningError::Io {
            op: "read",
            path: path.to_path_buf(),
            source,
        })?;
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

    /// Writes the file atomically (a temporary file in the same directory, then a rename), so
    /// a reader never sees half a file.
    pub fn save(&self, path: &Path) -> Result<(), TuningError> {
        let io = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| TuningError::Io { op, path, source }
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(io("create dir", &dir))?;
        let mut text = serde_json::to_string_pretty(self).map_err(|source| TuningError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        text.push('\n');
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| TUNING_FILE_NAME.to_string());
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, text).map_err(io("write", &tmp))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            TuningError::Io {
                op: "rename",
                path: path.to_path_buf(),
                source: e,
            }
        })
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

/// Why a tuning entry was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WarningKind {
    /// Measured on another device or backend.
    Foreign,
    /// Measured on this device with another compiler.
    Stale,
    /// Its choice does not fit the deployment (no common candidate, invalid shape).
    Unusable,
}

/// A tuning entry that was ignored, and why. Also logged with `tracing::warn!`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuningWarning {
    /// The reason class.
    pub kind: WarningKind,
    /// The spec key concerned.
    pub spec_key: String,
    /// A readable explanation naming both devices where relevant.
    pub message: String,
}

impl fmt::Display for TuningWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tuning for {} ignored: {}", self.spec_key, self.message)
    }
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
    /// directions and materialise of every buffer) takes the candidate with the smallest total
    /// time among those measured for all of them. DMA results are not a kernel shape; they
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
            let group: Vec<&KernelSpec> = specs.iter().filter(|s| field_of(s) == field).collect();
            let mut matched: Vec<&TuningEntry> = Vec::new();
            let mut transfers: Vec<&TuningEntry> = Vec::new();
            for spec in &group {
                for e in file.entries_for(spec) {
                    match e.device.compare(device) {
                        KeyMatch::Same => {
                            matched.push(e);
                            if matches!(spec, KernelSpec::TransferPages(_)) {
                                transfers.push(e);
                            }
                        }
                        kind => warnings.push(TuningWarning {
                            kind: if kind == KeyMatch::Stale {
                                WarningKind::Stale
                            } else {
                                WarningKind::Foreign
                            },
                            spec_key: e.spec_key.clone(),
                            message: format!("measured on [{}], this is [{}]", e.device, device),
                        }),
                    }
                }
            }
            if matched.is_empty() {
                continue;
            }
            let (best, path) = match field {
                Field::Copy => copy_choice(&matched, &transfers),
                _ => (best_common(&matched), TransferPath::Kernel),
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
                (Field::Copy, c) => match c.copy_launch() {
                    Some(l) => {
                        next.copy = l;
                        next.transfer_path = path;
                    }
                    None => continue,
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
                    applied.transfer_path = Some(out.transfer_path);
                }
                Field::Synth => applied.synth_threads = Some(out.synth_threads),
            }
        }
        for w in &warnings {
            tracing::warn!(target: "cp_hicache::tuning", deployment = %self.name, "{w}");
        }
        (out, warnings, applied)
    }
}

fn field_of(spec: &KernelSpec) -> Field {
    match spec {
        KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => Field::Alloc,
        KernelSpec::TransferPages(_) | KernelSpec::Materialise(_) => Field::Copy,
        KernelSpec::Synthesise(_) | KernelSpec::Verify(_) => Field::Synth,
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
        TransferPath::Dma if !rest.is_empty() => best_common(&rest),
        _ => best_common(matched),
    };
    (best, path)
}

/// DMA when every transfer entry measured it and its summed time beats the given kernel
/// shape's summed time over the same entries; the kernel otherwise (also when some entry has
/// no DMA time, e.g. a file tuned on the host executor).
fn transfer_path(transfers: &[&TuningEntry], kernel: &LaunchChoice) -> TransferPath {
    let sum = |c: &LaunchChoice| -> Option<f64> { transfers.iter().map(|e| e.seconds_of(c)).sum() };
    match (sum(&LaunchChoice::Dma), sum(kernel)) {
        (Some(dma), Some(k)) if !transfers.is_empty() && dma < k => TransferPath::Dma,
        _ => TransferPath::Kernel,
    }
}

/// The kernel choice with the smallest summed time over `entries`, among the choices every
/// entry measured (DMA excluded).
fn best_common(entries: &[&TuningEntry]) -> Option<LaunchChoice> {
    let choices: BTreeSet<LaunchChoice> = entries
        .iter()
        .flat_map(|e| e.results.iter())
        .filter(|r| r.seconds.is_some() && r.choice != LaunchChoice::Dma)
        .map(|r| r.choice)
        .collect();
    choices
        .into_iter()
        .filter_map(|c| {
            let total: Option<f64> = entries.iter().map(|e| e.seconds_of(&c)).sum();
            total.map(|t| (c, t))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(c, _)| c)
}

/// The one-call API for engines and `replay --tuning`: applies the tuning file at `path` (or,
/// when `None`, the default `<cache>/tuning.json` if it exists) to `dep` for `device`, and
/// returns the warnings for every entry ignored. An explicit path that cannot be read or parsed
/// is an error; a missing default file is not.
pub fn apply(
    dep: &mut Deployment,
    path: Option<&Path>,
    device: &DeviceKey,
) -> Result<Vec<TuningWarning>, TuningError> {
    let file = match path {
        Some(p) => TuningFile::load(p)?,
        None => {
            let p = default_path();
            if !p.exists() {
                tracing::debug!(target: "cp_hicache::tuning", path = %p.display(), "no tuning file");
                return Ok(Vec::new());
            }
            TuningFile::load(&p)?
        }
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
