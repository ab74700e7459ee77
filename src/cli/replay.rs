//! `cp-hicache replay`: the main job. Replays a prefix-sharing workload through the CP
//! cluster, verifying every request's materialised KV byte for byte, and reports hit rates,
//! traffic, throughput, replica agreement and mismatched tokens.

use super::common::parse_backend;
use crate::allocator::BufferSizes;
use crate::cluster::{
    Cluster, ClusterConfig, Fault, Ranks, ReplayReport, RequestStats, RollbackDrops, WritePolicy,
};
use crate::exec::{open_executor, Backend, Executor};
use crate::jit::{Jit, JitConfig, Sanitize};
use crate::kernels::{Deployment, ModelShape, TransferPath};
use crate::layout::CpLayout;
use crate::layout::Layout;
use crate::rank::LiveShape;
use crate::workload::{
    Conversations, ConversationsConfig, MooncakeTrace, Request, TraceConfig, WorkloadError,
    MAX_BLOCK_TOKENS,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// Model buffer shapes selectable on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelArg {
    /// DeepSeek-V3.2 NSA: kv 656 B/token + index_k 132 B/token (page size 64).
    Nsa,
    /// Plain MLA with a bf16 cache: 1152 B/token.
    Mla,
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
    /// `lane-exhaustion` are refused there.
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
    /// Materialise and verify each request on the first N ranks only (1..=--cp; default:
    /// every rank). Attention on every rank reads every page through that rank's own
    /// mappings of its peers' pools, so each rank verifies the whole sequence, which costs
    /// C times one verification on a CPU; a wrong mapping on a rank left out goes unseen.
    #[arg(long, value_name = "N")]
    pub verify_ranks: Option<u8>,
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
    /// Inject a fault to exercise a failure path: plain-alloc-on-load (the seed's bug),
    /// lane-exhaustion, host-pool-full, compile-error, launch-error.
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
fn live_shape(args: &ReplayArgs, req: &crate::workload::Request) -> LiveShape {
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

fn parse_fault(s: &str) -> Result<Fault, String> {
    s.parse()
}

/// A stream of requests, read or generated lazily.
type RequestStream = Box<dyn Iterator<Item = Result<Request, WorkloadError>>>;

/// Everything replay needs, validated.
struct ReplayPlan {
    deployment: Deployment,
    workload_name: String,
}

impl ReplayArgs {
    fn validate(&self) -> Result<ReplayPlan, crate::Error> {
        let model = match self.model {
            ModelArg::Nsa => ModelShape::Nsa,
            ModelArg::Mla => ModelShape::MlaBf16,
        };
        let layout = Layout::parse(&self.layout, self.interleave_size)
            .map_err(|e| crate::Error::Usage(format!("--layout: {e}")))?;
        let deployment = Deployment::new(model, self.page_size, self.cp)
            .and_then(|d| d.with_layout(layout))
            .map_err(|e| crate::Error::Usage(e.to_string()))?;
        if let Some(fault) = self.inject {
            fault
                .check_layout(layout)
                .map_err(|why| crate::Error::Usage(format!("--inject {fault}: {why}")))?;
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
    fn check_files(&self) -> Result<(), crate::Error> {
        super::common::check_outputs(
            &[
                ("--json", self.json.as_deref()),
                ("--request-log", self.request_log.as_deref()),
            ],
            &[
                ("--trace", self.trace.as_deref()),
                ("--tuning", self.tuning.as_deref()),
            ],
        )
    }

    /// The request stream and, when known, its length (for the progress bar). A trace in a
    /// regular file is read through and checked first, so a bad line is refused (exit
    /// status 2, naming file:line) before any work; a pipe cannot be read twice, so its bad
    /// line stops the replay where it is (see `run`).
    fn workload(&self) -> Result<(RequestStream, Option<u64>), crate::Error> {
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

/// Bytes of the cluster's kernel-backed lane allocators (one per rank), as
/// `(executor memory, host mirrors)`: each rank's buffers as the allocator sizes them
/// ([`BufferSizes`]), and its host mirror, a 4-byte page id per free page and one bit per page.
fn allocator_bytes(layout: &CpLayout) -> (u64, u64) {
    let (cp, pages) = (u64::from(layout.cp()), u64::from(layout.pages()));
    let per_rank = BufferSizes::of(layout).total();
    let mirror = 4 * pages + pages.div_ceil(64) * 8;
    (per_rank.saturating_mul(cp), mirror.saturating_mul(cp))
}

/// What a replay holds in host memory, by part.
#[derive(Debug, PartialEq, Eq)]
struct MemoryNeed {
    /// Device pools (host memory only on the CPU executor).
    device_pools: u64,
    /// Host pools.
    host_pools: u64,
    /// The lane allocators' executor buffers (host memory only on the CPU executor).
    allocators: u64,
    /// The lane allocators' host mirrors.
    mirrors: u64,
    /// Whether device memory is off the host (CUDA).
    on_gpu: bool,
}

impl MemoryNeed {
    fn new(config: &ClusterConfig, backend: Backend) -> Result<MemoryNeed, crate::Error> {
        let geometry = config.pool_geometry().map_err(cluster_error)?;
        let (device_pools, host_pools) = geometry.pool_bytes(&config.deployment);
        let (allocators, mirrors) = allocator_bytes(&config.layout().map_err(cluster_error)?);
        Ok(MemoryNeed {
            device_pools,
            host_pools,
            allocators,
            mirrors,
            // An open executor is never `Auto`; only CUDA keeps device memory off the host.
            on_gpu: backend == Backend::Cuda,
        })
    }

    /// Host bytes in all: on the CPU the device pools count twice (the dense
    /// materialisation buffers hold at most one device pool's worth).
    fn host_bytes(&self) -> u64 {
        let host = self.host_pools.saturating_add(self.mirrors);
        if self.on_gpu {
            host
        } else {
            host.saturating_add(self.device_pools.saturating_mul(2))
                .saturating_add(self.allocators)
        }
    }
}

/// Refuses, before anything is allocated, a replay whose pools and allocator buffers do not
/// fit in the memory available: allocating them would get the process killed without a
/// word. Host pools and the allocators' mirrors are host memory on every backend; on the
/// CPU so are the device pools, the dense materialisation buffers (at most one device
/// pool's worth) and the allocators' executor buffers.
fn check_memory(config: &ClusterConfig, backend: Backend) -> Result<(), crate::Error> {
    let need = MemoryNeed::new(config, backend)?;
    let Some(available) = available_memory() else {
        return Ok(());
    };
    if need.host_bytes() <= available {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let parts = if need.on_gpu {
        format!(
            "pinned host pools {:.1} GiB, lane allocator mirrors {:.1} GiB",
            gib(need.host_pools),
            gib(need.mirrors)
        )
    } else {
        format!(
            "device pools {:.1} GiB and as much again for materialisation, host pools {:.1} \
             GiB, lane allocators {:.1} GiB",
            gib(need.device_pools),
            gib(need.host_pools),
            gib(need.allocators.saturating_add(need.mirrors))
        )
    };
    Err(crate::Error::Usage(format!(
        "this replay needs about {:.1} GiB of host memory ({parts}) but {:.1} GiB is \
         available: lower --layers, --device-pages or --host-pages",
        gib(need.host_bytes()),
        gib(available)
    )))
}

/// Refuses, before anything is allocated, one rank of `config` (an engine process's
/// `RankCache`) whose pools, allocator and materialisation buffers do not fit in the memory
/// available: the same check as the replay's, for one rank, in the words of an API (`what`
/// names the arguments to lower). A rank holds its share of the pools and allocators, and a
/// materialisation buffer as large as the whole sequence (every owner's pages).
pub fn check_rank_memory(
    config: &ClusterConfig,
    backend: Backend,
    what: &str,
) -> Result<(), crate::Error> {
    let all = MemoryNeed::new(config, backend)?;
    let cp = u64::from(config.deployment.cp);
    let share = |b: u64| b.div_ceil(cp);
    let host = share(all.host_pools).saturating_add(share(all.mirrors));
    let need = if all.on_gpu {
        host
    } else {
        host.saturating_add(share(all.device_pools))
            .saturating_add(all.device_pools)
            .saturating_add(share(all.allocators))
    };
    let Some(available) = available_memory() else {
        return Ok(());
    };
    if need <= available {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    Err(crate::Error::Usage(format!(
        "this rank needs about {:.1} GiB of host memory but {:.1} GiB is available: lower \
         {what}",
        gib(need),
        gib(available)
    )))
}

/// `MemAvailable` of `/proc/meminfo` in bytes; `None` where it cannot be read.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Runs the replay and prints the report; the exit status says whether it was correct.
pub(super) fn run(args: &ReplayArgs) -> Result<ExitCode, crate::Error> {
    let plan = args.validate()?;
    args.check_files()?;
    let (workload, total) = args.workload()?;
    let exec: Arc<dyn Executor> = Arc::from(open_executor(args.backend)?);
    let jit = Jit::new(JitConfig::from_env()?);
    let setup = Setup::new(args, &plan, exec.as_ref(), &jit)?;
    check_memory(&setup.config, exec.backend())?;
    // One executor per rank where peers in this process can map each other's pools (shared
    // memory on the CPU), as engine processes each hold their own; on one GPU the ranks share
    // it (CUDA IPC handles cannot be opened by the process that made them).
    let mut cluster = if exec.maps_in_process() {
        let mut execs = vec![exec];
        for _ in 1..args.cp {
            execs.push(Arc::from(open_executor(args.backend)?));
        }
        Cluster::with_executors(setup.config.clone(), execs, &jit)
    } else {
        Cluster::new(setup.config.clone(), exec, &jit)
    }
    .map_err(cluster_error)?;
    drive(&mut cluster, args, plan, setup, workload, total)
}

/// Checks a replay's arguments as [`replay_rank`] will, before any rank starts: everything
/// `cp-hicache replay` refuses with exit status 2 (the settings, the trace's every line, the
/// output file) is refused here, so a launcher refuses it once instead of in every rank.
pub fn check_replay_args(args: &ReplayArgs) -> Result<(), crate::Error> {
    let plan = args.validate()?;
    args.check_files()?;
    if let Some(t) = args.trace.as_ref().filter(|t| t.exists() && !t.is_file()) {
        return Err(crate::Error::Usage(format!(
            "--trace {} is not a regular file: every rank process reads the trace itself, so \
             it cannot be a pipe",
            t.display()
        )));
    }
    drop(args.workload()?);
    // Checked once here: ranks checking while their peers allocate would see each other's
    // pools as used memory, and could refuse on some ranks only.
    let config = ClusterConfig {
        deployment: plan.deployment,
        layers: args.layers,
        device_pages: args.device_pages,
        host_pages: args.host_pages,
        policy: args.policy,
        fault: args.inject,
        sanitize: Sanitize::None,
    };
    check_memory(&config, args.backend.resolve())
}

/// Runs this process's rank (`group.rank()`) of a replay whose ranks are separate processes
/// (`python -m cp_hicache.replay`; its launcher calls [`check_replay_args`] first, which
/// checks memory for the whole group): the same workload, checks and report as
/// `cp-hicache replay`, on one [`RankCache`](crate::rank::RankCache) agreeing with its peers
/// through `group`. Every rank verifies (unless `--verify-ranks`); rank 0 prints the report
/// and writes `--json`. Every rank returns the same exit status.
///
/// The executor is this process's own (`--backend`), and peers map its pools (POSIX shared
/// memory on the CPU), so it must support [`Executor::peer_mapping`].
pub fn replay_rank(
    args: &ReplayArgs,
    group: Box<dyn crate::group::Collective>,
) -> Result<ExitCode, crate::Error> {
    let plan = args.validate()?;
    let (workload, total) = args.workload()?;
    if group.size() != usize::from(args.cp) {
        return Err(crate::Error::Usage(format!(
            "--cp {} needs {} rank processes, not {}",
            args.cp,
            args.cp,
            group.size()
        )));
    }
    let exec: Arc<dyn Executor> = Arc::from(open_executor(args.backend)?);
    if exec.peer_mapping().is_none() {
        return Err(crate::Error::Usage(format!(
            "the {} executor cannot map peers' pools across processes",
            exec.backend()
        )));
    }
    let jit = Jit::new(JitConfig::from_env()?);
    // Memory was checked once for the group (`check_replay_args`), not per rank.
    let setup = Setup::new(args, &plan, exec.as_ref(), &jit)?;
    let mut rank = crate::rank::RankCache::new(
        setup.config.clone(),
        exec,
        &jit,
        group,
        crate::rank::PeerAccess::Mapped,
    )
    .map_err(cluster_error)?;
    drive(&mut rank, args, plan, setup, workload, total)
}

/// The cluster settings a replay runs with, and what the report says about them.
struct Setup {
    config: ClusterConfig,
    deployment: Deployment,
    backend: String,
    tuning_file: Option<PathBuf>,
}

impl Setup {
    fn new(
        args: &ReplayArgs,
        plan: &ReplayPlan,
        exec: &dyn Executor,
        jit: &Jit,
    ) -> Result<Setup, crate::Error> {
        // Launch shapes tuned for this executor: from --tuning, else <cache>/tuning.json if any.
        let mut deployment = plan.deployment.clone();
        let device = crate::tuning::DeviceKey::for_executor(exec, jit)?;
        let warnings = crate::tuning::apply(&mut deployment, args.tuning.as_deref(), &device)?;
        // Named in the report only when some of its shapes run.
        let tuning_file = (deployment != plan.deployment).then(|| {
            args.tuning
                .clone()
                .unwrap_or_else(crate::tuning::default_path)
        });
        for warning in crate::tuning::warning_lines(&warnings) {
            eprintln!("warning: {warning}");
        }
        if let Some(path) = args.transfer {
            deployment.transfer_path = path;
        }
        let config = ClusterConfig {
            deployment: deployment.clone(),
            layers: args.layers,
            device_pages: args.device_pages,
            host_pages: args.host_pages,
            policy: args.policy,
            fault: args.inject,
            sanitize: Sanitize::from_env()?,
        };
        Ok(Setup {
            config,
            deployment,
            backend: exec.backend().to_string(),
            tuning_file,
        })
    }
}

/// The replay itself, over every rank in this process or this process's one rank: the same
/// calls either way (see [`Ranks`]), so both report the same.
fn drive(
    cluster: &mut dyn Ranks,
    args: &ReplayArgs,
    plan: ReplayPlan,
    setup: Setup,
    workload: RequestStream,
    total: Option<u64>,
) -> Result<ExitCode, crate::Error> {
    let Setup {
        deployment,
        backend,
        tuning_file,
        ..
    } = setup;
    let reports = cluster.reports();
    if let Some(n) = args.verify_ranks {
        cluster.set_verifying_ranks(usize::from(n));
    }
    tracing::info!(
        kernels_ms = cluster.kernels().startup_ms,
        cache_hits = cluster.kernels().cache_hits,
        "kernels ready"
    );
    // The request the injected launch failure is aimed at (on the last rank).
    let last = usize::from(args.cp) - 1;
    let mut launch_failure_at = None;
    if args.inject == Some(Fault::LaunchError) {
        // Fail a request in the middle, once the cache holds something worth protecting.
        let at = total.map_or(1, |t| (t / 2) as usize);
        cluster.inject_launch_failure_on(last, at);
        launch_failure_at = Some(at);
    }

    // Only the reporting process draws and notes; every rank still makes every call.
    let bar = if reports {
        progress_bar(total, args.quiet)
    } else {
        ProgressBar::hidden()
    };
    let say = |line: String| {
        if reports {
            note(&bar, line);
        }
    };
    let start = Instant::now();
    let mut totals = RequestStats::default();
    let mut requests = 0u64;
    let mut disagreed_at = None;
    let mut failed = 0u64;
    let mut dropped = RollbackDrops::default();
    let mut skipped = 0u64;
    // A bad line the up-front check could not see (a pipe, or a file changed since) stops
    // the replay there; what ran is still reported.
    let mut input_error = None;
    let mut log = String::new();
    for req in workload {
        let req = match req {
            Ok(req) => req,
            Err(e) => {
                input_error = Some(e);
                break;
            }
        };
        let before = cluster.replica_digests().map_err(cluster_error)?;
        let shape = live_shape(args, &req);
        let live = !shape.is_plain(req.tokens.len());
        let served = if live {
            cluster.serve_live(&req.tokens, &shape)
        } else {
            cluster.serve(&req.tokens)
        };
        let mut entry = serde_json::json!({
            "request": req.id,
            "outcome": match &served {
                Ok(_) => "served",
                Err(e) if e.is_pool_too_small() => "skipped",
                Err(_) => "failed",
            },
        });
        if let Ok(stats) = &served {
            entry["stats"] = serde_json::to_value(stats).unwrap_or_default();
        }
        match served {
            Ok(stats) => {
                totals.add(&stats);
                if let Some(first) = stats.first_mismatched_token {
                    say(format!(
                        "request {}: {} mismatched tokens, the first at token {first}",
                        req.id, stats.mismatched_tokens
                    ));
                }
            }
            Err(e) if e.is_pool_too_small() => {
                // The cluster rolled the request back; smaller ones can still be served. The
                // error says which lanes were short and why, not just a page count.
                if skipped == 0 {
                    let at = req
                        .line
                        .map_or(String::new(), |l| format!(" (trace line {l})"));
                    say(format!(
                        "warning: request {}{at} skipped: {e}; later requests that do not \
                             fit are skipped and counted too",
                        req.id
                    ));
                }
                skipped += 1;
                if launch_failure_at == Some(requests as usize) {
                    // The launch failure aimed at this request went with it (it launched
                    // nothing): aim at the next one, so the fault is still exercised.
                    let next = requests as usize + 1;
                    cluster.inject_launch_failure_on(last, next);
                    launch_failure_at = Some(next);
                }
            }
            Err(e) if e.is_usage() || e.is_group_broken() => {
                // A broken group (a rank gone, a timeout, diverged ranks) serves no more.
                bar.finish_and_clear();
                return Err(cluster_error(e));
            }
            Err(e) => {
                failed += 1;
                // The rollback may legitimately drop cache entries whose pages the failed
                // request had evicted (and may have reused): then the state differs from
                // before, but the replicas must still agree, and something must have been
                // dropped to explain the difference.
                let drops = cluster.last_rollback();
                dropped.device_pages += drops.device_pages;
                dropped.host_copies += drops.host_copies;
                let unchanged = cluster.replica_digests().map_err(cluster_error)? == before;
                let agree = cluster.replicas_agree().map_err(cluster_error)?;
                let state = match (unchanged, agree, drops.is_empty()) {
                    (true, _, _) => "unchanged".to_string(),
                    // Steps are agreed one by one: a failed one abandons the request, and
                    // what it inserted unfinished stays cached.
                    (false, true, _) if live => "abandoned on every rank".to_string(),
                    (false, true, false) => format!(
                        "rolled back, dropping stale cache entries ({} device pages, {} host copies)",
                        drops.device_pages, drops.host_copies
                    ),
                    (false, true, true) => "CHANGED although the rollback dropped nothing".into(),
                    (false, false, _) => "CHANGED and the replicas DISAGREE".into(),
                };
                say(format!(
                    "request {} failed: {e}\n  allocator and tree state {state} (digest before {})",
                    req.id,
                    before
                        .first()
                        .map_or("unknown".to_string(), ToString::to_string)
                ));
                if !agree || (!unchanged && drops.is_empty() && !live) {
                    disagreed_at.get_or_insert(req.id);
                }
            }
        }
        requests += 1;
        let after = cluster.replica_digests().map_err(cluster_error)?;
        let agree = !after.is_empty() && after.windows(2).all(|w| w[0] == w[1]);
        if disagreed_at.is_none() && !agree {
            disagreed_at = Some(req.id);
            say(format!("request {}: replicas disagree", req.id));
        }
        if args.request_log.is_some() {
            entry["digests"] = after.iter().map(ToString::to_string).collect();
            log.push_str(&entry.to_string());
            log.push('\n');
        }
        bar.inc(1);
        bar.set_message(format!("{} mismatched", totals.mismatched_tokens));
    }
    bar.finish_and_clear();
    // A run that verified nothing must not read as a pass.
    if requests == 0 {
        if let Some(e) = input_error {
            return Err(e.into());
        }
        return Err(crate::Error::Usage(format!(
            "{} has no request: nothing to verify",
            plan.workload_name
        )));
    }
    if skipped == requests {
        if let Some(e) = &input_error {
            eprintln!("error: {e}");
        }
        return Err(crate::Error::Usage(format!(
            "no request fits in the device pool: all {skipped} were skipped, nothing was \
             verified; raise --device-pages"
        )));
    }
    let fault_exercised = args
        .inject
        .map(|f| fault_exercised(f, &totals, failed, args.cp, args.device_pages));
    if let (true, Some(f), Some(Err(why))) = (reports, args.inject, &fault_exercised) {
        eprintln!("warning: the injected fault {f} never fired: {why}");
    }
    let wall = start.elapsed().as_secs_f64();
    // The allocator kernels' output is never read on the serving path (the host mirror
    // decides); compare the device lane stacks with the mirrors once now, off that path.
    let device_lanes_agree = match cluster.check_device_lanes() {
        Ok(()) => true,
        Err(e) if e.is_group_broken() => return Err(cluster_error(e)),
        Err(e) => {
            if reports {
                eprintln!("device lane stacks disagree with the allocator's host mirror: {e}");
            }
            false
        }
    };
    let served = requests - failed - skipped;
    let report = ReplayReport {
        requests,
        rounds_per_request: if served > 0 {
            totals.group_rounds as f64 / served as f64
        } else {
            0.0
        },
        tokens_per_second: if wall > 0.0 {
            totals.prompt_tokens as f64 / wall
        } else {
            0.0
        },
        totals,
        replicas_agree: disagreed_at.is_none() && device_lanes_agree,
        device_lanes_agree,
        wall_seconds: wall,
        backend,
        cp: args.cp,
        page_size: args.page_size,
        model: deployment.model.to_string(),
        layers: args.layers,
        policy: args.policy.to_string(),
        layout: deployment.layout.to_string(),
        chunk_tokens: args.chunk_tokens,
        decode_tokens: args.decode_tokens.map(|d| d.to_string()),
        workload: match &input_error {
            Some(e) => format!("{}, cut short by {e}", plan.workload_name),
            None => plan.workload_name,
        },
        failed_requests: failed,
        requests_skipped: skipped,
        rollback_dropped_device_pages: dropped.device_pages,
        rollback_dropped_host_copies: dropped.host_copies,
        fault: args.inject.map(|f| f.to_string()),
        fault_fired: fault_exercised.as_ref().map(Result::is_ok),
        fault_not_fired_because: fault_exercised.and_then(Result::err),
        tuning_file: tuning_file.map(|p| p.display().to_string()),
        copy_launch: deployment.copy.to_string(),
        group: cluster.group_info(),
        transfer_path: deployment.transfer_path.to_string(),
        synth_threads: deployment.synth_threads,
    };
    if reports {
        outln!("cp-hicache replay");
        out!("{}", report.to_table());
        if let Some(path) = &args.json {
            super::common::write_json(path, &report)?;
        }
        if let Some(path) = &args.request_log {
            super::common::write_output(path, &log)?;
        }
    }
    if let Some(e) = input_error {
        if reports {
            eprintln!(
            "error: {e}\n  the replay stopped there: the report covers the {requests} requests \
             before it"
            );
        }
        // A failure in what ran is the stronger verdict; otherwise the input is at fault.
        return Ok(if report.ok() && failed == 0 {
            ExitCode::from(2)
        } else {
            ExitCode::FAILURE
        });
    }
    if report.ok() && failed == 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}

/// Whether an injected fault did anything in this run, judged from what it must cause;
/// otherwise why not. A fault that never fired tested nothing, and a clean report would
/// read as if the failure path had been exercised.
fn fault_exercised(
    fault: Fault,
    totals: &RequestStats,
    failed: u64,
    cp: u8,
    device_pages: u32,
) -> Result<(), String> {
    let fired = match fault {
        // Only a page loaded into another owner's page tests anything: at CP 1, or when
        // the plain allocation happens to give the recorded owners, the bug is invisible.
        Fault::PlainAllocOnLoad => totals.pages_loaded_misowned > 0,
        Fault::LaneExhaustion => totals.evictions_lane + totals.load_degraded_to_miss > 0,
        Fault::HostPoolFull => totals.backups_skipped + totals.host_evictions_for_backup > 0,
        // The kernels are built before the first request, so a run that got here failed.
        Fault::CompileError => true,
        Fault::LaunchError => failed > 0,
    };
    if fired {
        return Ok(());
    }
    Err(match fault {
        Fault::PlainAllocOnLoad if totals.pages_loaded == 0 => format!(
            "no page was loaded back from the host, every prefix hit was still on the \
             device; a smaller --device-pages (now {device_pages}) forces load-backs"
        ),
        Fault::PlainAllocOnLoad if cp == 1 => format!(
            "at CP 1 every page has the one owner, so the {} pages loaded back could not \
             land on another owner's page; a CP above 1 makes the bug visible",
            totals.pages_loaded
        ),
        Fault::PlainAllocOnLoad => format!(
            "each of the {} pages loaded back happened to get the owner it was backed up \
             from, so the plain allocation matched the owner-preserving one",
            totals.pages_loaded
        ),
        Fault::LaneExhaustion => format!(
            "no allocation ran short of a lane: no lane-targeted eviction, no load-back \
             degraded to a miss; a smaller --device-pages (now {device_pages}) or more \
             requests make one"
        ),
        Fault::HostPoolFull => "no backup found the host pool full (none was skipped, no host \
             copy was evicted for one); longer or more requests make it"
            .into(),
        Fault::CompileError => "the kernels compiled".into(),
        Fault::LaunchError => "no request from the middle of the workload on launched a \
             kernel (each was skipped as too large, or empty)"
            .into(),
    })
}

fn cluster_error(e: crate::cluster::ClusterError) -> crate::Error {
    if e.is_usage() {
        crate::Error::Usage(e.to_string())
    } else {
        crate::Error::Cluster(e)
    }
}

/// A line for the user on stderr, above the progress bar when there is one.
fn note(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

fn progress_bar(total: Option<u64>, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match total {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} replay [{elapsed_precise}] {wide_bar} {pos}/{len} requests · {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_pool_full_fired_when_a_backup_was_skipped_or_made_room_for() {
        let fired = |skipped, evicted| {
            let totals = RequestStats {
                backups_skipped: skipped,
                host_evictions_for_backup: evicted,
                ..RequestStats::default()
            };
            fault_exercised(Fault::HostPoolFull, &totals, 0, 8, 64).is_ok()
        };
        assert!(fired(1, 0));
        assert!(
            fired(0, 1),
            "host eviction that made a backup fit is the fault firing"
        );
        assert!(!fired(0, 0));
    }

    /// The seed's bug is exercised only by a page loaded into another owner's page; a
    /// load-back alone (CP 1, or owners that happen to match) tested nothing, and says why.
    #[test]
    fn plain_alloc_on_load_fired_only_when_a_page_got_another_owner() {
        let check = |cp, loaded, misowned| {
            let totals = RequestStats {
                pages_loaded: loaded,
                pages_loaded_misowned: misowned,
                ..RequestStats::default()
            };
            fault_exercised(Fault::PlainAllocOnLoad, &totals, 0, cp, 64)
        };
        assert!(check(8, 4, 1).is_ok());
        assert!(check(8, 0, 0)
            .unwrap_err()
            .contains("no page was loaded back"));
        assert!(check(1, 4, 0).unwrap_err().contains("at CP 1"));
        assert!(check(8, 4, 0)
            .unwrap_err()
            .contains("happened to get the owner"));
    }

    /// The memory check counts the kernel-backed lane allocators: per rank 8 bytes per
    /// token of every logical page (out_locs) and 13 per page (pages_in, out_pages, stacks,
    /// owners_in), about cp × (8 · page_size + 13) bytes per logical page in all, plus the
    /// host mirrors. They used to be left out.
    #[test]
    fn the_memory_check_counts_the_lane_allocators() {
        let args = ReplayArgs::default();
        let plan = args.validate().unwrap();
        let config = ClusterConfig {
            deployment: plan.deployment,
            layers: 1,
            device_pages: 4096,
            host_pages: 16,
            policy: WritePolicy::WriteThrough,
            fault: None,
            sanitize: Sanitize::default(),
        };
        let (cp, page) = (8u64, 64u64);
        let need = MemoryNeed::new(&config, Backend::Host).unwrap();
        // Per rank: stacks, inputs and outputs per page; the lane tops; the select and the
        // release status words (CP + 2 each).
        assert_eq!(
            need.allocators,
            cp * (8 * page + 13) * 4096 + cp * 4 * cp + cp * 2 * 4 * (cp + 2)
        );
        assert_eq!(need.mirrors, cp * (4 * 4096 + 4096 / 8));
        assert_eq!(
            need.host_bytes(),
            need.host_pools + 2 * need.device_pools + need.allocators + need.mirrors
        );
        let gpu = MemoryNeed::new(&config, Backend::Cuda).unwrap();
        assert_eq!(gpu.host_bytes(), gpu.host_pools + gpu.mirrors);
    }
}
