"""Records written in parts on a real Mooncake Store (issue 44), through the launcher:
four rank processes at CP 4 under ``token-interleave`` (runs of 4 tokens: every rank holds
tokens of every record, so each record is four parts, assembled by the writer of the last
one without a lock), then fresh rank processes at CP 2 ``token-interleave`` (runs of 8) and
at CP 1 read them back, each hit verified. Prints each run's storage counts and time; exits
1 on a failed run or a mismatch.

Starts a ``mooncake_master`` on free loopback ports (``python/tests/mooncake_fixture.py``;
the wheel from ``scripts/mooncake-env.sh``) and a holder process for the segment. Run::

    scripts/python-dev.sh && scripts/mooncake-env.sh
    nice -n 10 .venv/bin/python python/examples/mooncake_token_interleave.py
"""
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))
from mooncake_fixture import mooncake_master_binary, start_master, stop_master  # noqa: E402

HOLDER = """
import sys
from cp_hicache.mooncake import MooncakeStore
s = MooncakeStore(sys.argv[1], metadata_server=sys.argv[2], segment_bytes=512 << 20,
                  buffer_bytes=16 << 20)
print("ready", flush=True)
sys.stdin.read()
s.close()
"""
tmp = Path(tempfile.mkdtemp())
proc, m = start_master(mooncake_master_binary(), tmp / "log")
h = None
status = 0
try:
    meta = m.options["metadata_server"]
    h = subprocess.Popen([sys.executable, "-c", HOLDER, m.url, meta], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert h.stdout.readline().strip() == "ready"
    url = f"{m.url}?metadata_server={meta}&segment_bytes=0&buffer_bytes=4194304"
    args = ["--model", "mla", "--page-size", "64", "--layers", "2", "--conversations", "6"]
    ti = ["--layout", "token-interleave", "--interleave-size"]
    runs = [
        ("write at CP 4, token-interleave(4)", ["--ranks", "4", "--cp", "4", *ti, "4"]),
        ("read at CP 2, token-interleave(8)", ["--ranks", "2", "--cp", "2", *ti, "8"]),
        ("read at CP 1", ["--ranks", "1", "--cp", "1"]),
    ]
    for name, extra in runs:
        t = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "cp_hicache.replay", *extra, *args,
                              "--storage", url, "--json", str(tmp / "r.json")],
                             capture_output=True, text=True, timeout=900)
        dt = time.monotonic() - t
        if out.returncode != 0:
            print(name, "FAILED", out.returncode, out.stderr[-3000:])
            status = 1
            break
        r = json.loads((tmp / "r.json").read_text())
        keys = ["storage_records_written", "storage_records_read", "storage_hit_tokens",
                "computed_tokens", "mismatched_tokens", "storage_refused_torn",
                "storage_refused_checksum", "storage_io_errors"]
        print(f"{name}: {dt:.1f} s", {k: r.get(k) for k in keys}, flush=True)
        if r.get("mismatched_tokens") != 0:
            status = 1
finally:
    if h is not None:
        h.stdin.close()
        h.wait(timeout=60)
    stop_master(proc)
    shutil.rmtree(tmp, ignore_errors=True)
sys.exit(status)
