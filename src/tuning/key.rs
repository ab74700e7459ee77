//! What a tuning result is valid for: the device it was measured on ([`DeviceKey`]) and the
//! kernel it describes independently of its launch shape ([`spec_key`]).

use serde::{Deserialize, Serialize};
use std::fmt;

use super::TuningError;
use crate::exec::{Backend, Executor};
use crate::jit::{Arch, Jit, Sanitize, Target};
use crate::kernels::{sources_digest, KernelSpec, TokenOrder};

/// The machine identity a tuning entry was measured on. An entry is applied only when every
/// field matches the device at hand, so a file copied between machines, or kept across a
/// compiler upgrade, is never misapplied.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceKey {
    /// `host` or `cuda`: which executor ran the candidates.
    pub backend: String,
    /// The executor's device name (the GPU's name, or the host emulator's description).
    pub device: String,
    /// The architecture the kernels were built for (`sm_90`; an sm_86 card runs `sm_80`
    /// CUBINs, and its name is in `device`), or the CPU model from `/proc/cpuinfo` on the
    /// host executor.
    pub capability: String,
    /// The compiler identity: NVRTC's version, or the host C++ compiler's `--version` line.
    pub compiler: String,
    /// [`sources_digest`] of the build that measured: the
    /// same shape on other kernel code is another kernel. Empty in files written before it
    /// existed, which are therefore stale.
    #[serde(default)]
    pub kernels: String,
}

impl fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} / {} / {} / {} / kernels {}",
            self.backend,
            self.device,
            self.capability,
            self.compiler,
            if self.kernels.is_empty() {
                "unknown"
            } else {
                &self.kernels
            }
        )
    }
}

/// The compiler identity recorded when no compiler is available (prebuilt kernels only).
pub const PREBUILT_COMPILER: &str = "prebuilt kernels (compiler not available)";

/// How a stored key relates to the device at hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyMatch {
    /// Same device and compiler: the entry applies.
    Same,
    /// Same device, other compiler or other kernel sources (an upgrade): the entry is stale.
    Stale,
    /// Another device or backend: the entry is foreign.
    Foreign,
}

impl DeviceKey {
    /// Compares a stored key with the device at hand.
    pub fn compare(&self, current: &DeviceKey) -> KeyMatch {
        if self == current {
            KeyMatch::Same
        } else if self.backend == current.backend
            && self.device == current.device
            && self.capability == current.capability
        {
            KeyMatch::Stale
        } else {
            KeyMatch::Foreign
        }
    }

    /// The key of `exec` with the compilers of `jit`: on the host, the CPU model and the host
    /// C++ compiler; on CUDA, the compute capability the JIT targets and NVRTC's version. A
    /// machine without the compiler (running a prebuilt cache with `CP_HICACHE_JIT=off`) gets
    /// [`PREBUILT_COMPILER`], so its results never match a machine that compiles.
    pub fn for_executor(exec: &dyn Executor, jit: &Jit) -> Result<DeviceKey, TuningError> {
        match exec.backend() {
            Backend::Cuda => Ok(DeviceKey {
                backend: Backend::Cuda.to_string(),
                device: exec.device_name(),
                capability: match crate::jit::target_for(exec, Arch::default(), Sanitize::None)? {
                    Target::Nvrtc { arch } => arch.to_string(),
                    Target::Host { .. } => Arch::default().to_string(),
                },
                compiler: jit
                    .nvrtc_identity()
                    .unwrap_or_else(|_| PREBUILT_COMPILER.to_string()),
                kernels: sources_digest().to_string(),
            }),
            _ => {
                let compiler = jit
                    .host_compiler()
                    .map(|c| c.identity().to_string())
                    .unwrap_or_else(|_| PREBUILT_COMPILER.to_string());
                // Sanitised builds run far slower and differently: their winners are theirs.
                let compiler = match Sanitize::from_env()? {
                    Sanitize::None => compiler,
                    s => format!("{compiler} [sanitize={s}]"),
                };
                Ok(DeviceKey {
                    backend: Backend::Host.to_string(),
                    device: exec.device_name(),
                    capability: cpu_model(),
                    compiler,
                    kernels: sources_digest().to_string(),
                })
            }
        }
    }
}

/// The CPU model name (`model name` in `/proc/cpuinfo`; on Arm, which has none, the
/// implementer, variant and part codes), or the architecture when the file is missing or has
/// neither.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| parse_cpu_model(&text))
        .unwrap_or_else(|| format!("unknown {} CPU", std::env::consts::ARCH))
}

/// The first `model name` value of a `/proc/cpuinfo` text, else its first Arm core
/// identification (`arm implementer 0x41 variant 0x1 part 0xd0c`).
pub fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    let value = |key: &str| {
        cpuinfo.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    value("model name").or_else(|| {
        let implementer = value("CPU implementer")?;
        let part = value("CPU part")?;
        let variant = value("CPU variant").unwrap_or_else(|| "?".into());
        Some(format!(
            "arm implementer {implementer} variant {variant} part {part}"
        ))
    })
}

/// The kernel a spec describes without its launch shape: the uri minus the thread, pages per
/// block, vector width and unroll parts (`transfer_pages_d2h_pf_ps64_b656_b132`,
/// `select_owner_pages_cp8_ps64`). Every tuning candidate of a spec has the same key.
pub fn spec_key(spec: &KernelSpec) -> String {
    let fam = spec.family();
    match spec {
        // Without token locations the select is other code (its own best block size).
        KernelSpec::SelectOwnerPages(s) => format!(
            "{fam}_cp{}_ps{}{}",
            s.cp,
            s.page_size,
            s.output.uri_suffix()
        ),
        KernelSpec::ReleasePages(s) => format!("{fam}_cp{}", s.cp),
        KernelSpec::TransferPages(s) => s.stem(),
        KernelSpec::Materialise(s) => {
            format!("{fam}_cp{}_ps{}_b{}", s.cp, s.page_size, s.bytes_per_token)
        }
        // A token-interleaved kernel is other code than the paged one: its own key.
        KernelSpec::Synthesise(s) => {
            let order = match s.order {
                TokenOrder::Paged => String::new(),
                TokenOrder::Interleaved { run, .. } => format!("_ti{run}"),
            };
            format!("{fam}_{}_cp{}_ps{}{order}", s.buffer, s.cp, s.page_size)
        }
        KernelSpec::Verify(s) => {
            let order = match s.order {
                TokenOrder::Paged => String::new(),
                TokenOrder::Interleaved { cp, run } => format!("_cp{cp}ti{run}"),
            };
            format!("{fam}_{}_ps{}{order}", s.buffer, s.page_size)
        }
        KernelSpec::Busy(_) => fam.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Deployment;

    #[test]
    fn token_interleaved_kernels_have_keys_of_their_own() {
        let paged = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let ti = Deployment::by_name("nsa_ps64_cp8_ti1").unwrap();
        let b = crate::kernels::BufferKind::NsaKv;
        assert_eq!(
            spec_key(&ti.synth_spec(b)),
            "synthesise_nsa_kv_cp8_ps64_ti1"
        );
        assert_eq!(spec_key(&ti.verify_spec(b)), "verify_nsa_kv_ps64_cp8ti1");
        assert_ne!(
            spec_key(&paged.verify_spec(b)),
            spec_key(&ti.verify_spec(b))
        );
        assert_eq!(
            spec_key(&paged.materialise_spec(b)),
            spec_key(&ti.materialise_spec(b))
        );
    }

    /// The select without token locations is tuned on its own: its best block size need
    /// not be the other's.
    #[test]
    fn the_selects_with_and_without_locations_have_keys_of_their_own() {
        use crate::kernels::SelectOutput;
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        assert_eq!(
            spec_key(&dep.select_spec(SelectOutput::PagesAndLocs)),
            "select_owner_pages_cp8_ps64"
        );
        assert_eq!(
            spec_key(&dep.select_spec(SelectOutput::Pages)),
            "select_owner_pages_cp8_ps64_nolocs"
        );
    }

    #[test]
    fn spec_key_is_shape_independent() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        for spec in dep.specs() {
            let key = spec_key(&spec);
            assert!(spec.uri().starts_with(&key), "{key} vs {}", spec.uri());
            for c in spec.candidates() {
                assert_eq!(spec_key(&c), key);
            }
        }
    }

    #[test]
    fn cpu_model_parses() {
        let text = "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags: x\n";
        assert_eq!(
            parse_cpu_model(text).as_deref(),
            Some("AMD EPYC 9654 96-Core Processor")
        );
        assert_eq!(parse_cpu_model("nothing"), None);
        let arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n\
                   CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd0c\n";
        assert_eq!(
            parse_cpu_model(arm).as_deref(),
            Some("arm implementer 0x41 variant 0x1 part 0xd0c")
        );
    }

    #[test]
    fn compare_classifies() {
        let a = DeviceKey {
            backend: "host".into(),
            device: "d".into(),
            capability: "cpu".into(),
            compiler: "gcc 12".into(),
            kernels: sources_digest().into(),
        };
        let mut b = a.clone();
        assert_eq!(b.compare(&a), KeyMatch::Same);
        b.compiler = "gcc 13".into();
        assert_eq!(b.compare(&a), KeyMatch::Stale);
        // Other kernel sources, or none recorded (a file from before the field), are stale.
        for kernels in ["0123456789ab", ""] {
            let mut k = a.clone();
            k.kernels = kernels.into();
            assert_eq!(k.compare(&a), KeyMatch::Stale, "{kernels:?}");
        }
        b.device = "other".into();
        assert_eq!(b.compare(&a), KeyMatch::Foreign);
    }
}
