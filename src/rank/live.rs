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

/// What [`RankCache::serve_batch`] did.
#[derive(Debug)]
pub struct BatchServed {
    /// Per request, in order: its statistics (`mismatched_tokens` sums its verifications),
    /// or why it failed (then it was abandoned on every rank, or never admitted).
    pub requests: Vec<Result<RequestStats, ClusterError>>,
    /// Serving steps made ([`RankCache::step`] calls).
    pub steps: u64,
    /// Group rounds those steps took (verification's rounds, a test harness's, not counted).
    pub step_rounds: u64,
}

/// One request of a batch in flight.
struct InFlight<'p> {
    req: Request,
    prompt: &'p [u32],
    output: &'p [u32],
    decoded: usize,
    prefill_verified: bool,
    bad: Mismatches,
    /// A step or verification failed it, on every rank alike: it takes no more steps.
    failed: Option<ClusterError>,
    /// This rank's forward (the synthesis) failed: the request goes on with the others (its
    /// steps are agreed), and this rank ends it with `ok = false`, so every rank abandons it.
    forward_failed: Option<ClusterError>,
}

impl RankCache {
    /// Serves `prompts` together as a scheduler batches them: one step admits them all (a
    /// chunked prefill's first chunk each), then every step gives each request its next
    /// prompt chunk or decoded token ([`RankCache::step`]: one round where something is
    /// decided, none for decode tokens in kept partial pages), each followed by the
    /// synthesised forward; every request is verified after its prefill and after its
    /// decode, and one step ends them all. A request whose step fails is abandoned on every
    /// rank at the end; the others go on. Every shape must prefill in the same chunks (a
    /// step's begins share one chunk size).
    pub fn serve_batch(
        &mut self,
        prompts: &[&[u32]],
        shapes: &[LiveShape],
    ) -> Result<BatchServed, ClusterError> {
        if prompts.len() != shapes.len() {
            return Err(ClusterError::Config(format!(
                "a batch of {} prompts came with {} shapes",
                prompts.len(),
                shapes.len()
            )));
        }
        let chunk = shapes.first().and_then(|s| s.chunk_tokens);
        if shapes.iter().any(|s| s.chunk_tokens != chunk) {
            return Err(ClusterError::Config(
                "a batch's requests prefill in one chunk size".into(),
            ));
        }
        let n0 = self.served;
        let armed = self
            .launch_failure_at
            .is_some_and(|a| (n0..n0 + prompts.len()).contains(&a));
        if armed {
            self.exec.inject_launch_failure();
        }
        let out = self.serve_batch_steps(prompts, shapes, chunk);
        if armed {
            self.exec.disarm_launch_failure();
        }
        out
    }

    fn serve_batch_steps(
        &mut self,
        prompts: &[&[u32]],
        shapes: &[LiveShape],
        chunk: Option<usize>,
    ) -> Result<BatchServed, ClusterError> {
        let mut steps = 1;
        let begun = self.step(Step {
            begin: prompts.to_vec(),
            allocate: true,
            chunk,
            ..Step::default()
        })?;
        let mut rounds = begun.rounds;
        let mut results: Vec<Option<Result<RequestStats, ClusterError>>> =
            (0..prompts.len()).map(|_| None).collect();
        let mut live: Vec<(usize, InFlight<'_>)> = Vec::new();
        for (i, r) in begun.begun.into_iter().enumerate() {
            match r {
                Ok(req) => live.push((
                    i,
                    InFlight {
                        req,
                        prompt: prompts[i],
                        output: &shapes[i].output,
                        decoded: 0,
                        prefill_verified: false,
                        bad: Mismatches::default(),
                        failed: None,
                        forward_failed: None,
                    },
                )),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        for (_, f) in &mut live {
            if let Err(e) = self.synthesise(&mut f.req) {
                f.forward_failed.get_or_insert(e);
            }
        }
        let chunk = chunk.unwrap_or(usize::MAX).max(1);
        loop {
            // Each request's next tokens: its next prompt chunk, else (its prefill verified)
            // its next decoded token.
            let mut next: Vec<Option<Vec<u32>>> = Vec::with_capacity(live.len());
            for (_, f) in &mut live {
                next.push(self.next_tokens(f, chunk)?);
            }
            if next.iter().all(Option::is_none) {
                break;
            }
            let out = self.step(Step {
                extend: live
                    .iter_mut()
                    .zip(&next)
                    .filter_map(|((_, f), t)| Some((&mut f.req, t.as_deref()?)))
                    .collect(),
                ..Step::default()
            })?;
            steps += 1;
            rounds += out.rounds;
            let grown = live
                .iter_mut()
                .zip(&next)
                .filter(|(_, t)| t.is_some())
                .map(|((_, f), _)| f);
            for (f, r) in grown.zip(out.extended) {
                match r {
                    Ok(()) => {
                        if let Err(e) = self.synthesise(&mut f.req) {
                            f.forward_failed.get_or_insert(e);
                        }
                    }
                    Err(e) => f.failed = Some(e),
                }
            }
        }
        for (_, f) in &mut live {
            if f.failed.is_none() && !f.output.is_empty() {
                self.verify_into(f)?;
            }
        }
        let done = self.step(Step {
            finish: live
                .iter_mut()
                .map(|(_, f)| {
                    let ok = f.failed.is_none() && f.forward_failed.is_none();
                    (&mut f.req, ok)
                })
                .collect(),
            ..Step::default()
        })?;
        steps += 1;
        rounds += done.rounds;
        for ((i, f), ending) in live.into_iter().zip(done.finished) {
            results[i] = Some(match (f.failed.or(f.forward_failed), ending) {
                (Some(e), _) | (None, Err(e)) => Err(e),
                (None, Ok(Ending::Finished(stats))) => {
                    let mut stats = *stats;
                    stats.mismatched_tokens = f.bad.count;
                    stats.first_mismatched_token = f.bad.first;
                    stats.prompt_tokens = f.prompt.len() as u64;
                    stats.extended_tokens = f.output.len() as u64;
                    Ok(stats)
                }
                (None, Ok(Ending::Abandoned { by })) => Err(ClusterError::Abandoned {
                    rank: self.rank.0,
                    request: f.req.n,
                    by,
                }),
            });
        }
        Ok(BatchServed {
            requests: results
                .into_iter()
                .map(|r| r.expect("every request has a result"))
                .collect(),
            steps,
            step_rounds: rounds,
        })
    }

    /// The tokens a batch gives `f` next (`None`: it is failed or has nothing left),
    /// verifying its prefill once the prompt is in.
    fn next_tokens(
        &mut self,
        f: &mut InFlight<'_>,
        chunk: usize,
    ) -> Result<Option<Vec<u32>>, ClusterError> {
        if f.failed.is_some() {
            return Ok(None);
        }
        let have = f.req.tokens.len();
        if have < f.prompt.len() {
            let end = have.saturating_add(chunk).min(f.prompt.len());
            return Ok(Some(f.prompt[have..end].to_vec()));
        }
        if !f.prefill_verified {
            f.prefill_verified = true;
            self.verify_into(f)?;
            if f.failed.is_some() {
                return Ok(None);
            }
        }
        Ok(f.output.get(f.decoded).map(|&t| {
            f.decoded += 1;
            vec![t]
        }))
    }

    /// Verifies `f`'s whole sequence on every rank and counts its mismatches; a failed
    /// verification fails the request (an error that broke the group ends the batch).
    fn verify_into(&mut self, f: &mut InFlight<'_>) -> Result<(), ClusterError> {
        match self.verify(&mut f.req) {
            Ok(v) => {
                f.bad.count += v.all.count;
                f.bad.first = f.bad.first.or(v.all.first);
                Ok(())
            }
            Err(e) if e.is_group_broken() => Err(e),
            Err(e) => {
                f.failed = Some(e);
                Ok(())
            }
        }
    }
}
