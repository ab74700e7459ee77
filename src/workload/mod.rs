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
    /// Where its generated tokens come from ([`Request::output`]).
    pub answer: Answer,
    /// The 1-based line of the trace it was read from (none for generated workloads).
    pub line: Option<usize>,
}

impl Request {
    /// The first `n` tokens it generates (`--decode-tokens`): deterministic, so every rank
    /// and every run decodes the same ones; `n` may exceed [`Request::output_tokens`].
    pub fn output(&self, n: usize) -> Vec<u32> {
        (0..n as u64).map(|j| self.answer.token(j)).collect()
    }
}

/// The generated tokens of a request, as a continuation of block contents: token `j` is
/// token `offset + j` of a run of blocks of `block_tokens` tokens, the first named `block`
/// and each later one derived from it.
///
/// A conversation's answer is one fresh block, the very block its next turn appends: a later
/// turn hits the decoded answer. A trace's answer continues the request's last block (so
/// the next turn's copy of that block hits), then blocks no trace names: the format does
/// not say which hash ids hold a previous answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The block the answer starts in.
    pub block: u64,
    /// Position of the answer's first token in that block.
    pub offset: u64,
    /// Tokens per block.
    pub block_tokens: u64,
}

impl Answer {
    /// Generated token `j`.
    pub fn token(&self, j: u64) -> u32 {
        let at = self.offset + j;
        let bt = self.block_tokens.max(1);
        let k = at / bt;
        let block = if k == 0 {
            self.block
        } else {
            mix64(self.block ^ k.wrapping_mul(GOLDEN)) | (1 << 63)
        };
        block_token(block, at % bt, VOCAB)
    }
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
