//! `replay`'s options: their parsers, what each means in `--help`, and the checks that
//! refuse bad combinations before any rank starts.

use crate::cli::common::parse_backend;
use crate::cluster::{Fault, WritePolicy};
use crate::exec::Backend;
use crate::kernels::{Deployment, ModelShape, TpShard, TransferPath};
use crate::layout::Layout;
use crate::rank::{LiveShape, StoragePolicy};
use crate::workload::{
    Conversations, ConversationsConfig, MooncakeTrace, Request, TraceConfig, WorkloadError,
    MAX_BLOCK_TOKENS,
};
use std::path::PathBuf;

/// Model buffer shapes selectable on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelArg {
    /// DeepSeek-V3.2 NSA: kv 656 B/token + index_k 132 B/token (page size 64).
    Nsa,
    /// Plain MLA with a bf16 cache: 1152 B/token.
    Mla,
    /// GQA/MHA, one TP shard's bf16 K and V: 4 × kv-heads × head-dim B/token, a page's
    /// keys then its values (shape: --kv-heads, --head-dim).
    Gqa,
}

/// How a replay's ranks read each other's pages to verify (`--peer-pools`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PeerPools {
    /// Each rank maps (or directly reaches) its peers' pools.
    Mapped,
    /// Each rank's pages of a sequence go through the group to every rank.
    Gathered,
}

/// Options of `replay`. Parsing has no side effects; validation happens when it runs.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// A Mooncake-format trace (JSON lines with timestamp, input_length, output_length,
    /// hash_ids). Without it, a built-in seeded multi-turn conversation workload runs. A
    /// trace without a request is a usage error: there would be nothing to verify.
    #[arg(long, value_name = "FILE.jsonl")]
    pub trace: Option<PathBuf>,
    /// Tokens one trace hash id stands for: the trace's block size, 1..=65536 (only with
    /// --trace; the published Mooncake traces use 512). Each line must have
    /// ceil(input_length / N) hash_ids and replays as input_length tokens.
    #[arg(
        long,
        default_value_t = 512,
        value_name = "N",
        requires = "trace",
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BLOCK_TOKENS))
    )]
    pub block_tokens: u32,
    /// Replay each hash id as N tokens instead of --block-tokens, scaling every prompt and
    /// output length by N / --block-tokens (only with --trace; default: the trace's own
    /// size). The prefix structure stays the trace's; a CPU replays e.g. 64 in a fraction of
    /// the time of 512.
    #[arg(
        long,
        value_name = "N",
        requires = "trace",
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BLOCK_TOKENS))
    )]
    pub replay_block_tokens: Option<u32>,
    /// Replay only the first N requests (N >= 1; default: all of them).
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_requests
    )]
    pub requests: Option<usize>,
    /// Seed of the built-in workload (not with --trace).
    #[arg(long, default_value_t = 0, conflicts_with = "trace")]
    pub seed: u64,
    /// Conversations in the built-in workload (not with --trace): each is a few turns whose
    /// prompts grow by the previous answer and a new message and start with one of three
    /// shared system prompts; more conversations mean more requests and longer reuse
    /// distances, hence more eviction and load-back.
    #[arg(
        long,
        value_name = "N",
        default_value_t = ConversationsConfig::default().conversations,
        conflicts_with = "trace",
        value_parser = parse_conversations
    )]
    pub conversations: usize,
    /// CP degree (1..=16).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub cp: u8,
    /// Tokens per page (a power of two, 1..=1024; NSA requires 64).
    #[arg(long, default_value_t = 64, value_parser = parse_page_size)]
    pub page_size: u32,
    /// Layers per KV buffer, 1..=256 (small by default so the CPU run is quick).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub layers: u32,
    /// Model buffer shapes.
    #[arg(long, value_enum, default_value_t = ModelArg::Nsa)]
    pub model: ModelArg,
    /// With `--model gqa`: KV heads per rank (the model's KV heads divided by the TP
    /// degree; e.g. 8 for Llama-3-70B at TP 1). At most 65536 elements with --head-dim.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub kv_heads: u16,
    /// With `--model gqa`: elements per head (bf16), e.g. 128.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u16).range(1..))]
    pub head_dim: u16,
    /// With `--model gqa` and `--tp-size` above 1: which TP head shard this group holds,
    /// 0..tp-size. Two shards of one model have the same shape but other heads: the shard
    /// goes into the store's fingerprint (each shard reads and writes only its own
    /// records, in a --storage directory of its own) and into the synthesised KV (a page of
    /// another shard fails verification).
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub tp_rank: u16,
    /// With `--model gqa`: the number of TP head shards the model's KV heads are split into
    /// (the TP degree, or the distinct shards where it exceeds the KV heads); 1: unsplit,
    /// the records and KV of a deployment without a shard. NSA and MLA keep the same
    /// latent KV on every TP rank, so they refuse a size above 1.
    #[arg(long, default_value_t = 1, value_name = "S")]
    pub tp_size: u16,
    /// Logical device pages across the CP group (each rank holds ceil(pages / cp)). A
    /// request whose pages do not fit, even after evicting everything unlocked, is skipped
    /// and counted; when every request is, nothing was verified: exit status 2.
    #[arg(long, default_value_t = 256, value_name = "PAGES")]
    pub device_pages: u32,
    /// Host pages per rank.
    #[arg(long, default_value_t = 512, value_name = "PAGES")]
    pub host_pages: u32,
    /// When device pages are backed up to the host.
    #[arg(long, default_value = "write_through", value_parser = policy_parser())]
    pub policy: WritePolicy,
    /// The CP layout: which rank owns each token. zigzag and round-robin record each
    /// page's owner and a load-back must restore it, so `--inject plain-alloc-on-load` is
    /// caught under both. Under page-interleave and token-interleave ownership is
    /// positional (page i of a sequence is rank i % C's) and pages are allocated in aligned
    /// groups of C, one per rank, kept in lockstep: a plain allocation gives the same
    /// pages, and one lane cannot run short alone, so `plain-alloc-on-load` and
    /// `lane-exhaustion` are refused there; `granule-shift-on-load` (each loaded granule's
    /// pages one rank on) is the seed's bug in their form, refused under the other two.
    #[arg(long, default_value = "zigzag", value_parser = layout_parser())]
    pub layout: String,
    /// Tokens per run of token-interleave (vLLM's cp_kv_cache_interleave_size): token t is
    /// on rank (t / N) % C. A power of two no larger than --page-size; 1 (SGLang's NSA
    /// round-robin token split) when not given. Refused with the other layouts.
    #[arg(long, value_name = "N")]
    pub interleave_size: Option<u32>,
    /// Executor that runs the kernels.
    #[arg(long, default_value = "auto", value_parser = backend_parser())]
    pub backend: Backend,
    /// A tuning file (see `cp-hicache tune`); without it `<cache>/tuning.json` is used when
    /// it exists (the report names the file), else the default launch shapes run.
    #[arg(long, value_name = "FILE")]
    pub tuning: Option<PathBuf>,
    /// How pages move between host and device: `kernel` (the transfer kernel), `dma` (copy
    /// regions: one cuMemcpyBatchAsync per batch on a GPU whose driver has it, else one
    /// cuMemcpyAsync per merged region; memcpy on the CPU) or `dma-each` (one cuMemcpyAsync
    /// per merged region even where the batch call exists). Default: what the tuning file
    /// chose, else the kernel.
    #[arg(long, value_name = "kernel|dma|dma-each", value_parser = parse_transfer_path)]
    pub transfer: Option<TransferPath>,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also write one JSON line per request to FILE: its id, outcome (served, skipped,
    /// failed), statistics and the replicas' digest after it, so that two runs (say the
    /// in-process and the multi-process replay) can be compared request by request.
    #[arg(long, value_name = "FILE.jsonl")]
    pub request_log: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
    /// Run each CP rank in a process of its own, as engine processes run them: this binary
    /// starts itself once per rank, the ranks agree through files in a fresh temporary
    /// folder and map each other's pools (shared memory on the CPU; CUDA IPC, with
    /// interprocess events as fences, on a GPU). Rank 0 prints the report; the exit status
    /// is the ranks' (1, naming the rank, when one dies). A round waits at most
    /// CP_HICACHE_GROUP_TIMEOUT seconds (default 300) for a peer. CP_HICACHE_REPLAY_WRAPPER
    /// names a command each rank is started under, `{rank}` replaced by its rank (`numactl
    /// --cpunodebind={rank}`); a rank that cannot be started ends the run naming it. `python
    /// -m cp_hicache.replay` does the same over torch.distributed.
    #[arg(long)]
    pub processes: bool,
    /// Load layer by layer inside steps too (--batch, --chunk-tokens), on the load stream,
    /// as where the engine's attention waits for each layer (`RankCache.layer_waits`): the
    /// verification waits for each layer, and ranks in processes of their own fence each
    /// layer with interprocess events instead of the whole load. Default: a step's loads
    /// are one transfer on the cache's stream.
    #[arg(long)]
    pub layer_waits: bool,
    /// Materialise and verify each request on the first N ranks only (1..=--cp; default:
    /// every rank). Attention on every rank reads every page through that rank's own
    /// mappings of its peers' pools, so each rank verifies the whole sequence, which costs
    /// C times one verification on a CPU; a wrong mapping on a rank left out goes unseen.
    #[arg(long, value_name = "N")]
    pub verify_ranks: Option<u8>,
    /// How a rank reads its peers' pages to verify: `mapped` (default: it maps their pools,
    /// shared memory on the CPU, or reaches them directly where ranks share one GPU) or
    /// `gathered` (no rank reaches a peer's pool: each reads back the sequence's pages it
    /// owns and sends them through the group, the way ranks over an engine's own memory in
    /// separate processes verify; the report's `bytes_gathered` is what that moves).
    #[arg(long, value_name = "mapped|gathered", default_value = "mapped")]
    pub peer_pools: PeerPools,
    /// Prefill each prompt in chunks of N tokens, as an engine's chunked prefill does: the
    /// first chunk begins the request, each later one extends it (the pages filled so far
    /// are inserted unfinished, a partial page is kept and filled on). Such requests are
    /// served step by step: a failed step abandons the request on every rank instead of
    /// rolling it back. Default: each prompt in one step.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub chunk_tokens: Option<u32>,
    /// After each prompt, decode tokens one step each (an extend per token, its KV written
    /// into the kept partial page): N tokens, or `trace` for each request's own output
    /// length (a trace's output_length; the built-in conversations' answers, which their
    /// next turn appends, so later turns hit the decoded answer). The whole sequence is
    /// verified after the prefill and again after the decode. Default: no decode.
    #[arg(long, value_name = "N|trace", value_parser = parse_decode_tokens)]
    pub decode_tokens: Option<DecodeTokens>,
    /// Serve N requests at a time, as a scheduler batches them: one step admits the N (a
    /// chunked prefill's first chunk each), each later step gives every request its next
    /// chunk or decoded token, one step ends them all. A step takes at most one group round
    /// whatever N (none where every token lands in a kept partial page); the report adds
    /// group rounds per step. A request whose step fails is abandoned on every rank, the
    /// others go on. Requests of one batch do not hit each other's KV (a conversation's
    /// next turn in the same batch misses). Default: 1, one request at a time.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
    /// A page store in directory DIR (created if need be), the third tier under device and
    /// host memory: pages go there from the host tier (--storage-policy), and a prefix that
    /// misses in device and host memory is read back from it, then verified like any
    /// load-back. Records are named by the model, layers and page size and by their
    /// prefix's tokens, never by the CP degree, rank or layout, so a later run with another
    /// --cp (or ranks in other processes) reads what this one wrote. Several runs may share
    /// the directory at once. Under --layout token-interleave, where a sequence page is split
    /// across ranks, each rank writes its tokens of a record as a part and the record
    /// appears whole when its last part comes; a rank reads the whole records its tokens
    /// come from. A store this process may only read (a read-only mount, another user's) is
    /// read and never written. Under `python -m cp_hicache.replay`, DIR may instead be
    /// mooncake://HOST:PORT?metadata_server=URL&segment_bytes=N (a Mooncake Store master,
    /// the client's options as the query): the same records, in Mooncake's memory.
    #[arg(long, value_name = "DIR")]
    pub storage: Option<PathBuf>,
    /// The store's capacity in bytes (a number, or with a K/M/G/T suffix, binary): over it,
    /// the least recently used records are evicted, whichever run wrote them.
    #[arg(long, value_name = "BYTES", requires = "storage", default_value = "16G", value_parser = parse_bytes)]
    pub storage_bytes: u64,
    /// When a rank writes its pages to the store: `with-host` (with every host backup) or
    /// `on-host-evict` (when a host copy is evicted to make room).
    #[arg(long, value_name = "POLICY", requires = "storage", default_value = "with-host", value_parser = parse_storage_policy)]
    pub storage_policy: StoragePolicy,
    /// Read no records ahead: by default each rank starts reading the next request's
    /// records (past what the current one will cache) while the current one is served, as
    /// HiCache's prefetch thread does, and a request waits only for records still being
    /// read.
    #[arg(long, requires = "storage")]
    pub no_prefetch: bool,
    /// Inject a fault to exercise a failure path: plain-alloc-on-load (the seed's bug),
    /// granule-shift-on-load (the same under page- and token-interleave), lane-exhaustion, host-pool-full, compile-error, launch-error. With --storage, one
    /// record read in three is damaged first: storage-torn (cut short, as after a power
    /// loss), storage-flip (a payload byte flipped), storage-foreign (another deployment's
    /// record under the same key): each is refused and counted, served as a miss, with 0
    /// mismatches; storage-unchecked serves a changed byte as if the store skipped its
    /// checksum, which verification must catch (mismatches, exit status 1); storage-io fails
    /// one read and one write in three with an I/O error (counted, served as a miss or left
    /// unwritten, 0 mismatches); storage-part-missing leaves a record as all but one of its
    /// parts (a rank of a split page died before writing its part): refused as incomplete.
    /// The records read come from an earlier run with the same --storage.
    #[arg(long, value_name = "FAULT", value_parser = parse_fault)]
    pub inject: Option<Fault>,
}

impl Default for ReplayArgs {
    fn default() -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: ReplayArgs,
        }
        Wrap::parse_from(["replay"]).args
    }
}

/// How many tokens `replay --decode-tokens` decodes after each prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeTokens {
    /// The same number after every prompt.
    Count(u32),
    /// Each request's own output length.
    Trace,
}

impl std::fmt::Display for DecodeTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeTokens::Count(n) => write!(f, "{n}"),
            DecodeTokens::Trace => f.write_str("trace"),
        }
    }
}

fn parse_decode_tokens(s: &str) -> Result<DecodeTokens, String> {
    if s == "trace" {
        return Ok(DecodeTokens::Trace);
    }
    match s.parse::<u32>() {
        Ok(n) if u64::from(n) <= crate::workload::MAX_PROMPT_TOKENS => Ok(DecodeTokens::Count(n)),
        _ => Err(format!(
            "`{s}` is neither `trace` nor a token count in 0..={}",
            crate::workload::MAX_PROMPT_TOKENS
        )),
    }
}

/// How `replay` feeds `req`: its chunks and decoded tokens (`--chunk-tokens`,
/// `--decode-tokens`).
pub(super) fn live_shape(args: &ReplayArgs, req: &crate::workload::Request) -> LiveShape {
    let decode = match args.decode_tokens {
        None => 0,
        Some(DecodeTokens::Count(n)) => n,
        Some(DecodeTokens::Trace) => req.output_tokens,
    };
    LiveShape {
        chunk_tokens: args.chunk_tokens.map(|c| c as usize),
        output: req.output(decode as usize),
    }
}

fn parse_page_size(s: &str) -> Result<u32, String> {
    let v: u32 = s.parse().map_err(|_| format!("`{s}` is not a page size"))?;
    if v == 0 || !v.is_power_of_two() || v > crate::layout::MAX_PAGE_SIZE {
        return Err(format!(
            "page size {v} must be a power of two between 1 and {}",
            crate::layout::MAX_PAGE_SIZE
        ));
    }
    Ok(v)
}

/// `--policy` with each value's meaning in `--help` (the `-` spellings stay accepted).
fn policy_parser() -> impl clap::builder::TypedValueParser<Value = WritePolicy> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("write_through")
            .alias("write-through")
            .help("back up every node to the host when it is inserted"),
        PossibleValue::new("write_back")
            .alias("write-back")
            .help("back up a node only when it is evicted from the device"),
    ])
    .try_map(|s| s.parse::<WritePolicy>())
}

/// `--layout` with each value's meaning in `--help`.
fn layout_parser() -> impl clap::builder::TypedValueParser<Value = String> {
    use clap::builder::{PossibleValue, PossibleValuesParser};
    PossibleValuesParser::new([
        PossibleValue::new("zigzag")
            .help("2C chunks of pages, chunk k on rank k, then back (balances causal attention)"),
        PossibleValue::new("round-robin").help("computed page i on rank i % C"),
        PossibleValue::new("page-interleave")
            .help("SGLang's logical pages: groups of C pages, page i of a sequence on rank i % C"),
        PossibleValue::new("token-interleave").help(
            "vLLM decode CP: token t on rank (t / --interleave-size) % C, pages hold one rank's tokens",
        ),
    ])
}

/// `--backend` with each value's meaning in `--help` (`cpu` and `gpu` stay accepted).
fn backend_parser() -> impl clap::builder::TypedValueParser<Value = Backend> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("auto").help("CUDA when a GPU is usable, else the CPU emulation"),
        PossibleValue::new("host")
            .alias("cpu")
            .help("the CPU emulation executor (kernels built with the host C++ compiler)"),
        PossibleValue::new("cuda")
            .alias("gpu")
            .help("the CUDA driver on GPU 0 (NVRTC-compiled kernels)"),
    ])
    .try_map(|s| parse_backend(&s))
}

/// The most conversations of the built-in workload (4 million requests, far past a CPU run).
const MAX_CONVERSATIONS: usize = 1_000_000;

/// `--conversations N`, 1..=[`MAX_CONVERSATIONS`].
fn parse_conversations(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_CONVERSATIONS).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a conversation count in 1..={MAX_CONVERSATIONS}"
        )),
    }
}

/// `--requests N`, N >= 1: replaying no request would verify nothing.
fn parse_requests(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err(
            "replaying 0 requests verifies nothing: give N >= 1, or leave --requests \
             out to replay them all"
                .into(),
        ),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a request count")),
    }
}

fn parse_transfer_path(s: &str) -> Result<TransferPath, String> {
    s.parse()
}

fn parse_storage_policy(s: &str) -> Result<StoragePolicy, String> {
    s.parse()
}

/// A byte count: digits, optionally followed by K, M, G or T (powers of 1024; a trailing
/// `B` or `iB` is accepted).
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("`{s}`: unknown unit `{c}` (expected K, M, G or T)")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{s}` is not a positive byte count (e.g. 512M, 16G)"))
}

fn parse_fault(s: &str) -> Result<Fault, String> {
    s.parse()
}

/// A stream of requests, read or generated lazily.
pub(super) type RequestStream = Box<dyn Iterator<Item = Result<Request, WorkloadError>>>;

/// Everything replay needs, validated.
pub(super) struct ReplayPlan {
    pub(super) deployment: Deployment,
    pub(super) workload_name: String,
}

impl ReplayArgs {
    /// The model `--model` (with `--kv-heads` and `--head-dim` for GQA) names.
    pub fn model_shape(&self) -> ModelShape {
        match self.model {
            ModelArg::Nsa => ModelShape::Nsa,
            ModelArg::Mla => ModelShape::MlaBf16,
            ModelArg::Gqa => ModelShape::Gqa {
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
            },
        }
    }

    pub(super) fn validate(&self) -> Result<ReplayPlan, crate::Error> {
        let model = self.model_shape();
        if self.model != ModelArg::Gqa && (self.kv_heads != 8 || self.head_dim != 128) {
            return Err(crate::Error::Usage(format!(
                "--kv-heads and --head-dim describe a GQA model: give --model gqa (not {:?})",
                self.model
            )));
        }
        let layout = Layout::parse(&self.layout, self.interleave_size)
            .map_err(|e| crate::Error::Usage(format!("--layout: {e}")))?;
        let tp = TpShard::new(self.tp_rank, self.tp_size)
            .map_err(|e| crate::Error::Usage(format!("--tp-rank/--tp-size: {e}")))?;
        let deployment = Deployment::new(model, self.page_size, self.cp)
            .and_then(|d| d.with_layout(layout))
            .and_then(|d| d.with_tp(tp))
            .map_err(|e| crate::Error::Usage(e.to_string()))?;
        if let Some(fault) = self.inject {
            fault
                .check_layout(layout)
                .map_err(|why| crate::Error::Usage(format!("--inject {fault}: {why}")))?;
            if fault.storage_damage().is_some() && self.storage.is_none() {
                return Err(crate::Error::Usage(format!(
                    "--inject {fault} damages records of the storage tier: give --storage DIR \
                     (holding records an earlier run wrote)"
                )));
            }
        }
        if let Some(n) = self.verify_ranks {
            if n == 0 || n > self.cp {
                return Err(crate::Error::Usage(format!(
                    "--verify-ranks {n} is not in 1..={} (--cp): at least one rank must \
                     verify, and there are {} ranks",
                    self.cp, self.cp
                )));
            }
        }
        if self.tuning.as_ref().is_some_and(|t| !t.exists()) {
            return Err(crate::Error::Usage(format!(
                "tuning file {} does not exist",
                self.tuning
                    .as_ref()
                    .map_or(String::new(), |t| t.display().to_string())
            )));
        }
        let workload_name = match &self.trace {
            Some(t) => match self.replay_block_tokens {
                Some(rb) if rb != self.block_tokens => format!(
                    "trace {} ({} tokens per block, replayed as {rb})",
                    t.display(),
                    self.block_tokens
                ),
                _ => format!(
                    "trace {} ({} tokens per block)",
                    t.display(),
                    self.block_tokens
                ),
            },
            None => format!(
                "built-in conversations (seed {}, {} conversations)",
                self.seed, self.conversations
            ),
        };
        Ok(ReplayPlan {
            deployment,
            workload_name,
        })
    }

    /// Refuses output files that would overwrite an input or each other, or cannot be
    /// written.
    pub(super) fn check_files(&self) -> Result<(), crate::Error> {
        crate::cli::common::check_outputs(
            &[
                ("--json", self.json.as_deref()),
                ("--request-log", self.request_log.as_deref()),
            ],
            &[
                ("--trace", self.trace.as_deref()),
                ("--tuning", self.tuning.as_deref()),
            ],
        )?;
        match &self.storage {
            Some(dir) if dir.exists() && !dir.is_dir() => Err(crate::Error::Usage(format!(
                "--storage {} is not a directory (the store is a directory of records)",
                dir.display()
            ))),
            _ => Ok(()),
        }
    }

    /// The request stream and, when known, its length (for the progress bar). A trace in a
    /// regular file is read through and checked first, so a bad line is refused (exit
    /// status 2, naming file:line) before any work; a pipe cannot be read twice, so its bad
    /// line stops the replay where it is (see `run`).
    pub(super) fn workload(&self) -> Result<(RequestStream, Option<u64>), crate::Error> {
        match &self.trace {
            Some(path) => {
                let config = TraceConfig {
                    block_tokens: self.block_tokens,
                    replay_block_tokens: self.replay_block_tokens,
                    max_requests: self.requests,
                };
                let trace = MooncakeTrace::open(path, config.clone())?;
                let total = if path.is_file() {
                    Some(MooncakeTrace::check(path, config)?)
                } else {
                    None
                };
                if total == Some(0) {
                    // Refused before the kernels are built: an empty trace verifies nothing.
                    return Err(crate::Error::Usage(format!(
                        "trace {} has no request (it is empty or blank): nothing to verify",
                        path.display()
                    )));
                }
                Ok((Box::new(trace), total.map(|n| n as u64)))
            }
            None => {
                let config = ConversationsConfig {
                    seed: self.seed,
                    conversations: self.conversations,
                    ..ConversationsConfig::default()
                };
                let gen = Conversations::new(config, self.requests)?;
                let total = gen.total_requests() as u64;
                Ok((Box::new(gen), Some(total)))
            }
        }
    }
}
