//! Deterministic inputs and buffer ownership shared by every bench: the splitmix64 stream that
//! fixes page ids and hashes, kernel-input bytes, and the buffer list freed on drop.

use crate::exec::{BufferId, ExecError, Executor, MemKind};

/// Deterministic splitmix64 stream (fixed seeds keep runs comparable).
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::kernels::reference::mix64(self.0)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// The first `take` entries of a random permutation of `0..n`.
    pub fn sample(&mut self, n: u32, take: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        let take = take.min(n) as usize;
        for i in 0..take {
            let j = i + self.below((v.len() - i) as u64) as usize;
            v.swap(i, j);
        }
        v.truncate(take);
        v
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// Little-endian bytes of a `u32` slice (kernel inputs).
pub fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Frees a list of buffers when dropped.
pub(super) struct Owned<'e> {
    pub(super) exec: &'e dyn Executor,
    pub(super) ids: Vec<BufferId>,
}

impl Owned<'_> {
    pub(super) fn alloc(
        &mut self,
        kind: MemKind,
        bytes: u64,
        fill: u8,
    ) -> Result<BufferId, ExecError> {
        let id = self.exec.alloc(kind, bytes.max(1) as usize, fill)?;
        self.ids.push(id);
        Ok(id)
    }
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            let _ = self.exec.free(id);
        }
    }
}
