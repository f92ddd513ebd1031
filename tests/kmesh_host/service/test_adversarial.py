"""Adversarial checks of the cache service on CPU shared memory (seeded, reproducible).

Hand-crafted and mutated binary restore frames, wrong-typed JSON requests, lifecycle misuse, and
races (restore vs close, a client SIGKILLed after a restore it never waited for, connections
abandoned in the middle of a frame). After every test: a victim registration of another
connection was never written, no request caused an internal error, and a fresh well-formed
restore by another client still lands bit-exactly.

Checks that currently fail (bugs) live in /tmp/audit/service/failing_tests.py, not here.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kmesh_gpu import place_many
from kmesh_gpu.errors import KmeshError, OwnershipError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache, protocol, restore_wire
from kmesh_host.service.client import Registration
from tests.kmesh_host.service.helpers import (fingerprint, item, put_original, registration_of, small_layout,
                                              small_rope, socket_dir, wait_for)

POISON = 0x5A
MAX_BODY = 1 << 20
MAX_CONNECTIONS = 24
FRAME_TIMEOUT_S = 3.0  # how long a stalled frame lives: all of test_connections_abandoned_mid_frame's connect in less
T = 4  # tokens of the original "adv-src"
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
FIXED = restore_wire.RESTORE_REQUEST
BINARY_ERROR_CODES = set(protocol.ERROR_CODES) - {"service", "kmesh"}  # typed, and not an internal error
FP = fingerprint()
#: the tables below name the original "adv-src"; its key is the service's (set by the world fixture)
KEYS: dict[str, str] = {}


# ---------------------------------------------------------------------------------- service and clients
@pytest.fixture(scope="module")
def world():
    layout, rope = small_layout(), small_rope()
    g = torch.Generator().manual_seed(20240611)
    kv = torch.randn(2, 2, T, 2, 8, generator=g).to(torch.bfloat16)
    pos = torch.arange(T, dtype=torch.int64)
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            reap_interval_s=0.02, frame_timeout_s=FRAME_TIMEOUT_S, max_connections=MAX_CONNECTIONS,
                            max_body_bytes=MAX_BODY, receive_spin_s=0.0)
        with CacheService(cfg) as svc, \
                CacheClient(svc.socket_path, timeout=60) as own, \
                CacheClient(svc.socket_path, timeout=60) as victim_client, \
                SharedCache(layout, fill=POISON) as victim_cache, \
                SharedCache(layout, fill=POISON) as att_cache, \
                SharedCache(layout, fill=POISON) as wit_cache:
            key = KEYS["adv-src"] = put_original(own, kv, pos)
            # another connection's registration, the attacker's own, and one fresh clients restore into after each test
            victim = victim_client.register(victim_cache, layout, model_fingerprint=FP, rope=rope)
            att = own.register(att_cache, layout, model_fingerprint=FP, rope=rope)
            wit = own.register(wit_cache, layout, model_fingerprint=FP, rope=rope)
            wit_slots, wit_new = [28, 29, 30, 31], [100, 101, 102, 103]
            wit_item = item(key, wit_slots, wit_new)
            wit_ref = wit_cache.tensor.clone()
            place_many([kv], wit_ref, layout, [torch.tensor(wit_slots)], rope=rope, old_positions=[pos],
                       new_positions=[torch.tensor(wit_new)])
            w = SimpleNamespace(svc=svc, cfg=cfg, path=svc.socket_path, layout=layout, rope=rope, kv=kv, pos=pos,
                                key=key,
                                own=own, victim_client=victim_client, victim_cache=victim_cache, victim=victim,
                                att_cache=att_cache, att=att, wit_cache=wit_cache, wit=wit, wit_item=wit_item,
                                wit_ref=wit_ref, victim_bits=_bits(victim_cache.tensor))
            yield w
            victim_client.close_registration(victim, timeout=60)
            own.close_registration(att, timeout=60)
            own.close_registration(wit, timeout=60)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).clone()


def _store_keys(w, status=None) -> list:
    """The keys in the service's (private) store (``status``: as of that status)."""
    from kmesh_host import SegmentStore

    root = (status or w.own.status())["originals"]["store_root"]
    return SegmentStore(root).keys()


def _reg_state(client, reg) -> dict:
    return registration_of(client.status(), reg.reg_id)


def _quiet(w, reg=None) -> None:
    """The registration has nothing held or pending."""
    r = _reg_state(w.own, reg or w.att)
    assert r["held_blocks"] == [] and r["pending_ops"] == [], r


@pytest.fixture(autouse=True)
def guard(world):
    """Per test: no internal error, the victim untouched, a fresh client's restore still exact."""
    w = world
    before = w.own.status()["counters"]
    yield
    st = w.own.status()
    assert st["healthy"] is True
    assert st["counters"]["internal_errors"] == before["internal_errors"], "bad input caused an internal error"
    assert torch.equal(_bits(w.victim_cache.tensor), w.victim_bits), "the victim's cache was written"
    v = registration_of(st, w.victim.reg_id)
    assert v["state"] == "open" and v["held_blocks"] == [] and v["pending_ops"] == []
    with CacheClient(w.path, timeout=30) as fresh:
        fresh.restore(w.wit, [w.wit_item])
    assert torch.equal(_bits(w.wit_cache.tensor), _bits(w.wit_ref))
    _quiet(w, w.wit)


# ---------------------------------------------------------------------------------- raw frames
def _connect(w) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(w.path)  # blocking: waits for room in the listen backlog instead of failing with EAGAIN
    s.settimeout(15)
    return s


def restore_frame(reg_id: int, secret: bytes, items, *, rid: int = 1, bits: int = restore_wire.BIT_WAIT,
                  timeout: float = 0.0, event: bytes = b"", extras: bytes = b"", n: int | None = None,
                  keys_len: int | None = None, extras_len: int | None = None, table: bytes | None = None,
                  body: bytes | None = None, kind: int = restore_wire.KIND_RESTORE) -> bytes:
    """A binary restore frame built field by field (any field may be overridden with a wrong value).
    ``items``: ``(key: str | bytes, slots, new_positions or None)`` (a name of :data:`KEYS` stands
    for its key)."""
    keys = [KEYS.get(k, k).encode("utf-8") if isinstance(k, str) else k for k, _, _ in items]
    if table is None:
        table = struct.pack(f"<{3 * len(items)}i", *[v for (_, s, p), kb in zip(items, keys)
                                                     for v in (len(kb), len(s), -1 if p is None else len(p))])
    blob = b"".join(keys)
    head = FIXED.pack(kind, bits, len(items) if n is None else n, rid, reg_id, secret, timeout,
                      len(blob) if keys_len is None else keys_len, len(extras) if extras_len is None else extras_len)
    header = head + event + table + blob + extras
    header += bytes(-len(header) % 8)
    if body is None:
        values = [v for _, s, _ in items for v in s] + [v for _, _, p in items if p is not None for v in p]
        body = struct.pack(f"<{len(values)}q", *values)
    return protocol.PREFIX.pack(protocol.MAGIC, protocol.VERSION, protocol.FLAG_BINARY, len(header), len(body)) \
        + header + body


def answer(s: socket.socket):
    """``("ok", RestoreReply)``, ``(code, error header)`` for a typed error, or ``("closed", None)``."""
    try:
        flags, buf, body = protocol.read_frame(s, max_body_bytes=MAX_BODY, frame_timeout=15)
    except (protocol.ConnectionClosed, OSError):
        return "closed", None
    raw = memoryview(buf)[:len(buf) - len(body)]
    if flags & protocol.FLAG_BINARY:
        return "ok", restore_wire.decode_restore_reply(raw, body)
    h = protocol.decode_header(raw)
    assert h["ok"] is False and h["error"]["code"] in protocol.ERROR_CODES, h
    assert isinstance(h["error"]["message"], str)
    return h["error"]["code"], h


def ask(s: socket.socket, frame: bytes):
    try:
        s.sendall(frame)
    except (BrokenPipeError, ConnectionResetError):  # refused before the end of a large frame
        pass
    return answer(s)


def _att(w, items, **kw) -> bytes:
    return restore_frame(w.att.reg_id, w.att.secret_bytes, items, **kw)


def _reference(w, before: torch.Tensor, items) -> torch.Tensor:
    """``before`` (the cache's bytes, see :func:`_bits`) with ``items`` placed in this process."""
    ref = before.clone().view(w.layout.dtype)
    for key, slots, new in items:
        assert key == "adv-src"
        kw = {} if new is None else dict(rope=w.rope, old_positions=[w.pos], new_positions=[torch.tensor(new)])
        place_many([w.kv], ref, w.layout, [torch.tensor(slots)], **kw)
    return ref


# ---------------------------------------------------------------------------------- binary: values
NS = 32  # small_layout: 8 blocks x 4 slots
NP = 4096  # small_rope: max_position
BAD_VALUES = [
    ("slot-at-bound", [("adv-src", [29, 30, 31, NS], None)], "layout"),
    ("slot-bound+1", [("adv-src", [29, 30, 31, NS + 1], None)], "layout"),
    ("slot-minus-2", [("adv-src", [0, 1, 2, -2], None)], "layout"),
    ("slot-int64-min", [("adv-src", [0, 1, 2, I64_MIN], None)], "layout"),
    ("slot-int64-max", [("adv-src", [0, 1, 2, I64_MAX], None)], "layout"),
    ("slot-first-huge", [("adv-src", [I64_MAX, 0, 1, 2], None)], "layout"),
    ("skips-then-out-of-range", [("adv-src", [-1, -1, -1, NS], None)], "layout"),
    ("duplicate-in-item", [("adv-src", [0, 1, 1, 2], None)], "layout"),
    ("duplicate-unsorted", [("adv-src", [5, 0, 5, 1], None)], "layout"),
    ("duplicate-across-items", [("adv-src", [0, 1, 2, 3], None), ("adv-src", [3, 4, 5, 6], None)], "layout"),
    ("duplicate-across-items-reordered", [("adv-src", [8, 9, 10, 11], None), ("adv-src", [4, 5, 6, 11], None)],
     "layout"),
    ("duplicate-shifted-and-plain", [("adv-src", [0, 1, 2, 3], [0, 1, 2, 3]), ("adv-src", [7, 6, 5, 3], None)],
     "layout"),
    ("position-at-bound", [("adv-src", [0, 1, 2, 3], [0, 1, 2, NP])], "layout"),
    ("position-minus-1", [("adv-src", [0, 1, 2, 3], [0, 1, 2, -1])], "layout"),
    ("position-int64-max", [("adv-src", [0, 1, 2, 3], [I64_MAX, 1, 2, 3])], "layout"),
    ("position-int64-min", [("adv-src", [0, 1, 2, 3], [0, 1, 2, I64_MIN])], "layout"),
    ("position-of-skipped-token", [("adv-src", [0, 1, 2, -1], [0, 1, 2, NP])], "layout"),
    ("positions-bad-in-second-item",
     [("adv-src", [0, 1, 2, 3], [0, 1, 2, 3]), ("adv-src", [4, 5, 6, 7], [0, 1, 2, -5])], "layout"),
    ("fewer-slots-than-tokens", [("adv-src", [0, 1, 2], None)], "layout"),
    ("more-slots-than-tokens", [("adv-src", [0, 1, 2, 3, 4], None)], "layout"),
    ("fewer-positions-than-slots", [("adv-src", [0, 1, 2, 3], [0, 1, 2])], "layout"),
    ("more-positions-than-slots", [("adv-src", [0, 1, 2, 3], [0, 1, 2, 3, 4])], "layout"),
    ("no-slots-at-all", [("adv-src", [], None)], "layout"),
    ("unknown-key", [("adv-src", [0, 1, 2, 3], None), ("no-such-key", [4, 5, 6, 7], None)], "not_found"),
    ("empty-key", [("", [0, 1, 2, 3], None)], "not_found"),
    ("longest-key", [("k" * restore_wire.MAX_KEY_BYTES, [0, 1, 2, 3], None)], "not_found"),
    ("nul-in-key", [("adv-src\0", [0, 1, 2, 3], None)], "not_found"),
    ("key-too-long", [("k" * (restore_wire.MAX_KEY_BYTES + 1), [0, 1, 2, 3], None)], "protocol"),
    ("key-not-utf8", [(b"adv-\xff\xfe", [0, 1, 2, 3], None)], "protocol"),
    ("key-lone-surrogate", [(b"adv-\xed\xa0\x80", [0, 1, 2, 3], None)], "protocol"),
    ("key-overlong-encoding", [(b"\xc0\xafadv", [0, 1, 2, 3], None)], "protocol"),
]


@pytest.mark.parametrize("items, code", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_binary_bad_values_are_typed_errors_and_write_nothing(world, items, code):
    w = world
    before = _bits(w.att_cache.tensor)
    with _connect(w) as s:
        for bits in (restore_wire.BIT_WAIT, 0):  # synchronous and not
            got, h = ask(s, _att(w, items, rid=77, bits=bits))
            assert got == code, h
            assert h["id"] == 77
        assert ask(s, _att(w, [("adv-src", [12, 13, 14, 15], None)], rid=78))[0] == "ok"  # the connection is usable
    ref = _reference(w, before, [("adv-src", [12, 13, 14, 15], None)])
    assert torch.equal(_bits(w.att_cache.tensor), _bits(ref))  # only the good request wrote, exactly
    _quiet(w)


def test_binary_exact_bounds_are_accepted(world):
    w = world
    items = [("adv-src", [28, -1, 30, NS - 1], [NP - 4, NP - 3, 0, NP - 1]), ("adv-src", [0, 1, -1, 3], None)]
    before = _bits(w.att_cache.tensor)
    with _connect(w) as s:
        got, reply = ask(s, _att(w, items, rid=5))
    assert got == "ok" and reply.request_id == 5 and reply.state == "drained"
    assert torch.equal(_bits(w.att_cache.tensor), _bits(_reference(w, before, items)))
    _quiet(w)


def test_binary_counts_disagreeing_with_lengths(world):
    w = world
    rng = random.Random(7)
    before = _bits(w.att_cache.tensor)
    good = [("adv-src", [0, 1, 2, 3], [4, 5, 6, 7])]
    cases = [
        ("n-larger", _att(w, good, n=2), "protocol"),
        ("n-zero", _att(w, good, n=0), "protocol"),
        ("n-max+1", _att(w, good, n=restore_wire.MAX_RESTORE_ITEMS + 1), "protocol"),
        ("n-2^32-1", _att(w, good, n=0xFFFFFFFF), "protocol"),
        ("keys-len-short", _att(w, good, keys_len=6), "protocol"),
        ("keys-len-huge", _att(w, good, keys_len=0xFFFFFFFF), "protocol"),
        ("extras-len-without-extras", _att(w, good, extras_len=8), "protocol"),
        ("slot-count-int32-max", _att(w, good, table=struct.pack("<3i", 7, 2 ** 31 - 1, 4)), "protocol"),
        ("position-count-int32-max", _att(w, good, table=struct.pack("<3i", 7, 4, 2 ** 31 - 1)), "protocol"),
        ("counts-sum-overflow", restore_frame(w.att.reg_id, w.att.secret_bytes,
                                              [("adv-src", [0], None), ("adv-src", [1], None)],
                                              table=struct.pack("<6i", 7, 2 ** 31 - 1, -1, 7, 2 ** 31 - 1, -1)),
         "protocol"),
        ("position-count-minus-2", _att(w, good, table=struct.pack("<3i", 7, 4, -2)), "protocol"),
        ("slot-count-negative", _att(w, good, table=struct.pack("<3i", 7, -4, 4)), "protocol"),
        ("key-length-negative", _att(w, good, table=struct.pack("<3i", -7, 4, 4)), "protocol"),
        ("body-ragged", _att(w, good, body=bytes(61)), "protocol"),
        ("kind-0", _att(w, good, kind=0), "protocol"),
        ("kind-ffff", _att(w, good, kind=0xFFFF), "protocol"),
        ("event-bit-without-event", _att(w, good, bits=restore_wire.BIT_WAIT | restore_wire.BIT_EVENT), "protocol"),
    ]
    for i in range(40):  # seeded: random items, then a body that is off by a random amount
        items = [("adv-src", list(range(rng.randint(0, 6))), rng.choice([None, [0] * rng.randint(0, 6)]))
                 for _ in range(rng.randint(1, 4))]
        right = 8 * sum(len(s) + (len(p) if p is not None else 0) for _, s, p in items)
        wrong = right + rng.choice([-16, -8, -3, 1, 8, 24])
        if wrong < 0:
            wrong = right + 8
        cases.append((f"random-{i}", _att(w, items, body=bytes(wrong)), "protocol"))
    with _connect(w) as s:
        for name, frame, code in cases:
            got, h = ask(s, frame)
            assert got == code, (name, h)
    assert torch.equal(_bits(w.att_cache.tensor), before)
    _quiet(w)


def test_binary_many_items(world):
    w = world
    m = restore_wire.MAX_RESTORE_ITEMS
    before = _bits(w.att_cache.tensor)
    with _connect(w) as s:
        # the most items a request may have (one-byte keys: the most fit in one header): parsed, then
        # refused by the first item's key (a key of the service's store has 64 characters)
        got, h = ask(s, _att(w, [("a", [], None)] * m))
        assert got == "not_found" and "'a'" in h["error"]["message"]
        got, _ = ask(s, _att(w, [("", [], None)] * (m + 1)))
        assert got == "protocol"
        # every item valid on its own, together far beyond the registration's slots
        many = [("adv-src", [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], None) for i in range(1000)]
        assert ask(s, _att(w, many))[0] == "layout"
        # a header over the limit loses the frame: an error, then the connection is closed
        got, h = ask(s, _att(w, [("abcd", [], None)] * m))
        assert got == "protocol" and "header length" in h["error"]["message"]
        assert answer(s)[0] == "closed"
    assert torch.equal(_bits(w.att_cache.tensor), before)
    _quiet(w)


def test_binary_flag_combinations(world):
    w = world
    items = [("adv-src", [16, 17, 18, 19], [9, 8, 7, 6])]
    rng = random.Random(11)
    with _connect(w) as s:
        for bits in range(16):
            event = bytes(rng.getrandbits(8) for _ in range(64)) if bits & restore_wire.BIT_EVENT else b""
            for timeout in ([0.0, 2.5, protocol.MAX_TIMEOUT_S] if bits & restore_wire.BIT_TIMEOUT else [0.0]):
                got, reply = ask(s, _att(w, items, rid=100 + bits, bits=bits, timeout=timeout, event=event))
                assert got == "ok", (bits, timeout, reply)
                assert reply.request_id == 100 + bits
                assert reply.state == ("drained" if bits & restore_wire.BIT_WAIT else "pending")
                if bits & restore_wire.BIT_TIMINGS:
                    assert {"received", "parsed", "validated", "completed", "reply_sent"} <= set(reply.timings)
                else:
                    assert reply.timings is None
                w.own.drain(w.att)
        for bit in range(4, 16):  # every unknown bit alone and with the known ones
            for base in (0, 15):
                got, h = ask(s, _att(w, items, bits=base | (1 << bit), timeout=1.0, event=bytes(64)))
                assert got == "protocol" and "unknown bits" in h["error"]["message"], h
        timed = restore_wire.BIT_WAIT | restore_wire.BIT_TIMEOUT
        for timeout in (math.nan, -math.nan, math.inf, -math.inf, -1.0, -5e-324,
                        protocol.MAX_TIMEOUT_S * (1 + 1e-15), 1e300):
            got, h = ask(s, _att(w, items, bits=timed, timeout=timeout))
            assert got == "protocol" and "timeout" in h["error"]["message"], (timeout, h)
        for timeout in (1.0, math.nan, 5e-324):  # a timeout without its bit
            got, h = ask(s, _att(w, items, bits=restore_wire.BIT_WAIT, timeout=timeout))
            assert got == "protocol", (timeout, h)
    _quiet(w)


def test_binary_credentials(world):
    w = world
    item = [("adv-src", [0, 1, 2, 3], None)]
    before = _bits(w.att_cache.tensor)
    with _connect(w) as s:
        cases = [
            (w.victim.reg_id, w.att.secret_bytes),  # another registration's id with my secret
            (w.victim.reg_id, bytes(32)),
            (w.victim.reg_id, w.victim.secret_bytes[:31] + bytes([w.victim.secret_bytes[31] ^ 1])),
            (w.att.reg_id, w.victim.secret_bytes),  # my id with the other registration's secret
            (w.att.reg_id, bytes(32)),
            (w.att.reg_id, w.att.secret_bytes[:16]),  # short: zero-padded to 32 bytes by the layout
            (0, w.att.secret_bytes),
            (1 << 62, w.att.secret_bytes),
            (I64_MAX, w.att.secret_bytes),
        ]
        for rid, (reg_id, secret) in enumerate(cases, 1):
            got, h = ask(s, restore_frame(reg_id, secret, item, rid=rid))
            assert got == "ownership" and h["id"] == rid, (reg_id, h)
        for rid, reg_id in ((50, -1), (51, I64_MIN)):
            got, h = ask(s, restore_frame(reg_id, w.att.secret_bytes, item, rid=rid))
            assert got == "protocol" and h["id"] == rid
        got, h = ask(s, restore_frame(w.att.reg_id, w.att.secret_bytes, item, rid=-3))
        assert got == "protocol" and h["id"] is None  # a negative request id is not echoed
        # a header cut inside the secret
        short = _att(w, item)[protocol.PREFIX.size:protocol.PREFIX.size + 40]
        frame = protocol.PREFIX.pack(protocol.MAGIC, protocol.VERSION, protocol.FLAG_BINARY, len(short), 0) + short
        assert ask(s, frame)[0] == "protocol"
        # the victim's registration through a JSON request with the attacker's secret
        for op in ("attach", "acquire", "drain", "cancel", "close"):
            protocol.send_message(s, {"op": op, "id": 9, "reg": w.victim.reg_id, "secret": w.att.secret,
                                      "blocks": [0], "op_id": 1})
            h = protocol.read_message(s).header
            assert h["ok"] is False and h["error"]["code"] == "ownership", (op, h)
    assert torch.equal(_bits(w.att_cache.tensor), before)
    _quiet(w)


EXTRAS = [
    (b'{"model_fingerprint":[]}', "protocol"),  # (the registration's fingerprint is used since version 4)
    (b'{"model_fingerprint":"m"}', "protocol"),
    (b'{"model_fingerprint":1}', "protocol"),
    (b'{"model_fingerprint":true}', "protocol"),
    (b'{"model_fingerprint":1.5}', "protocol"),
    (b'{"model_fingerprint":{}}', "protocol"),
    (b'{"inject":[1]}', "protocol"),
    (b'{"inject":"spin"}', "protocol"),
    (b'{"inject":{"bogus":1}}', "protocol"),
    (b'{"inject":{"spin_cycles":1,"rm -rf":1}}', "protocol"),
    (b'{"timings":true}', "protocol"),
    (b'{"secret":"00"}', "protocol"),
    (b'[]', "protocol"),
    (b'null', "protocol"),
    (b'"x"', "protocol"),
    (b'{"inject":', "protocol"),
    (b'\xff\xfe{}', "protocol"),
    (b'{"inject":null}', "ok"),
    (b'{"inject":{}}', "ok"),
]


def test_binary_untrusted_extras(world):
    w = world
    items = [("adv-src", [20, 21, 22, 23], None)]
    before = _bits(w.att_cache.tensor)
    with _connect(w) as s:
        for extras, code in EXTRAS:
            got, h = ask(s, _att(w, items, extras=extras))
            assert got == code, (extras, h)
    assert torch.equal(_bits(w.att_cache.tensor), _bits(_reference(w, before, items)))
    _quiet(w)


def test_fault_injection_refused_when_disabled():
    """A service that does not allow fault injection refuses ``inject`` before anything is held."""
    layout = small_layout()
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), receive_spin_s=0.0)
        with CacheService(cfg) as svc, CacheClient(svc.socket_path, timeout=30) as c, \
                SharedCache(layout, fill=POISON) as cache:
            key = put_original(c, torch.ones(2, 2, T, 2, 8, dtype=torch.bfloat16))
            reg = c.register(cache, layout, model_fingerprint=FP)
            untouched = _bits(cache.tensor)
            for inject in ({"refuse_waits": 3}, {"fail_after_submit": True}, {"spin_cycles": 10},
                           {"refuse_waits": "x"}):
                with pytest.raises(KmeshError, match="fault injection is disabled"):
                    c.restore(reg, [(key, [0, 1, 2, 3])], inject=inject)
            assert torch.equal(_bits(cache.tensor), untouched)
            r = registration_of(c.status(), reg.reg_id)
            assert r["held_blocks"] == [] and r["pending_ops"] == []
            assert c.status()["counters"]["internal_errors"] == 0
            assert c.close_registration(reg) is True


def test_binary_seeded_mutations(world):
    """Random byte changes in the header and body of a valid request: each is answered (a typed
    error, or a success when the change kept it valid); nothing reaches the victim."""
    w = world
    rng = random.Random(4242)
    base = _att(w, [("adv-src", [12, 13, 14, 15], [40, 41, 42, 43])], rid=3)
    outcomes: dict[str, int] = {}
    s = _connect(w)
    try:
        for _ in range(400):
            frame = bytearray(base)
            for _ in range(rng.randint(1, 3)):
                frame[rng.randrange(protocol.PREFIX.size, len(frame))] = rng.getrandbits(8)
            got, _ = ask(s, bytes(frame))
            outcomes[got] = outcomes.get(got, 0) + 1
            if got == "closed":  # not expected (the prefix is intact), but recover to keep fuzzing
                s.close()
                s = _connect(w)
            elif got == "ok":
                w.own.drain(w.att)
    finally:
        s.close()
    assert outcomes.get("closed", 0) == 0, outcomes
    assert set(outcomes) <= BINARY_ERROR_CODES | {"ok"}, outcomes
    assert outcomes.get("protocol", 0) > 100 and outcomes.get("ownership", 0) > 0, outcomes
    w.own.drain(w.att)
    _quiet(w)


# ---------------------------------------------------------------------------------- JSON requests
BAD = [True, 1.5, "s", [], {}, [1], {"a": 1}, 1e308]
BAD_INT = [-1, 0, 2 ** 63, 10 ** 30, -(10 ** 30)]


def _json_cases(w, spare: SharedCache):
    """``(op, base request, field, invalid values)``: every value must be refused."""
    auth = {"reg": w.att.reg_id, "secret": w.att.secret}
    tensors, body = protocol.pack_tensors({"kv": w.kv, "positions": w.pos, "token_ids": w.pos + 7})
    save_t, save_body = protocol.pack_int64({"slots": np.array([8, 9, 10, 11]), "positions": np.arange(4),
                                             "token_ids": np.arange(4)})
    mem = spare.handle.to_dict()
    lay = w.layout.to_dict()
    missing = object()
    fp = FP.to_dict()
    fp_variants = BAD + [missing, None, {**fp, "num_layers": 0}, {**fp, "dtype": "int8"}, {"architecture": "x"},
                         {**fp, "num_layers": 3}]
    mem_fields = {
        "kind": ["cumem", 5, None, "SHM"],
        "handle": [5, "zz", "", None, b"../etc/passwd".hex(), b"/".hex(), b"psm_does_not_exist".hex(), "61" * 251],
        "offset": [-1, 1.5, True, "0", 1 << 50, 8],
        "nbytes": [0, -1, 1 << 50, True, mem["nbytes"] - 2, mem["nbytes"] + 2],
        "device": [0, 1, True, "cpu", None],
    }
    mem_variants = [{**mem, k: v} for k, vs in mem_fields.items() for v in vs]
    kinds = [
        ("register", {"memory": mem, "layout": lay, "rope": w.rope.to_dict(), "instance": 1, "model_fingerprint": fp},
         b"", {
            "model_fingerprint": fp_variants,
            "memory": BAD + [missing, None] + mem_variants,
            "layout": BAD + [missing, None, {}, {**lay, "dtype": 5}, {**lay, "dtype": "Tensor"},
                             {**lay, "physical_shape": [1]}, {**lay, "dtype": "float32"}],
            "rope": [True, 1.5, "s", [], [1], 1e308, {}, {"a": 1}, {**w.rope.to_dict(), "head_size": 4},
                     {**w.rope.to_dict(), "dtype": "int8"}],
            "instance": [True, 1.5, "s", [], {}, [1], {"a": 1}, 1e308],
        }),
        ("attach", dict(auth), b"", {"reg": BAD + BAD_INT + [missing, None], "secret": BAD + [missing, None, "00" * 32,
                                                                                        "0" * 63, w.victim.secret]}),
        ("put", {"tensors": tensors, "model_fingerprint": fp}, body, {
            "model_fingerprint": fp_variants + [{**fp, "architecture": 5}],
            "tensors": BAD + [missing, None, {"positions": tensors["positions"]},
                              {"kv": tensors["kv"], "positions": tensors["positions"]},
                              {**tensors, "kv": {**tensors["kv"], "dtype": "complex64"}},
                              {**tensors, "kv": {**tensors["kv"], "shape": [2, 2, T, 2, 9]}},
                              {**tensors, "kv": {**tensors["kv"], "offset": -1}},
                              {**tensors, "kv": {**tensors["kv"], "offset": 1 << 62}},
                              {**tensors, "kv": {**tensors["kv"], "nbytes": 1 << 62}},
                              {**tensors, "kv": {**tensors["kv"], "shape": [1 << 39] * 8}},
                              {**tensors, "kv": {**tensors["kv"], "shape": [2, 2, T, 2, 8, 1, 1, 1, 1]}},
                              {**tensors, "positions": {**tensors["positions"], "dtype": "int32"}},
                              {**tensors, "token_ids": tensors["positions"] | {"shape": [T + 1]}}]}),
        ("get", {"key": w.key, "model_fingerprint": fp}, b"", {
            "key": [True, 1.5, [], {}, 5, missing, None, "absent", "0" * 64],
            "model_fingerprint": fp_variants + [{**fp, "architecture": "LlamaForCausalLM"}]}),
        ("evict", {"key": "adv-never-stored"}, b"", {"key": [True, 1.5, [], {}, 5, missing, None]}),
        ("save", {**auth, "tensors": save_t}, save_body, {
            "reg": BAD + BAD_INT + [missing], "secret": BAD + [missing, "00" * 32],
            "tensors": BAD + [missing, None, {"slots": save_t["slots"]},
                              {"slots": save_t["slots"], "positions": save_t["positions"]},
                              {**save_t, "slots": {**save_t["slots"], "dtype": "float32"}},
                              {**save_t, "positions": {**save_t["positions"], "shape": [3], "nbytes": 24}}],
            "inject": [True, 1.5, "s", [], [1], 5, {"bogus": 1}]}),
        ("cancel", {**auth, "op_id": 1}, b"", {"reg": BAD + BAD_INT + [missing], "secret": BAD + [missing],
                                               "op_id": BAD + BAD_INT + [missing, None]}),
        ("drain", {**auth, "ops": []}, b"", {"reg": BAD + BAD_INT + [missing], "secret": BAD + [missing],
                                             "ops": [True, 1.5, "s", {}, [1.5], ["1"], [True], [None], [10 ** 30],
                                                     [-1], [0], {"a": 1}],
                                             "timeout": [True, "s", [], {}, [1]]}),
        ("acquire", {**auth, "blocks": [0]}, b"", {
            "reg": BAD + BAD_INT + [missing], "secret": BAD + [missing],
            "blocks": [True, 1.5, "s", {}, {"a": 1}, 1e308, 5, [8], [-1], [2 ** 63], [10 ** 30], [True], ["0"], [0.0],
                       [0, 8], [None], missing, None],
            "timeout": [True, "s", [], {}, [1]]}),
        ("close", dict(auth), b"", {"reg": BAD + BAD_INT + [missing], "secret": BAD + [missing, "00" * 32]}),
    ]
    for op, base, body_, fields in kinds:
        for name, values in fields.items():
            for v in values:
                h = {"op": op, "id": 1, **base}
                if v is missing:
                    h.pop(name, None)
                else:
                    h[name] = v
                yield op, name, v, h, body_


def test_json_wrong_fields_are_refused_without_effect(world):
    w = world
    with SharedCache(w.layout, fill=0) as spare:
        st0 = w.own.status()
        regs0 = {r["reg"] for r in st0["registrations"]}
        att0, vic0 = _bits(w.att_cache.tensor), _bits(w.victim_cache.tensor)
        n = 0
        with _connect(w) as s:
            for op, name, v, h, body in _json_cases(w, spare):
                protocol.send_message(s, h, body)
                r = protocol.read_message(s).header
                assert r["ok"] is False, (op, name, v, r)
                assert r["error"]["code"] in BINARY_ERROR_CODES, (op, name, v, r)
                assert r["id"] == 1
                n += 1
            # extra fields are ignored; a non-int id is answered with id null; unknown ops are refused
            protocol.send_message(s, {"op": "status", "id": 2, "zzz": [1, {"a": None}], "reg": "x"})
            assert protocol.read_message(s).header["ok"] is True
            for rid in ("7", 1.5, None, [1], True):
                protocol.send_message(s, {"op": "nope", "id": rid})
                r = protocol.read_message(s).header
                assert r["ok"] is False and r["error"]["code"] == "protocol" and r["id"] is None
            for op in (5, None, [], {}, "STATUS", "status ", "", "__init__", "op_status", "_authorize"):
                protocol.send_message(s, {"op": op, "id": 3})
                r = protocol.read_message(s).header
                assert r["ok"] is False and r["error"]["code"] == "protocol", (op, r)
        assert n > 250
        st = w.own.status()
        assert {r["reg"] for r in st["registrations"]} == regs0  # no registration was created or lost
        assert st["pending_ops"] == [] and st["held_sources"] == {}
        # nothing was published: no put or save of them wrote a segment
        assert st["originals"]["host_keys"] == st0["originals"]["host_keys"]
        assert sorted(_store_keys(w)) == sorted(_store_keys(w, st0))
        assert torch.equal(_bits(w.att_cache.tensor), att0) and torch.equal(_bits(w.victim_cache.tensor), vic0)
    _quiet(w)


def test_json_lifecycle_misuse(world):
    w = world
    c = w.own
    with SharedCache(w.layout, fill=POISON) as cache:
        other = c.register(cache, w.layout, model_fingerprint=FP)  # a second registration of the same client
        op = c.restore(other, [(w.key, [0, 1, 2, 3])], wait=False)
        # op ids of another registration, unknown ops
        for call in (lambda: c.cancel(w.att, op), lambda: c.drain(w.att, [op]), lambda: c.cancel(w.att, 10 ** 9),
                     lambda: c.drain(w.att, [0]), lambda: c.cancel(other, op + 10 ** 6)):
            with pytest.raises(OwnershipError, match="not pending"):
                call()
        assert registration_of(c.status(), other.reg_id)["pending_ops"] == [op]  # untouched by those
        # blocks out of range
        for blocks in ([8], [-1], [0, 8], [2 ** 63 - 1]):
            with pytest.raises(KmeshError, match="outside"):
                c.acquire(other, blocks)
        assert c.acquire(other, [0, 7, 7]) == [op]
        # cancel keeps holds until drained; then the op is gone
        op2 = c.restore(other, [(w.key, [4, 5, 6, 7])], wait=False, inject={"refuse_waits": 1})
        assert c.cancel(other, op2)["outcome"] == "cancelled"
        assert registration_of(c.status(), other.reg_id)["held_blocks"] == [1]
        with pytest.raises(KmeshError, match="refused"):
            c.drain(other, [op2])
        assert registration_of(c.status(), other.reg_id)["held_blocks"] == [1]
        assert c.drain(other, [op2]) == [op2]
        with pytest.raises(OwnershipError, match="not pending"):
            c.cancel(other, op2)
        # close, then every use of the registration is refused; a second close too
        assert c.close_registration(other) is True
        with pytest.raises(OwnershipError, match="closed"):
            c.close_registration(other)
        written = _bits(cache.tensor)
        uses = [lambda: c.restore(other, [(w.key, [8, 9, 10, 11])]), lambda: c.acquire(other, [0]),
                lambda: c.drain(other), lambda: c.cancel(other, op), lambda: c.attach(other),
                lambda: c.save(other, [0, 1], [0, 1], [0, 1])]
        for use in uses:
            with pytest.raises(OwnershipError, match="closed"):
                use()
        with _connect(w) as s:  # the binary path too
            got, h = ask(s, restore_frame(other.reg_id, other.secret_bytes, [("adv-src", [8, 9, 10, 11], None)]))
            assert got == "ownership" and "closed" in h["error"]["message"]
        assert torch.equal(_bits(cache.tensor), written)  # nothing written after the close
        # a replacement registration of the same memory never answers to the old credentials
        again = c.register(cache, w.layout, model_fingerprint=FP)
        assert again.reg_id != other.reg_id and again.secret != other.secret
        mixed = [Registration(again.reg_id, again.generation, other.secret, w.layout, again.handle, cache.tensor),
                 Registration(other.reg_id, other.generation, again.secret, w.layout, again.handle, cache.tensor)]
        for reg in mixed:
            with pytest.raises(OwnershipError, match="wrong secret|closed"):
                c.restore(reg, [(w.key, [8, 9, 10, 11])])
        assert torch.equal(_bits(cache.tensor), written)
        assert c.close_registration(again) is True
    _quiet(w)


# ---------------------------------------------------------------------------------- concurrency
def test_restore_racing_close_on_the_same_registration(world):
    """Two connections of one client: one restores in a loop (synchronous and not), the other closes
    the registration at a seeded random moment. Every refusal is typed; once the close reports the
    memory released nothing is written any more, and nothing is left held."""
    w = world
    rng = random.Random(99)
    for round_ in range(6):
        with SharedCache(w.layout, fill=POISON) as cache, CacheClient(w.path, timeout=30) as closer, \
                CacheClient(w.path, timeout=30) as worker:
            reg = closer.register(cache, w.layout, model_fingerprint=FP, rope=w.rope)
            errors: list = []
            done = threading.Event()
            successes = [0]

            def loop():
                i = 0
                while not done.is_set() and i < 2000:
                    b = i % 8
                    one = item(w.key, [4 * b, 4 * b + 1, 4 * b + 2, 4 * b + 3], [1, 2, 3, 4])
                    try:
                        worker.restore(reg, [one], wait=bool(i % 2))
                        successes[0] += 1
                        if i % 2 == 0:
                            worker.drain(reg)
                    except OwnershipError as exc:
                        errors.append(str(exc))
                        if "closing" in str(exc) or "closed" in str(exc):
                            break
                    except KmeshError as exc:  # anything else is a finding
                        errors.append(f"UNEXPECTED {type(exc).__name__}: {exc}")
                        break
                    i += 1

            t = threading.Thread(target=loop)
            t.start()
            time.sleep(rng.uniform(0.0, 0.03))
            freed = closer.close_registration(reg, timeout=60)
            snap = _bits(cache.tensor)
            done.set()
            t.join(30)
            assert not t.is_alive()
            assert freed is True, round_
            assert not [e for e in errors if e.startswith("UNEXPECTED")], errors
            assert all(("closing" in e or "closed" in e or "held by operation" in e) for e in errors), errors
            assert torch.equal(_bits(cache.tensor), snap), "written after the close released the memory"
            assert registration_of(closer.status(), reg.reg_id) is None
    st = w.own.status()
    assert st["pending_ops"] == [] and st["held_sources"] == {}
    _quiet(w)


def test_concurrent_overlapping_restores(world):
    """Several connections restore into overlapping blocks of one registration at once: each
    request is applied whole or refused as held; the result is exactly one restore's bytes."""
    w = world
    items = [item(w.key, [8, 9, 10, 11], [7, 8, 9, 10])]
    before = _bits(w.att_cache.tensor)
    ref = _reference(w, before, [("adv-src", [8, 9, 10, 11], [7, 8, 9, 10])])
    outcomes: list = []

    def run(seed):
        r = random.Random(seed)
        with CacheClient(w.path, timeout=30) as c:
            for _ in range(25):
                try:
                    c.restore(w.att, items, wait=True)
                    outcomes.append("ok")
                except OwnershipError as exc:
                    assert "held by operation" in str(exc)
                    outcomes.append("held")
                except Exception as exc:  # pragma: no cover - reported by the assertion below
                    outcomes.append(f"{type(exc).__name__}: {exc}")
                time.sleep(r.uniform(0, 0.002))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 100 and set(outcomes) <= {"ok", "held"}, set(outcomes)
    assert outcomes.count("ok") > 0
    assert torch.equal(_bits(w.att_cache.tensor), _bits(ref))
    _quiet(w)


CHILD = r"""
import json, os, sys, time
import numpy as np, torch
from kmesh_host.service import CacheClient, SharedCache, protocol, restore_wire
from tests.kmesh_host.service.helpers import fingerprint, put_original, small_layout
layout = small_layout()
cache = SharedCache(layout, fill=0)
c = CacheClient(sys.argv[1], timeout=30)
key = put_original(c, torch.ones(2, 2, 4, 2, 8, dtype=torch.bfloat16), token_ids=torch.arange(4) + os.getpid())
reg = c.register(cache, layout, model_fingerprint=fingerprint())
items = restore_wire.restore_items([key], [4], [None])
parts = restore_wire.restore_frame(items, 99, reg.reg_id, reg.secret_bytes, [np.arange(4, 8, dtype=np.int64)],
                                   wait=False, inject={"refuse_waits": int(sys.argv[2])})
protocol.send_parts(c._sock, parts)  # the reply is never read
print(json.dumps({"reg": reg.reg_id, "secret": reg.secret, "shm": cache.handle.handle.decode(), "key": key}),
      flush=True)
time.sleep(600)
"""


def test_client_sigkilled_after_a_restore_it_never_waited_for(world):
    """The dead client's registration is orphaned, stays held while the reaper's waits are refused,
    and is reaped only after a wait succeeded; meanwhile other clients are served."""
    w = world
    refusals = 150  # the reaper's waits refused for ~3 s (reap_interval_s=0.02): the checks below run meanwhile
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, w.path, str(refusals)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=os.getcwd())
    info = None
    try:
        line = b""
        while not line.startswith(b"{"):  # libraries may print warnings first
            line = proc.stdout.readline()
            assert line, "the child died before it sent its restore"
        info = json.loads(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        st = wait_for(lambda: (lambda s: s if (registration_of(s, info["reg"]) or {}).get("state") == "orphaned"
                               else None)(w.own.status()), timeout=30)
        dead = registration_of(st, info["reg"])
        assert dead["held_blocks"] == [1] and len(dead["pending_ops"]) == 1, dead  # slots 4..7
        with pytest.raises(OwnershipError, match="held by a pending operation"):
            w.own.evict(info["key"])
        # others keep working while the orphan waits
        with CacheClient(w.path, timeout=30) as other:
            other.restore(w.wit, [w.wit_item])
        op = wait_for(lambda: [o for o in w.own.status()["pending_ops"] if o["reg"] == info["reg"]
                               and o["wait_failures"] > 0], timeout=30)[0]
        assert op["state"] == "pending"
        wait_for(lambda: registration_of(w.own.status(), info["reg"]) is None, timeout=30)
        stale = Registration(info["reg"], info["reg"], info["secret"], w.layout, w.att.handle, w.att_cache.tensor)
        with pytest.raises(OwnershipError, match="reaped"):
            w.own.restore(stale, [(w.key, [0, 1, 2, 3])])
        assert w.own.evict(info["key"]) is True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if info is not None:
            try:
                os.unlink(os.path.join("/dev/shm", info["shm"].lstrip("/")))
            except FileNotFoundError:
                pass
    _quiet(w)


def _connections(w) -> int:
    """Connections the service holds, besides the one asking."""
    with CacheClient(w.path, timeout=30) as c:
        return c.status()["connections"] - 1


def test_connections_abandoned_mid_frame(world):
    """Connections that stop in the middle of a frame (closed, or left stalled) are ended by the
    service (end of stream, or the frame timeout); a half-sent restore writes nothing; beyond
    max_connections a typed refusal; afterwards everything is back to its baseline."""
    w = world
    rng = random.Random(31337)
    baseline = _connections(w)
    before = _bits(w.att_cache.tensor)
    restore = _att(w, [("adv-src", [24, 25, 26, 27], [1, 2, 3, 4])])
    status = protocol.encode({"op": "status", "id": 1})
    big = protocol.PREFIX.pack(protocol.MAGIC, protocol.VERSION, 0, 2, MAX_BODY) + b"{}" + bytes(1000)
    frames = [restore, status, big]
    # closed mid-frame: end of stream in the prefix, the header or the body
    for i in range(60):
        f = frames[i % 3]
        cut = rng.randrange(1, len(f))
        with _connect(w) as s:
            s.sendall(f[:cut])
    # left stalled mid-frame, more than the service takes: the last ones are refused, typed
    stalled = []
    refused = 0
    for i in range(MAX_CONNECTIONS + 4):
        s = _connect(w)
        f = frames[i % 3]
        s.sendall(f[:rng.randrange(1, len(f))])
        stalled.append(s)
    for s in stalled:
        got, h = answer(s)  # refused: a typed error then end of stream; stalled: ended by the frame timeout
        if got != "closed":
            assert got == "service" and "too many connections" in h["error"]["message"], h
            refused += 1
            assert answer(s)[0] == "closed"
        s.close()
    assert refused >= 4
    assert torch.equal(_bits(w.att_cache.tensor), before)  # no half-sent restore was applied
    wait_for(lambda: _connections(w) <= baseline, timeout=30)  # (the baseline may count a closing one)
    st = w.own.status()
    assert st["pending_ops"] == [] and st["held_sources"] == {}
    _quiet(w)
