"""The client's interprocess event: a request carries one only when the client's stream has work
queued (an idle side stream sends none, so the device gets no command of the client's context
between the service's copies), and the service's copy still lands after that work when it has.
"""

from __future__ import annotations


import pytest
import torch

from kmesh_gpu import place_many
from kmesh_host.service import CacheClient, restore_wire
from tests.kmesh_host.service.helpers import fingerprint, put_original, running_service, small_layout, small_rope

POISON = 0x5A
SLOTS = [2, 3, 4, 5, 13, 14]


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


def _poisoned(layout):
    """A CUDA cache whose every byte is POISON (``allocate(fill=)`` fills values, not bytes)."""
    cache = layout.allocate("cuda")
    cache.view(torch.uint8).fill_(POISON)
    return cache


def _original(name: str, first_new: int):
    """``(layout, key, kv, positions, new positions, the expected cache bytes)`` of one original
    restored into SLOTS of a poisoned cache with its keys shifted to ``first_new``... (``key``: its
    name, the service's key once put)"""
    layout = small_layout()
    kv = torch.randn(2, 2, len(SLOTS), 2, 8).to(torch.bfloat16)
    pos = torch.arange(len(SLOTS), dtype=torch.int64)
    new = [first_new + i for i in range(len(SLOTS))]
    ref = _poisoned(layout)
    place_many([kv.cuda()], ref, layout, [torch.tensor(SLOTS)], rope=small_rope(), old_positions=[pos],
               new_positions=[torch.tensor(new)])
    torch.cuda.synchronize()
    return layout, name, kv, pos, new, ref.view(torch.uint8).cpu()


@pytest.mark.gpu
def test_client_records_its_event_only_when_its_stream_has_work(service):
    """On a side stream with nothing queued the request carries no event (nothing to wait for); with
    work queued it does, and the restore lands after that work. The legacy default stream alike:
    see :func:`test_default_stream_covers_blocking_streams` for the work a query of it reports."""
    layout, key, kv, pos, new, want = _original("sig-side", 70)
    with CacheClient(service.socket_path, timeout=120) as client:
        key = put_original(client, kv, pos)
        cache = _poisoned(layout)
        reg = client.register(cache, layout, model_fingerprint=fingerprint(), rope=small_rope())
        side = torch.cuda.Stream()
        try:
            with torch.cuda.stream(side):
                torch.cuda.synchronize()
                with client._lock:
                    assert client._record_event(reg) is None
                torch.cuda._sleep(100_000_000)
                with client._lock:
                    handle = client._record_event(reg)
                assert handle is not None and len(handle) == restore_wire.EVENT_HANDLE_BYTES
                torch.cuda.synchronize()
                torch.cuda._sleep(300_000_000)  # ahead of a fill of the whole cache on the side stream
                cache.view(torch.uint8).fill_(POISON)
                client.restore(reg, [(key, SLOTS, new)])
                torch.cuda.synchronize()
                assert torch.equal(cache.view(torch.uint8).cpu(), want), "the restore did not wait for the fill"
            torch.cuda.synchronize()
            with client._lock:
                assert client._record_event(reg) is None  # the default stream, idle
        finally:
            torch.cuda.synchronize()
            assert client.close_registration(reg, timeout=60) is True
            client.evict(key)


def _blocking_stream():
    """A stream created with default flags (blocking: the legacy default stream synchronises with
    it, as with CuPy's default streams; torch's own streams are non-blocking)."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    assert cu.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(0)) == 0
    flags = ctypes.c_uint()
    assert cu.cuStreamGetFlags(handle, ctypes.byref(flags)) == 0 and flags.value == 0
    return torch.cuda.ExternalStream(handle.value), lambda: cu.cuStreamDestroy_v2(handle)


@pytest.mark.gpu
def test_default_stream_covers_blocking_streams(service):
    """A client on the legacy default stream with its earlier writes on a blocking stream (which
    the default stream synchronises with): the request carries its event and the restore lands
    after those writes; once everything is idle it carries none."""
    layout, key, kv, pos, new, want = _original("sig-legacy", 90)
    with CacheClient(service.socket_path, timeout=120) as client:
        key = put_original(client, kv, pos)
        cache = _poisoned(layout)
        reg = client.register(cache, layout, model_fingerprint=fingerprint(), rope=small_rope())
        blocking, destroy = _blocking_stream()
        try:
            assert torch.cuda.current_stream().cuda_stream == 0  # the legacy default stream
            client.restore(reg, [(key, SLOTS, new)])
            torch.cuda.synchronize()
            assert torch.equal(cache.view(torch.uint8).cpu(), want)
            with client._lock:
                assert client._record_event(reg) is None  # all idle: nothing to wait for
            with torch.cuda.stream(blocking):
                torch.cuda._sleep(300_000_000)  # ahead of a fill of the whole cache
                cache.view(torch.uint8).fill_(POISON)
            with client._lock:  # the default stream has nothing of its own queued, yet must wait
                assert client._record_event(reg) is not None
            client.restore(reg, [(key, SLOTS, new)])
            torch.cuda.synchronize()
            assert torch.equal(cache.view(torch.uint8).cpu(), want), "the restore did not wait for the fill"
        finally:
            torch.cuda.synchronize()
            destroy()
            assert client.close_registration(reg, timeout=60) is True
            client.evict(key)
