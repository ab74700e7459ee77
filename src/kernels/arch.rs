//! The target GPU architecture of a deployment's NVRTC builds.

use std::fmt;

/// A CUDA GPU architecture the NVRTC path can emit a CUBIN for: the target of a deployment
/// (the render itself is arch-independent), one enum shared with the JIT so a deployment's
/// arch needs no translation.
///
/// The default is `sm_90` (Hopper), the architecture the kernels are tuned for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    /// Ampere (A100), compute capability 8.0.
    Sm80,
    /// Hopper (H100/H200), compute capability 9.0.
    #[default]
    Sm90,
    /// Blackwell (B200), compute capability 10.0.
    Sm100,
}

impl Arch {
    /// Every supported architecture, in ascending order (for compile matrices).
    pub const ALL: [Arch; 3] = [Arch::Sm80, Arch::Sm90, Arch::Sm100];

    /// The `(major, minor)` compute capability, as the driver reports it.
    pub fn compute_capability(self) -> (u32, u32) {
        match self {
            Arch::Sm80 => (8, 0),
            Arch::Sm90 => (9, 0),
            Arch::Sm100 => (10, 0),
        }
    }

    /// The architecture matching a driver-reported compute capability, if supported.
    pub fn from_compute_capability(major: u32, minor: u32) -> Option<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.compute_capability() == (major, minor))
    }

    /// The newest supported architecture whose CUBINs a device of compute capability
    /// `major.minor` runs: CUBINs run on the same major version with an equal or higher
    /// minor (an sm_80 CUBIN runs on sm_86), never across major versions.
    pub fn for_device(major: u32, minor: u32) -> Option<Arch> {
        Arch::ALL.into_iter().rev().find(|a| {
            let (ma, mi) = a.compute_capability();
            ma == major && mi <= minor
        })
    }
}

impl fmt::Display for Arch {
    /// The spelling NVRTC and cache directories use (`sm_90`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability();
        write!(f, "sm_{major}{minor}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_spelling() {
        assert_eq!(Arch::default().to_string(), "sm_90");
        assert_eq!(Arch::for_device(9, 0), Some(Arch::Sm90));
        assert_eq!(Arch::for_device(8, 6), Some(Arch::Sm80));
        assert_eq!(Arch::for_device(10, 3), Some(Arch::Sm100));
        assert_eq!(Arch::for_device(12, 0), None);
        assert_eq!(Arch::for_device(7, 5), None);
        assert_eq!(Arch::from_compute_capability(8, 0), Some(Arch::Sm80));
        assert_eq!(Arch::from_compute_capability(7, 5), None);
    }
}
