//! The [`Jit`] driver: cache lookups, compiling and committing misses, warm-up and event logs.

use super::cache::{self, Lookup, Manifest, NewEntry};
use super::identity::LibraryStamp;
use super::key::{self, KeyInputs};
use super::{
    nvrtc, validate_uri, Artifact, CacheError, CacheHit, CacheKey, CompiledKernel, DiskCache,
    HostCcError, HostCcOptions, HostCompiler, JitConfig, JitError, JitMode, JitRequest,
    NvrtcCompiler, NvrtcError, NvrtcOptions, Target,
};
use rayon::prelude::*;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Instant;

enum Compiler {
    /// NVRTC itself is loaded only when something must be compiled.
    Nvrtc(NvrtcOptions),
    Host(HostCompiler, HostCcOptions),
}

struct Plan {
    compiler: Compiler,
    compiler_id: String,
    args: Vec<String>,
    key: CacheKey,
    target_dir: String,
}

/// The whole host compiler command line with placeholder paths: the key covers the
/// arguments added around the options too, not only the options.
fn host_key_args(opts: &HostCcOptions) -> Vec<String> {
    HostCompiler::command_args(opts, Path::new("<source>"), Path::new("<output>"))
}

/// A disk hit whose manifest describes another entry (another full key hash, uri or target,
/// e.g. a copied or hand-edited directory) is corrupt: the directory name is only a prefix of
/// the key, so the manifest is what vouches for the artifact.
fn for_request(found: Lookup, req: &JitRequest, hash: &str, target: &str) -> Lookup {
    let Lookup::Hit(entry) = found else {
        return found;
    };
    let m = &entry.manifest;
    let mismatch = if m.key != hash {
        Some(format!("manifest key {} is not {hash}", m.key))
    } else if m.uri != req.uri {
        Some(format!("manifest uri {:?} is not {:?}", m.uri, req.uri))
    } else if m.target != target {
        Some(format!("manifest target {:?} is not {target:?}", m.target))
    } else {
        None
    };
    match mismatch {
        Some(reason) => Lookup::Corrupt {
            dir: entry.dir,
            reason,
        },
        None => Lookup::Hit(entry),
    }
}

fn corrupt_entry(req: &JitRequest, path: PathBuf, reason: String) -> JitError {
    tracing::debug!(
        target: "cp_hicache::jit",
        uri = %req.uri,
        target_name = %req.target,
        path = %path.display(),
        reason = %reason,
        "corrupt JIT cache entry with CP_HICACHE_JIT=off"
    );
    JitError::CorruptEntry {
        uri: req.uri.clone(),
        path,
        reason,
    }
}

/// The JIT front end: compilers (loaded lazily), the disk cache and the in-memory map.
pub struct Jit {
    pub(super) config: JitConfig,
    pub(super) cache: DiskCache,
    pub(super) nvrtc: OnceLock<Result<NvrtcCompiler, NvrtcError>>,
    host: OnceLock<Result<HostCompiler, HostCcError>>,
    memory: RwLock<HashMap<String, CompiledKernel>>,
}

impl fmt::Debug for Jit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Jit")
            .field("cache_dir", &self.config.cache_dir)
            .field("mode", &self.config.mode)
            .finish_non_exhaustive()
    }
}

impl Jit {
    /// A JIT with this configuration. Nothing is loaded until the first request.
    pub fn new(config: JitConfig) -> Jit {
        Jit {
            cache: DiskCache::new(config.cache_dir.clone()),
            config,
            nvrtc: OnceLock::new(),
            host: OnceLock::new(),
            memory: RwLock::new(HashMap::new()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &JitConfig {
        &self.config
    }

    /// The disk cache.
    pub fn cache(&self) -> &DiskCache {
        &self.cache
    }

    /// The NVRTC compiler, loading it on first use.
    pub fn nvrtc(&self) -> Result<&NvrtcCompiler, JitError> {
        if !self.config.nvrtc_enabled {
            return Err(JitError::NvrtcUnavailable {
                searched: vec!["nothing: NVRTC disabled by JitConfig::nvrtc_enabled".to_string()],
                requested: None,
            });
        }
        self.nvrtc
            .get_or_init(NvrtcCompiler::load)
            .as_ref()
            .map_err(|e| e.clone().into())
    }
    /// The host compiler, detecting it on first use.
    pub fn host_compiler(&self) -> Result<&HostCompiler, JitError> {
        self.host
            .get_or_init(|| {
                HostCompiler::detect_within(self.config.cxx.as_deref(), self.config.compile_timeout)
            })
            .as_ref()
            .map_err(|e| e.clone().into())
    }

    /// Forgets the in-memory map (the disk cache is untouched).
    pub fn clear_memory(&self) {
        self.memory
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    fn plan(&self, req: &JitRequest) -> Result<Plan, JitError> {
        let (compiler, compiler_id) = match req.target {
            Target::Nvrtc { arch } => (
                Compiler::Nvrtc(self.config.nvrtc.clone().with_arch(arch)),
                self.nvrtc_identity()?,
            ),
            Target::Host { sanitize } => {
                let cc = self.host_compiler()?.clone();
                let id = format!("{} [{}]", cc.identity(), cc.program());
                let opts = self.config.host.clone().with_sanitize(sanitize);
                (Compiler::Host(cc, opts), id)
            }
        };
        let (key, args) = self.key_with(req, &compiler_id);
        Ok(Plan {
            compiler,
            compiler_id,
            args,
            key,
            target_dir: req.target.to_string(),
        })
    }

    /// The cache key a request would use (loads the compiler to learn its version).
    pub fn key_for(&self, req: &JitRequest) -> Result<CacheKey, JitError> {
        validate_uri(&req.uri)?;
        Ok(self.plan(req)?.key)
    }

    /// Returns the compiled kernel for a request: from memory, from disk, or by compiling it.
    ///
    /// Errors: an invalid uri, a missing compiler, a compile error (with the full log), a cache
    /// I/O error, or [`JitError::JitOff`] on a miss when compiling is off. A corrupt disk entry
    /// (its artifact does not match its manifest, or its manifest names another key, uri or
    /// target) is never loaded: it is logged, discarded and recompiled, or, when compiling is
    /// off, left untouched and reported as [`JitError::CorruptEntry`].
    pub fn get(&self, req: &JitRequest) -> Result<CompiledKernel, JitError> {
        let start = Instant::now();
        let result = self.resolve(req, start);
        if let Err(e) = &result {
            tracing::debug!(
                target: "cp_hicache::jit",
                uri = %req.uri,
                target_name = %req.target,
                cache = "failed",
                ms = start.elapsed().as_secs_f64() * 1e3,
                error = %e,
                "jit"
            );
        }
        result
    }

    /// [`Jit::get`] without the failure event.
    fn resolve(&self, req: &JitRequest, start: Instant) -> Result<CompiledKernel, JitError> {
        validate_uri(&req.uri)?;
        let plan = match self.plan(req) {
            Ok(plan) => plan,
            // No compiler here: a prebuilt cache may still hold the entry.
            Err(e) if e.is_unavailable() && self.config.mode == JitMode::Off => {
                return self.get_prebuilt(req, start);
            }
            Err(e) => return Err(e),
        };
        let ms = |s: Instant| s.elapsed().as_secs_f64() * 1e3;

        let cached = self
            .memory
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&plan.key.hash)
            .cloned();
        if let Some(mut k) = cached {
            k.cache_hit = CacheHit::Memory;
            k.compile_ms = ms(start);
            self.log(&k);
            return Ok(k);
        }

        let cache_err = |source: CacheError| JitError::Cache {
            uri: req.uri.clone(),
            source: Arc::new(source),
        };
        let (td, name) = (plan.target_dir.as_str(), plan.key.readable.as_str());
        let lookup = || -> Result<Lookup, JitError> {
            let found = self.cache.lookup(td, name).map_err(cache_err)?;
            Ok(for_request(found, req, &plan.key.hash, td))
        };
        // Fast path without the lock: committed entries only appear by rename, manifest last.
        if let Lookup::Hit(entry) = lookup()? {
            return Ok(self.finish(req, &plan.key, *entry, CacheHit::Disk, ms(start)));
        }
        // The lock only keeps two compilers of one entry apart. With compiling off nothing is
        // written, not even a lock file: a prebuilt cache is left exactly as it was, and a
        // read-only one answers a miss with JitOff rather than a lock-file error. (Commits
        // are atomic, manifest last, so reading beside another process's commit is safe.)
        let lock = match self.config.mode {
            JitMode::Off => None,
            JitMode::On => {
                let wait = Instant::now();
                let lock = self.cache.lock(td, name).map_err(cache_err)?;
                let waited = ms(wait);
                if waited >= 1.0 {
                    // Another thread or process held the entry: usually compiling it.
                    tracing::debug!(
                        target: "cp_hicache::jit",
                        uri = %req.uri,
                        target_name = %req.target,
                        ms = waited,
                        "waited for the entry lock"
                    );
                }
                Some(lock)
            }
        };
        let corrupt = match lookup()? {
            Lookup::Hit(entry) => {
                return Ok(self.finish(req, &plan.key, *entry, CacheHit::Disk, ms(start)))
            }
            Lookup::Corrupt { dir, reason } if self.config.mode == JitMode::Off => {
                // A prebuilt cache is never modified; the error comes once the key is confirmed.
                Some((dir, reason))
            }
            Lookup::Corrupt { dir, reason } => {
                tracing::warn!(
                    target: "cp_hicache::jit",
                    uri = %req.uri,
                    target_name = %req.target,
                    key = %plan.key.readable,
                    path = %dir.display(),
                    reason = %reason,
                    "corrupt JIT cache entry discarded"
                );
                self.cache.discard(td, name).map_err(cache_err)?;
                None
            }
            Lookup::Miss => None,
        };
        if matches!(plan.compiler, Compiler::Nvrtc(_)) {
            // The key may rest on a remembered NVRTC identity: confirm it with the library itself
            // before declaring a miss.
            match self.nvrtc() {
                Ok(nv) if nv.identity() != plan.compiler_id => {
                    tracing::warn!(
                        target: "cp_hicache::jit",
                        remembered = %plan.compiler_id,
                        loaded = %nv.identity(),
                        "NVRTC identity changed; re-keying"
                    );
                    let id = nv.identity();
                    if let Some(stamp) = nvrtc::locate()
                        .and_then(|p| LibraryStamp::of(&p))
                        .filter(|s| nv.library() == Some(s.library.as_path()))
                    {
                        self.remember_identity(stamp, &id);
                    }
                    drop(lock);
                    // NVRTC is loaded now, so `plan` asks it directly: no further recursion.
                    return self.resolve(req, start);
                }
                Ok(_) => {}
                Err(e) if e.is_unavailable() && self.config.mode == JitMode::Off => {
                    drop(lock);
                    return self.get_prebuilt(req, start);
                }
                Err(e) => return Err(e),
            }
        }
        if let Some((path, reason)) = corrupt {
            return Err(corrupt_entry(req, path, reason));
        }
        if self.config.mode == JitMode::Off {
            let path = self.cache.entry_dir(td, name).map_err(cache_err)?;
            return Err(JitError::JitOff {
                uri: req.uri.clone(),
                key: plan.key.readable.clone(),
                path,
            });
        }

        let compile_start = Instant::now();
        let (bytes, artifact_file, extra) = match &plan.compiler {
            Compiler::Nvrtc(opts) => {
                let nv = self.nvrtc()?;
                let out = nv.compile(&req.uri, &req.source, opts)?;
                let extra = serde_json::json!({ "report": out.report, "log": out.log });
                (out.cubin, format!("{}.cubin", req.uri), extra)
            }
            Compiler::Host(cc, opts) => {
                let so = cc.compile(&req.uri, &req.source, &self.config.emu_header, opts)?;
                (so, format!("{}.so", req.uri), serde_json::Value::Null)
            }
        };
        let compile_ms = ms(compile_start);
        let source_file = format!("{}.cu", req.uri);
        let manifest = Manifest::describe(
            &req.uri,
            &plan.key.hash,
            td,
            &plan.compiler_id,
            plan.args.clone(),
            compile_ms,
            extra,
        );
        let entry = self
            .cache
            .commit(
                td,
                name,
                NewEntry {
                    artifact_file: &artifact_file,
                    artifact: &bytes,
                    source_file: &source_file,
                    source: &req.source,
                    manifest,
                },
            )
            .map_err(cache_err)?;
        drop(lock);
        Ok(self.finish(req, &plan.key, entry, CacheHit::Miss, ms(start)))
    }

    /// The key of a request under a given compiler identity, and the compiler arguments it
    /// covers (recorded in the manifest). Needs no compiler, so a prebuilt entry can be
    /// matched on a machine that has none.
    fn key_with(&self, req: &JitRequest, compiler_id: &str) -> (CacheKey, Vec<String>) {
        let (args, digest, header) = match req.target {
            Target::Nvrtc { arch } => {
                let opts = self.config.nvrtc.clone().with_arch(arch);
                (opts.to_args(), key::stable_digest(&opts), None)
            }
            Target::Host { sanitize } => {
                let opts = self.config.host.clone().with_sanitize(sanitize);
                (
                    host_key_args(&opts),
                    key::stable_digest(&opts),
                    Some(self.config.emu_header.as_str()),
                )
            }
        };
        let key = CacheKey::compute(&KeyInputs {
            crate_version: env!("CARGO_PKG_VERSION"),
            uri: &req.uri,
            source: &req.source,
            compiler: compiler_id,
            options_args: &args,
            options_digest: digest,
            target: &req.target.to_string(),
            emu_header: header,
            env: &self.config.env,
        });
        (key, args)
    }

    /// Prebuilt-only lookup when the target's compiler (NVRTC or the host C++ compiler) is
    /// unavailable and JIT is off: the compiler version (a key input) is unknown, so every committed entry
    /// `<cache>/<target>/<uri>-*/` is considered, its key recomputed from the request with the
    /// compiler its manifest names, and it is used only if exactly one entry both reproduces its
    /// own key (same crate version, uri, source, options, arch and environment) and passes its
    /// integrity check. When none passes but an entry of this uri is corrupt,
    /// [`JitError::CorruptEntry`] names it; otherwise [`JitError::JitOff`].
    fn get_prebuilt(&self, req: &JitRequest, start: Instant) -> Result<CompiledKernel, JitError> {
        let cache_err = |source: CacheError| JitError::Cache {
            uri: req.uri.clone(),
            source: Arc::new(source),
        };
        let td = req.target.to_string();
        let target_root = self.cache.root().join(&td);
        let prefix = format!("{}-", req.uri);
        let mut names: Vec<String> = match std::fs::read_dir(&target_root) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    n.len() == prefix.len() + CacheKey::PREFIX_HEX
                        && n.starts_with(&prefix)
                        && n[prefix.len()..].bytes().all(|b| b.is_ascii_hexdigit())
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        names.sort();
        let mut matches: Vec<(CacheKey, cache::CacheEntry)> = Vec::new();
        // Entries of this uri that may be the one asked for but fail their integrity check.
        let mut corrupt: Vec<(PathBuf, String)> = Vec::new();
        for name in &names {
            let dir = target_root.join(name);
            let Ok(text) = std::fs::read(dir.join(cache::MANIFEST)) else {
                continue;
            };
            let manifest = match serde_json::from_slice::<Manifest>(&text) {
                Ok(m) => m,
                Err(e) => {
                    corrupt.push((dir, format!("unreadable manifest: {e}")));
                    continue;
                }
            };
            let (key, _) = self.key_with(req, &manifest.compiler);
            if key.hash != manifest.key || &key.readable != name {
                continue;
            }
            let found = self.cache.lookup(&td, name).map_err(cache_err)?;
            match for_request(found, req, &key.hash, &td) {
                Lookup::Hit(entry) => matches.push((key, *entry)),
                Lookup::Corrupt { dir, reason } => {
                    tracing::warn!(
                        target: "cp_hicache::jit",
                        uri = %req.uri,
                        path = %dir.display(),
                        reason = %reason,
                        "corrupt prebuilt JIT cache entry not used"
                    );
                    corrupt.push((dir, reason));
                }
                Lookup::Miss => {}
            }
        }
        if matches.is_empty() {
            if let Some((path, reason)) = corrupt.into_iter().next() {
                return Err(corrupt_entry(req, path, reason));
            }
        }
        if matches.len() == 1 {
            if let Some((key, entry)) = matches.pop() {
                let cached = self
                    .memory
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key.hash)
                    .cloned();
                let elapsed = start.elapsed().as_secs_f64() * 1e3;
                if let Some(mut k) = cached {
                    k.cache_hit = CacheHit::Memory;
                    k.compile_ms = elapsed;
                    self.log(&k);
                    return Ok(k);
                }
                return Ok(self.finish(req, &key, entry, CacheHit::Disk, elapsed));
            }
        }
        let key = format!(
            "{prefix}* (NVRTC unavailable; {} prebuilt entries match, exactly one is needed)",
            matches.len()
        );
        tracing::debug!(
            target: "cp_hicache::jit",
            uri = %req.uri,
            target_name = %req.target,
            path = %target_root.display(),
            matching = matches.len(),
            "JIT miss with CP_HICACHE_JIT=off and no NVRTC"
        );
        Err(JitError::JitOff {
            uri: req.uri.clone(),
            key,
            path: target_root,
        })
    }

    fn finish(
        &self,
        req: &JitRequest,
        key: &CacheKey,
        entry: cache::CacheEntry,
        hit: CacheHit,
        elapsed_ms: f64,
    ) -> CompiledKernel {
        let (artifact, report) = match req.target {
            Target::Nvrtc { .. } => {
                let report = entry
                    .manifest
                    .extra
                    .get("report")
                    .and_then(|r| serde_json::from_value(r.clone()).ok());
                (Artifact::Cubin(Arc::from(entry.artifact)), report)
            }
            Target::Host { .. } => (Artifact::SharedObject(entry.artifact_path), None),
        };
        let k = CompiledKernel {
            uri: req.uri.clone(),
            target: req.target,
            artifact,
            report,
            compile_ms: elapsed_ms,
            cache_hit: hit,
            key: key.clone(),
            entry_dir: entry.dir,
        };
        self.memory
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.hash.clone(), k.clone());
        self.log(&k);
        k
    }

    fn log(&self, k: &CompiledKernel) {
        tracing::info!(
            target: "cp_hicache::jit",
            uri = %k.uri,
            target_name = %k.target,
            key = %k.key.readable,
            cache = %k.cache_hit,
            ms = k.compile_ms,
            path = %k.entry_dir.display(),
            "jit"
        );
    }

    /// Compiles (or loads) every request in parallel; one result per request, in order.
    pub fn warm_up(&self, requests: &[JitRequest]) -> Vec<Result<CompiledKernel, JitError>> {
        self.warm_up_with(requests, |_| {})
    }

    /// [`Jit::warm_up`], calling `on_done` (from a worker thread) as each request finishes, e.g.
    /// to advance a progress bar.
    pub fn warm_up_with(
        &self,
        requests: &[JitRequest],
        on_done: impl Fn(&Result<CompiledKernel, JitError>) + Sync,
    ) -> Vec<Result<CompiledKernel, JitError>> {
        let start = Instant::now();
        let results: Vec<Result<CompiledKernel, JitError>> = requests
            .par_iter()
            .map(|r| {
                let result = self.get(r);
                on_done(&result);
                result
            })
            .collect();
        let count = |h: CacheHit| {
            results
                .iter()
                .filter(|r| matches!(r, Ok(k) if k.cache_hit == h))
                .count()
        };
        tracing::info!(
            target: "cp_hicache::jit",
            kernels = requests.len(),
            compiled = count(CacheHit::Miss),
            disk_hits = count(CacheHit::Disk),
            memory_hits = count(CacheHit::Memory),
            failed = results.iter().filter(|r| r.is_err()).count(),
            ms = start.elapsed().as_secs_f64() * 1e3,
            "jit warm-up"
        );
        results
    }
}
