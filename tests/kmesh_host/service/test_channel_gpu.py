"""The channel on the GPU (separate processes): restores through a channel land the same bits as
through the socket, what the channel does not serve goes through the socket with its error named,
its blocks are held while its copy runs, and close, drains and a killed client stop and reap
channels without disturbing anyone else. The compiled loop's checks alone: ``test_channel_jit.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from kmesh_gpu import gather
from kmesh_gpu.errors import OwnershipError
from kmesh_host.service import CacheClient
from tests.kmesh_host.service.helpers import (fingerprint_of, join_or_kill, put_original, registration_of,
                                              running_service, wait_for)

pytestmark = pytest.mark.gpu

# a layout the run kernel's compiled path serves (16-byte rows, runs of a block's length)
LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 16, 16, 2, 64
COUNTS = (32, 16, 8)  # the originals' tokens
POISON = 0x5A


def _layout():
    from kmesh_gpu import KVLayout

    return KVLayout.from_vllm("NHD", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS,
                              head_size=HEAD, dtype=torch.bfloat16)


def _rope():
    from kmesh_gpu import RopeSpec

    return RopeSpec(HEAD, HEAD, 10000.0, True, 4096, torch.bfloat16)


def _fp():
    return fingerprint_of(_layout())


def _cache(layout, per_layer: bool = False):
    if per_layer:
        caches = [torch.empty(layout.per_layer().physical_shape, dtype=layout.dtype, device="cuda")
                  for _ in range(layout.num_layers)]
        for c in caches:
            c.view(torch.uint8).fill_(POISON)
        torch.cuda.synchronize()  # (a channel serves a client whose stream is idle)
        return caches
    cache = layout.allocate("cuda")
    cache.view(torch.uint8).fill_(POISON)
    torch.cuda.synchronize()
    return cache


def _bytes(cache) -> torch.Tensor:
    if isinstance(cache, list):
        return torch.cat([c.view(torch.uint8).flatten() for c in cache]).cpu()
    return cache.view(torch.uint8).cpu()


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


@pytest.fixture
def originals(service):
    """Three originals put in the service: ``[(key, tokens)]`` (evicted afterwards)."""
    gen = torch.Generator().manual_seed(11)
    keys = []
    with CacheClient(service.socket_path, timeout=120) as c:
        for i, n in enumerate(COUNTS):
            kv = torch.randn(2, LAYERS, n, HEADS, HEAD, generator=gen).to(torch.bfloat16)
            key = put_original(c, kv, torch.arange(n, dtype=torch.int64) + 7 * i, fp=_fp())
            keys.append((key, n))
        yield keys
        for key, _ in keys:
            try:
                c.evict(key)
            except OwnershipError:
                pass


def _items(originals, first_slot: int, shifted: bool, first_pos: int = 300):
    items, slot, pos = [], first_slot, first_pos
    for key, n in originals:
        slots = torch.arange(slot, slot + n, dtype=torch.int64)
        new = torch.arange(pos, pos + n, dtype=torch.int64) if shifted else None
        items.append((key, slots, new) if shifted else (key, slots))
        slot += n
        pos += n + 5
    return items


def _pair(service, originals, items, per_layer=False):
    """The same restore through the socket and through a channel: (socket bytes, channel bytes, the
    channel client's route counts)."""
    layout = _layout()
    with CacheClient(service.socket_path, timeout=120) as plain, \
            CacheClient(service.socket_path, timeout=120, channel=True) as fast:
        a, b = _cache(layout, per_layer), _cache(layout, per_layer)
        ra = plain.register(a, layout, model_fingerprint=_fp(), rope=_rope())
        rb = fast.register(b, layout, model_fingerprint=_fp(), rope=_rope())
        plain.restore(ra, items)
        for _ in range(3):  # the first looks the rows up; all three go through the channel
            fast.restore(rb, items)
        torch.cuda.synchronize()
        out = _bytes(a), _bytes(b), dict(fast.route_counts)
        assert plain.close_registration(ra, timeout=60) and fast.close_registration(rb, timeout=60)
    return out


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("per_layer", [False, True])
def test_a_channel_restores_the_same_bits_as_the_socket(service, originals, shifted, per_layer):
    want, got, counts = _pair(service, originals, _items(originals, 16, shifted), per_layer)
    assert counts == {"channel": 3, "socket": 0}
    assert torch.equal(want, got)
    assert not torch.equal(want, torch.full_like(want, POISON))


def test_what_a_channel_does_not_serve_goes_through_the_socket(service, originals):
    layout = _layout()
    (k0, n0), (k1, n1), (k2, n2) = originals
    with CacheClient(service.socket_path, timeout=120, channel=True) as fast:
        cache = _cache(layout)
        reg = fast.register(cache, layout, model_fingerprint=_fp(), rope=_rope())
        items = _items(originals, 0, True)
        fast.restore(reg, items)
        assert fast.route_counts == {"channel": 1, "socket": 0}
        # items some shifted, some not; slots out of order; a skipped token: the socket path places them
        fast.restore(reg, [items[0], (k1, torch.arange(100, 100 + n1))])
        fast.restore(reg, [(k1, torch.arange(100, 100 + n1), torch.arange(500, 500 + n1)),
                           (k0, torch.arange(0, n0), torch.arange(600, 600 + n0))])
        skip = torch.arange(200, 200 + n2)
        skip[3] = -1
        fast.restore(reg, [(k2, skip)])
        assert fast.route_counts == {"channel": 1, "socket": 3}
        # blocks held by a copy still in flight: refused with the socket path's error
        op = fast.restore(reg, [(k2, torch.arange(0, n2))], wait=False, inject={"spin_cycles": 400_000_000})
        with pytest.raises(OwnershipError, match="held by operation"):
            fast.restore(reg, [(k2, torch.arange(0, n2))])
        fast.drain(reg, [op], timeout=60)
        fast.restore(reg, [(k2, torch.arange(0, n2))])
        # an original evicted after the channel looked it up: its row is dropped (nothing reads the
        # dropped device copy), and the restore is served again from the store, with the same bytes
        torch.cuda.synchronize()
        slots = torch.arange(0, n2)
        before = gather(cache, layout, slots)
        cache.view(layout.storage_dtype).fill_(POISON)
        with CacheClient(service.socket_path, timeout=120) as other:
            assert other.evict(k2)
        fast.restore(reg, [(k2, slots)])
        torch.cuda.synchronize()
        assert torch.equal(gather(cache, layout, slots).view(torch.uint8), before.view(torch.uint8))
        # (the wait=False restore went through the socket; the one refused there is not counted)
        assert sum(fast.route_counts.values()) == 7 and fast.route_counts["channel"] >= 2
        assert fast.close_registration(reg, timeout=60)


def test_a_channel_restore_lands_after_the_clients_queued_work(service, originals):
    """With work of its own queued on its stream the client records its event, and the channel's
    copy waits for it on the service's stream (as the socket path's does)."""
    layout = _layout()
    with CacheClient(service.socket_path, timeout=120, channel=True) as fast:
        cache = _cache(layout)
        reg = fast.register(cache, layout, model_fingerprint=_fp(), rope=_rope())
        items = _items(originals, 0, True)
        fast.restore(reg, items)
        torch.cuda.synchronize()
        want = _bytes(cache)
        assert not torch.equal(want, torch.full_like(want, POISON))
        torch.cuda._sleep(300_000_000)  # ahead of a fill of the whole cache, on the client's stream
        cache.view(torch.uint8).fill_(POISON)
        fast.restore(reg, items)
        torch.cuda.synchronize()
        assert torch.equal(_bytes(cache), want), "the channel's copy did not wait for the client's fill"
        assert fast.route_counts == {"channel": 2, "socket": 0}
        assert fast.close_registration(reg, timeout=60)


def test_channel_blocks_are_held_by_its_operation_and_drains_leave_it_open(service, originals):
    layout = _layout()
    with CacheClient(service.socket_path, timeout=120, channel=True) as fast:
        cache = _cache(layout)
        reg = fast.register(cache, layout, model_fingerprint=_fp(), rope=_rope())
        items = _items(originals, 0, True)
        fast.restore(reg, items)
        st = registration_of(fast.status(), reg.reg_id)
        # the channel is an operation of its own, holding nothing between requests (listed apart);
        # its restores drained before their replies
        assert st["pending_ops"] == [] and len(st["channels"]) == 1 and st["held_blocks"] == []
        channel_op = st["channels"][0]
        assert fast.drain(reg, timeout=30) == []  # a drain of everything leaves the channel open
        assert fast.acquire(reg, list(range(BLOCKS)), timeout=30) == []  # nothing to drain: the channel stays
        fast.restore(reg, items)
        assert fast.route_counts == {"channel": 2, "socket": 0}
        status = fast.status()
        assert status["channels"]["open"] >= 1 and status["channels"]["served"] >= 2
        assert fast.close_registration(reg, timeout=60) is True
        status = fast.status()
        assert registration_of(status, reg.reg_id) is None and channel_op > 0
        assert not [op for op in status["pending_ops"] if op["reg"] == reg.reg_id]
        with pytest.raises(OwnershipError):
            fast.restore(reg, items)


def _child_channel_then_die(socket_path: str, keys: list, out) -> None:
    layout = _layout()
    cache = _cache(layout)
    c = CacheClient(socket_path, timeout=60, channel=True)
    reg = c.register(cache, layout, model_fingerprint=_fp(), rope=_rope())
    c.restore(reg, _items(keys, 0, True))
    out.put({"reg": reg.reg_id, "channel": dict(c.route_counts)})
    out.close()
    out.join_thread()  # the queue's feeder thread has written it (os._exit would drop it)
    os._exit(0)  # no close: the service must stop the channel, then reap the registration


def test_a_client_that_dies_with_a_channel_open_is_reaped_and_others_go_on(service, originals):
    layout = _layout()
    with CacheClient(service.socket_path, timeout=120, channel=True) as fast:
        cache = _cache(layout)
        reg = fast.register(cache, layout, model_fingerprint=_fp(), rope=_rope())
        items = _items(originals, 0, True)
        fast.restore(reg, items)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_child_channel_then_die, args=(service.socket_path, originals, out))
        p.start()
        got = out.get(timeout=120)
        join_or_kill(p)
        assert got["channel"] == {"channel": 1, "socket": 0}
        wait_for(lambda: registration_of(fast.status(), got["reg"]) is None, timeout=30)
        for _ in range(5):
            fast.restore(reg, items)
        assert fast.route_counts == {"channel": 6, "socket": 0}
        assert fast.status()["channels"]["stuck"] == 0
        assert fast.close_registration(reg, timeout=60) is True
    wait_for(lambda: fast_status_channels(service) == 0, timeout=30)


def fast_status_channels(service) -> int:
    with CacheClient(service.socket_path, timeout=60) as c:
        return c.status()["channels"]["open"]


def test_sixteen_channels_at_once(service, originals):
    """Many registrations with channels restoring at once from threads of one process (the
    benchmark runs sixteen processes): every restore lands, nothing is left held."""
    import threading

    layout = _layout()
    items = _items(originals, 16, True)
    with CacheClient(service.socket_path, timeout=120) as plain:
        ref = _cache(layout)
        rref = plain.register(ref, layout, model_fingerprint=_fp(), rope=_rope())
        plain.restore(rref, items)
        torch.cuda.synchronize()
        want = _bytes(ref)
        assert plain.close_registration(rref, timeout=60)
    errors, results = [], []

    def worker():
        try:  # each thread on a stream of its own, idle when it restores (the default stream is shared)
            with torch.cuda.stream(torch.cuda.Stream()), \
                    CacheClient(service.socket_path, timeout=120, channel=True) as c:
                cache = _cache(layout)
                reg = c.register(cache, layout, model_fingerprint=_fp(), rope=_rope())
                for _ in range(20):
                    c.restore(reg, items)
                results.append((torch.equal(_bytes(cache), want), dict(c.route_counts)))
                assert c.close_registration(reg, timeout=60)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(results) == 16 and all(ok for ok, _ in results)
    assert all(c == {"channel": 20, "socket": 0} for _, c in results)
    with CacheClient(service.socket_path, timeout=60) as c:
        wait_for(lambda: c.status()["channels"]["open"] == 0, timeout=30)
        st = c.status()
        assert not st["registrations"] and not st["pending_ops"]


def test_malformed_channel_requests_are_refused_and_the_service_serves_on(service, originals):
    import socket as _socket

    from kmesh_gpu.errors import ProtocolError
    from kmesh_host.service import channel, sockets

    layout = _layout()
    event = torch.cuda.Event(interprocess=True)
    event.record()
    good_event = bytes(event.ipc_handle()).hex()
    with CacheClient(service.socket_path, timeout=120, channel=False) as c:
        cache = _cache(layout)
        reg = c.register(cache, layout, model_fingerprint=_fp(), rope=_rope())

        def open_channel(max_tokens=layout.num_slots, event_hex=good_event, seal=True):
            if seal:
                page, fd = channel.Page.create(layout.num_slots)
            else:
                page, fd = None, os.memfd_create("unsealed")
                os.ftruncate(fd, channel.page_bytes(layout.num_slots))
            efds = [channel.new_eventfd(), channel.new_eventfd()]
            try:
                header = {"op": "channel", "reg": reg.reg_id, "secret": reg.secret, "fds": 3, "max_tokens": max_tokens,
                          "event": event_hex}
                return c._call(header, after=lambda s: _socket.send_fds(s, [sockets.FD_MARK], [fd, *efds])).header
            finally:
                if page is not None:
                    page.close()
                for x in (fd, *efds):
                    os.close(x)

        with pytest.raises(ProtocolError, match="max_tokens"):
            open_channel(max_tokens=5)
        with pytest.raises(ProtocolError, match="event"):
            open_channel(event_hex="zz")
        with pytest.raises(ProtocolError, match="event"):
            open_channel(event_hex="00" * 10)
        with pytest.raises(ProtocolError, match="sealed"):
            open_channel(seal=False)
        assert c.status()["channels"]["open"] == 0
        ok = open_channel()  # a well-formed one is accepted
        assert ok["channel"] > 0 and c.status()["channels"]["open"] == 1
        for _ in range(channel.MAX_CHANNELS_PER_REGISTRATION - 1):
            open_channel()
        from kmesh_gpu.errors import ServiceError

        with pytest.raises(ServiceError, match="channels open already"):  # each one is a thread of the service
            open_channel()
        assert c.status()["channels"]["open"] == channel.MAX_CHANNELS_PER_REGISTRATION
        c.restore(reg, _items(originals, 0, True))  # (through the socket: this client has channels off)
        assert c.close_registration(reg, timeout=60) is True
        assert c.status()["channels"]["open"] == 0
