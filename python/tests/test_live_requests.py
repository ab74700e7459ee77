"""Live requests as an engine drives them (issue 45, findings 2 and 4): a chunked prefill, more
chunks through ``extend``, then decode tokens one at a time, with the CP ranks as threads of
this process over a Python group. After every step ``token_locations`` covers every token of
the request so far, exactly where the layout says, and ``stats()["tokens"]`` counts them; an
engine that writes KV through those locations passes the cache's own verification; and a real
(tiny, randomly initialised) torch model served through the pools gives, at every step, the
logits of a run without a cache, in every layout."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cp_hicache  # noqa: E402

CP = 2
PAGE = 16
LAYERS = 2
#: Every layout, token-interleave with runs of one token and of four.
LAYOUTS = [
    ("zigzag", None),
    ("round-robin", None),
    ("page-interleave", None),
    ("token-interleave", 1),
    ("token-interleave", 4),
]
IDS = [f"{n}{'' if i is None else i}" for n, i in LAYOUTS]
#: A token's bytes in the `mla_kv` pool (576 bf16).
TOKEN_BYTES = 1152


def deployment(layout, interleave) -> cp_hicache.Deployment:
    return cp_hicache.Deployment(model="mla", page_size=PAGE, cp=CP, layers=LAYERS,
                                 layout=layout, interleave_size=interleave)


class Ranks:
    """CP ranks as threads: each round of a group is an all-gather through a barrier, and
    the ranks can meet at a barrier of their own (the engine's collective)."""

    def __init__(self, size: int = CP):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self._groups = 0

    def group(self):
        """A new group (one per cache): a member per rank."""
        slots = [None] * self.size
        barrier = threading.Barrier(self.size, timeout=120)

        class Member:
            size = self.size

            def __init__(self, rank):
                self.rank = rank

            def exchange(self, what, payload, why):
                slots[self.rank] = (what, payload, why)
                barrier.wait()
                out = list(slots)
                barrier.wait()
                return out

        return Member

    def run(self, target):
        """Runs ``target(rank)`` on every rank's thread; their results in rank order. A rank
        that fails breaks the barriers, so its peers fail instead of waiting."""
        results, errors = [None] * self.size, []

        def body(rank):
            try:
                results[rank] = target(rank)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append((rank, e))
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            rank, e = min(errors, key=lambda x: isinstance(x[1], threading.BrokenBarrierError))
            raise AssertionError(f"rank {rank} failed: {e!r}") from e
        return results


def cache(dep, rank, member, **kw) -> cp_hicache.RankCache:
    args = dict(device_pages=64 * CP, host_pages=128, backend="host")
    args.update(kw)
    return cp_hicache.RankCache(dep, rank, member(rank), **args)


def layout_locations(dep, rc, pages, n):
    """Each token's owner and slot, as the layout's table says (docs/DESIGN.md §2.1),
    written out here independently of the cache: page layouts fill page ``t // ps``;
    token-interleave puts run ``k`` of a granule (``cp`` pages) on rank ``k % cp``."""
    ps, cp = dep.page_size, dep.cp
    run = dep.interleave_size or ps
    page_owner, local = rc.locate(pages)
    owners, slots = [], []
    for t in range(n):
        if run == ps:
            i, j = divmod(t, ps)
        else:
            g, rel = divmod(t, ps * cp)
            i = g * cp + (rel // run) % cp
            j = (rel // (run * cp)) * run + rel % run
            assert page_owner[i] == (t // run) % cp  # positional: token t's rank
        if dep.layout in ("page-interleave", "token-interleave"):
            assert page_owner[i] == i % cp
        owners.append(page_owner[i])
        slots.append(local[i] * ps + j)
    return np.array(owners, dtype=np.uint32), np.array(slots, dtype=np.uint32)


def by_token(pool) -> "torch.Tensor":
    """A pool as ``[layers, local_pages * page_size, token_bytes]``."""
    t = torch.from_dlpack(pool)
    return t.view(t.shape[0], t.shape[1] * PAGE, t.shape[2] // PAGE)


PROMPT = np.arange(3000, 3070, dtype=np.uint32)  # 70 tokens: a partial last page
CHUNKS = [(24, 48), (48, 70)]
DECODE = np.arange(7000, 7010, dtype=np.uint32)


def steps(rc, req):
    """The steps after ``begin(PROMPT, allocate=True, chunk=24)``: two more prefill chunks,
    then ten decode tokens, one ``extend`` each; yields after each."""
    for lo, hi in CHUNKS:
        rc.extend(req, PROMPT[lo:hi])
        yield
    for t in DECODE:
        rc.extend(req, [int(t)])
        yield


@pytest.mark.parametrize("layout, interleave", LAYOUTS, ids=IDS)
def test_token_locations_cover_every_token_and_an_engine_writing_through_them_verifies(
    layout, interleave
):
    """Each rank has two caches making the same calls: a reference whose stand-in forward
    (``synthesise``) writes the KV the verification expects, and the engine's, into which
    the engine copies each new token's KV from the reference, token by token, through the
    locations of both (each rank the tokens it owns). Every token so far is located after
    every step, where the layout says; the engine's cache then verifies with 0 mismatches,
    and before the copy exactly the new tokens mismatch."""
    dep = deployment(layout, interleave)
    ranks = Ranks()
    ref_group, eng_group = ranks.group(), ranks.group()

    def rank_main(rank):
        ref, eng = cache(dep, rank, ref_group), cache(dep, rank, eng_group)
        src = [by_token(ref.pool("mla_kv", owner=o)) for o in range(CP)]
        dst = by_token(eng.pool("mla_kv"))
        log = []

        def forward(r_req, e_req):
            n = len(e_req.tokens)
            stats = e_req.stats()
            assert stats["tokens"] == n == len(r_req.tokens), stats
            assert stats["tokens"] == stats["prompt_tokens"] + stats["extended_tokens"]
            owners, slots = eng.token_locations(e_req)
            assert len(owners) == len(slots) == n
            want = layout_locations(dep, eng, e_req.pages, n)
            assert (owners == want[0]).all() and (slots == want[1]).all()
            r_owners, r_slots = ref.token_locations(r_req)
            assert (r_owners == owners).all()  # the same calls: the same owners
            new = n - e_req.computed_from
            ref.synthesise(r_req)  # the reference forward
            ranks.barrier.wait()
            # The engine's cache holds none of the new tokens yet: each one mismatches.
            log.append(("before", eng.verify(e_req), new))
            ranks.barrier.wait()
            for t in range(e_req.computed_from, n):
                if owners[t] == rank:
                    dst[:, int(slots[t])] = src[rank][:, int(r_slots[t])]
            ranks.barrier.wait()  # every rank wrote its tokens
            log.append(("after", eng.verify(e_req), 0))

        r_req = ref.begin(PROMPT, allocate=True, chunk=24)
        e_req = eng.begin(PROMPT, allocate=True, chunk=24)
        forward(r_req, e_req)
        for _ in zip(steps(ref, r_req), steps(eng, e_req)):
            forward(r_req, e_req)
        assert len(e_req.tokens) == 70 + len(DECODE)
        stats = eng.finish(e_req)
        ref.finish(r_req)
        assert stats["tokens"] == 80 and stats["prompt_tokens"] == 24, stats
        eng.check_invariants()
        for c in (ref, eng):
            c.close()
        return log

    for log in ranks.run(rank_main):
        assert len(log) == 2 * (1 + len(CHUNKS) + len(DECODE))
        for when, got, want in log:
            assert got == want, (when, log)


# --- A real model -------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """A causal transformer small enough for a test, randomly initialised from a seed: its
    K and V per token and layer (float32) are what an engine keeps in the KV cache."""

    def __init__(self, vocab=8192, d=32, heads=2, layers=LAYERS, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.d, self.heads = d, heads

        def w(*shape, scale=0.3):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.emb = w(vocab, d, scale=1.0)
        self.pos = w(512, d, scale=1.0)
        self.qkvo = torch.nn.ParameterList([w(4, d, d) for _ in range(layers)])
        self.mlp = torch.nn.ParameterList([w(2, d, d) for _ in range(layers)])
        self.out = w(d, vocab)

    def forward(self, tokens, start, kv):
        """Logits of ``tokens`` at positions ``start ..``; ``kv(layer, k, v)`` keeps the new
        tokens' K and V and returns every token's so far (the cache's part)."""
        n = len(tokens)
        pos = torch.arange(start, start + n)
        x = self.emb[torch.as_tensor(tokens.astype(np.int64))] + self.pos[pos]
        hd = self.d // self.heads
        for layer, (wq, wk, wv, wo) in enumerate(self.qkvo):
            h = torch.nn.functional.layer_norm(x, (self.d,))
            q, k, v = h @ wq, h @ wk, h @ wv
            keys, values = kv(layer, k, v)  # [start + n, d]
            total = keys.shape[0]
            qh = q.view(n, self.heads, hd).transpose(0, 1)
            kh = keys.view(total, self.heads, hd).transpose(0, 1)
            vh = values.view(total, self.heads, hd).transpose(0, 1)
            scores = qh @ kh.transpose(1, 2) / hd**0.5
            causal = torch.arange(total)[None, :] > pos[:, None]
            att = scores.masked_fill(causal, float("-inf")).softmax(-1) @ vh
            x = x + att.transpose(0, 1).reshape(n, self.d) @ wo
            m1, m2 = self.mlp[layer]
            x = x + torch.nn.functional.gelu(
                torch.nn.functional.layer_norm(x, (self.d,)) @ m1) @ m2
        return torch.nn.functional.layer_norm(x, (self.d,)) @ self.out

    @torch.no_grad()
    def without_cache(self, tokens):
        """Every position's logits of ``tokens`` in one forward, K and V in plain tensors."""
        def kv(layer, k, v):
            return k, v

        return self.forward(tokens, 0, kv)


@pytest.mark.parametrize("layout, interleave", LAYOUTS, ids=IDS)
def test_a_real_model_through_the_cache_gives_the_logits_of_no_cache(layout, interleave):
    """Each rank (a thread) runs the model's forward over the new tokens, writes the K and V
    of the tokens it owns into its pool through ``token_locations``, and, once every rank
    wrote the layer, attention reads every token's K and V from its owner's pool. Request 1:
    a chunked prefill (24, 24, 22 tokens) then 10 greedy decode steps. Request 2 shares
    request 1's first 64 tokens (device hits); request 3 is request 2 again after every page
    went to host memory (loaded back, owners kept). Every step's logits equal those of one forward
    over the whole sequence without a cache."""
    dep = deployment(layout, interleave)
    model = TinyLM()
    ranks = Ranks()
    member = ranks.group()
    d = model.d

    def rank_main(rank):
        rc = cache(dep, rank, member)
        pools = [by_token(rc.pool("mla_kv", owner=o)).view(torch.float32) for o in range(CP)]
        out = []

        @torch.no_grad()
        def forward(req, lo):
            """The forward of the request's tokens from ``lo``: their logits."""
            tokens = req.tokens
            owners, slots = rc.token_locations(req)
            owners_t = torch.as_tensor(owners.astype(np.int64))
            slots_t = torch.as_tensor(slots.astype(np.int64))
            mine = torch.nonzero(owners_t[lo:] == rank).flatten() + lo

            def kv(layer, k, v):
                rows = pools[rank][layer]
                rows[slots_t[mine], :d] = k[mine - lo]
                rows[slots_t[mine], d:2 * d] = v[mine - lo]
                ranks.barrier.wait()  # the engine's collective: every rank wrote the layer
                kv_all = torch.empty(len(tokens), 2 * d)
                for o in range(CP):
                    at = torch.nonzero(owners_t == o).flatten()
                    kv_all[at] = pools[o][layer][slots_t[at], :2 * d]
                ranks.barrier.wait()  # every rank read it (a page may be reused after)
                return kv_all[:, :d], kv_all[:, d:]

            return model.forward(tokens[lo:], lo, kv)

        # Request 1: chunked prefill, then greedy decode.
        req = rc.begin(PROMPT, allocate=True, chunk=24)
        logits = [forward(req, 0)]
        for lo, hi in CHUNKS:
            rc.extend(req, PROMPT[lo:hi])
            logits.append(forward(req, lo))
        for _ in range(10):
            token = int(logits[-1][-1].argmax())
            n = len(req.tokens)
            rc.extend(req, [token])
            logits.append(forward(req, n))
        out.append((req.tokens, torch.cat(logits), 0))
        rc.finish(req)
        # Requests 2 and 3: a shared prefix, from device memory, then from host memory.
        second = np.concatenate([req.tokens[:64], np.arange(100, 120, dtype=np.uint32)])
        for evict in (False, True):
            if evict:
                rc.evict(1 << 30)
            req = rc.begin(second, allocate=True)
            cached = req.computed_from
            out.append((req.tokens, forward(req, cached), cached))
            stats = rc.finish(req)
            hit = stats["host_hit_tokens"] if evict else stats["device_hit_tokens"]
            # Request 2 hits request 1's first 64 tokens; request 3 also request 2's whole
            # pages (granules) past them.
            assert hit == cached and cached >= 64 and (evict or cached == 64), stats
        rc.check_invariants()
        rc.close()
        return out

    results = ranks.run(rank_main)
    for tokens, logits, cached in results[0]:
        want = model.without_cache(tokens)[cached:]
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        if cached == 0:
            # The greedy tokens are the no-cache run's.
            assert (want[69:-1].argmax(-1).numpy() == tokens[70:]).all()
    for other in results[1:]:
        for (t0, l0, _), (t1, l1, _) in zip(results[0], other):
            assert (t0 == t1).all() and torch.equal(l0, l1)


# --- The owner rule under the positional layouts ------------------------------------------


@pytest.mark.parametrize("layout, interleave",
                         [("page-interleave", None), ("token-interleave", 1),
                          ("token-interleave", 4)])
def test_a_load_onto_another_ranks_slot_is_caught_in_the_positional_layouts(layout, interleave):
    """``granule-shift-on-load`` is the seed's bug in the positional layouts' form: a
    load-back puts each granule's pages one rank on, so every page loaded back is read from
    another rank's slot. Verification counts the mismatches and ``check_invariants`` names
    the owner it broke, as ``plain-alloc-on-load`` under zigzag; without the fault the same
    requests verify clean."""
    dep = deployment(layout, interleave)

    def rank_main(fault, member, rank):
        rc = cache(dep, rank, member, fault=fault)
        first = rc.serve(PROMPT)
        rc.evict(1 << 30)  # every prefix to host memory: the next hit is a load-back
        again = rc.serve(PROMPT)
        try:
            rc.check_invariants()
            audit = None
        except cp_hicache.CacheError as e:
            audit = str(e)
        return first, again, audit

    for fault in (None, "granule-shift-on-load"):
        ranks = Ranks()
        member = ranks.group()
        for first, again, audit in ranks.run(lambda r: rank_main(fault, member, r)):
            assert first["mismatched_tokens"] == 0
            assert again["host_hit_tokens"] == 64  # two granules of CP 2 x 16 tokens
            if fault is None:
                assert again["mismatched_tokens"] == 0 and audit is None, (again, audit)
                assert again["pages_loaded_misowned"] == 0
            else:
                # Every loaded token is read from the wrong rank's slot.
                assert again["mismatched_tokens"] == 64, again
                assert again["pages_loaded_misowned"] == 4, again
                assert audit is not None and "owned by rank" in audit, audit


@pytest.mark.parametrize("layout", ["zigzag", "round-robin"])
def test_the_granule_shift_fault_is_refused_where_a_granule_is_one_page(layout):
    with pytest.raises(cp_hicache.UsageError, match="nothing to shift"):
        cp_hicache.RankCache(
            cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2, layout=layout),
            device_pages=64, host_pages=64, backend="host", fault="granule-shift-on-load")
