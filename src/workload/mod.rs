//! Request streams for replay: real Mooncake-format traces read by path, and a built-in,
//! seeded generator of multi-turn conversations with shared system prompts.
//!
//! Both yield [`Request`]s one at a time, so a long trace is never expanded into memory at
//! once. Token ids are deterministic functions of the input, so every replica and every run
//! sees the same tokens, and the synthesised KV (a function of the token prefix) is
//! reproducible.

mod synthetic;
mod trace;

pub use synthetic::{Conversations, ConversationsConfig};
pub use trace::{
    max_line_bytes, MooncakeTrace, TraceConfig, MAX_BLOCK_TOKENS, MAX_LINE_BYTES,
    MOONCAKE_BLOCK_TOKENS,
};

use std::path::PathBuf;

/// One prompt to prefill, then (notionally) decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Position of the request in its workload (0-based).
    pub id: usize,
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Tokens the request would generate; conversations append them to the next turn.
    pub output_tokens: u32,
    /// The 1-based line of the trace it was read from (none for generated workloads).
    pub line: Option<usize>,
}

/// Why a workload could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The trace path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A trace line is not a valid record; `line` is 1-based.
    #[error("{path}:{line}: {message}")]
    BadLine {
        /// The trace path.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A trace line is longer than [`max_line_bytes`]: no record needs that much, so the
    /// file is not a JSON-lines trace or is corrupt. Read no further than the limit.
    #[error(
        "{path}:{line}: the line is longer than {limit} bytes, more than any trace record \
         needs: not a JSON-lines trace, or a corrupt one"
    )]
    LineTooLong {
        /// The trace path.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The limit in bytes ([`max_line_bytes`] of the trace's block size).
        limit: usize,
    },
    /// A configuration value is out of range.
    #[error("invalid workload setting: {0}")]
    Config(String),
}

impl WorkloadError {
    /// The 1-based trace line the error is about, if it is about one.
    pub fn line(&self) -> Option<usize> {
        match self {
            WorkloadError::BadLine { line, .. } | WorkloadError::LineTooLong { line, .. } => {
                Some(*line)
            }
            WorkloadError::Io { .. } | WorkloadError::Config(_) => None,
        }
    }
}

/// The longest prompt accepted, in tokens (a trace's `input_length`, a generated
/// conversation's longest turn); anything longer is a corrupt record or a mistaken setting.
pub const MAX_PROMPT_TOKENS: u64 = 16 * 1024 * 1024;

pub(crate) use crate::kernels::reference::mix64;

/// The golden-ratio increment of splitmix64; keeps zero inputs away from `mix64(0) == 0`.
pub(crate) const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Token id of position `j` inside a block whose content is named by `block`.
pub(crate) fn block_token(block: u64, j: u64, vocab: u32) -> u32 {
    (mix64((block.wrapping_mul(0x1_0000_0001) ^ j).wrapping_add(GOLDEN)) % u64::from(vocab)) as u32
}

/// Vocabulary size tokens are drawn from (DeepSeek-V3's is 129,280).
pub const VOCAB: u32 = 129_280;
