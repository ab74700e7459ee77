"""``RankCache.step`` (issue 45): a scheduler's whole batch in at most one group round a
step, none for decode tokens in kept partial pages, and one request's failure failing that
request on every rank, not the step. The CP ranks are threads of this process over a Python
group that counts its rounds."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cp_hicache
from test_live_requests import CP, Ranks, cache, deployment


def counting(ranks: Ranks):
    """A group (a member class) that counts the rounds rank 0 takes."""
    member = ranks.group()
    count = {"rounds": 0}

    class Counted(member):
        def exchange(self, what, payload, why):
            if self.rank == 0:
                count["rounds"] += 1
            return super().exchange(what, payload, why)

    return Counted, count


def prompt(i: int, n: int = 40) -> np.ndarray:
    return np.arange(10_000 * (i + 1), 10_000 * (i + 1) + n, dtype=np.uint32)


@pytest.mark.parametrize("layout,interleave", [("zigzag", None), ("token-interleave", 4)])
def test_a_batch_takes_a_round_a_step_and_decode_in_kept_pages_none(layout, interleave):
    ranks = Ranks()
    member, count = counting(ranks)
    dep = deployment(layout, interleave)
    batch = 8

    def body(rank):
        rc = cache(dep, rank, member)
        rounds = []

        def counted(f):
            before = count["rounds"]
            ranks.barrier.wait()
            out = f()
            ranks.barrier.wait()
            rounds.append(count["rounds"] - before)
            return out

        reqs = counted(lambda: rc.step(begin=[prompt(i) for i in range(batch)]))
        for r in reqs:
            rc.synthesise(r)
        for t in range(24):
            counted(lambda: rc.step(extend=[(r, [50_000 + t]) for r in reqs]))
            for r in reqs:
                rc.synthesise(r)
        bad = sum(rc.verify(r) for r in reqs)
        for r in reqs:
            assert r.stats()["tokens"] == 64
            owners, slots = rc.token_locations(r)
            assert len(owners) == len(slots) == 64
        counted(lambda: rc.step(finish=reqs))
        rc.close()
        return rounds, bad

    out = ranks.run(body)
    rounds, bad = out[0]
    assert bad == 0 and out[1][1] == 0
    assert rounds[0] == 1, rounds  # the admission
    assert rounds[-1] == 1, rounds  # the end
    decode = rounds[1:-1]
    # A round only where a page fills up or a new one is needed: 40 + 24 tokens cross two
    # page boundaries of 16 (at 48 and 64 tokens), plus the first step inserting the
    # prompt's whole pages (more where a layout's granule spans CP pages).
    assert max(decode) == 1 and 1 <= sum(decode) <= 4, decode
    assert decode.count(0) >= 20, decode


def test_one_requests_failure_fails_it_on_every_rank_and_the_step_goes_on():
    """Rank 1 ends one request with ok=False while rank 0 finishes it: every rank abandons
    it (rank 0 learns it through StepError), the other requests finish, and a prompt the
    pools cannot hold is refused while the others of the same step are admitted."""
    ranks = Ranks()
    member, _ = counting(ranks)
    dep = deployment("zigzag", None)

    def body(rank):
        rc = cache(dep, rank, member, device_pages=24 * CP)
        reqs = rc.step(begin=[prompt(i) for i in range(3)])
        for r in reqs:
            rc.synthesise(r)
        finish = [(r, not (i == 1 and rank == 1)) for i, r in enumerate(reqs)]
        huge = np.arange(200_000, 200_000 + 16 * 40, dtype=np.uint32)
        try:
            new = rc.step(finish=finish, begin=[prompt(7), huge])
            failures, kinds = [], []
        except cp_hicache.StepError as e:
            new = e.requests
            failures = [(k, i) for k, i, _ in e.failures]
            kinds = [type(x).__name__ for _, _, x in e.failures]
        assert new[0] is not None and new[1] is None
        rc.synthesise(new[0])
        assert rc.verify(new[0]) == 0
        rc.finish(new[0])
        hits = [rc.serve(prompt(i))["device_hit_tokens"] for i in range(3)]
        rc.close()
        return failures, kinds, hits

    out = ranks.run(body)
    for rank, (failures, kinds, hits) in enumerate(out):
        want = [("begin", 1)] if rank == 1 else [("finish", 1), ("begin", 1)]
        assert failures == want, (rank, failures)
        assert "CacheFullError" in kinds
        assert hits == [32, 0, 32]


def test_bad_steps_are_refused_before_any_round():
    ranks = Ranks(1)
    member, count = counting(ranks)
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=1)

    def body(rank):
        rc = cache(dep, rank, member)
        (req,) = rc.step(begin=[prompt(0)])
        before = count["rounds"]
        with pytest.raises(cp_hicache.UsageError, match="twice"):
            rc.step(extend=[(req, [1]), (req, [2])])
        with pytest.raises(cp_hicache.UsageError, match="at least one token"):
            rc.step(extend=[(req, [])])
        with pytest.raises(cp_hicache.UsageError, match="allocate"):
            rc.step(begin=[prompt(1)], allocate=False, chunk=8)
        with pytest.raises(cp_hicache.UsageError, match="u32"):
            rc.step(begin=[[-1]])
        assert count["rounds"] == before
        rc.step(finish=[(req, False)])
        rc.close()

    ranks.run(body)
    assert threading.active_count() >= 1
