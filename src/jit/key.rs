//! The cache key: one SHA-256 over everything that can change the compiled bytes, plus a
//! readable prefix (`<uri>-<16 hex>`) used as the entry's directory name.

use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};

/// Environment variables that can change what a compiler produces (GCC also finds its
/// sub-programs and link inputs through `COMPILER_PATH` and `LIBRARY_PATH`); their values (or
/// absence) are part of every key. Kept sorted.
pub const KEY_ENV_ALLOWLIST: &[&str] = &[
    "COMPILER_PATH",
    "CPATH",
    "CPLUS_INCLUDE_PATH",
    "CXX",
    "C_INCLUDE_PATH",
    "GCC_EXEC_PREFIX",
    "LIBRARY_PATH",
];

/// Snapshot of the allow-listed environment, sorted by name (`None` = unset), taken once so that
/// keys do not change under a running process.
pub fn capture_env(allow: &[&str]) -> Vec<(String, Option<String>)> {
    let mut env: Vec<(String, Option<String>)> = allow
        .iter()
        .map(|name| (name.to_string(), std::env::var(name).ok()))
        .collect();
    env.sort();
    env.dedup();
    env
}

/// A [`Hasher`] that feeds every byte it is given into SHA-256, so a `#[derive(Hash)]` value gets
/// a digest that is stable across processes (unlike `DefaultHasher`, which is randomly seeded
/// per build of std and not meant to be persisted).
#[derive(Default)]
pub struct Sha256Hasher(Sha256);

impl Sha256Hasher {
    /// The SHA-256 of everything written so far.
    pub fn digest(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

impl Hasher for Sha256Hasher {
    fn finish(&self) -> u64 {
        let d = self.0.clone().finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        u64::from_le_bytes(b)
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    // Fixed-width little-endian encodings, so the digest does not depend on the platform.
    fn write_usize(&mut self, i: usize) {
        self.0.update((i as u64).to_le_bytes());
    }

    fn write_isize(&mut self, i: isize) {
        self.0.update((i as i64).to_le_bytes());
    }
}

/// SHA-256 of a value's derived `Hash` stream.
pub fn stable_digest<T: Hash + ?Sized>(value: &T) -> [u8; 32] {
    let mut h = Sha256Hasher::default();
    value.hash(&mut h);
    h.digest()
}

/// Everything a key covers. Build one per request; [`CacheKey::compute`] turns it into a key.
#[derive(Debug, Clone, Copy)]
pub struct KeyInputs<'a> {
    /// The crate version (`CARGO_PKG_VERSION`): a new release never reuses old binaries.
    pub crate_version: &'a str,
    /// Readable kernel name (the spec's `uri()`); also the entry point.
    pub uri: &'a str,
    /// The rendered source.
    pub source: &'a str,
    /// Compiler identity and version (`nvrtc 12.9 (sha256 …)`, or the first line of `c++ --version`).
    pub compiler: &'a str,
    /// The options' flag vector.
    pub options_args: &'a [String],
    /// [`stable_digest`] of the options struct (covers fields that are not flags).
    pub options_digest: [u8; 32],
    /// Target directory name (`sm_90`, `host`, `host-asan`).
    pub target: &'a str,
    /// The emulation header text, for host builds.
    pub emu_header: Option<&'a str>,
    /// Allow-listed environment, sorted (see [`capture_env`]).
    pub env: &'a [(String, Option<String>)],
}

/// A content-addressed cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// Full SHA-256, lower-case hex (64 characters).
    pub hash: String,
    /// `<uri>-<first 16 hex of hash>`: the entry's directory name and the log label.
    pub readable: String,
}

impl CacheKey {
    /// Number of hash hex digits kept in the readable name.
    pub const PREFIX_HEX: usize = 16;

    /// Hashes all inputs, each tagged and length-prefixed so fields cannot run into each other.
    pub fn compute(inputs: &KeyInputs<'_>) -> CacheKey {
        let mut h = Sha256::new();
        let mut field = |tag: &str, bytes: &[u8]| {
            h.update((tag.len() as u64).to_le_bytes());
            h.update(tag.as_bytes());
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field("format", b"cp-hicache-jit-key-v1");
        field("crate_version", inputs.crate_version.as_bytes());
        field("uri", inputs.uri.as_bytes());
        field("source", inputs.source.as_bytes());
        field("compiler", inputs.compiler.as_bytes());
        for arg in inputs.options_args {
            field("arg", arg.as_bytes());
        }
        field("options_digest", &inputs.options_digest);
        field("target", inputs.target.as_bytes());
        match inputs.emu_header {
            Some(text) => field("emu_header", text.as_bytes()),
            None => field("no_emu_header", b""),
        }
        let mut env: Vec<&(String, Option<String>)> = inputs.env.iter().collect();
        env.sort();
        for (name, value) in env {
            field("env_name", name.as_bytes());
            match value {
                Some(v) => field("env_value", v.as_bytes()),
                None => field("env_unset", b""),
            }
        }
        let hash = hex::encode(h.finalize());
        let readable = format!("{}-{}", inputs.uri, &hash[..Self::PREFIX_HEX]);
        CacheKey { hash, readable }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Hash)]
    struct Opt {
        a: u32,
        b: Vec<String>,
    }

    #[test]
    fn stable_digest_is_deterministic_and_sensitive() {
        let x = Opt {
            a: 1,
            b: vec!["x".into()],
        };
        let y = Opt {
            a: 2,
            b: vec!["x".into()],
        };
        assert_eq!(stable_digest(&x), stable_digest(&x));
        assert_ne!(stable_digest(&x), stable_digest(&y));
    }

    #[test]
    fn readable_prefix() {
        let env = vec![];
        let args = vec![];
        let k = CacheKey::compute(&KeyInputs {
            crate_version: "0.1.0",
            uri: "k_ps64",
            source: "s",
            compiler: "c",
            options_args: &args,
            options_digest: [0; 32],
            target: "sm_90",
            emu_header: None,
            env: &env,
        });
        assert_eq!(k.hash.len(), 64);
        assert_eq!(k.readable, format!("k_ps64-{}", &k.hash[..16]));
    }

    #[test]
    fn env_order_does_not_matter() {
        let args = vec![];
        let a = vec![
            ("A".to_string(), Some("1".to_string())),
            ("B".to_string(), None),
        ];
        let b = vec![
            ("B".to_string(), None),
            ("A".to_string(), Some("1".to_string())),
        ];
        let mk = |env| {
            CacheKey::compute(&KeyInputs {
                crate_version: "0.1.0",
                uri: "k",
                source: "s",
                compiler: "c",
                options_args: &args,
                options_digest: [0; 32],
                target: "host",
                emu_header: Some("h"),
                env,
            })
        };
        assert_eq!(mk(&a), mk(&b));
    }
}
