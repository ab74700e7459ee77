"""The engine-shaped example runs as documented: four ranks, each a process over gloo, drive
the step API (begin with allocate, their own forward through the pool tensors, finish), and
attention on every rank reads every page of every request from its owner's pool: the cached
pages (device hits, and pages loaded back from host memory after an eviction) and the pages
the peers computed in that same request. One rank is a straggler, so its peers reach
``finish`` while it still reads their pages. The reads are the example's own, not the cache's
verification. The original bug (loaded pages losing their owners) shows as wrong KV."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"


def run(*args):
    return subprocess.run([sys.executable, str(EXAMPLE), "--ranks", "4", "--backend", "host",
                           "--slow-rank", "1", *args], capture_output=True, text=True,
                          timeout=300)


def test_the_engine_loop_reads_back_what_it_wrote():
    out = run()
    assert out.returncode == 0, out.stderr
    assert re.search(r"request  6: .* device hit    0, loaded  128", out.stdout), out.stdout
    m = re.search(r"read back by attention: (\d+) page-layers \((\d+) cached\), (\d+) wrong",
                  out.stdout)
    assert m, out.stdout
    total, cached, wrong = (int(g) for g in m.groups())
    assert cached > 0 and total > cached, out.stdout  # peers' fresh pages were read too
    assert wrong == 0, out.stdout
    assert "cache rounds per request: 2" in out.stdout


def test_the_engine_loop_sees_the_seed_bug():
    out = run("--fault", "plain-alloc-on-load")
    assert out.returncode == 1, out.stderr
    m = re.search(r"read back by attention: (\d+) page-layers \((\d+) cached\), (\d+) wrong",
                  out.stdout)
    assert m and int(m.group(3)) > 0, out.stdout


@pytest.mark.parametrize("sched", ["adversarial", "lazy"])
def test_the_engine_loop_on_the_stand_in_cuda_driver(tmp_path, sched):
    """The same loop on the CUDA executor, over the repository's stand-in driver
    (`tests/fake_cuda/`): two rank processes whose pools are shared through CUDA IPC, streams
    scheduled as a GPU may run them (`adversarial`: the load stream held back; `lazy`: a
    backup runs only when something waits for it), the race checker on. The stand-in keeps
    device memory in host memory, so its pools are handed out as CPU tensors and the CPU
    build of torch writes and reads them in place. Every page-layer attention reads is right,
    and the driver reports no race."""
    from test_ops_cuda import stand_in_driver

    lib = stand_in_driver(tmp_path)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    env.setdefault("CP_HICACHE_CACHE_DIR", str(tmp_path / "jit"))
    env["FAKE_CUDA_SCHED"] = sched
    out = subprocess.run([sys.executable, str(EXAMPLE), "--ranks", "2", "--backend", "cuda",
                          "--slow-rank", "1", "--slow-ms", "20"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert "fake libcuda: RACE" not in out.stderr, out.stderr[-4000:]
    assert out.returncode == 0, out.stderr[-4000:]
    m = re.search(r"read back by attention: (\d+) page-layers \((\d+) cached\), (\d+) wrong",
                  out.stdout)
    assert m, out.stdout
    total, cached, wrong = (int(g) for g in m.groups())
    assert cached > 0 and total > cached, out.stdout
    assert wrong == 0, out.stdout
