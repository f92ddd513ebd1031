"""Signalled restores: the service answers a waiting restore into CUDA memory once the copy is
submitted, records the registration's interprocess signal event after it, and drains the operation
right after its reply; the client returns only once that event has completed. Host registrations
ignore the request (their copies are synchronous) and answer drained.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kmesh_gpu import place_many
from kmesh_gpu.errors import ProtocolError
from kmesh_host.service import CacheClient, RestoreItem, SharedCache, protocol
from tests.helpers.service import registration_of, running_service, small_layout, small_rope

SECRET = bytes(range(32))
POISON = 0x5A
SLOTS = [2, 3, 4, 5, 13, 14]


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


def _frame(signal: bool, wait: bool = True) -> bytes:
    items = protocol.restore_items(["k"], [2], [2])
    parts = protocol.restore_frame(items, 7, 3, SECRET, [np.array([1, 2, 10, 11], dtype=np.int64)], wait=wait,
                                   signal=signal)
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def _decode(frame: bytes) -> protocol.RestoreRequest:
    _, _, _, header_len, _ = protocol.PREFIX.unpack_from(frame)
    p = protocol.PREFIX.size
    return protocol.decode_restore(memoryview(frame)[p:p + header_len], memoryview(frame)[p + header_len:])


def test_signal_bit_roundtrip():
    assert _decode(_frame(True)).signal is True
    assert _decode(_frame(False)).signal is False


def test_signal_without_wait_is_refused_both_ways():
    with pytest.raises(ProtocolError, match="signal"):
        _frame(True, wait=False)
    frame = bytearray(_frame(True))
    bits_at = protocol.PREFIX.size + 2  # RESTORE_REQUEST: kind (H), then bits (H)
    assert int.from_bytes(frame[bits_at:bits_at + 2], "little") & protocol.BIT_SIGNAL
    frame[bits_at] &= ~protocol.BIT_WAIT & 0xFF
    with pytest.raises(ProtocolError, match="signal bit without the wait bit"):
        _decode(bytes(frame))


def test_host_registration_answers_a_signalled_request_drained(service):
    """A host (shared-memory) registration has no signal event: the request is served as a plain
    waiting one, and the reply says drained, so a client never waits on an event it does not have."""
    layout = small_layout()
    kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
    key = f"sig-host-{os.getpid()}"
    with SharedCache(layout, fill=POISON) as cache, CacheClient(service.socket_path, timeout=60) as client:
        client.put(key, kv, torch.arange(4))
        reg = client.register(cache, layout)
        assert reg.signal_handle is None
        items = protocol.restore_items([key], [4], [None])
        slots = np.array([0, 1, 2, 3], dtype=np.int64)

        def build(rid, event):
            return protocol.restore_frame(items, rid, reg.reg_id, reg.secret_bytes, [slots], signal=True)

        rid, flags, buf, body = client._exchange("restore", build)
        reply = protocol.decode_restore_reply(memoryview(buf)[:len(buf) - len(body)], body)
        assert reply.request_id == rid and reply.state == "drained"
        ref = layout.allocate(fill=POISON)
        place_many([kv], ref, layout, [torch.from_numpy(slots)])
        assert torch.equal(cache.tensor.view(torch.uint8), ref.view(torch.uint8))
        assert client.close_registration(reg) is True


def _poisoned(layout):
    """A CUDA cache whose every byte is POISON (``allocate(fill=)`` fills values, not bytes)."""
    cache = layout.allocate("cuda")
    cache.view(torch.uint8).fill_(POISON)
    return cache


def _original(name: str, first_new: int):
    """``(layout, key, kv, positions, new positions, the expected cache bytes)`` of one original
    restored into SLOTS of a poisoned cache with its keys shifted to ``first_new``..."""
    layout = small_layout()
    kv = torch.randn(2, 2, len(SLOTS), 2, 8).to(torch.bfloat16)
    pos = torch.arange(len(SLOTS), dtype=torch.int64)
    new = [first_new + i for i in range(len(SLOTS))]
    ref = _poisoned(layout)
    place_many([kv.cuda()], ref, layout, [torch.tensor(SLOTS)], rope=small_rope(), old_positions=[pos],
               new_positions=[torch.tensor(new)])
    torch.cuda.synchronize()
    return layout, f"{name}-{os.getpid()}", kv, pos, new, ref.view(torch.uint8).cpu()


@pytest.mark.gpu
def test_signalled_restore_returns_after_a_slow_copy(service):
    """The copy is held back by a spin kernel queued ahead of it on the service's stream: the
    signalled restore still returns only after it has landed (read without any synchronisation of
    the service's stream), and the service has drained the operation by the next request."""
    layout, key, kv, pos, new, want = _original("sig-slow", 300)
    with CacheClient(service.socket_path, timeout=120, signal_wait=True) as client:
        client.put(key, kv, pos)
        cache = _poisoned(layout)
        reg = client.register(cache, layout, rope=small_rope())
        assert reg.signal_handle is not None and len(reg.signal_handle) == protocol.EVENT_HANDLE_BYTES
        try:
            for round_ in range(3):
                cache.view(torch.uint8).fill_(POISON)
                torch.cuda.synchronize()
                op = client.restore(reg, [RestoreItem(key, SLOTS, new)], inject={"spin_cycles": 200_000_000},
                                    timings=True)
                got = cache.view(torch.uint8).cpu()  # the client's stream only: nothing waits on the service's
                assert torch.equal(got, want), f"round {round_}: returned before the copy landed"
                t = client.last_timings
                assert "signalled" in t["client"] and "completed" not in t["service"]
                assert t["client"]["signalled"] >= t["client"]["received"]
                # the same connection's next request comes after the service's drain of this one
                r = registration_of(client.status(), reg.reg_id)
                assert op not in r["pending_ops"] and not r["held_blocks"]
        finally:
            assert client.close_registration(reg, timeout=60) is True
            client.evict(key)


@pytest.mark.gpu
def test_signalled_and_plain_restores_give_the_same_bits(service):
    layout, key, kv, pos, new, want = _original("sig-same", 40)
    got = {}
    for signal in (True, False):
        with CacheClient(service.socket_path, timeout=120, signal_wait=signal) as client:
            if signal:
                client.put(key, kv, pos)  # the service keeps it for the next client
            cache = _poisoned(layout)
            reg = client.register(cache, layout, rope=small_rope())
            client.restore(reg, [(key, SLOTS, new)], timings=True)
            got[signal] = cache.view(torch.uint8).cpu()
            assert ("signalled" in client.last_timings["client"]) is signal
            assert ("completed" in client.last_timings["service"]) is not signal
            assert client.close_registration(reg, timeout=60) is True
            if not signal:
                client.evict(key)
    assert torch.equal(got[True], want) and torch.equal(got[False], want)


@pytest.mark.gpu
def test_client_records_its_event_only_when_its_stream_has_work(service):
    """On a side stream with nothing queued the request carries no event (nothing to wait for); with
    work queued it does, and the restore lands after that work; the legacy default stream always
    records (a record there also covers other blocking streams, which a query of it does not)."""
    layout, key, kv, pos, new, want = _original("sig-side", 70)
    with CacheClient(service.socket_path, timeout=120) as client:
        client.put(key, kv, pos)
        cache = _poisoned(layout)
        reg = client.register(cache, layout, rope=small_rope())
        side = torch.cuda.Stream()
        try:
            with torch.cuda.stream(side):
                torch.cuda.synchronize()
                with client._lock:
                    assert client._record_event(reg) is None
                torch.cuda._sleep(100_000_000)
                with client._lock:
                    handle = client._record_event(reg)
                assert handle is not None and len(handle) == protocol.EVENT_HANDLE_BYTES
                torch.cuda.synchronize()
                torch.cuda._sleep(300_000_000)  # ahead of a fill of the whole cache on the side stream
                cache.view(torch.uint8).fill_(POISON)
                client.restore(reg, [(key, SLOTS, new)])
                torch.cuda.synchronize()
                assert torch.equal(cache.view(torch.uint8).cpu(), want), "the restore did not wait for the fill"
            with client._lock:
                assert client._record_event(reg) is not None  # the default stream, idle or not
        finally:
            torch.cuda.synchronize()
            assert client.close_registration(reg, timeout=60) is True
            client.evict(key)
