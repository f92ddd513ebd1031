"""The connection's shared-memory channel (kmesh_host.service.channel): restores through it give the
socket's results and errors, anything written to its page gets an error reply without harming the
service, both sides sleep and wake correctly, and it ends with its connection."""

from __future__ import annotations

import os
import random
import socket
import threading

import numpy as np
import pytest
import torch

from kmesh_gpu.errors import LayoutError, OwnershipError, ProtocolError, ServiceError
from kmesh_host.service import CacheClient, RestoreItem, SharedCache, protocol
from kmesh_host.service import channel as chm
from tests.helpers.service import (
    SPAWN,
    child_restore_through_channel_then_hang,
    join_or_kill,
    registration_of,
    running_service,
    small_layout,
    small_rope,
    wait_for,
)

POISON = 0x5A
pytestmark = pytest.mark.skipif(chm.compiled() is None, reason="the channel needs Numba")


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.02) as svc:
        yield svc


def _put(client, key, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, T, 2, 8, generator=g).to(torch.bfloat16)
    client.put(key, kv, torch.arange(T, dtype=torch.int64))


def _bits(t):
    return t.view(torch.uint8).clone()


def _channel_requests(client) -> int:
    return client.status()["counters"]["channel_requests"]


def test_restore_through_channel_matches_socket(service, request):
    key = request.node.name
    layout = small_layout()
    with CacheClient(service.socket_path, channel=True) as ch, CacheClient(service.socket_path, channel=False) as so, \
            SharedCache(layout, fill=POISON) as a, SharedCache(layout, fill=POISON) as b:
        assert ch.uses_channel and not so.uses_channel
        _put(ch, key)
        item = RestoreItem(key, [1, 2, 3, 9, 10, 30], [40, 41, 42, 43, 44, 45])
        ra, rb = ch.register(a, layout, rope=small_rope()), so.register(b, layout, rope=small_rope())
        before = _channel_requests(so)
        for _ in range(3):
            ch.restore(ra, [item])
            so.restore(rb, [item])
        assert _channel_requests(so) == before + 3  # the channel client's three, none of the socket's
        assert torch.equal(_bits(a.tensor), _bits(b.tensor))
        assert not torch.equal(_bits(a.tensor), torch.full_like(_bits(a.tensor), POISON))
        # a restore that does not wait comes back pending through the channel too, and drains
        op = ch.restore(ra, [item], wait=False)
        ch.drain(ra, [op])
        assert ch.close_registration(ra) and so.close_registration(rb)


def test_typed_errors_through_channel_write_nothing(service, request):
    key = request.node.name
    layout = small_layout()
    with CacheClient(service.socket_path, channel=True) as c, SharedCache(layout, fill=POISON) as cache:
        _put(c, key)
        reg = c.register(cache, layout, rope=small_rope())
        before = _bits(cache.tensor)
        with pytest.raises(LayoutError, match="outside"):
            c.restore(reg, [RestoreItem(key, [0, 1, 2, 3, 4, 32])])
        with pytest.raises(LayoutError, match="twice"):
            c.restore(reg, [RestoreItem(key, [0, 1, 2, 3, 4, 4])])
        stale = type(reg)(reg.reg_id, reg.generation, "00" * 32, layout, reg.handle, reg.cache)
        with pytest.raises(OwnershipError, match="wrong secret"):
            c.restore(stale, [RestoreItem(key, [0, 1, 2, 3, 4, 5])])
        assert torch.equal(_bits(cache.tensor), before)
        assert c.uses_channel  # errors leave the channel usable
        c.restore(reg, [RestoreItem(key, [0, 1, 2, 3, 4, 5])])
        assert not torch.equal(_bits(cache.tensor), before)
        assert c.close_registration(reg)


def _raw(ch: chm.ClientChannel, frame: bytes, length: int | None = None):
    """Post ``frame`` as it is (its declared length ``length``) and return the reply's header."""
    flags, buf, body = ch.exchange([frame], len(frame) if length is None else length, spin_s=0.01, timeout=30,
                                   max_body_bytes=protocol.DEFAULT_MAX_BODY_BYTES)
    assert not flags & protocol.FLAG_BINARY
    return protocol.decode_header(memoryview(buf)[:len(buf) - len(body)])


def test_garbage_on_the_page_gets_error_replies(service, request):
    key = request.node.name
    layout = small_layout()
    with CacheClient(service.socket_path, channel=True) as c, SharedCache(layout, fill=POISON) as cache:
        _put(c, key)
        reg = c.register(cache, layout)
        before = _bits(cache.tensor)
        ch = c._channel
        good = b"".join(bytes(p) for p in protocol.restore_frame(
            protocol.restore_items([key], [6], [None]), 7, reg.reg_id, reg.secret_bytes,
            [np.arange(6, dtype=np.int64)]))
        cases = [
            (b"\x00" * 8, None, "length"),  # shorter than a prefix
            (good, 1 << 40, "length"),  # an absurd length
            (good, ch.capacity + 1, "length"),  # just over the capacity
            (good[:-8], None, "do not make"),  # truncated: the prefix says more
            (b"XXXX" + good[4:], None, "bad prefix"),
            (protocol.encode({"op": "status", "id": 3}), None, "binary restore frames only"),
            (good[:16] + b"\x09" + good[17:], None, "unknown kind"),  # a well-framed header that does not parse
        ]
        for frame, length, match in cases:
            h = _raw(ch, frame, length)
            assert h["ok"] is False and h["error"]["code"] == "protocol" and match in h["error"]["message"], h
        rng = random.Random(5)
        for _ in range(40):
            n = rng.randrange(0, 600)
            h = _raw(ch, bytes(rng.getrandbits(8) for _ in range(n)), rng.choice([None, rng.randrange(0, 1 << 62)]))
            assert h["ok"] is False
        assert torch.equal(_bits(cache.tensor), before)
        # the channel, the connection and the service all go on
        c.restore(reg, [(key, [0, 1, 2, 3, 4, 5])])
        assert c.uses_channel and c.status()["healthy"]
        assert c.close_registration(reg)


@pytest.mark.parametrize("spin", [0.0, 0.002], ids=["asleep", "polling"])
def test_both_sides_sleep_and_wake(request, spin):
    key = request.node.name
    layout = small_layout()
    with running_service(reap_interval_s=0.05, receive_spin_s=spin) as svc, \
            CacheClient(svc.socket_path, channel=True, reply_spin_s=spin) as c, \
            SharedCache(layout, fill=POISON) as cache, SharedCache(layout, fill=POISON) as ref:
        _put(c, key)
        reg = c.register(cache, layout)
        with CacheClient(svc.socket_path, channel=False) as so:
            rref = so.register(ref, layout)
            so.restore(rref, [(key, [3, 4, 5, 6, 7, 8])])
            assert so.close_registration(rref)
        for i in range(50):
            c.restore(reg, [(key, [3, 4, 5, 6, 7, 8])])
        assert torch.equal(_bits(cache.tensor), _bits(ref.tensor))
        assert _channel_requests(c) == 50
        assert c.close_registration(reg)


def test_large_restore_takes_the_socket(request):
    key = request.node.name
    layout = small_layout(num_blocks=64)
    with running_service(reap_interval_s=0.05, channel_capacity=512) as svc, \
            CacheClient(svc.socket_path, channel=True) as c, SharedCache(layout, fill=POISON) as cache:
        _put(c, key, T=100)
        reg = c.register(cache, layout)
        c.restore(reg, [(key, list(range(100)))])  # an 800-byte body: over the 512-byte channel
        assert _channel_requests(c) == 0
        _put(c, key + "-small", T=4)
        c.restore(reg, [(key + "-small", [200, 201, 202, 203])])
        assert _channel_requests(c) == 1
        assert c.close_registration(reg)


def test_channels_turned_off():
    with running_service(reap_interval_s=0.05, channel_capacity=0) as svc:
        with CacheClient(svc.socket_path) as c:
            assert not c.uses_channel  # auto: the service has none to offer
        with pytest.raises(ProtocolError, match="turned off"):
            CacheClient(svc.socket_path, channel=True)


def test_one_channel_per_connection(service):
    with CacheClient(service.socket_path, channel=True) as c:
        with pytest.raises(ProtocolError, match="already has a channel"):
            c.call({"op": "open_channel"})
        assert c.status()["channels"] >= 1


def test_service_gone_breaks_the_channel_not_the_client(request):
    key = request.node.name
    layout = small_layout()
    with SharedCache(layout, fill=POISON) as cache:
        with running_service(reap_interval_s=0.05) as svc:
            c = CacheClient(svc.socket_path, channel=True, timeout=20)
            _put(c, key)
            reg = c.register(cache, layout)
            c.restore(reg, [(key, [0, 1, 2, 3, 4, 5])])
        try:
            with pytest.raises(ServiceError):
                c.restore(reg, [(key, [0, 1, 2, 3, 4, 5])])
            assert not c.uses_channel
        finally:
            c.close()


def test_killed_client_closes_its_channel(service, request):
    layout = small_layout()
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=child_restore_through_channel_then_hang, args=(service.socket_path, out))
    proc.start()
    try:
        info = out.get(timeout=60)
        with CacheClient(service.socket_path, channel=True) as c, SharedCache(layout, fill=POISON) as cache:
            channels = c.status()["channels"]
            assert channels >= 2  # the child's and this one's
            proc.kill()
            join_or_kill(proc, 10)
            wait_for(lambda: c.status()["channels"] == channels - 1, timeout=20)
            wait_for(lambda: registration_of(c.status(), info["reg"]) is None, timeout=20)
            # this client is undisturbed
            _put(c, request.node.name)
            reg = c.register(cache, layout)
            c.restore(reg, [(request.node.name, [0, 1, 2, 3, 4, 5])])
            assert c.uses_channel and c.close_registration(reg)
    finally:
        join_or_kill(proc, 10)
        if "info" in locals():
            try:
                os.unlink(os.path.join("/dev/shm", info["shm"].lstrip("/")))
            except FileNotFoundError:
                pass


def test_handshake_under_load():
    """Both ends in one process (dup'ed descriptors): thousands of exchanges, polling and asleep in
    turn, each answered with its own request's id."""
    a, b = socket.socketpair()

    def serve(raw, body, received):
        return protocol.encode_restore_reply(protocol.binary_request_id(raw), len(body) // 8, "drained")

    svc = chm.ServiceChannel(serve, name="test-channel", spin_s=0.0005)
    client = chm.ClientChannel([os.dup(fd) for fd in svc.fds], a)
    svc.start()
    try:
        items = protocol.restore_items(["k"], [3], [None])
        for i in range(1, 2001):
            parts = protocol.restore_frame(items, i, 1, b"s" * 32, [np.arange(3, dtype=np.int64) + i])
            nbytes = sum(len(bytes(p)) for p in parts)
            flags, buf, body = client.exchange(parts, nbytes, spin_s=0.0 if i % 3 else 0.001, timeout=10,
                                               max_body_bytes=1 << 20)
            reply = protocol.decode_restore_reply(memoryview(buf)[:len(buf) - len(body)], body)
            assert (reply.request_id, reply.op_id) == (i, 3)
    finally:
        svc.close()
        svc.thread.join(10)
        client.close()
        a.close()
        b.close()
    assert not svc.thread.is_alive()


def test_service_channel_closed_before_start_releases_everything():
    svc = chm.ServiceChannel(lambda raw, body, received: b"", name="never-started")
    fds = list(svc.fds)
    svc.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert not threading.Thread.is_alive(svc.thread)
