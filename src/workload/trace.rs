//! Mooncake-format traces: one JSON object per line with `timestamp`, `input_length`,
//! `output_length` and `hash_ids`, where each hash id names one 512-token block of the
//! prompt (equal ids mean equal prefixes).

use super::{block_token, Request, WorkloadError, VOCAB};
use serde::Deserialize;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Tokens per hash id in the published Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Longest prompt accepted, in trace tokens; anything longer is a corrupt record. Prompts
/// scaled by `--block-tokens` are held to the same bound.
const MAX_INPUT_LENGTH: u64 = 16 * 1024 * 1024;

/// Largest `--block-tokens`: a hash id stands for at most this many tokens.
pub const MAX_BLOCK_TOKENS: u32 = 64 * 1024;

/// How a trace is replayed.
#[derive(Clone, Debug)]
pub struct TraceConfig {
    /// Tokens one hash id stands for in the replay (the trace's 512 scaled down to keep CPU
    /// replays fast; lengths scale the same way).
    pub block_tokens: u32,
    /// Take at most this many requests.
    pub max_requests: Option<usize>,
}

#[derive(Deserialize)]
struct Record {
    timestamp: Option<f64>,
    input_length: i64,
    output_length: i64,
    hash_ids: Vec<i64>,
}

/// A streaming reader of a Mooncake trace; yields one [`Request`] per non-blank line.
pub struct MooncakeTrace {
    path: PathBuf,
    reader: BufReader<File>,
    line_no: usize,
    next_id: usize,
    config: TraceConfig,
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

    fn bad(&self, message: impl Into<String>) -> WorkloadError {
        WorkloadError::BadLine {
            path: self.path.clone(),
            line: self.line_no,
            message: message.into(),
        }
    }

    fn parse(&self, line: &str) -> Result<Request, WorkloadError> {
        let rec: Record = serde_json::from_str(line)
            .map_err(|e| self.bad(format!("not a Mooncake trace record: {e}")))?;
        if let Some(t) = rec.timestamp.filter(|t| !t.is_finite() || *t < 0.0) {
            return Err(self.bad(format!(
                "timestamp {t} is out of range: it must be a finite number >= 0"
            )));
        }
        if rec.input_length <= 0 || rec.input_length as u64 > MAX_INPUT_LENGTH {
            return Err(self.bad(format!(
                "input_length {} is out of range 1..={MAX_INPUT_LENGTH}",
                rec.input_length
            )));
        }
        if rec.output_length < 0 || rec.output_length as u64 > MAX_INPUT_LENGTH {
            return Err(self.bad(format!(
                "output_length {} is out of range 0..={MAX_INPUT_LENGTH}",
                rec.output_length
            )));
        }
        if let Some(h) = rec.hash_ids.iter().find(|&&h| h < 0) {
            return Err(self.bad(format!("hash id {h} is negative")));
        }
        let input = rec.input_length as u64;
        let blocks = rec.hash_ids.len() as u64;
        // Trace units: each hash id is one 512-token block whatever --block-tokens says, so a
        // prompt of `input` tokens has exactly ceil(input / 512) of them.
        let want = input.div_ceil(MOONCAKE_BLOCK_TOKENS);
        if blocks != want {
            let which = if blocks < want { "few" } else { "many" };
            return Err(self.bad(format!(
                "too {which} hash_ids: input_length {input} needs ceil({input} / \
                 {MOONCAKE_BLOCK_TOKENS}) = {want} (one per {MOONCAKE_BLOCK_TOKENS}-token block), \
                 the line has {blocks}"
            )));
        }
        let bt = u64::from(self.config.block_tokens);
        // Scale the prompt length like the blocks; the tail of the last block is cut, but at
        // least one token of it is kept.
        let scaled = (input * bt)
            .div_ceil(MOONCAKE_BLOCK_TOKENS)
            .clamp((blocks - 1) * bt + 1, blocks * bt);
        if scaled > MAX_INPUT_LENGTH {
            return Err(self.bad(format!(
                "input_length {input} scaled to {bt} tokens per block is {scaled} tokens, \
                 more than {MAX_INPUT_LENGTH}: lower --block-tokens"
            )));
        }
        let tokens = rec
            .hash_ids
            .iter()
            .flat_map(|&h| (0..bt).map(move |j| block_token(h as u64, j, VOCAB)))
            .take(scaled as usize)
            .collect();
        let output = (rec.output_length as u64 * bt).div_ceil(MOONCAKE_BLOCK_TOKENS);
        let output_tokens = u32::try_from(output).map_err(|_| {
            self.bad(format!(
                "output_length {} scaled to {bt} tokens per block is {output} tokens, more \
                 than {}",
                rec.output_length,
                u32::MAX
            ))
        })?;
        Ok(Request {
            id: self.next_id,
            tokens,
            output_tokens,
            line: Some(self.line_no),
        })
    }
}

impl Iterator for MooncakeTrace {
    type Item = Result<Request, WorkloadError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.config.max_requests.is_some_and(|m| self.next_id >= m) {
            return None;
        }
        let mut bytes = Vec::new();
        loop {
            bytes.clear();
            match self.reader.read_until(b'\n', &mut bytes) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(source) => {
                    return Some(Err(WorkloadError::Io {
                        path: self.path.clone(),
                        source,
                    }))
                }
            }
            // Count the line before judging it, so every error names it.
            self.line_no += 1;
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
            if line.trim().is_empty() {
                continue;
            }
            let req = self.parse(line);
            if req.is_ok() {
                self.next_id += 1;
            }
            return Some(req);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn trace(lines: &str, block_tokens: u32) -> Vec<Result<Request, WorkloadError>> {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(lines.as_bytes()).unwrap();
        MooncakeTrace::open(
            f.path(),
            TraceConfig {
                block_tokens,
                max_requests: None,
            },
        )
        .unwrap()
        .collect()
    }

    #[test]
    fn expands_blocks_and_scales_lengths() {
        let reqs = trace(
            "{\"timestamp\": 0, \"input_length\": 700, \"output_length\": 10, \"hash_ids\": [0, 1]}\n\n\
             {\"timestamp\": 1, \"input_length\": 1024, \"output_length\": 0, \"hash_ids\": [0, 2]}\n",
            64,
        );
        let a = reqs[0].as_ref().unwrap();
        let b = reqs[1].as_ref().unwrap();
        assert_eq!(a.tokens.len(), 88); // ceil(700 * 64 / 512)
        assert_eq!(b.tokens.len(), 128);
        assert_eq!(
            a.tokens[..64],
            b.tokens[..64],
            "equal hash ids, equal blocks"
        );
        assert_ne!(a.tokens[64..88], b.tokens[64..88]);
        assert_eq!((a.id, b.id), (0, 1));
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
                 (one per 512-token block), the line has 2",
            ),
            (
                "{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}",
                "too few hash_ids: input_length 600 needs ceil(600 / 512) = 2 \
                 (one per 512-token block), the line has 1",
            ),
            (
                "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": []}",
                "too few hash_ids: input_length 10 needs ceil(10 / 512) = 1",
            ),
            (
                "{\"input_length\": 10, \"output_length\": -1, \"hash_ids\": [3]}",
                "output_length",
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
            let got = trace(&text, 16);
            let err = got[1].as_ref().unwrap_err().to_string();
            assert!(err.contains(":2: "), "{err}");
            assert!(err.contains(want), "{err} should mention {want}");
        }
    }

    /// A byte order mark before the first record is skipped, not read as JSON; one later
    /// in the file is still an error.
    #[test]
    fn a_leading_byte_order_mark_is_skipped() {
        let rec = "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}";
        let got = trace(&format!("\u{feff}{rec}\n{rec}\n"), 16);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap().tokens.len(), 1);
        assert!(got[1].is_ok());
        let got = trace(&format!("{rec}\n\u{feff}{rec}\n"), 16);
        let err = got[1].as_ref().unwrap_err().to_string();
        assert!(err.contains(":2: not a Mooncake trace record"), "{err}");
        // A BOM on a line of its own is a blank line.
        assert!(trace("\u{feff}\n \n", 16).is_empty());
    }

    #[test]
    fn a_non_utf8_line_is_named() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}\n\n{\"x\": \"\xff\"}\n")
            .unwrap();
        let got: Vec<_> = MooncakeTrace::open(
            f.path(),
            TraceConfig {
                block_tokens: 16,
                max_requests: None,
            },
        )
        .unwrap()
        .collect();
        assert!(got[0].is_ok());
        match got[1].as_ref().unwrap_err() {
            WorkloadError::BadLine { line, message, .. } => {
                assert_eq!(*line, 3);
                assert!(message.contains("not UTF-8"), "{message}");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn block_tokens_are_bounded() {
        let f = tempfile::NamedTempFile::new().unwrap();
        for bt in [0, MAX_BLOCK_TOKENS + 1, u32::MAX] {
            let err = MooncakeTrace::open(
                f.path(),
                TraceConfig {
                    block_tokens: bt,
                    max_requests: None,
                },
            )
            .err()
            .unwrap();
            assert!(matches!(err, WorkloadError::Config(_)), "{err}");
            assert!(err.to_string().contains("--block-tokens"), "{err}");
        }
    }

    #[test]
    fn scaled_lengths_are_bounded_without_allocating() {
        // 16 Mi trace tokens at 64 Ki tokens per block would be 2 Gi tokens.
        let blocks = MAX_INPUT_LENGTH / MOONCAKE_BLOCK_TOKENS;
        let ids: Vec<String> = (0..blocks).map(|i| i.to_string()).collect();
        let line = format!(
            "{{\"input_length\": {MAX_INPUT_LENGTH}, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
            ids.join(",")
        );
        let got = trace(&line, MAX_BLOCK_TOKENS);
        let err = got[0].as_ref().unwrap_err().to_string();
        assert!(
            err.contains(":1: ") && err.contains("lower --block-tokens"),
            "{err}"
        );
        // The largest scaled output still fits a u32.
        let got = trace(
            &format!(
                "{{\"input_length\": 5, \"output_length\": {MAX_INPUT_LENGTH}, \"hash_ids\": [0]}}\n"
            ),
            MAX_BLOCK_TOKENS,
        );
        assert_eq!(
            got[0].as_ref().unwrap().output_tokens,
            (MAX_INPUT_LENGTH * u64::from(MAX_BLOCK_TOKENS) / MOONCAKE_BLOCK_TOKENS) as u32
        );
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let err = MooncakeTrace::open(
            Path::new("/nonexistent/trace.jsonl"),
            TraceConfig {
                block_tokens: 64,
                max_requests: None,
            },
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("/nonexistent/trace.jsonl"));
    }
}
