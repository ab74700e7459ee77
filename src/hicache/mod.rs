//! HiCache, the hierarchical (device → host) KV cache of one rank.
//!
//! For now this holds only the per-rank radix tree ([`tree`]): the deterministic index that
//! says which token prefixes are resident on the device, backed up on the host, or both. The
//! layer that glues the tree to the allocator and the transfer kernels (`write_cp`,
//! `load_cp`) builds on it. [`decode`] is a CPU reference decode step that shows what a
//! verified hit means for attention output.

pub mod decode;
pub mod host_pool;
pub mod tree;
