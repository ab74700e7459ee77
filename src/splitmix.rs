//! The splitmix64 finaliser, below every other module: the kernels' references
//! ([`kernels::reference::mix64`](crate::kernels::reference::mix64) re-exports it), the
//! workloads and the CUDA executor's process token all use it, and the executors import
//! nothing from the kernels.

/// The splitmix64 finaliser.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
