"""The seed's six copy tests across processes (section 23) and the poisoned-canary test (section 22).

Host -> device (restore) and device -> host (save), each: success; an error whose pending work can
be completed (drained, never resubmitted); an error whose first wait is refused (source and
destination stay held until a later wait succeeds). The same bodies run over CPU shared memory here
and, with ``-m gpu``, over CUDA IPC with real asynchronous copies. GPU only: every request waits for
the client's earlier work although the service opens the client's event once, and the service's
device copy of an original follows an evict and a new publication of its key.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest
import torch

from kmesh_gpu import gather, place_many
from kmesh_gpu.errors import DrainError, KmeshError, OwnershipError
from kmesh_host import SegmentStore
from kmesh_host.service import CacheClient, SharedCache
from tests.helpers.devices import DEVICES
from tests.kmesh_host.service.helpers import (fingerprint, put_original, registration_of, running_service, small_layout,
                                              small_rope, wait_for)

MODES = ["success", "error-completes", "first-wait-refused"]
POISON = 0x5A
SLOTS = [2, 3, 4, 5, 13, 14]  # blocks 0, 1, 3
BLOCKS = [0, 1, 3]
FP = fingerprint()


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


@pytest.fixture
def client(service):
    with CacheClient(service.socket_path, timeout=120) as c:
        yield c


class _Cache:
    """A registrable cache on ``device``: CUDA memory (IPC) or CPU shared memory."""

    def __init__(self, layout, device):
        self.shared = SharedCache(layout, fill=POISON) if device == "cpu" else None
        self.tensor = self.shared.tensor if self.shared else layout.allocate(device, fill=POISON)
        self.registrable = self.shared if self.shared else self.tensor

    def close(self):
        self.tensor = self.registrable = None
        if self.shared is not None:
            self.shared.close()


@pytest.fixture
def env(client, device):
    layout = small_layout()
    c = _Cache(layout, device)
    reg = client.register(c.registrable, layout, model_fingerprint=FP, rope=small_rope())
    yield layout, c, reg
    if device == "cuda":
        torch.cuda.synchronize()
    client.close_registration(reg, timeout=60)
    c.close()


def _bits(t):
    return t.view(torch.uint8).cpu().clone()


def _held(client, reg):
    r = registration_of(client.status(), reg.reg_id)
    return r["held_blocks"], r["pending_ops"]


def _tokens(name: str) -> torch.Tensor:
    """Token ids of one test's original (one key per test: the same tokens and bytes are one key)."""
    return torch.arange(len(SLOTS), dtype=torch.int64) + zlib.crc32(name.encode())


def _published(client) -> list:
    """The keys in the service's store."""
    return SegmentStore(client.status()["originals"]["store_root"]).keys()


def _failed_request(call, mode):
    inject = {"fail_after_submit": True}
    if mode == "first-wait-refused":
        inject["refuse_waits"] = 1
    with pytest.raises(KmeshError, match="injected failure") as info:
        call(inject)
    assert info.value.op_id is not None
    return info.value.op_id


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_host_to_device(client, env, device, mode, request):
    layout, cache, reg = env
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 2, len(SLOTS), 2, 8, generator=g).to(torch.bfloat16)
    pos = torch.arange(len(SLOTS), dtype=torch.int64)
    key = put_original(client, kv, pos, _tokens(f"h2d-{device}-{mode}-{os.getpid()}"))
    new = [100 + i for i in range(len(SLOTS))]
    ref = layout.allocate(device, fill=POISON)
    place_many([kv.to(device)], ref, layout, [torch.tensor(SLOTS)], rope=small_rope(), old_positions=[pos],
               new_positions=[torch.tensor(new)])
    items = [(key, SLOTS, new)]
    if mode == "success":
        client.restore(reg, items)
    else:
        op = _failed_request(lambda inject: client.restore(reg, items, wait=False, inject=inject), mode)
        # Held: the destination blocks cannot be reused, the source cannot be evicted.
        assert _held(client, reg) == (BLOCKS, [op])
        with pytest.raises(OwnershipError, match="held by operation"):
            client.restore(reg, items)
        with pytest.raises(OwnershipError, match="held by a pending operation"):
            client.evict(key)
        if mode == "first-wait-refused":
            with pytest.raises(DrainError, match="refused"):
                client.drain(reg, [op], timeout=60)
            assert _held(client, reg) == (BLOCKS, [op])
            with pytest.raises(OwnershipError):
                client.evict(key)
        assert client.drain(reg, [op], timeout=60) == [op]
    assert _held(client, reg) == ([], [])
    # The one submitted copy completed (a drain never resubmits); nothing else was written.
    assert torch.equal(_bits(cache.tensor), _bits(ref))
    assert client.evict(key) is True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_device_to_host(client, env, device, mode):
    layout, cache, reg = env
    name = f"d2h-{device}-{mode}-{os.getpid()}"
    g = torch.Generator().manual_seed(11)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g).to(cache.tensor.dtype))
    expected = gather(cache.tensor, layout, torch.tensor(SLOTS)).cpu()
    before = _bits(cache.tensor)
    positions = list(range(50, 50 + len(SLOTS)))
    src = put_original(client, torch.zeros(2, 2, len(SLOTS), 2, 8, dtype=torch.bfloat16), token_ids=_tokens(name))
    published = _published(client)
    if mode == "success":
        key = client.save(reg, SLOTS, _tokens(name), positions)
        seg = client.get(key, model_fingerprint=FP)
        assert torch.equal(seg.kv.view(torch.uint8), expected.view(torch.uint8)) and seg.positions.tolist() == positions
        assert sorted(_published(client)) == sorted(published + [key])
        assert client.evict(key) is True
    else:
        op = _failed_request(lambda inject: client.save(reg, SLOTS, _tokens(name), positions, inject=inject), mode)
        assert _held(client, reg) == (BLOCKS, [op])  # the source blocks
        with pytest.raises(OwnershipError, match="held by operation"):
            client.restore(reg, [(src, SLOTS)])  # nothing may overwrite the blocks being read
        if mode == "first-wait-refused":
            with pytest.raises(DrainError, match="refused"):
                client.drain(reg, [op], timeout=60)
            assert _held(client, reg) == (BLOCKS, [op])
        assert client.drain(reg, [op], timeout=60) == [op]
        assert _held(client, reg) == ([], [])
        assert _published(client) == published  # a failed save is freed after its drain, never published
    assert torch.equal(_bits(cache.tensor), before)  # reading never writes the source
    assert client.evict(src) is True


@pytest.mark.gpu
def test_cancelled_destination_not_handed_out_before_copy_finished(client, service):
    """Poisoned canary: a slow copy (a spin kernel queued ahead of it on the service's stream) is
    cancelled; its blocks are refused until its CUDA event has completed, and a canary written by
    the next owner after the hand-out is never overwritten.

    The restore is sent from a second thread and connection: parts of a placement may wait for the
    stream on the host (pageable uploads), so the request can still be in submission while the
    first connection cancels and asks for the blocks.
    """
    layout = small_layout()
    cache = layout.allocate("cuda", fill=POISON)
    reg = client.register(cache, layout, model_fingerprint=FP)
    kv = torch.randn(2, 2, len(SLOTS), 2, 8).to(torch.bfloat16)
    key = put_original(client, kv)
    ref = layout.allocate("cuda", fill=POISON)
    place_many([kv.cuda()], ref, layout, [torch.tensor(SLOTS)])
    torch.cuda.synchronize()
    result = {}

    def slow_restore():
        with CacheClient(service.socket_path, timeout=120) as other:
            try:  # ~2-4 s of spinning ahead of the copy
                result["op"] = other.restore(reg, [(key, SLOTS)], wait=False, inject={"spin_cycles": 4_000_000_000})
            except Exception as exc:
                result["error"] = exc

    worker = threading.Thread(target=slow_restore)
    worker.start()
    try:
        pending = wait_for(lambda: registration_of(client.status(), reg.reg_id)["pending_ops"], timeout=60)
        op = pending[0]
        client.cancel(reg, op)
        with pytest.raises(DrainError, match="still"):
            client.acquire(reg, BLOCKS, timeout=0.05)
        with pytest.raises(OwnershipError, match="held by operation"):
            client.restore(reg, [(key, SLOTS)])
        assert _held(client, reg) == (BLOCKS, [op])
        assert client.acquire(reg, BLOCKS, timeout=120) == [op]
    finally:
        worker.join(120)
    assert result.get("op") == op and "error" not in result
    # Handed out only now: the cancelled copy has physically landed already ...
    assert torch.equal(_bits(cache), _bits(ref))
    # ... so a canary written by the new owner is never overwritten by it.
    canary = 0x3C3C
    words = cache.view(torch.int16)  # NHD: [L, B, N, H, 2D], blocks on dim 1
    for b in BLOCKS:
        words[:, b].fill_(canary)
    torch.cuda.synchronize()
    time.sleep(0.5)
    assert bool((words[:, BLOCKS] == canary).all())
    assert client.close_registration(reg, timeout=60) is True
    client.evict(key)


@pytest.mark.gpu
def test_every_request_waits_for_the_clients_earlier_work(client):
    """The service opens a connection's interprocess event once and the client re-records it before
    each request: every restore must still land after the work the client queued before it (a slow
    fill of the whole cache, queued behind a spin kernel; a restore that did not wait would be
    overwritten by it)."""
    layout = small_layout()
    cache = layout.allocate("cuda", fill=POISON)
    reg = client.register(cache, layout, model_fingerprint=FP, rope=small_rope())
    kv = torch.randn(2, 2, len(SLOTS), 2, 8).to(torch.bfloat16)
    pos = torch.arange(len(SLOTS), dtype=torch.int64)
    key = put_original(client, kv, pos)
    new = [200 + i for i in range(len(SLOTS))]
    try:
        for round_ in range(3):
            fill = 0x11 * (round_ + 1)
            ref = layout.allocate("cuda")
            ref.view(torch.uint8).fill_(fill)  # the same byte pattern the cache is filled with below
            place_many([kv.cuda()], ref, layout, [torch.tensor(SLOTS)], rope=small_rope(), old_positions=[pos],
                       new_positions=[torch.tensor(new)])
            torch.cuda._sleep(300_000_000)  # ~0.1-0.2 s ahead of the fill on the client's stream
            cache.view(torch.uint8).fill_(fill)
            client.restore(reg, [(key, SLOTS, new)])
            torch.cuda.synchronize()
            assert torch.equal(_bits(cache), _bits(ref)), f"round {round_}: the restore did not wait for the fill"
    finally:
        torch.cuda.synchronize()
        assert client.close_registration(reg, timeout=60) is True
        client.evict(key)


@pytest.mark.gpu
def test_device_copy_of_an_original_follows_evict(client):
    """The service restores from device copies of originals; evicting a key drops its host entry and
    device copy, and the next restore reads it from the store again (the same bytes: an original
    never changes under its key)."""
    layout = small_layout()
    cache = layout.allocate("cuda", fill=POISON)
    reg = client.register(cache, layout, model_fingerprint=FP)
    pos = torch.arange(len(SLOTS), dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, len(SLOTS), 2, 8, generator=g).to(torch.bfloat16)
    key = put_original(client, kv, pos, _tokens(f"device-copy-{os.getpid()}"))
    ref = layout.allocate("cuda", fill=POISON)
    place_many([kv.cuda()], ref, layout, [torch.tensor(SLOTS)])
    reads = None
    try:
        for _ in range(2):
            client.restore(reg, [(key, SLOTS)])
            client.restore(reg, [(key, SLOTS)])  # the second restore reads the device copy
            torch.cuda.synchronize()
            assert torch.equal(_bits(cache), _bits(ref))
            originals = client.status()["originals"]
            assert originals["device_keys"] >= 1
            if reads is not None:  # evicted before: read from the store again, once
                assert originals["tier"]["reads"] == reads + 1
            reads = originals["tier"]["reads"]
            assert client.evict(key) is True
            originals = client.status()["originals"]
            assert originals["device_keys"] == 0 and key in SegmentStore(originals["store_root"])
            cache.view(layout.storage_dtype).fill_(POISON)  # as layout.allocate(fill=) writes it
    finally:
        assert client.close_registration(reg, timeout=60) is True
