//! HiCache, the hierarchical (device → host) KV cache of one rank.
//!
//! The per-rank pieces: the radix tree ([`tree`]), the deterministic index that says which
//! token prefixes are resident on the device, backed up on the host, or both, and the host
//! page pool ([`host_pool`]). The glue that drives them with the allocator and the transfer
//! kernels (load-back, backup, eviction) for one rank is
//! [`RankCache`](crate::rank::RankCache). [`decode`] is a CPU reference decode step that shows
//! what a verified hit means for attention output.

pub mod decode;
pub mod host_pool;
pub mod tree;
