"""The engine-shaped example runs as documented: the engine's own KV, written through the pool
tensors, comes back intact after eviction to the host and load-back, and the original bug
(loaded pages losing their owners) shows as wrong KV read by attention."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"


def run(*args):
    return subprocess.run([sys.executable, str(EXAMPLE), "--ranks", "2", "--backend", "host",
                           *args], capture_output=True, text=True, timeout=300)


def test_the_engine_loop_reads_back_what_it_wrote():
    out = run()
    assert out.returncode == 0, out.stderr
    assert re.search(r"request  6: .* device hit    0, loaded  128", out.stdout), out.stdout
    m = re.search(r"read back by attention: (\d+) page-layers, (\d+) wrong", out.stdout)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0", out.stdout


def test_the_engine_loop_sees_the_seed_bug():
    out = run("--fault", "plain-alloc-on-load")
    assert out.returncode == 1, out.stderr
    m = re.search(r"read back by attention: (\d+) page-layers, (\d+) wrong", out.stdout)
    assert m and int(m.group(2)) > 0, out.stdout
