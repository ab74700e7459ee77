"""`python -m cp_hicache.replay --storage`: a store written by a CP 8 replay is read back by
four fresh rank processes at CP 4 with 0 mismatches on every rank, and the totals are the
in-process replay's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import launch

pytest.importorskip("torch")

ARGS = ["--model", "mla", "--page-size", "64", "--layers", "2", "--conversations", "6"]


def test_four_processes_read_back_what_a_cp8_run_wrote(tmp_path, binary):
    store = tmp_path / "store"
    written = subprocess.run(
        [str(binary), "replay", *ARGS, "--cp", "8", "--storage", str(store), "-q",
         "--json", str(tmp_path / "cp8.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert written.returncode == 0, written.stderr
    w = json.loads((tmp_path / "cp8.json").read_text())
    assert w["storage_records_written"] > 0 and w["mismatched_tokens"] == 0

    # The same read in process (threads) and across processes: the same totals.
    threads = subprocess.run(
        [str(binary), "replay", *ARGS, "--cp", "4", "--storage", str(store), "-q",
         "--json", str(tmp_path / "threads.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert threads.returncode == 0, threads.stderr
    procs = launch(["--ranks", "4", "--cp", "4", *ARGS, "--storage", str(store),
                    "--json", str(tmp_path / "procs.json")])
    assert procs.returncode == 0, procs.stderr
    assert "4 processes, torch.distributed group" in procs.stdout
    a = json.loads((tmp_path / "threads.json").read_text())
    b = json.loads((tmp_path / "procs.json").read_text())
    assert b["storage_hit_tokens"] > 0 and b["mismatched_tokens"] == 0
    assert b["storage_records_read"] * 64 == b["storage_hit_tokens"]
    for k in ("storage_hit_tokens", "storage_records_read", "storage_bytes_read",
              "storage_records_written", "computed_tokens", "device_hit_tokens",
              "group_rounds", "mismatched_tokens"):
        assert a[k] == b[k], k


def test_rank_processes_write_records_in_parts_that_another_layout_reads(tmp_path, binary):
    """Four processes under token-interleave each write their tokens of every record as a
    part, assembling records across processes; a zigzag run at CP 2 reads them back."""
    store = tmp_path / "store"
    procs = launch(["--ranks", "4", "--cp", "4", *ARGS, "--layout", "token-interleave",
                    "--storage", str(store), "--json", str(tmp_path / "w.json")])
    assert procs.returncode == 0, procs.stderr
    w = json.loads((tmp_path / "w.json").read_text())
    assert w["storage_records_written"] > 0 and w["mismatched_tokens"] == 0
    parts = store / "parts"
    assert not parts.exists() or not any(parts.iterdir()), "every record's parts came"
    read = subprocess.run(
        [str(binary), "replay", *ARGS, "--cp", "2", "--storage", str(store), "-q",
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert read.returncode == 0, read.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["storage_hit_tokens"] > 0 and r["mismatched_tokens"] == 0
    assert r["storage_refused_torn"] == 0 and r["storage_refused_checksum"] == 0


def test_a_store_that_is_not_a_directory_is_refused_before_any_rank_starts(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")
    out = launch(["--ranks", "2", "--cp", "2", *ARGS, "--storage", str(blocker)])
    assert out.returncode == 2, out.stderr
    assert "is not a directory" in out.stderr
    assert "joined the group" not in out.stderr


def test_a_rank_cache_reads_back_what_another_process_stored(tmp_path):
    """The engine API: one RankCache stores its pages, a fresh one (another process, as after
    a restart) reads them back, verified, and the records are refused under another model."""
    import numpy as np

    import cp_hicache

    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)
    prompt = np.arange(160, dtype=np.uint32)  # 10 pages
    first = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    first.attach_storage(tmp_path / "store", capacity_bytes=64 << 20)
    cold = first.serve(prompt)
    assert cold["computed_tokens"] == 160
    assert cold["storage_records_written"] == 10
    with pytest.raises(cp_hicache.UsageError, match="negative"):
        first.prefetch(prompt, skip_tokens=-1)
    del first
    code = f"""
import numpy as np, cp_hicache
dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)
rc = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
assert rc.prefetch(np.arange(160, dtype=np.uint32)) == 0  # no store yet
rc.attach_storage({str(tmp_path / "store")!r}, policy="on-host-evict")
# The first 96 tokens read now, the rest ahead (as for a request still waiting).
assert rc.prefetch(np.arange(160, dtype=np.uint32), skip_tokens=96) == 4
s = rc.serve(np.arange(160, dtype=np.uint32))
assert s["storage_hit_tokens"] == 160, s
assert s["storage_records_read"] == 10 and s["mismatched_tokens"] == 0, s
assert s["storage_records_prefetched"] == 4, s
rc.check_invariants()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    other = cp_hicache.RankCache(
        cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=4),
        device_pages=64, host_pages=64, backend="host")
    with pytest.raises(ValueError, match="holds records of"):
        other.attach_storage(tmp_path / "store")
    with pytest.raises(ValueError, match="storage policy"):
        other.attach_storage(tmp_path / "store", policy="sometimes")
