//! cp-hicache: a context-parallel aware hierarchical KV cache whose data paths are
//! template-rendered CUDA kernels, JIT-compiled with NVRTC, and run on the CPU through an
//! emulation executor when no GPU is present.
#![deny(missing_docs)]
pub mod exec;
