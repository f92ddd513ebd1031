"""The direct route (kmesh_host/restore/direct.py): KvikIO/cuFile reads into GPU memory, verified
and placed; never called direct without evidence. Needs CUDA and KvikIO (the refusals: CPU)."""

from __future__ import annotations

import pytest
import torch

import kmesh_gpu
from kmesh_gpu import KVLayout
from kmesh_gpu.errors import BackendError
from kmesh_host import InProcessRestorer, IntegrityError, RestoreItem, RouteConfig, SegmentStore
from tests.helpers.restore import cache_for, restore_once
from tests.helpers.route_model import DTYPE, FP, ROPE, D, H, L

TOKENS = [37, 64, 100]
DIRECT = RouteConfig(route="direct")


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "store")


@pytest.fixture
def segments(store):
    out = []
    for i, T in enumerate(TOKENS):
        kv = torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(i)).to(DTYPE)
        pos = torch.arange(T) + 5 * i
        out.append((store.put(kv, torch.arange(T), pos, model_fingerprint=FP), kv, pos))
    return out


def cache_and_items(segments, *, shifted):
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=32, block_size=16, num_kv_heads=H, head_size=D,
                                dtype=DTYPE)
    cache = layout.allocate("cuda", fill=0x7F)
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(1))
    items, start = [], 0
    for key, kv, pos in segments:
        T = kv.shape[2]
        new = (torch.arange(T) + 200 + start).cuda() if shifted else None
        items.append(RestoreItem(key, perm[start: start + T].cuda(), new))
        start += T
    return layout, cache, items


def reference_cache(segments, items, layout, *, rope):
    cache = layout.allocate("cuda", fill=0x7F)
    for (key, kv, pos), t in zip(segments, items):
        if rope is None:
            kmesh_gpu.place(kv.cuda(), cache, layout, t.slots)
        else:
            kmesh_gpu.place(kv.cuda(), cache, layout, t.slots, rope=rope, old_positions=pos.cuda(),
                            new_positions=t.new_positions)
    return cache


def test_direct_needs_cuda(store, segments):
    layout, cache, _ = cache_for(store, [segments[0][0]])
    with pytest.raises(BackendError, match="not a CUDA device"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, config=DIRECT)


@pytest.mark.gpu
@pytest.mark.parametrize("shifted", [False, True], ids=["copy", "rope-shift"])
def test_direct_route_end_to_end(store, segments, shifted):
    pytest.importorskip("kvikio", reason="the direct route needs the kvikio package")
    layout, cache, items = cache_and_items(segments, shifted=shifted)
    rope = ROPE if shifted else None
    result = restore_once(store, items, cache=cache, layout=layout, model_fingerprint=FP, rope=rope, route="direct")
    rep = result.report
    assert rep.path == "in_process" and rep.route == "direct"
    assert rep.placed and rep.bytes_read == sum(h.padded_length for h in result.headers)
    for (key, kv, pos), got in zip(segments, result.kv):
        assert torch.equal(got.cpu().view(torch.uint8), kv.view(torch.uint8))
    expect = reference_cache(segments, items, layout, rope=rope)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    # The destination is exported as a DMA-BUF where the device supports it (the guide's H200 does).
    dma = rep.facts["dma_buf"]
    assert dma["exported"] is bool(rep.facts["device_dmabuf_supported"]), dma
    if dma["exported"]:
        assert dma["bytes"] >= sum(h.padded_length for h in result.headers)
    # Never call a bounce-buffer copy direct.
    if rep.direct_dma:
        assert rep.facts["gds_available"] is True and rep.facts["kvikio_compat_preferred"] is False
        assert "GPUDirect Storage" in rep.mechanism
    else:
        assert "NOT direct" in rep.mechanism


@pytest.mark.gpu
def test_direct_route_refuses_corrupt_payload(store, segments):
    pytest.importorskip("kvikio", reason="the direct route needs the kvikio package")
    key = segments[2][0]
    off = store.read_header(key).payload_offset
    with open(store.path(key), "r+b") as f:
        f.seek(off + 4096 + 7)
        f.write(b"\x55")
    layout, cache, items = cache_and_items(segments, shifted=False)
    before = cache.clone()
    with pytest.raises(IntegrityError, match=key):
        restore_once(store, items, cache=cache, layout=layout, model_fingerprint=FP, route="direct")
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
