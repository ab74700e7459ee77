//! Page tables: how the kernels reach a device pool, whoever laid it out. A pool is one
//! pointer per layer (per owner and layer, for materialise) to that layer's first page, and
//! a stride from page to page, so one kernel serves the cache's own `[layer][page][bytes]`
//! pools, an engine's per-layer tensors (SGLang), and one cross-layer tensor in either order
//! (vLLM's `[page][layer]`: the stride spans every layer). The executor checks each pointer
//! and writes the table at launch ([`KernelArg::Table`]).

use crate::exec::{BufferId, KernelArg};

/// A device pool as a kernel's page table argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTable {
    /// Where the executor writes the addresses: 8 bytes per entry, 8-byte aligned, in device
    /// memory the launch may read.
    pub at: (BufferId, u64),
    /// Each layer's first page (for materialise, owner-major: `owner × layers + layer`).
    pub entries: Vec<(BufferId, u64)>,
    /// Bytes from one page of a layer to the next: a multiple of 16, at least a page.
    pub page_stride: u32,
}

impl PageTable {
    /// The table of a `[layers][pages][page_bytes]` pool in `buffer` (the cache's own pools):
    /// layer `l` at `l × pages × page_bytes`, pages `page_bytes` apart.
    pub fn layer_major(
        at: (BufferId, u64),
        buffer: BufferId,
        layers: u32,
        pages: u32,
        page_bytes: u64,
    ) -> PageTable {
        PageTable {
            at,
            entries: (0..layers)
                .map(|l| (buffer, u64::from(l) * u64::from(pages) * page_bytes))
                .collect(),
            page_stride: page_stride(page_bytes),
        }
    }

    /// The launch argument.
    pub fn arg(&self) -> KernelArg<'_> {
        KernelArg::Table(self.at.0, self.at.1, &self.entries)
    }

    /// The table of layers `range` alone (a launch told `layers = range.len()`).
    pub fn layers(&self, range: std::ops::Range<usize>) -> PageTable {
        PageTable {
            at: self.at,
            entries: self.entries[range].to_vec(),
            page_stride: self.page_stride,
        }
    }
}

/// A page's bytes as a stride. Pages are a few tens of KiB; one of 4 GiB or more has no
/// stride a `u32` can say, so the launch is refused by the executor's check of the stride
/// (given as 0, which no page of more than 0 bytes accepts) rather than wrapped.
pub fn page_stride(page_bytes: u64) -> u32 {
    u32::try_from(page_bytes).unwrap_or(0)
}
