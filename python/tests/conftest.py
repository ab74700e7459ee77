"""Shared fixtures: the repository, the `cp-hicache` binary, and running the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def binary() -> Path:
    """The `cp-hicache` binary: CP_HICACHE_BIN (scripts/test.sh hands in the one `cargo test`
    built), else the release one, built here if missing."""
    path = Path(os.environ.get("CP_HICACHE_BIN", ROOT / "target" / "release" / "cp-hicache"))
    if not path.exists():
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    return path


def launch(args, timeout=600, **kw) -> subprocess.CompletedProcess:
    """Runs `python -m cp_hicache.replay ARGS` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "cp_hicache.replay", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _our_segments() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("cp-hicache-")}
    except FileNotFoundError:
        return set()


def _left_behind(name: str) -> bool:
    """Whether segment `name` (`cp-hicache-<creator pid>-...`) is a leftover of this suite:
    made by this process, or by one that has ended. Every process the suite starts has ended
    by its end; a live process's segments are another run's on the same machine (another
    suite, an engine), not ours to count."""
    try:
        pid = int(name.split("-")[2])
    except (IndexError, ValueError):
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """After the whole suite (killed ranks, terminated launchers, failed starts included),
    /dev/shm holds no segment of ours that was not there before it."""
    before = _our_segments()
    yield
    left = {n for n in _our_segments() - before if _left_behind(n)}
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
