"""A real Mooncake Store master on loopback for the tests (issue 44): installed by
scripts/mooncake-env.sh into this Python's environment (skipped only when the install is
impossible here: no network, no wheel for the platform; a failure instead under
`CP_HICACHE_REQUIRE_MOONCAKE=1`, which CI sets), started on free ports, stopped by its pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_install = {}


def mooncake_master_binary() -> str:
    """The `mooncake_master` binary, installing the wheel first if need be."""
    if "master" not in _install:
        out = subprocess.run(
            [str(ROOT / "scripts" / "mooncake-env.sh"), sys.executable],
            capture_output=True, text=True, timeout=600,
        )
        if out.returncode == 3:
            _install["skip"] = f"Mooncake cannot be installed here: {out.stderr.strip()[-400:]}"
        elif out.returncode != 0:
            raise RuntimeError(f"scripts/mooncake-env.sh failed:\n{out.stderr}")
        else:
            _install["master"] = out.stdout.split()[-1]
    if "skip" in _install:
        if os.environ.get("CP_HICACHE_REQUIRE_MOONCAKE") == "1":
            # CI installs Mooncake: a test that cannot have it fails, never skips unseen.
            pytest.fail(f"{_install['skip']}\n(CP_HICACHE_REQUIRE_MOONCAKE=1 is set)")
        pytest.skip(_install["skip"])
    return _install["master"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Master:
    """A running master: its URL for `attach_storage`, and the client options."""

    pid: int
    rpc_port: int
    http_port: int

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    @property
    def options(self) -> dict:
        return {
            "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
            "segment_bytes": 64 << 20,
            "buffer_bytes": 16 << 20,
        }


def start_master(binary: str, log_path) -> "tuple[subprocess.Popen, Master]":
    """Starts `binary` (a mooncake_master) on free loopback ports, its output to
    `log_path`; returns once it listens. Stop it with :func:`stop_master`."""
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics}", "--default_kv_lease_ttl=500"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    try:
        wait_listening(proc, rpc, http, log_path)
    except BaseException:
        stop_master(proc)
        raise
    return proc, Master(proc.pid, rpc, http)


def restart_master(binary: str, master: Master, log_path) -> subprocess.Popen:
    """Starts `binary` again on `master`'s ports (after it was killed)."""
    metrics = _free_port()
    log = open(log_path, "a")
    proc = subprocess.Popen(
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={master.rpc_port}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={master.http_port}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics}", "--default_kv_lease_ttl=500"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    try:
        wait_listening(proc, master.rpc_port, master.http_port, log_path)
    except BaseException:
        stop_master(proc)
        raise
    master.pid = proc.pid
    return proc


def wait_listening(proc: subprocess.Popen, rpc: int, http: int, log_path) -> None:
    deadline = time.monotonic() + 30
    while not (_listening(rpc) and _listening(http)):
        if proc.poll() is not None:
            raise RuntimeError(
                f"mooncake_master exited ({proc.returncode}):\n"
                f"{Path(log_path).read_text()[-2000:]}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError("mooncake_master did not listen within 30 s")
        time.sleep(0.1)


def stop_master(proc: subprocess.Popen) -> None:
    """Stops a master started here (SIGTERM, then SIGKILL), by its pid."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


# A client that only contributes a segment to the master, until its stdin closes.
_HOLDER = """
import sys
from cp_hicache.mooncake import MooncakeStore
s = MooncakeStore(sys.argv[1], metadata_server=sys.argv[2], segment_bytes=int(sys.argv[3]),
                  buffer_bytes=int(sys.argv[4]))
print("ready", flush=True)
sys.stdin.read()
s.close()
"""


def spawn_segment_holder(url: str, metadata_server: str, segment_bytes: int,
                         buffer_bytes: int = 16 << 20) -> subprocess.Popen:
    """Starts a client process that holds a segment of ``segment_bytes`` for the master at
    ``url`` (so the bytes other clients put cross TCP). It prints ``ready`` on its stdout
    once the segment is mounted, and leaves when its stdin closes."""
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER, url, metadata_server, str(segment_bytes),
         str(buffer_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


@pytest.fixture
def mooncake_master(tmp_path):
    """Starts a master on free loopback ports; stops it (SIGTERM, then SIGKILL) by pid."""
    proc, master = start_master(mooncake_master_binary(), tmp_path / "mooncake_master.log")
    try:
        yield master
    finally:
        stop_master(proc)
