//! Mooncake-format traces: one JSON object per line with `timestamp`, `input_length`,
//! `output_length` and `hash_ids`, where each hash id names one block of
//! [`TraceConfig::block_tokens`] prompt tokens (512 in the published traces; equal ids mean
//! equal prefixes).
//!
//! Requests are replayed in file order. Timestamps are checked (finite, `>= 0`, or absent) but
//! do not reorder or pace the replay: a trace out of timestamp order replays in the order of
//! its lines.
//!
//! A line is read at most [`MAX_LINE_BYTES`] at a time, so a corrupt file (a huge line, or no
//! newline at all) costs bounded memory. [`MooncakeTrace::check`] reads a whole trace without
//! expanding a token, so a replay can refuse a bad line before any work.

use super::{block_token, Answer, Request, WorkloadError, MAX_PROMPT_TOKENS, VOCAB};
use serde::Deserialize;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// Tokens per hash id in the published Mooncake traces (the default `--block-tokens`).
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Largest `--block-tokens`: a hash id stands for at most this many tokens.
pub const MAX_BLOCK_TOKENS: u32 = 64 * 1024;

/// The widest record of 512-token blocks at the longest prompt: per block an id of up to
/// 19 digits and a `", "` separator, plus the other fields.
const WIDEST_512_RECORD: usize = (MAX_PROMPT_TOKENS / MOONCAKE_BLOCK_TOKENS) as usize * 21 + 256;

/// The longest trace line read (4 MiB), newline excluded, for blocks of 256 tokens or more:
/// about six times the widest record of 512-token blocks. Smaller blocks need more ids per
/// record, and get twice their widest record instead ([`max_line_bytes`]). A longer line is
/// [`WorkloadError::LineTooLong`].
pub const MAX_LINE_BYTES: usize = 4 << 20;

/// The longest line read for a trace of `block_tokens`-token blocks: [`MAX_LINE_BYTES`], or
/// twice the widest valid record (an id of up to 19 digits and a separator per block of the
/// longest prompt, plus the other fields) when that is more.
pub fn max_line_bytes(block_tokens: u32) -> usize {
    let ids = MAX_PROMPT_TOKENS.div_ceil(u64::from(block_tokens.max(1)));
    let widest = usize::try_from(ids * 21 + 256).unwrap_or(usize::MAX);
    MAX_LINE_BYTES.max(widest.saturating_mul(2))
}

const _: () = assert!(MAX_LINE_BYTES >= 4 * WIDEST_512_RECORD);

/// How a trace is replayed.
#[derive(Clone, Debug)]
pub struct TraceConfig {
    /// Tokens one hash id stands for: the trace's block size (512 in the published traces),
    /// 1..=[`MAX_BLOCK_TOKENS`]. A record with `input_length` tokens has exactly
    /// `ceil(input_length / block_tokens)` hash ids and replays as `input_length` tokens.
    pub block_tokens: u32,
    /// Tokens each hash id becomes in the replay, when not `block_tokens` (1..=
    /// [`MAX_BLOCK_TOKENS`]): every block, and the input and output lengths, scale by
    /// `replay_block_tokens / block_tokens` (the last block keeps at least one token). Keeps
    /// CPU replays of long-prompt traces fast while the prefix structure stays the trace's.
    pub replay_block_tokens: Option<u32>,
    /// Take at most this many requests.
    pub max_requests: Option<usize>,
}

impl TraceConfig {
    /// A trace of `block_tokens`-token blocks, replayed at its own scale, every request.
    pub fn new(block_tokens: u32) -> TraceConfig {
        TraceConfig {
            block_tokens,
            replay_block_tokens: None,
            max_requests: None,
        }
    }
}

#[derive(Deserialize)]
struct Record {
    timestamp: Option<f64>,
    input_length: i64,
    output_length: i64,
    hash_ids: Vec<i64>,
}

/// A record that passed every check, not yet expanded into tokens.
struct Checked {
    hash_ids: Vec<i64>,
    input_length: u64,
    output_length: u32,
}

/// A streaming reader of a Mooncake trace; yields one [`Request`] per non-blank line.
pub struct MooncakeTrace {
    path: PathBuf,
    reader: BufReader<File>,
    line_no: usize,
    next_id: usize,
    config: TraceConfig,
}

/// JSON's whitespace: a line of nothing else is blank (skipped). Other Unicode whitespace
/// (NBSP, U+2028) is no JSON, so a line of it is a bad record.
const JSON_WHITESPACE: [char; 4] = [' ', '\t', '\r', '\n'];

/// serde's message with the column only: the line is ours (serde sees one line at a time,
/// so its own line number is always 1).
fn json_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    match full.strip_suffix(&position) {
        Some(message) => format!("{message} at column {}", e.column()),
        None => full,
    }
}

impl MooncakeTrace {
    /// Opens a trace file.
    pub fn open(path: &Path, config: TraceConfig) -> Result<Self, WorkloadError> {
        if config.block_tokens == 0 || config.block_tokens > MAX_BLOCK_TOKENS {
            return Err(WorkloadError::Config(format!(
                "--block-tokens {} is out of range 1..={MAX_BLOCK_TOKENS}",
                config.block_tokens
            )));
        }
        if let Some(rb) = config
            .replay_block_tokens
            .filter(|&rb| rb == 0 || rb > MAX_BLOCK_TOKENS)
        {
            return Err(WorkloadError::Config(format!(
                "--replay-block-tokens {rb} is out of range 1..={MAX_BLOCK_TOKENS}"
            )));
        }
        if path.is_dir() {
            return Err(WorkloadError::Config(format!(
                "trace {} is a directory: name a JSON-lines trace file",
                path.display()
            )));
        }
        let file = File::open(path).map_err(|source| WorkloadError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok(MooncakeTrace {
            path: path.to_owned(),
            reader: BufReader::new(file),
            line_no: 0,
            next_id: 0,
            config,
        })
    }

    /// Reads the trace at `path` through (at most `config.max_requests` requests) and checks
    /// every line as the replay would, without expanding any token; returns the number of
    /// requests. Memory stays bounded by one line ([`MAX_LINE_BYTES`]) whatever the file's
    /// size. Only for a file that can be read twice: a pipe would be drained.
    pub fn check(path: &Path, config: TraceConfig) -> Result<usize, WorkloadError> {
        let mut trace = MooncakeTrace::open(path, config)?;
        let mut n = 0;
        while let Some(rec) = trace.next_checked() {
            rec?;
            n += 1;
        }
        Ok(n)
    }

    fn bad(&self, message: impl Into<String>) -> WorkloadError {
        WorkloadError::BadLine {
            path: self.path.clone(),
            line: self.line_no,
            message: message.into(),
        }
    }

    fn parse(&self, line: &str) -> Result<Checked, WorkloadError> {
        let rec: Record = serde_json::from_str(line)
            .map_err(|e| self.bad(format!("not a Mooncake trace record: {}", json_message(&e))))?;
        if let Some(t) = rec.timestamp.filter(|t| !t.is_finite() || *t < 0.0) {
            return Err(self.bad(format!(
                "timestamp {t} is out of range: it must be a finite number >= 0"
            )));
        }
        if rec.input_length <= 0 || rec.input_length as u64 > MAX_PROMPT_TOKENS {
            return Err(self.bad(format!(
                "input_length {} is out of range 1..={MAX_PROMPT_TOKENS}",
                rec.input_length
            )));
        }
        if rec.output_length < 0 || rec.output_length as u64 > MAX_PROMPT_TOKENS {
            return Err(self.bad(format!(
                "output_length {} is out of range 0..={MAX_PROMPT_TOKENS}",
                rec.output_length
            )));
        }
        if let Some(h) = rec.hash_ids.iter().find(|&&h| h < 0) {
            return Err(self.bad(format!("hash id {h} is negative")));
        }
        let input = rec.input_length as u64;
        let blocks = rec.hash_ids.len() as u64;
        // Each hash id is one block of --block-tokens tokens, the last one possibly partial.
        let bt = u64::from(self.config.block_tokens);
        let want = input.div_ceil(bt);
        if blocks != want {
            let which = if blocks < want { "few" } else { "many" };
            let hint =
                if bt != MOONCAKE_BLOCK_TOKENS && blocks == input.div_ceil(MOONCAKE_BLOCK_TOKENS) {
                    format!(
                        "; it fits {MOONCAKE_BLOCK_TOKENS}-token blocks, as in the published \
                     Mooncake traces: --block-tokens is the trace's block size"
                    )
                } else {
                    String::new()
                };
            return Err(self.bad(format!(
                "too {which} hash_ids: input_length {input} needs ceil({input} / {bt}) = \
                 {want} (one per {bt}-token block, --block-tokens {bt}), the line has \
                 {blocks}{hint}"
            )));
        }
        let (input_length, output) = match self.config.replay_block_tokens {
            Some(rb) if u64::from(rb) != bt => {
                let rb = u64::from(rb);
                // Lengths scale like the blocks; the tail of the last block is cut, but at
                // least one token of it is kept.
                let scaled = (input * rb)
                    .div_ceil(bt)
                    .clamp((blocks - 1) * rb + 1, blocks * rb);
                let output = (rec.output_length as u64 * rb).div_ceil(bt);
                for (what, n) in [("input_length", scaled), ("output_length", output)] {
                    if n > MAX_PROMPT_TOKENS {
                        return Err(self.bad(format!(
                            "{what} scaled to {rb} tokens per block is {n} tokens, more than \
                             {MAX_PROMPT_TOKENS}: lower --replay-block-tokens"
                        )));
                    }
                }
                (scaled, output)
            }
            _ => (input, rec.output_length as u64),
        };
        Ok(Checked {
            hash_ids: rec.hash_ids,
            input_length,
            // At most MAX_PROMPT_TOKENS, checked above.
            output_length: output as u32,
        })
    }

    /// The request of a checked record: the replay's tokens per hash id, cut to its
    /// (possibly scaled) `input_length`.
    fn expand(&self, rec: Checked) -> Request {
        let bt = u64::from(
            self.config
                .replay_block_tokens
                .unwrap_or(self.config.block_tokens),
        );
        let tokens = rec
            .hash_ids
            .iter()
            .flat_map(|&h| (0..bt).map(move |j| block_token(h as u64, j, VOCAB)))
            .take(rec.input_length as usize)
            .collect();
        let last = rec.hash_ids.last().copied().unwrap_or_default() as u64;
        let answer = Answer {
            block: last,
            offset: rec.input_length - (rec.hash_ids.len() as u64).saturating_sub(1) * bt,
            block_tokens: bt,
        };
        Request {
            id: self.next_id - 1,
            tokens,
            output_tokens: rec.output_length,
            answer,
            line: Some(self.line_no),
        }
    }

    /// The next line, read at most [`max_line_bytes`] (plus its newline) at a time; `None`
    /// at the end of the file. The line count includes it, so every error names it.
    fn read_line(&mut self, bytes: &mut Vec<u8>) -> Option<Result<(), WorkloadError>> {
        bytes.clear();
        let max = max_line_bytes(self.config.block_tokens);
        let limit = max as u64 + 1;
        let read = (&mut self.reader).take(limit).read_until(b'\n', bytes);
        match read {
            Ok(0) => return None,
            Ok(_) => {}
            Err(source) => {
                return Some(Err(WorkloadError::Io {
                    path: self.path.clone(),
                    source,
                }))
            }
        }
        self.line_no += 1;
        let ended = bytes.last() == Some(&b'\n');
        let len = bytes.len() - usize::from(ended);
        if len > max {
            // Skip the rest of the line without keeping it, so the next line number is right.
            // A read error here surfaces at the next read.
            if !ended {
                let _ = skip_line(&mut self.reader);
            }
            bytes.clear();
            return Some(Err(WorkloadError::LineTooLong {
                path: self.path.clone(),
                line: self.line_no,
                limit: max,
            }));
        }
        Some(Ok(()))
    }

    /// The next non-blank line, checked but not expanded.
    fn next_checked(&mut self) -> Option<Result<Checked, WorkloadError>> {
        if self.config.max_requests.is_some_and(|m| self.next_id >= m) {
            return None;
        }
        let mut bytes = Vec::new();
        loop {
            if let Err(e) = self.read_line(&mut bytes)? {
                return Some(Err(e));
            }
            let line = match std::str::from_utf8(&bytes) {
                Ok(line) => line,
                Err(e) => {
                    return Some(Err(self.bad(format!(
                        "not UTF-8 (invalid byte at column {})",
                        e.valid_up_to() + 1
                    ))))
                }
            };
            // Editors on Windows start UTF-8 files with a byte order mark; it is no content.
            let line = if self.line_no == 1 {
                line.strip_prefix('\u{feff}').unwrap_or(line)
            } else {
                line
            };
            if line.trim_matches(JSON_WHITESPACE).is_empty() {
                continue;
            }
            // Without its terminator, so serde sees one line and its column is ours.
            let line = line.strip_suffix('\n').unwrap_or(line);
            let line = line.strip_suffix('\r').unwrap_or(line);
            let rec = self.parse(line);
            if rec.is_ok() {
                self.next_id += 1;
            }
            return Some(rec);
        }
    }
}

/// Consumes `reader` up to and including the next newline, keeping nothing.
fn skip_line(reader: &mut impl BufRead) -> std::io::Result<()> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            reader.consume(i + 1);
            return Ok(());
        }
        let n = buf.len();
        reader.consume(n);
    }
}

impl Iterator for MooncakeTrace {
    type Item = Result<Request, WorkloadError>;

    fn next(&mut self) -> Option<Self::Item> {
        let rec = self.next_checked()?;
        Some(rec.map(|rec| self.expand(rec)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn trace(lines: &str, block_tokens: u32) -> Vec<Result<Request, WorkloadError>> {
        trace_bytes(lines.as_bytes(), block_tokens)
    }

    fn config(block_tokens: u32) -> TraceConfig {
        TraceConfig::new(block_tokens)
    }

    fn trace_bytes(bytes: &[u8], block_tokens: u32) -> Vec<Result<Request, WorkloadError>> {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        MooncakeTrace::open(f.path(), config(block_tokens))
            .unwrap()
            .collect()
    }

    /// Decoded tokens continue the request's last block: the next turn, which names that
    /// block again, holds them, so its prefix hit covers the decoded part of the block.
    #[test]
    fn the_answer_continues_the_last_block() {
        let reqs = trace(
            "{\"input_length\": 100, \"output_length\": 40, \"hash_ids\": [5, 6]}\n\
             {\"input_length\": 180, \"output_length\": 0, \"hash_ids\": [5, 6, 7]}\n",
            64,
        );
        let (a, b) = (reqs[0].as_ref().unwrap(), reqs[1].as_ref().unwrap());
        // Tokens 100..128 finish block 6; the rest fall in blocks no record names.
        assert_eq!(a.output(28), b.tokens[100..128]);
        assert_ne!(a.output(40)[28..], b.tokens[128..140]);
        assert_eq!(a.output(40), a.output(40), "deterministic");
    }

    /// A hash id stands for `block_tokens` tokens: a record of `input_length` tokens has
    /// `ceil(input_length / block_tokens)` ids and replays as exactly `input_length` tokens.
    #[test]
    fn expands_blocks_to_the_input_length() {
        let reqs = trace(
            "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 10, \"hash_ids\": [0, 1]}\n\n\
             {\"timestamp\": 1, \"input_length\": 128, \"output_length\": 0, \"hash_ids\": [0, 2]}\n",
            64,
        );
        let a = reqs[0].as_ref().unwrap();
        let b = reqs[1].as_ref().unwrap();
        assert_eq!(a.tokens.len(), 100);
        assert_eq!(b.tokens.len(), 128);
        assert_eq!((a.output_tokens, b.output_tokens), (10, 0));
        assert_eq!(
            a.tokens[..64],
            b.tokens[..64],
            "equal hash ids, equal blocks"
        );
        assert_ne!(a.tokens[64..100], b.tokens[64..100]);
        assert_eq!((a.id, b.id), (0, 1));
        assert_eq!((a.line, b.line), (Some(1), Some(3)));
    }

    /// A trace of 64-token blocks replays with `--block-tokens 64` (it was refused: the ids
    /// were always counted as 512-token blocks).
    #[test]
    fn block_tokens_is_the_traces_block_size() {
        let line = "{\"input_length\": 128, \"output_length\": 1, \"hash_ids\": [1, 2]}\n";
        let got = trace(line, 64);
        assert_eq!(got[0].as_ref().unwrap().tokens.len(), 128);
        let err = trace(line, 512)[0].as_ref().unwrap_err().to_string();
        assert!(
            err.contains("too many hash_ids: input_length 128 needs ceil(128 / 512) = 1"),
            "{err}"
        );
        // A published trace read with a smaller block size says what the ids fit.
        let err = trace(
            "{\"input_length\": 700, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
            64,
        )[0]
        .as_ref()
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(
                "too few hash_ids: input_length 700 needs ceil(700 / 64) = 11 (one per \
                 64-token block, --block-tokens 64), the line has 2; it fits 512-token blocks"
            ),
            "{err}"
        );
    }

    #[test]
    fn replay_block_tokens_scales_blocks_and_lengths() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        // Two published 512-token blocks, the second partial (700 tokens), 1000 out.
        f.write_all(b"{\"input_length\": 700, \"output_length\": 1000, \"hash_ids\": [7, 9]}\n")
            .unwrap();
        let scaled = |rb| {
            let config = TraceConfig {
                replay_block_tokens: Some(rb),
                ..TraceConfig::new(512)
            };
            let mut t = MooncakeTrace::open(f.path(), config).unwrap();
            t.next().unwrap().unwrap()
        };
        let full = scaled(512);
        assert_eq!((full.tokens.len(), full.output_tokens), (700, 1000));
        let small = scaled(64);
        // ceil(700 * 64 / 512) = 88 tokens: all of block 7, 24 of block 9; 125 out.
        assert_eq!((small.tokens.len(), small.output_tokens), (88, 125));
        // The same block ids give the same tokens at either scale: prefixes stay shared.
        assert_eq!(small.tokens[..64], full.tokens[..64]);
        assert_eq!(small.tokens[64..88], full.tokens[512..536]);
        // A partial last block keeps at least one token.
        assert_eq!(scaled(1).tokens.len(), 2);
    }

    #[test]
    fn replay_block_tokens_out_of_range_is_a_config_error() {
        let f = tempfile::NamedTempFile::new().unwrap();
        for rb in [0, MAX_BLOCK_TOKENS + 1] {
            let config = TraceConfig {
                replay_block_tokens: Some(rb),
                ..TraceConfig::new(512)
            };
            let err = MooncakeTrace::check(f.path(), config).unwrap_err();
            assert!(
                matches!(&err, WorkloadError::Config(m) if m.contains("--replay-block-tokens")),
                "{err}"
            );
        }
    }

    #[test]
    fn the_line_cap_fits_the_widest_record_of_any_block_size() {
        assert_eq!(max_line_bytes(512), MAX_LINE_BYTES);
        for bt in [1, 2, 16, 32, 64, 512, MAX_BLOCK_TOKENS] {
            let ids = MAX_PROMPT_TOKENS.div_ceil(u64::from(bt)) as usize;
            // The longest prompt's record with 19-digit ids fits.
            assert!(max_line_bytes(bt) >= ids * 21 + 256, "{bt}");
        }
    }

    #[test]
    fn bad_lines_name_the_line() {
        let cases = [
            ("not json", "not a Mooncake trace record"),
            (
                "{\"input_length\": -5, \"output_length\": 1, \"hash_ids\": [1]}",
                "input_length -5",
            ),
            (
                "{\"input_length\": 99999999999, \"output_length\": 1, \"hash_ids\": [1]}",
                "out of range",
            ),
            (
                "{\"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1, 2]}",
                "too many hash_ids: input_length 100 needs ceil(100 / 512) = 1 \
                 (one per 512-token block, --block-tokens 512), the line has 2",
            ),
            (
                "{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}",
                "too few hash_ids: input_length 600 needs ceil(600 / 512) = 2 \
                 (one per 512-token block, --block-tokens 512), the line has 1",
            ),
            (
                "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": []}",
                "too few hash_ids: input_length 10 needs ceil(10 / 512) = 1",
            ),
            (
                "{\"input_length\": 10, \"output_length\": -1, \"hash_ids\": [3]}",
                "output_length",
            ),
            (
                "{\"input_length\": 10, \"output_length\": 99999999999, \"hash_ids\": [3]}",
                "output_length 99999999999 is out of range",
            ),
            // A negative id would otherwise just wrap to another token stream.
            (
                "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [-1]}",
                "hash id -1 is negative",
            ),
            (
                "{\"timestamp\": -2.5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
                "timestamp -2.5 is out of range: it must be a finite number >= 0",
            ),
        ];
        for (line, want) in cases {
            let text = format!(
                "{{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}}\n{line}\n"
            );
            let got = trace(&text, 512);
            let err = got[1].as_ref().unwrap_err().to_string();
            assert!(err.contains(":2: "), "{err}");
            assert!(err.contains(want), "{err} should mention {want}");
        }
    }

    /// serde's own position (always line 1: it sees one line) is cut to the column.
    #[test]
    fn json_errors_name_the_column_only() {
        let got = trace(
            "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}\n{\"input_length\": 7",
            512,
        );
        let err = got[1].as_ref().unwrap_err().to_string();
        assert!(
            err.ends_with(
                ":2: not a Mooncake trace record: EOF while parsing an object at column 18"
            ),
            "{err}"
        );
        assert!(!err.contains("line 1"), "{err}");
    }

    /// A line of JSON whitespace is blank; one of other Unicode whitespace is no JSON, and
    /// is a bad record both when reading and when checking ahead (they used to disagree: the
    /// reader skipped it, the line count counted it).
    #[test]
    fn only_json_whitespace_is_blank() {
        let rec = "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}";
        let got = trace(&format!("{rec}\n \t\r\n{rec}\n"), 512);
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(Result::is_ok));
        for ws in ["\u{a0}", "\u{2028}", "\u{3000}"] {
            let text = format!("{rec}\n{ws}\n{rec}\n");
            let got = trace(&text, 512);
            let err = got[1].as_ref().unwrap_err().to_string();
            assert!(err.contains(":2: not a Mooncake trace record"), "{err}");
            let mut f = tempfile::NamedTempFile::new().unwrap();
            f.write_all(text.as_bytes()).unwrap();
            let err = MooncakeTrace::check(f.path(), config(512)).unwrap_err();
            assert_eq!(err.line(), Some(2), "{err}");
        }
    }

    /// A byte order mark before the first record is skipped, not read as JSON; one later
    /// in the file is still an error.
    #[test]
    fn a_leading_byte_order_mark_is_skipped() {
        let rec = "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}";
        let got = trace(&format!("\u{feff}{rec}\n{rec}\n"), 16);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap().tokens.len(), 5);
        assert!(got[1].is_ok());
        let got = trace(&format!("{rec}\n\u{feff}{rec}\n"), 16);
        let err = got[1].as_ref().unwrap_err().to_string();
        assert!(err.contains(":2: not a Mooncake trace record"), "{err}");
        // A BOM on a line of its own is a blank line.
        assert!(trace("\u{feff}\n \n", 16).is_empty());
    }

    #[test]
    fn a_non_utf8_line_is_named() {
        let got = trace_bytes(
            b"{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}\n\n{\"x\": \"\xff\"}\n",
            16,
        );
        assert!(got[0].is_ok());
        match got[1].as_ref().unwrap_err() {
            WorkloadError::BadLine { line, message, .. } => {
                assert_eq!(*line, 3);
                assert!(message.contains("not UTF-8"), "{message}");
            }
            other => panic!("{other}"),
        }
    }

    /// A line is read at most MAX_LINE_BYTES at a time (a 100 MB line used to be read whole,
    /// then parsed into a vector: ~925 MB), with or without a newline, and the lines after
    /// it keep their numbers.
    #[test]
    fn an_overlong_line_is_refused_without_reading_it_whole() {
        let rec = "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let mut huge = String::from("{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [");
        huge.push_str(&"1,".repeat(MAX_LINE_BYTES / 2));
        for tail in ["0]}\n", ""] {
            let text = format!("{rec}{huge}{tail}{rec}");
            let got = trace(&text, 512);
            match got[1].as_ref().unwrap_err() {
                WorkloadError::LineTooLong { line, limit, .. } => {
                    assert_eq!((*line, *limit), (2, MAX_LINE_BYTES));
                }
                other => panic!("{other}"),
            }
            assert!(got[1]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains(":2: the line is longer than 4194304 bytes"));
            if tail.is_empty() {
                // No newline after the huge line: the record behind it is part of it.
                assert_eq!(got.len(), 2);
            } else {
                assert_eq!(got[2].as_ref().unwrap().line, Some(3));
            }
        }
        // A line of exactly the limit is read (and judged as JSON).
        let exact = format!("{rec}{}\n", " ".repeat(MAX_LINE_BYTES));
        assert_eq!(trace(&exact, 512).len(), 1, "a blank line of the limit");
        // The widest record of 512-token blocks fits.
        let ids = vec![i64::MAX.to_string(); (MAX_PROMPT_TOKENS / MOONCAKE_BLOCK_TOKENS) as usize];
        let widest = format!(
            "{{\"timestamp\": 0, \"input_length\": {MAX_PROMPT_TOKENS}, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
            ids.join(", ")
        );
        assert!(widest.len() <= WIDEST_512_RECORD);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(widest.as_bytes()).unwrap();
        assert_eq!(MooncakeTrace::check(f.path(), config(512)).unwrap(), 1);
    }

    /// `check` reads through the trace without expanding tokens and stops at the first bad
    /// line or at `max_requests`.
    #[test]
    fn check_counts_requests_and_names_the_first_bad_line() {
        let rec = "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(format!("{rec}\n{rec}{rec}not json\n{rec}").as_bytes())
            .unwrap();
        let err = MooncakeTrace::check(f.path(), config(512)).unwrap_err();
        assert!(
            matches!(err, WorkloadError::BadLine { line: 5, .. }),
            "{err}"
        );
        let first3 = TraceConfig {
            max_requests: Some(3),
            ..TraceConfig::new(512)
        };
        assert_eq!(MooncakeTrace::check(f.path(), first3).unwrap(), 3);
    }

    #[test]
    fn block_tokens_are_bounded() {
        let f = tempfile::NamedTempFile::new().unwrap();
        for bt in [0, MAX_BLOCK_TOKENS + 1, u32::MAX] {
            let err = MooncakeTrace::open(f.path(), config(bt)).err().unwrap();
            assert!(matches!(err, WorkloadError::Config(_)), "{err}");
            assert!(err.to_string().contains("--block-tokens"), "{err}");
        }
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let err = MooncakeTrace::open(Path::new("/nonexistent/trace.jsonl"), config(64))
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/trace.jsonl"));
    }
}
