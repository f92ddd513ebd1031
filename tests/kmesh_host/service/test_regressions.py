"""Regressions of the cache service found by an adversarial audit (each failed before its fix):
unparsable JSON dropping the connection, an error reply too large to send, save and close
checking fields after acting, malformed fault-injection values leaving an operation stuck, bad
input reported as internal errors, one shared-memory allocation registered twice under two
spellings of its name, a frame's body allocated before it arrives, a failed publish failing close.
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np
import pytest
import torch

from kmesh_gpu.errors import KmeshError, OwnershipError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache, protocol, restore_wire
from kmesh_host.service.memory import MemoryHandle
from kmesh_host import SegmentStore
from tests.kmesh_host.service.helpers import (fingerprint, put_original, registration_of, small_layout, small_rope,
                                              socket_dir, wait_for)

T = 4
FP = fingerprint()


@pytest.fixture(scope="module")
def service():
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            reap_interval_s=0.02, frame_timeout_s=1.0, receive_spin_s=0.0, shutdown_drain_s=2.0)
        with CacheService(cfg) as svc:
            yield svc


@pytest.fixture
def env(service):
    layout = small_layout()
    with CacheClient(service.socket_path, timeout=30) as c, SharedCache(layout, fill=0) as cache:
        key = put_original(c, torch.randn(2, 2, T, 2, 8).to(torch.bfloat16))
        reg = c.register(cache, layout, model_fingerprint=FP, rope=small_rope())
        yield c, cache, reg, key, layout
        try:
            c.close_registration(reg, timeout=60)
        except KmeshError:
            pass


def _raw(service) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(service.socket_path)
    s.settimeout(10)
    return s


def _json_frame(raw_header: bytes, body: bytes = b"") -> bytes:
    return protocol.PREFIX.pack(protocol.MAGIC, protocol.VERSION, 0, len(raw_header), len(body)) + raw_header + body


def _reply(s: socket.socket):
    """The JSON reply, or ``None`` when the service closed the connection without one."""
    try:
        return protocol.read_message(s).header
    except (protocol.ConnectionClosed, OSError):
        return None


def _send(s, data: bytes) -> None:
    try:
        s.sendall(data)
    except OSError:
        pass


def _internal_errors(service) -> int:
    with CacheClient(service.socket_path, timeout=30) as c:
        return c.status()["counters"]["internal_errors"]


@pytest.mark.parametrize("raw", [
    b'{"op":"status","id":1,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError in json.loads
    b'{"op":"status","id":1,"x":' + b"1" * 5000 + b"}",  # ValueError: int over sys.get_int_max_str_digits()
], ids=["deep-nesting", "int-5000-digits"])
def test_unparsable_json_header_gets_a_typed_error_and_keeps_the_connection(service, raw):
    """A well-delimited frame whose header does not parse is answered with an error and the
    connection stays usable (protocol.py). Before its fix the connection thread died
    with an uncaught exception (decode_header caught only JSONDecodeError/UnicodeDecodeError): no
    reply, the connection closed, the peer's registrations attached to it orphaned."""
    with _raw(service) as s:
        _send(s, _json_frame(raw))
        first = _reply(s)
        assert first is not None and first["ok"] is False and first["error"]["code"] == "protocol", first
        _send(s, protocol.encode({"op": "status", "id": 2}))
        assert (_reply(s) or {}).get("ok") is True


@pytest.mark.parametrize("extras", [
    b'{"inject":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model_fingerprint":{"x":' + b"1" * 5000 + b"}}",
], ids=["deep-nesting", "int-5000-digits"])
def test_binary_restore_extras_that_do_not_parse_get_a_typed_error(service, env, extras):
    """Same in the binary restore's extras (decode_restore -> decode_header): the exception escaped
    _serve_binary (which catches ProtocolError only) and ended the connection thread."""
    c, cache, reg, key, layout = env
    items = restore_wire.restore_items([key], [T], [None])
    head = restore_wire.RESTORE_REQUEST.pack(restore_wire.KIND_RESTORE, restore_wire.BIT_WAIT, 1, 5, reg.reg_id,
                                         reg.secret_bytes, 0.0, items.keys_len, len(extras))
    header = head + items.raw + extras
    header += bytes(-len(header) % 8)
    body = np.arange(T, dtype="<i8").tobytes()
    frame = protocol.PREFIX.pack(protocol.MAGIC, protocol.VERSION, protocol.FLAG_BINARY, len(header), len(body))
    with _raw(service) as s:
        _send(s, frame + header + body)
        first = _reply(s)
        assert first is not None and first["error"]["code"] == "protocol" and first["id"] == 5, first


@pytest.mark.parametrize("request_", [
    {"op": "\u00e9" * 400_000, "id": 1},  # 'op: unknown operation ...' repeats it, JSON-escaped (x3)
    {"op": "get", "id": 1, "key": "\u00e9" * 400_000, "model_fingerprint": FP.to_dict()},  # "segment '...': not a key"
    {"op": [0] * 400_000, "id": 1},  # repr of a list is longer than its JSON
], ids=["op", "get-key", "op-list"])
def test_error_reply_to_a_large_request_is_sent(service, request_):
    """Bad input must get a typed error reply. Before its fix the message quoted the whole input,
    the reply header exceeded MAX_HEADER_BYTES and the service closed the connection without a reply."""
    raw = json.dumps(request_, ensure_ascii=False, separators=(",", ":")).encode()
    assert len(raw) <= protocol.MAX_HEADER_BYTES  # a valid frame
    with _raw(service) as s:
        _send(s, _json_frame(raw))
        first = _reply(s)
        assert first is not None and first["ok"] is False and first["id"] == 1, first


@pytest.mark.parametrize("bad", [{"timeout": "soon"}, {"timeout": [1]}, {"inject": "x"}, {"wait_event": "zz"}],
                         ids=["timeout", "timeout-list", "inject", "wait-event"])
def test_save_with_a_wrong_typed_field_has_no_effect(env, bad):
    """A refused request must have no effect. Before its fix op_save read 'wait' and 'timeout' only
    after _submit(): the copy was made, its blocks stayed held (the error carried no op id to
    drain), and after any drain the segment was published as an original."""
    c, cache, reg, key, layout = env
    tensors, body = protocol.pack_int64({"slots": np.array([8, 9, 10, 11]), "positions": np.arange(4),
                                         "token_ids": np.arange(4)})
    store = SegmentStore(c.status()["originals"]["store_root"])
    published = store.keys()
    with pytest.raises(KmeshError) as info:
        c.call({"op": "save", "reg": reg.reg_id, "secret": reg.secret, "tensors": tensors, **bad}, body)
    assert info.value.__class__.__name__ == "ProtocolError"
    mine = registration_of(c.status(), reg.reg_id)
    held = (mine["held_blocks"], mine["pending_ops"])
    c.drain(reg)
    assert held == ([], []) and store.keys() == published, f"held={held}"


@pytest.mark.parametrize("timeout", ["later", [1], {"s": 1}, True])
def test_close_with_a_wrong_typed_timeout_is_refused_without_closing(env, timeout):
    """Before its fix op_close closed the registration first and parsed 'timeout' afterwards: the
    client got a ProtocolError, yet the registration was closed (and freed)."""
    c, cache, reg, key, layout = env
    with pytest.raises(KmeshError, match="timeout"):
        c.call({"op": "close", "reg": reg.reg_id, "secret": reg.secret, "timeout": timeout})
    state = registration_of(c.status(), reg.reg_id)
    assert state is not None and state["state"] == "open", state


@pytest.mark.parametrize("inject", [{"refuse_waits": "x"}, {"refuse_waits": [1]}, {"refuse_waits": {"n": 1}}],
                         ids=["str", "list", "dict"])
def test_malformed_inject_is_refused_before_anything_is_written(env, inject):
    """Fault-injection fields come from the client (allow_fault_injection=True). Before its fix
    their values were not checked; _submit() converted refuse_waits with int() after the copy and
    before Registry.submitted(): an internal error, the cache written, and the op 'submitting'
    forever (blocks never released, the registration never freed)."""
    c, cache, reg, key, layout = env
    before = cache.tensor.view(torch.uint8).clone()
    try:
        c.restore(reg, [(key, [0, 1, 2, 3])], inject=inject)
    except KmeshError:
        pass
    mine = registration_of(c.status(), reg.reg_id)
    ops = [o for o in c.status()["pending_ops"] if o["reg"] == reg.reg_id]
    assert torch.equal(cache.tensor.view(torch.uint8), before), "the cache was written by a refused request"
    assert mine["pending_ops"] == [] and not any(o["state"] == "submitting" for o in ops), ops
    assert c.close_registration(reg, timeout=60) is True


@pytest.mark.parametrize("request_", [
    lambda reg: {"op": "acquire", "reg": reg.reg_id, "secret": reg.secret, "blocks": [0], "timeout": 10 ** 400},
    lambda reg: {"op": "drain", "reg": reg.reg_id, "secret": reg.secret, "timeout": 10 ** 400},
    lambda reg: {"op": "register", "memory": {"kind": "shm", "handle": "00", "offset": 0, "nbytes": 1, "device": -1},
                 "layout": {**small_layout().to_dict(), "sizes": "abc"}, "model_fingerprint": FP.to_dict()},
    lambda reg: {"op": "register", "memory": {"kind": "shm", "handle": "00", "offset": 0, "nbytes": 1, "device": -1},
                 "layout": small_layout().to_dict(), "rope": {**small_rope().to_dict(), "head_size": "abc"},
                 "model_fingerprint": FP.to_dict()},
    lambda reg: {"op": "register", "memory": {"kind": "shm", "handle": "00", "offset": 0, "nbytes": 1, "device": -1},
                 "layout": small_layout().to_dict(), "model_fingerprint": {**FP.to_dict(), "num_layers": "abc"}},
], ids=["acquire-timeout-10^400", "drain-timeout-10^400", "layout-sizes-str", "rope-head-size-str",
        "fingerprint-layers-str"])
def test_out_of_range_values_are_client_errors_not_internal_errors(service, env, request_):
    """Bad input gets a protocol/layout error, not an internal one (code 'service', a traceback on the
    service's stderr). Before its fix JSON timeouts were only type-checked (an int beyond float
    range raised OverflowError; NaN/inf were accepted, which the binary path refuses), and
    KVLayout/RopeSpec.from_dict let ValueError through."""
    c, cache, reg, key, layout = env
    before = _internal_errors(service)
    with pytest.raises(KmeshError) as info:
        c.call(request_(reg))
    assert _internal_errors(service) == before and "internal error" not in str(info.value), str(info.value)


def test_one_allocation_cannot_be_registered_twice_by_aliasing_its_name(env):
    """Registry.register refuses the same live allocation twice. Before its fix that was keyed by the
    raw handle bytes, and _ShmMapping strips leading '/' from the name, so '/psm_x' (or '//psm_x')
    mapped the same segment under another key: two live registrations of one cache, each with its
    own block holders. Now keyed by the mapped file (device, inode), offset and size."""
    c, cache, reg, key, layout = env
    h = cache.handle
    for prefix in (b"/", b"//"):
        alias = MemoryHandle(h.kind, prefix + h.handle, h.offset, h.nbytes, h.device)
        with pytest.raises(OwnershipError, match="already registration"):
            reply = c.call({"op": "register", "memory": alias.to_dict(), "layout": layout.to_dict(),
                            "model_fingerprint": FP.to_dict()}).header
            c.call({"op": "close", "reg": reply["reg"], "secret": reply["secret"]})


def test_an_announced_body_is_not_allocated_before_it_arrives():
    """Before its fix read_frame allocated (and zeroed) header_len + body_len bytes as soon as the
    16-byte prefix arrived: a client sending only prefixes announcing max_body_bytes pinned that
    much service memory per connection (defaults: 256 MiB x 256 connections = 64 GiB)."""
    n_conn, max_body = 4, 64 << 20

    def rss_mib(pid):
        with open(f"/proc/{pid}/status") as f:
            return int([x for x in f if x.startswith("VmRSS")][0].split()[1]) // 1024

    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), max_body_bytes=max_body,
                            receive_spin_s=0.0)
        with CacheService(cfg) as svc:
            with CacheClient(svc.socket_path) as c:  # the start-up warm-up (Numba) has grown the RSS first
                wait_for(lambda: c.status()["warm"], timeout=120)
            base = rss_mib(svc.pid)
            socks = []
            try:
                for _ in range(n_conn):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(svc.socket_path)
                    s.sendall(protocol.PREFIX.pack(protocol.MAGIC, protocol.VERSION, 0, 2, max_body) + b"{}")
                    socks.append(s)
                time.sleep(1.0)
                grown = rss_mib(svc.pid) - base
            finally:
                for s in socks:
                    s.close()
            assert grown < 32, f"service RSS grew by {grown} MiB for {n_conn} x 18 bytes received"


def test_a_failed_publish_is_not_reported_as_a_failed_close():
    """A save drained by a close whose publication then fails (here: the store cannot be written)
    must not fail the close. Before its fix on_drained raised inside Registry._release, so
    close_registration raised although the registration was closed (freed later by the reaper)."""
    layout = small_layout()
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            reap_interval_s=0.05, receive_spin_s=0.0)
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c, SharedCache(layout, fill=0) as cache:
            reg = c.register(cache, layout, model_fingerprint=FP)
            root = c.status()["originals"]["store_root"]
            segments = os.path.join(root, "segments")
            os.makedirs(segments, exist_ok=True)
            os.rename(segments, segments + ".gone")
            with open(segments, "w") as f:  # the store's directory is a file now: every write fails
                f.write("not a directory")
            try:
                with pytest.raises(KmeshError) as info:  # its own wait refused: the close drains it
                    c.save(reg, [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], inject={"refuse_waits": 1})
                assert info.value.op_id is not None
                assert c.close_registration(reg, timeout=60) is True
            finally:
                os.unlink(segments)
                os.rename(segments + ".gone", segments)
