//! Operation [`Counters`]: what an executor has launched, read back, synchronised, allocated
//! and copied, so a caller can assert that a path is free of stalls.

#[cfg(doc)]
use super::Executor;

/// Operation counts since the executor was created. Take a snapshot before a scope and call
/// [`Counters::since`] after it to get that scope's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    /// Kernel launches (including failed ones).
    pub launches: u64,
    /// Synchronisations: explicit ones ([`Executor::synchronize`], [`Executor::time_work`])
    /// and, on CUDA, writes to pinned host memory, which wait for the device. Frees, which
    /// also wait on CUDA, are counted in `frees` only ([`Counters::stalls`] adds them up).
    pub syncs: u64,
    /// Read-backs ([`Executor::read`]); each one waits for the work writing the buffer.
    pub reads: u64,
    /// Bytes read back.
    pub bytes_read: u64,
    /// Uploads ([`Executor::upload`]).
    pub uploads: u64,
    /// Bytes uploaded.
    pub bytes_uploaded: u64,
    /// Buffer allocations, and on CUDA the pinned staging rings uploads had to allocate
    /// (a page-locked allocation stalls concurrent streams, as a device allocation does).
    pub allocs: u64,
    /// Buffers freed ([`Executor::free`]), on every backend (as `allocs` counts allocations);
    /// on CUDA the memory goes back to the driver once the executor's streams are past the
    /// free (events, queried later; never a context-wide synchronisation), and `cuMemFree`
    /// itself may still stall the device.
    pub frees: u64,
    /// Copy batches ([`Executor::copy_regions`]).
    pub copies: u64,
    /// Bytes moved by copy batches.
    pub bytes_copied: u64,
    /// Fill batches ([`Executor::fill`]).
    pub fills: u64,
    /// Bytes written by fill batches.
    pub bytes_filled: u64,
}

impl Counters {
    /// What a path that must not stall the device adds up to, and must keep at 0: read-backs,
    /// synchronisations, allocations and frees. Each waits for the device, or stalls other
    /// streams, on CUDA; counting all four on every backend lets a CPU test see a path that
    /// would stall a GPU.
    pub fn stalls(&self) -> u64 {
        self.reads + self.syncs + self.allocs + self.frees
    }

    /// `self` and `other` added up (a caller's share of work counted in pieces).
    pub fn plus(&self, other: &Counters) -> Counters {
        Counters {
            launches: self.launches + other.launches,
            syncs: self.syncs + other.syncs,
            reads: self.reads + other.reads,
            bytes_read: self.bytes_read + other.bytes_read,
            uploads: self.uploads + other.uploads,
            bytes_uploaded: self.bytes_uploaded + other.bytes_uploaded,
            allocs: self.allocs + other.allocs,
            frees: self.frees + other.frees,
            copies: self.copies + other.copies,
            bytes_copied: self.bytes_copied + other.bytes_copied,
            fills: self.fills + other.fills,
            bytes_filled: self.bytes_filled + other.bytes_filled,
        }
    }

    /// Counts accumulated between `earlier` and `self`.
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            launches: self.launches.saturating_sub(earlier.launches),
            syncs: self.syncs.saturating_sub(earlier.syncs),
            reads: self.reads.saturating_sub(earlier.reads),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            uploads: self.uploads.saturating_sub(earlier.uploads),
            bytes_uploaded: self.bytes_uploaded.saturating_sub(earlier.bytes_uploaded),
            allocs: self.allocs.saturating_sub(earlier.allocs),
            frees: self.frees.saturating_sub(earlier.frees),
            copies: self.copies.saturating_sub(earlier.copies),
            bytes_copied: self.bytes_copied.saturating_sub(earlier.bytes_copied),
            fills: self.fills.saturating_sub(earlier.fills),
            bytes_filled: self.bytes_filled.saturating_sub(earlier.bytes_filled),
        }
    }

    /// True when the scope neither read back nor synchronised.
    pub fn is_sync_free(&self) -> bool {
        self.reads == 0 && self.syncs == 0
    }
}
