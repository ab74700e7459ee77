"""cp_hicache._native.PageStore.put_part from Python: records written in parts by the ranks
that each hold some of a page's tokens (vLLM's decode context parallelism), assembled by a
callable of the engine's, visible only once whole."""

from __future__ import annotations

import numpy as np
import pytest

from cp_hicache import _native

PAGE = 64


def store(tmp_path):
    return _native.PageStore(str(tmp_path / "store"), "test parts v1", PAGE, 1 << 20)


def buf(a: np.ndarray):
    return [(int(a.ctypes.data), int(a.nbytes))]


def test_parts_assemble_into_one_whole_record(tmp_path):
    s = store(tmp_path)
    halves = [np.full(PAGE // 2, 1, np.uint8), np.full(PAGE // 2, 2, np.uint8)]
    calls = []

    def assemble(parts):
        calls.append([len(p) for p in parts])
        return b"".join(parts)

    assert s.put_part("r", 1, 2, buf(halves[1]), assemble) == "held"
    assert not s.exists("r")  # not visible before its last part
    assert s.put_part("r", 0, 2, buf(halves[0]), assemble) == "completed"
    assert calls == [[PAGE // 2, PAGE // 2]]
    out = np.zeros(PAGE, np.uint8)
    assert s.get("r", buf(out))
    assert out.tobytes() == halves[0].tobytes() + halves[1].tobytes()
    assert s.put_part("r", 0, 2, buf(halves[0]), assemble) == "present"


def test_an_assembler_that_fails_fails_the_call(tmp_path):
    s = store(tmp_path)
    half = np.zeros(PAGE // 2, np.uint8)

    def boom(parts):
        raise KeyError("the engine's assembler failed")

    s.put_part("a", 0, 2, buf(half), boom)
    with pytest.raises(KeyError, match="the engine's assembler failed"):
        s.put_part("a", 1, 2, buf(half), boom)
    assert not s.exists("a")
    s.put_part("b", 0, 2, buf(half), lambda ps: b"short")
    with pytest.raises(_native.UsageError, match=f"returned 5 bytes, this store's pages are {PAGE}"):
        s.put_part("b", 1, 2, buf(half), lambda ps: b"short")
    s.put_part("c", 0, 2, buf(half), lambda ps: "not bytes")
    with pytest.raises(_native.UsageError, match="must return the record's payload as bytes"):
        s.put_part("c", 1, 2, buf(half), lambda ps: "not bytes")
    assert not s.exists("b") and not s.exists("c")
    with pytest.raises(_native.UsageError, match="a null part buffer address"):
        s.put_part("d", 0, 2, [(0, 4)], lambda ps: b"")
