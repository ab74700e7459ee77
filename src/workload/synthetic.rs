//! The built-in workload: seeded multi-turn conversations that share a few system prompts.
//! Each turn's prompt is the previous prompt plus the previous answer plus a new user
//! message, so later turns hit the cache; conversations are interleaved so that reuse
//! distances are long enough to force eviction and host load-back.

use super::{block_token, mix64, Answer, Request, WorkloadError, GOLDEN, MAX_PROMPT_TOKENS, VOCAB};
use std::collections::VecDeque;
use std::ops::RangeInclusive;

/// Shape of the built-in workload. `Default` is sized so that the default replay finishes in
/// about a minute on two CPU cores while exercising eviction and load-back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversationsConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Number of conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts shared between conversations.
    pub system_prompts: usize,
    /// Length of each system prompt in tokens.
    pub system_tokens: usize,
    /// Length range of a user message.
    pub user_tokens: RangeInclusive<usize>,
    /// Length range of an answer.
    pub output_tokens: RangeInclusive<usize>,
    /// Conversations in flight at once; requests are drawn among them at random.
    pub concurrency: usize,
}

impl Default for ConversationsConfig {
    fn default() -> Self {
        ConversationsConfig {
            seed: 0,
            conversations: 96,
            turns: 4,
            system_prompts: 3,
            system_tokens: 1024,
            user_tokens: 64..=640,
            output_tokens: 32..=384,
            concurrency: 10,
        }
    }
}

impl ConversationsConfig {
    /// Checks the settings before generating.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |m: &str| Err(WorkloadError::Config(m.into()));
        if self.conversations == 0 || self.turns == 0 {
            return bad("conversations and turns must be at least 1");
        }
        if self.conversations.checked_mul(self.turns).is_none() {
            return bad("conversations × turns overflows the request count");
        }
        if self.system_prompts == 0 || self.concurrency == 0 {
            return bad("system prompts and concurrency must be at least 1");
        }
        if self.user_tokens.is_empty() || *self.user_tokens.start() == 0 {
            return bad("user message lengths must be a non-empty range of at least 1 token");
        }
        if self.output_tokens.is_empty() {
            return bad("answer lengths must be a non-empty range");
        }
        // Each turn adds the previous answer and a new message to the prompt, so the longest
        // prompt is the system prompt plus every turn at its longest. Bounding it also keeps
        // the length ranges' spans within u64 and an answer's length within u32.
        let longest = (*self.user_tokens.end())
            .checked_add(*self.output_tokens.end())
            .and_then(|turn| turn.checked_mul(self.turns))
            .and_then(|turns| turns.checked_add(self.system_tokens))
            .filter(|&n| n as u64 <= MAX_PROMPT_TOKENS);
        if longest.is_none() {
            return Err(WorkloadError::Config(format!(
                "a conversation's longest prompt (system {} + {} turns × (user {} + answer {}) \
                 tokens) must be at most {MAX_PROMPT_TOKENS} tokens",
                self.system_tokens,
                self.turns,
                self.user_tokens.end(),
                self.output_tokens.end()
            )));
        }
        Ok(())
    }
}

/// Deterministic generator state.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix64(self.0)
    }

    /// A value in `r`, whose span `validate` keeps far below `u64::MAX`.
    fn in_range(&mut self, r: &RangeInclusive<usize>) -> usize {
        let span = (r.end() - r.start()) as u64 + 1;
        r.start() + (self.next() % span) as usize
    }

    /// A fresh block id for new content; high bit set so it never collides with system
    /// prompt blocks.
    fn fresh_block(&mut self) -> u64 {
        self.next() | (1 << 63)
    }
}

struct Conversation {
    prompt: Vec<u32>,
    turns_left: usize,
    pending_output: usize,
    /// The block of the pending answer: the last turn's generated tokens, which this turn
    /// appends.
    answer_block: u64,
}

impl Conversation {
    /// The pending answer: one block of its own, however long.
    fn answer(&self) -> Answer {
        Answer {
            block: self.answer_block,
            offset: 0,
            block_tokens: u64::MAX,
        }
    }
}

/// Iterator over the built-in workload's requests.
pub struct Conversations {
    config: ConversationsConfig,
    rng: Rng,
    active: VecDeque<Conversation>,
    started: usize,
    next_id: usize,
    max_requests: Option<usize>,
}

impl Conversations {
    /// A generator for `config`, stopping after `max_requests` if given.
    pub fn new(
        config: ConversationsConfig,
        max_requests: Option<usize>,
    ) -> Result<Self, WorkloadError> {
        config.validate()?;
        let rng = Rng(mix64(config.seed ^ 0x636f_6e76));
        Ok(Conversations {
            config,
            rng,
            active: VecDeque::new(),
            started: 0,
            next_id: 0,
            max_requests,
        })
    }

    /// Requests the full workload yields (before `max_requests`).
    pub fn total_requests(&self) -> usize {
        // Checked by `validate`; saturating keeps a config built around it from wrapping.
        let all = self.config.conversations.saturating_mul(self.config.turns);
        self.max_requests.map_or(all, |m| m.min(all))
    }

    fn start_conversation(&mut self) -> Conversation {
        let c = &self.config;
        let system = self.rng.next() % c.system_prompts as u64;
        let prompt = (0..c.system_tokens as u64)
            .map(|j| block_token(system, j, VOCAB))
            .collect();
        self.started += 1;
        Conversation {
            prompt,
            turns_left: c.turns,
            pending_output: 0,
            answer_block: 0,
        }
    }

    fn append_fresh(&mut self, prompt: &mut Vec<u32>, n: usize) {
        let block = self.rng.fresh_block();
        prompt.extend((0..n as u64).map(|j| block_token(block, j, VOCAB)));
    }

    /// Appends the previous turn's answer (its own block, drawn when that turn was made)
    /// and draws the block of this turn's answer, in the draw the answer always took.
    fn append_answer(&mut self, conv: &mut Conversation, prompt: &mut Vec<u32>) {
        let answer = conv.answer();
        prompt.extend((0..conv.pending_output as u64).map(|j| answer.token(j)));
        conv.answer_block = self.rng.fresh_block();
    }
}

impl Iterator for Conversations {
    type Item = Result<Request, WorkloadError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next_id >= self.total_requests() {
            return None;
        }
        while self.active.len() < self.config.concurrency
            && self.started < self.config.conversations
        {
            let conv = self.start_conversation();
            self.active.push_back(conv);
        }
        let pick = (self.rng.next() % self.active.len() as u64) as usize;
        let mut conv = self.active.remove(pick)?;
        // The previous answer, then a new user message.
        let user = self.rng.in_range(&self.config.user_tokens.clone());
        let mut prompt = std::mem::take(&mut conv.prompt);
        self.append_answer(&mut conv, &mut prompt);
        self.append_fresh(&mut prompt, user);
        conv.pending_output = self.rng.in_range(&self.config.output_tokens.clone());
        conv.turns_left -= 1;
        let req = Request {
            id: self.next_id,
            tokens: prompt.clone(),
            // At most MAX_PROMPT_TOKENS (`validate`), so it fits.
            output_tokens: u32::try_from(conv.pending_output).unwrap_or(u32::MAX),
            answer: conv.answer(),
            line: None,
        };
        conv.prompt = prompt;
        if conv.turns_left > 0 {
            self.active.push_back(conv);
        }
        self.next_id += 1;
        Some(Ok(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_prefix_sharing() {
        let a: Vec<_> = Conversations::new(ConversationsConfig::default(), None)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let b: Vec<_> = Conversations::new(ConversationsConfig::default(), None)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(a, b);
        assert_eq!(a.len(), 384);
        // Every prompt starts with one of the shared system prompts.
        let sys = ConversationsConfig::default().system_tokens;
        let distinct: std::collections::BTreeSet<_> =
            a.iter().map(|r| r.tokens[..sys].to_vec()).collect();
        assert!(distinct.len() <= 3);
        // Some request extends an earlier one (a later turn).
        assert!(a.iter().enumerate().any(|(i, r)| a[..i]
            .iter()
            .any(|p| r.tokens.len() > p.tokens.len() && r.tokens.starts_with(&p.tokens))));
        let other = ConversationsConfig {
            seed: 7,
            ..Default::default()
        };
        let c: Vec<_> = Conversations::new(other, Some(5))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(c.len(), 5);
        assert_ne!(
            c[0].tokens,
            a[0].tokens[..c[0].tokens.len().min(a[0].tokens.len())].to_vec()
        );
    }

    /// A turn's decoded answer is exactly what its conversation's next turn appends, so a
    /// decode replay's next turn hits it.
    #[test]
    fn the_next_turn_appends_the_decoded_answer() {
        let all: Vec<_> = Conversations::new(ConversationsConfig::default(), None)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let mut checked = 0;
        for (i, r) in all.iter().enumerate() {
            let Some(next) = all[i + 1..]
                .iter()
                .find(|q| q.tokens.len() > r.tokens.len() && q.tokens.starts_with(&r.tokens))
            else {
                continue;
            };
            let n = r.output_tokens as usize;
            assert_eq!(
                next.tokens[r.tokens.len()..][..n],
                r.output(n)[..],
                "request {i}"
            );
            checked += 1;
        }
        assert!(checked > 100, "{checked}");
    }

    #[test]
    fn rejects_empty_settings() {
        let bad = ConversationsConfig {
            turns: 0,
            ..Default::default()
        };
        assert!(Conversations::new(bad, None).is_err());
    }

    /// Length ranges whose span wraps (`0..=usize::MAX`, which used to divide by zero) or
    /// whose answers do not fit a u32 (which used to be truncated) are refused, as is a
    /// conversation whose prompt would outgrow the longest accepted prompt.
    #[test]
    fn rejects_lengths_past_the_longest_prompt() {
        let long = |c: ConversationsConfig| match Conversations::new(c, None) {
            Err(WorkloadError::Config(m)) => m,
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        };
        for c in [
            ConversationsConfig {
                user_tokens: 1..=usize::MAX,
                ..Default::default()
            },
            ConversationsConfig {
                output_tokens: 0..=usize::MAX,
                ..Default::default()
            },
            ConversationsConfig {
                output_tokens: 0..=u32::MAX as usize + 1,
                ..Default::default()
            },
            ConversationsConfig {
                system_tokens: usize::MAX,
                ..Default::default()
            },
            ConversationsConfig {
                turns: usize::MAX / 2,
                conversations: 1,
                ..Default::default()
            },
        ] {
            let m = long(c);
            assert!(m.contains("longest prompt"), "{m}");
        }
        // The largest accepted settings generate.
        let c = ConversationsConfig {
            conversations: 1,
            turns: 1,
            system_tokens: 0,
            user_tokens: 1..=1,
            output_tokens: 0..=(MAX_PROMPT_TOKENS as usize - 1),
            ..Default::default()
        };
        let r: Vec<_> = Conversations::new(c, None).unwrap().collect();
        assert!(r[0].as_ref().unwrap().output_tokens < MAX_PROMPT_TOKENS as u32);
    }
}
