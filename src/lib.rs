//! cp-hicache: a context-parallel (CP) aware hierarchical KV cache whose data paths are
//! template-rendered CUDA kernels, JIT-compiled with NVRTC, and run on the CPU through an
//! emulation executor when no GPU is present.
//!
//! With CP degree C each KV page is owned by one rank and attention reads every page from its
//! owner. A cache hit must therefore load pages back into pages with *the same owners* they
//! were written from; otherwise decoding silently reads pages nobody loaded. This crate makes
//! that the only possible way to load, and verifies every hit byte for byte.
//!
//! ```
//! use cp_hicache::{allocator::OwnerLaneAllocator, layout::{CpLayout, zigzag_owners}};
//!
//! let layout = CpLayout::new(2, 64, 1024)?;
//! let mut alloc = OwnerLaneAllocator::new(layout);
//! let owners = zigzag_owners(2, 5); // 0,0,1,1,0
//! let run = alloc.alloc_pages_with_owners(&owners)?;
//! let got: Vec<u8> = run.pages().iter().map(|&p| layout.owner(p).0).collect();
//! assert_eq!(got, owners);
//! # Ok::<(), cp_hicache::Error>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod allocator;
/// The binary's commands; public for `src/main.rs` and the CLI tests, not a library API.
#[doc(hidden)]
pub mod cli;
pub mod cluster;
mod env;
mod error;
pub mod exec;
pub mod group;
pub mod hicache;
pub mod jit;
pub mod kernels;
pub mod layout;
pub mod metadata;
pub mod ops;
pub mod rank;
mod splitmix;
pub mod storage;
pub mod tuning;
pub mod workload;

pub use error::Error;
