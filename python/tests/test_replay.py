"""`python -m cp_hicache.replay`: one process per rank gives exactly the in-process replay's
results, faults show across processes, and a rank that dies ends the run naming it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import launch

pytest.importorskip("torch")

# MLA, page 16, 4 ranks, a device pool small enough that prefixes are evicted to the host and
# loaded back (and one request does not fit and is skipped).
ARGS = ["--cp", "4", "--model", "mla", "--page-size", "16", "--layers", "2",
        "--requests", "24", "--device-pages", "192"]


@pytest.mark.parametrize(
    "live",
    [
        [],
        ["--chunk-tokens", "64", "--decode-tokens", "24"],
        ["--chunk-tokens", "64", "--decode-tokens", "24", "--batch", "4"],
    ],
    ids=["whole-prompts", "chunked-prefill-and-decode", "batches-of-4"],
)
def test_four_processes_replay_exactly_as_the_in_process_cluster(tmp_path, binary, live):
    one = subprocess.run(
        [str(binary), "replay", *ARGS, *live, "-q", "--json", str(tmp_path / "threads.json"),
         "--request-log", str(tmp_path / "threads.jsonl")],
        capture_output=True, text=True, timeout=600,
    )
    assert one.returncode == 0, one.stderr
    many = launch(["--ranks", "4", *ARGS, *live, "--json", str(tmp_path / "procs.json"),
                   "--request-log", str(tmp_path / "procs.jsonl")])
    assert many.returncode == 0, many.stderr
    assert "cp-hicache replay" in many.stdout
    assert "4 processes, torch.distributed group" in many.stdout
    a = json.loads((tmp_path / "threads.json").read_text())
    b = json.loads((tmp_path / "procs.json").read_text())
    assert a["group"].pop("kind") == "local"
    assert b["group"].pop("kind") == "torch.distributed"
    assert a["group"] == b["group"]  # ranks, peer pools, an executor each, who verifies
    assert set(a) == set(b)  # the same fields
    timing = {"wall_seconds", "tokens_per_second", "group"}
    assert {k: v for k, v in a.items() if k not in timing} == {
        k: v for k, v in b.items() if k not in timing
    }
    assert b["mismatched_tokens"] == 0
    if "--batch" not in live:
        assert b["host_hit_tokens"] > 0 and b["pages_loaded"] > 0  # load-backs happened
        assert b["evictions_lru"] > 0
    # Request by request: outcome, every statistic, and every rank's digest after it.
    lines_a = (tmp_path / "threads.jsonl").read_text().splitlines()
    lines_b = (tmp_path / "procs.jsonl").read_text().splitlines()
    assert len(lines_a) == 24
    assert [json.loads(x) for x in lines_a] == [json.loads(x) for x in lines_b]
    if "--batch" not in live:
        assert any(json.loads(x)["outcome"] == "skipped" for x in lines_b)
    else:
        # At most a round a step, but for the admissions a pool too small refused (each
        # costs a rollback and another round).
        assert b["steps"] > 24 / 4 and 0 < b["rounds_per_step"] < 1.5
    if live:
        assert b["extends"] > 24 and b["extended_tokens"] > 0


def test_the_seed_bug_across_four_processes_mismatches_and_exits_1(tmp_path):
    out = launch(["--ranks", "4", *ARGS, "--inject", "plain-alloc-on-load",
                  "--json", str(tmp_path / "r.json")])
    assert out.returncode == 1, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mismatched_tokens"] > 0
    assert report["pages_loaded_misowned"] > 0
    assert report["fault_fired"] is True
    assert re.search(r"request \d+: \d+ mismatched tokens", out.stderr)


def test_a_launch_failure_on_one_process_is_rolled_back_by_all(tmp_path):
    out = launch(["--ranks", "4", *ARGS, "--inject", "launch-error",
                  "--json", str(tmp_path / "r.json")])
    assert out.returncode == 1, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["failed_requests"] == 1 and report["replicas_agree"] is True
    assert report["mismatched_tokens"] == 0
    assert "rank 3" in out.stderr  # the failure aimed at the last rank names it


def test_a_killed_rank_ends_the_run_naming_it():
    proc = subprocess.Popen(
        [sys.executable, "-m", "cp_hicache.replay", "--ranks", "4", "--cp", "4", "--model",
         "mla", "--page-size", "16", "--layers", "2", "--requests", "2000",
         "--device-pages", "192", "--group-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids = {}
    seen = []
    start = time.monotonic()
    while len(pids) < 4:
        line = proc.stderr.readline()
        seen.append(line)
        assert line, (
            f"the launcher ended before every rank joined (status {proc.wait()}); "
            f"stderr: {''.join(seen)}"
        )
        # Anywhere in the line: a library's warning written in pieces may precede it.
        for m in re.finditer(r"rank (\d) \(pid (\d+)\) joined the group", line):
            pids[int(m.group(1))] = int(m.group(2))
        assert time.monotonic() - start < 300
    time.sleep(2.0)  # well into the replay
    import os

    os.kill(pids[2], signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "rank 2 was killed by SIGKILL" in err, err
    # The survivors failed on their own (their collective saw the peer gone): none had to be
    # terminated by the launcher.
    assert "exit statuses by rank: [1, 1, -9, 1]" in err, err
    assert re.search(r"error: rank [013]: ", err), err  # each survivor says why it stopped
    assert time.monotonic() - killed_at < 60  # within the group timeout, no hang
    # The killed rank's pools (and everyone's) were unlinked once every peer had mapped
    # them: nothing of any rank is left in /dev/shm.
    left = [n for n in os.listdir("/dev/shm")
            if any(n.startswith(f"cp-hicache-{pid}-") for pid in pids.values())]
    assert left == [], left


@pytest.mark.parametrize(
    "args, status, message",
    [
        (["--ranks", "3", "--cp", "4"], 2, "--ranks 3 but --cp 4"),
        (["--ranks", "2", "--cp", "2", "--trace", "/nonexistent.jsonl"], 2, "nonexistent"),
        (["--ranks", "2", "--cp", "2", "--model", "nsa", "--page-size", "16"], 2, "64"),
        (["--ranks", "2", "--cp", "2", "--group-timeout", "0"], 2, "group-timeout"),
        (["--cp", "2"], 2, "--ranks"),
        (["--ranks", "2", "--cp", "2", "--verify-ranks", "3"], 2, "verify-ranks"),
    ],
)
def test_bad_arguments_exit_2_before_any_rank_starts(args, status, message):
    out = launch(args, timeout=60)
    assert out.returncode == status, out.stderr
    assert message in out.stderr
    assert "joined the group" not in out.stderr


def test_help_names_the_launcher_options():
    out = launch(["--help"], timeout=60)
    assert out.returncode == 0
    assert "--ranks" in out.stdout and "--group-timeout" in out.stdout
    assert "--trace" in out.stdout  # the replay options of cp-hicache replay
