//! A request served as an engine serves a live one ([`RankCache::serve_live`]): a chunked
//! prefill, then decode a token at a time, each step through the step API with the
//! synthesised KV standing in for the model's forward, verified after the prefill and again
//! after the decode (partial pages included), then finished.

use super::*;

/// How [`RankCache::serve_live`] feeds a request: prompt chunks and decoded tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveShape {
    /// Prefill chunk in tokens (`None`: the whole prompt in one step).
    pub chunk_tokens: Option<usize>,
    /// Tokens decoded after the prompt, one step each.
    pub output: Vec<u32>,
}

impl LiveShape {
    /// Whether this is a plain request (one prefill step, nothing decoded): what
    /// [`RankCache::serve`] serves, all or nothing.
    pub fn is_plain(&self, prompt_tokens: usize) -> bool {
        self.output.is_empty() && self.chunk_tokens.is_none_or(|c| c >= prompt_tokens)
    }
}

impl RankCache {
    /// Serves `prompt` as a live request: [`RankCache::begin_chunk`] (the whole prompt
    /// matched, its cached prefix and first chunk taken), then an [`RankCache::extend`] per
    /// further chunk and per decoded token, each followed by the
    /// synthesised forward of its new tokens only (so a kept partial page must keep what the
    /// earlier steps wrote); the whole sequence is verified on every rank after the prefill
    /// and after the decode, then the request finishes. Every step is agreed on its own, so
    /// a failure does not roll the whole request back: the request is abandoned on every
    /// rank (the pages it inserted unfinished stay cached) and the error returned.
    ///
    /// Returns this rank's statistics; `mismatched_tokens` sums both verifications,
    /// `prompt_tokens` is the whole prompt and `extended_tokens` the decoded tokens.
    pub fn serve_live(
        &mut self,
        prompt: &[u32],
        shape: &LiveShape,
    ) -> Result<RequestStats, ClusterError> {
        let n = self.served;
        let armed = self.launch_failure_at == Some(n) && !prompt.is_empty();
        if armed {
            self.exec.inject_launch_failure();
        }
        let chunk = shape.chunk_tokens.unwrap_or(prompt.len()).max(1);
        let out = self.begin_chunk(prompt, chunk).and_then(|mut req| {
            let result = self.live_steps(&mut req, prompt, chunk, &shape.output);
            match result {
                Ok(()) => self.finish(&mut req).map(|mut stats| {
                    // Report by what the tokens were: the prompt, then what was decoded.
                    stats.prompt_tokens = prompt.len() as u64;
                    stats.extended_tokens = shape.output.len() as u64;
                    stats
                }),
                Err(e) if e.is_group_broken() => Err(e),
                Err(e) => {
                    // Every rank failed the same step (steps are agreed): give it up together.
                    self.abandon(&mut req)?;
                    Err(e)
                }
            }
        });
        if armed {
            self.exec.disarm_launch_failure();
        }
        out
    }

    fn live_steps(
        &mut self,
        req: &mut Request,
        prompt: &[u32],
        chunk: usize,
        output: &[u32],
    ) -> Result<(), ClusterError> {
        self.synthesise(req)?;
        for next in prompt[req.tokens.len()..].chunks(chunk) {
            self.extend(req, next)?;
            self.synthesise(req)?;
        }
        let mut bad = self.verify(req)?.all;
        for &t in output {
            self.extend(req, &[t])?;
            self.synthesise(req)?;
        }
        if !output.is_empty() {
            let after = self.verify(req)?.all;
            bad.count += after.count;
            bad.first = bad.first.or(after.first);
        }
        req.stats.mismatched_tokens = bad.count;
        req.stats.first_mismatched_token = bad.first;
        req.load = None;
        Ok(())
    }
}
