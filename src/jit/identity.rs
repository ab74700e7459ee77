//! The NVRTC identity remembered per library file, so that a warm start need not load NVRTC.

use super::{nvrtc, Jit, JitError, JitMode};
use std::path::PathBuf;

/// File in the cache root remembering each NVRTC library's identity. (`v2`: identities include
/// the library's digest; records of the older `nvrtc-identity.json`, version only, are not
/// reused.)
pub const NVRTC_IDENTITY_FILE: &str = "nvrtc-identity.v2.json";

/// What identifies one library file on disk: a changed file changes its length or mtime.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct LibraryStamp {
    pub(super) library: PathBuf,
    len: u64,
    mtime_ns: u64,
}

impl LibraryStamp {
    pub(super) fn of(path: &std::path::Path) -> Option<LibraryStamp> {
        let meta = std::fs::metadata(path).ok()?;
        let mtime_ns = meta
            .modified()
            .ok()?
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_nanos();
        let mtime_ns = u64::try_from(mtime_ns).ok()?;
        Some(LibraryStamp {
            library: path.to_path_buf(),
            len: meta.len(),
            mtime_ns,
        })
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct IdentityRecord {
    stamp: LibraryStamp,
    identity: String,
}

impl Jit {
    /// The NVRTC identity ([`NvrtcCompiler::identity`]: version and library digest) that goes
    /// into cache and tuning keys, without loading NVRTC when possible: once NVRTC is loaded it
    /// is asked directly; otherwise the library that discovery would load is located (no
    /// `dlopen`, no hashing) and its identity is read from
    /// `<cache>/nvrtc-identity.v2.json`, recorded per (path, length, mtime) the first time that
    /// library was loaded. A warm start thus reads cache entries without paying the NVRTC load;
    /// a miss loads NVRTC anyway and re-keys if the remembered identity was wrong.
    ///
    /// [`NvrtcCompiler::identity`]: super::NvrtcCompiler::identity
    pub fn nvrtc_identity(&self) -> Result<String, JitError> {
        if let Some(Ok(nv)) = self.nvrtc.get() {
            return Ok(nv.identity());
        }
        let located = if self.config.nvrtc_enabled {
            nvrtc::locate().and_then(|p| LibraryStamp::of(&p))
        } else {
            None
        };
        if let Some(stamp) = &located {
            if let Some(id) = self.remembered_identity(stamp) {
                return Ok(id);
            }
        }
        let nv = self.nvrtc()?;
        let id = nv.identity();
        if let Some(stamp) = located.filter(|s| nv.library() == Some(s.library.as_path())) {
            self.remember_identity(stamp, &id);
        }
        Ok(id)
    }

    fn remembered_identity(&self, stamp: &LibraryStamp) -> Option<String> {
        let text = self.cache.read_aux(NVRTC_IDENTITY_FILE)?;
        let known: Vec<IdentityRecord> = serde_json::from_slice(&text).ok()?;
        known
            .into_iter()
            .find(|r| &r.stamp == stamp)
            .map(|r| r.identity)
    }

    pub(super) fn remember_identity(&self, stamp: LibraryStamp, identity: &str) {
        if self.config.mode == JitMode::Off {
            return; // a prebuilt cache is left exactly as it was
        }
        let mut known: Vec<IdentityRecord> = self
            .cache
            .read_aux(NVRTC_IDENTITY_FILE)
            .and_then(|t| serde_json::from_slice(&t).ok())
            .unwrap_or_default();
        known.retain(|r| r.stamp.library != stamp.library);
        known.push(IdentityRecord {
            stamp,
            identity: identity.to_string(),
        });
        let written = serde_json::to_vec_pretty(&known)
            .map_err(|e| e.to_string())
            .and_then(|t| {
                self.cache
                    .write_aux(NVRTC_IDENTITY_FILE, &t)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            tracing::debug!(target: "cp_hicache::jit", error = %e, "NVRTC identity not recorded");
        }
    }
}
