//! Measurement building blocks shared by `tune`, `bench` and `bench --check`: workload sizes,
//! median timing, the buffers and argument lists of each kernel family (docs/KERNELS.md), the
//! baselines (`memcpy` on the host, pinned `cuMemcpyAsync` on CUDA, the Rust references), the
//! DMA path of transfers, and compiling
//! plus loading a set of specs through the JIT.

mod allocator;
mod busy;
mod compile;
mod copy;
mod synth;
#[cfg(test)]
mod tests;
mod timing;
mod workload;

pub use allocator::{AllocBench, AllocInputs};
pub use busy::{Beside, BesideTiming, BusyBench, CompanionShape, StampedRun, Stamps};
pub use compile::{compile_and_load, target_for, SourceHook};
pub use copy::{
    baseline_name, no_dma_path, time_copy_baseline, CopyBench, CopyPages, TransferBuffers,
};
pub use synth::{synth_pages, SynthBench};
pub use timing::{time_device, time_with, Sizes, Timing};
pub use workload::{u32_bytes, SplitMix};
