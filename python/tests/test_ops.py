"""`cp_hicache.ops`: the cache's kernels on tensors the test allocated (per-layer lists and
cross-layer tensors, torch and numpy), equal to plain indexing, and clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

import cp_hicache
from cp_hicache.ops import Ops

torch = pytest.importorskip("torch")

MLA = cp_hicache.Deployment(model="mla", page_size=16, cp=2, layers=3)


def rand(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_transfer_moves_pages_between_per_layer_and_cross_layer_tensors():
    ops = Ops(MLA)
    pb = ops.page_bytes("mla_kv")
    assert ops.buffers == ["mla_kv"]
    dev_pages, host_pages = 5, 8
    # The engine's device KV: one bf16 tensor per layer, [pages * page_size, 576].
    device = [torch.from_numpy(rand((dev_pages * 16, 576 * 2), l)).view(torch.bfloat16)
              for l in range(3)]
    host = rand((3, host_pages, pb), 9)  # layer-first host pool, numpy
    want_dev = [d.view(torch.uint8).numpy().reshape(dev_pages, pb).copy() for d in device]
    src, dst = np.array([7, 0, 3]), np.array([4, 1, 2])
    moved = ops.transfer("h2d", [device], [host], src, dst, layers=range(1, 3))
    assert moved == 3 * 2 * pb
    for l in range(3):
        if l >= 1:
            want_dev[l][dst] = host[l][src]
        got = device[l].view(torch.uint8).numpy().reshape(dev_pages, pb)
        assert (got == want_dev[l]).all(), l
    # And back: device → host, every layer, the per-layer list against the cross-layer tensor.
    want_host = host.copy()
    ops.transfer("d2h", [device], [host], [4, 2], [5, 6])
    for l in range(3):
        want_host[l][[5, 6]] = device[l].view(torch.uint8).numpy().reshape(dev_pages, pb)[[4, 2]]
    assert (host == want_host).all()


def test_nsa_moves_both_buffers_in_one_call_with_a_page_first_host_pool():
    dep = cp_hicache.Deployment(model="nsa", page_size=64, cp=2, layers=2)
    ops = Ops(dep)
    assert ops.buffers == ["nsa_kv", "nsa_idx"]
    dev = [torch.from_numpy(rand((2, 4, ops.page_bytes(b)), i)) for i, b in enumerate(ops.buffers)]
    host = [rand((6, 2, ops.page_bytes(b)), 5 + i) for i, b in enumerate(ops.buffers)]
    want = [d.numpy().copy() for d in dev]
    ops.transfer("h2d", dev, host, [5, 0], [3, 1])
    for w, h, d in zip(want, host, dev):
        for l in range(2):
            w[l][[3, 1]] = h[[5, 0], l]  # page-first: [page][layer]
        assert (d.numpy() == w).all()
    # Per-layer device tensors (SGLang) take the same launch; a page-first host pool is one
    # tensor per buffer.
    ops.transfer("h2d", [list(dev[0]), list(dev[1])], host, [1], [0])
    for w, h, d in zip(want, host, dev):
        for l in range(2):
            w[l][0] = h[1, l]
        assert (d.numpy() == w).all()
    with pytest.raises(cp_hicache.UsageError, match="page-first"):
        ops.transfer("h2d", dev, [list(host[0].transpose(1, 0, 2).copy()), host[1]], [0], [1])


def test_a_page_major_device_tensor_is_vllms_cross_layer_cache():
    from cp_hicache.ops import PageMajor

    ops = Ops(MLA)
    pb = ops.page_bytes("mla_kv")
    # vLLM's cross-layer KV cache: [num_blocks, num_layers, block bytes].
    dev = torch.from_numpy(rand((5, 3, pb), 31))
    host = rand((3, 8, pb), 32)  # layer-first host pool
    want = dev.numpy().copy()
    ops.transfer("h2d", [PageMajor(dev)], [host], [6, 2], [4, 0], layers=range(0, 2))
    for l in range(2):
        want[[4, 0], l] = host[l][[6, 2]]
    assert (dev.numpy() == want).all()
    back = host.copy()
    ops.transfer("d2h", [PageMajor(dev)], [back], [4], [7])
    for l in range(3):
        assert (back[l][7] == dev.numpy()[4, l]).all()
    # Every rank's pool page-major: materialise reads each page from its owner.
    pools = [torch.from_numpy(rand((4, 3, pb), 40 + r)) for r in range(2)]
    seq = np.array([3, 0, 6, 5])
    out = torch.zeros((3, len(seq), pb), dtype=torch.uint8)
    ops.materialise("mla_kv", [PageMajor(p) for p in pools], seq, out)
    for i, p in enumerate(seq):
        assert (out[:, i].numpy() == pools[p % 2][p // 2].numpy()).all()
    with pytest.raises(cp_hicache.UsageError, match="host\\[mla_kv\\]: a page-major tensor"):
        ops.transfer("h2d", [dev], [PageMajor(torch.from_numpy(host))], [0], [1])


def test_materialise_gathers_every_page_from_its_owner():
    ops = Ops(MLA)
    pb = ops.page_bytes("mla_kv")
    pools = [torch.from_numpy(rand((3, 4, pb), 20 + r)) for r in range(2)]
    seq = np.array([3, 0, 6, 5, 1])  # page p: rank p % 2, local page p // 2
    out = torch.zeros((3, len(seq), pb), dtype=torch.uint8)
    ops.materialise("mla_kv", pools, seq, out)
    for i, p in enumerate(seq):
        assert (out[:, i].numpy() == pools[p % 2][:, p // 2].numpy()).all()
    # Per-layer pools and output give the same bytes.
    per = [torch.zeros((len(seq), pb), dtype=torch.uint8) for _ in range(3)]
    ops.materialise("mla_kv", [list(p) for p in pools], seq, per)
    assert all((per[l].numpy() == out[l].numpy()).all() for l in range(3))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda o, d, h: o.transfer("h2d", [d], [h], [0, 1], [2, 2]), "dst_pages"),
        (lambda o, d, h: o.transfer("h2d", [d], [h], [0], [9]), "dst_pages\\[0\\]: page 9"),
        (lambda o, d, h: o.transfer("sideways", [d], [h], [0], [1]), "neither"),
        (lambda o, d, h: o.transfer("h2d", [d], [h], [0], [1], layers=range(2, 5)), "layers"),
        (lambda o, d, h: o.transfer("h2d", [d, d], [h], [0], [1]), "2 entries"),
        (lambda o, d, h: o.transfer("h2d", [d[:, ::2]], [h], [0], [1]), "not contiguous"),
        (lambda o, d, h: o.transfer("h2d", [d[:2]], [h], [0], [1]), "3 layers of whole"),
        (lambda o, d, h: o.transfer("h2d", [list(d)[:2]], [h], [0], [1]), "2 per-layer tensors"),
        (lambda o, d, h: o.transfer("h2d", [d], [np.zeros(10, dtype="V7")], [0], [1]), "tile"),
        (lambda o, d, h: o.transfer("h2d", [d], [h], [0], [1], stream=7), "stream="),
        (lambda o, d, h: o.transfer("h2d", [d], ["h"], [0], [1]), "not a torch tensor"),
        (lambda o, d, h: o.materialise("nsa_kv", [d, d], [0], d), "not one of"),
        (lambda o, d, h: o.materialise("mla_kv", [d], [0], d), "1 pools given for 2 ranks"),
    ],
)
def test_bad_arguments_raise_usage_errors_naming_them(call, message):
    ops = Ops(MLA)
    pb = ops.page_bytes("mla_kv")
    d = torch.zeros((3, 4, pb), dtype=torch.uint8)
    h = np.zeros((3, 4, pb), dtype=np.uint8)
    with pytest.raises(cp_hicache.UsageError, match=message):
        call(ops, d, h)
    assert not d.any() and not h.any()  # nothing was launched


def test_select_and_release_keep_owners_on_the_engines_lanes():
    from cp_hicache.ops import Lanes

    ops = Ops(MLA)
    lanes = Lanes.of([2, 4, 6, 1, 3], cp=2, lane_cap=4)
    # Torch int32 tensors work as well as numpy uint32 ones.
    lanes.tops = torch.from_numpy(lanes.tops.astype(np.int32))
    pages, locs = ops.select(lanes, [0, 1, 0])
    assert pages.tolist() == [6, 3, 4]  # each page on its owner's lane, LIFO
    assert (pages % 2 == [0, 1, 0]).all()
    assert locs.tolist() == [p * 16 + j for p in (6, 3, 4) for j in range(16)]
    assert lanes.tops.tolist() == [1, 1]
    with pytest.raises(cp_hicache.CacheFullError, match="lane 1 is 2 short"):
        ops.select(lanes, [1, 1, 1])
    assert lanes.tops.tolist() == [1, 1]  # all or nothing
    assert lanes.status[0] == 1  # the kernel counted the refusal
    # Outputs of the caller's are what comes back; out_locs needs out_pages.
    with pytest.raises(cp_hicache.UsageError, match="without out_pages"):
        ops.select(lanes, [0], out_locs=np.zeros(16, dtype=np.int64))
    out = (np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int64))
    assert ops.select(lanes, [], out_pages=out[0], out_locs=out[1])[0] is out[0]
    ops.release(lanes, [6, 3, 4])
    assert lanes.tops.tolist() == [3, 2]
    assert lanes.stacks[0, :3].tolist() == [2, 6, 4]
    with pytest.raises(cp_hicache.UsageError, match="null page"):
        ops.release(lanes, [0])
    with pytest.raises(cp_hicache.UsageError, match="32-bit words"):
        ops.select(Lanes(lanes.stacks.astype(np.uint64), lanes.tops, lanes.status), [0])


def test_select_with_out_pages_alone_leaves_the_slots_to_the_engine():
    from cp_hicache.ops import Lanes

    ops = Ops(MLA)
    lanes = Lanes.of([2, 4, 6, 1, 3], cp=2, lane_cap=4)
    # The pages-only kernel: the same pages as with slots, and no slots written or returned.
    pages = np.full(4, 0xA5A5A5A5, dtype=np.uint32)
    got, locs = ops.select(lanes, [0, 1, 0], out_pages=pages[:3])
    assert got is not None and locs is None
    assert pages.tolist() == [6, 3, 4, 0xA5A5A5A5]  # nothing past the pages asked for
    assert lanes.tops.tolist() == [1, 1]
    # The engine derives the slots; the kernel that writes them agrees.
    ops.release(lanes, [4, 3, 6])
    both = (np.zeros(3, dtype=np.uint32), np.zeros(3 * 16, dtype=np.int64))
    ops.select(lanes, [0, 1, 0], out_pages=both[0], out_locs=both[1])
    assert both[0].tolist() == [6, 3, 4]
    derived = (both[0].astype(np.int64)[:, None] * 16 + np.arange(16)).reshape(-1)
    assert (both[1] == derived).all()
    # Refused: every page written is 0, no lane moves, typed error.
    pages[:] = 7
    with pytest.raises(cp_hicache.CacheFullError, match="lane 1 is 2 short"):
        ops.select(lanes, [1, 1, 1], out_pages=pages[:3])
    assert pages.tolist() == [0, 0, 0, 7]
    assert lanes.tops.tolist() == [1, 1]
    # Bad outputs are usage errors, never crashes.
    with pytest.raises(cp_hicache.UsageError, match="out_pages"):
        ops.select(lanes, [0], out_pages=np.zeros(2, dtype=np.uint32))
    with pytest.raises(cp_hicache.UsageError, match="out_locs"):
        ops.select(lanes, [0], out_pages=pages[:1], out_locs=np.zeros(8, dtype=np.int64))


def test_the_backend_is_checked():
    with pytest.raises(cp_hicache.UsageError, match="\"host\" or \"cuda\""):
        Ops(MLA, backend="tpu")
