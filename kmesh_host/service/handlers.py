"""The service's JSON requests, one handler each: the fields of a request checked and the work handed
to the component that owns it (originals, registrations, operations, channels).

Each handler is ``handler(header, body, connection) -> (reply fields, reply body)`` and raises a
:class:`~kmesh_gpu.KmeshError` subclass for anything it refuses (answered as a typed error reply;
an error concerning a submitted operation carries its id in ``op_id``). A registration-bound request
is authorised first (peer pid and uid, per-registration secret); nothing is changed by a request
refused for a malformed field (every field is checked before anything acts on it).
"""

from __future__ import annotations

import os

from kmesh_gpu.errors import DrainError, LayoutError, OwnershipError, ProtocolError

from ..segment import ModelFingerprint
from . import protocol
from .channel import MAX_TOKENS, ROWS, jit
from .channel_service import Channels
from .operations import Operations, check_inject
from .originals import Originals
from .registrations import Registrations
from .registry import PeerIdentity, Registration, Registry
from .restore_wire import EVENT_HANDLE_BYTES, VERSION
from .sockets import FdStream


class Connection:
    """One client connection as the handlers see it: its id, socket (for descriptors that follow a
    frame) and the kernel's word on its peer."""

    __slots__ = ("conn_id", "sock", "peer")

    def __init__(self, conn_id: int, sock, peer: PeerIdentity):
        self.conn_id, self.sock, self.peer = conn_id, sock, peer


def _fingerprint(h: dict) -> ModelFingerprint:
    return ModelFingerprint.from_dict(protocol.field(h, "model_fingerprint", dict))


def _hex(h: dict, name: str, *, optional: bool = False) -> bytes | None:
    text = protocol.field(h, name, str, optional=optional)
    if not text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError as exc:
        raise ProtocolError(f"{name}: expected hex bytes") from exc


class Handlers:
    """The JSON handlers of one service (see the module docstring). ``status_of()``: the
    service-level part of a ``status`` reply (health, connections, warm-up, counters)."""

    def __init__(self, registry: Registry, originals: Originals, registrations: Registrations,
                 operations: Operations, channels: Channels, *, max_body_bytes: int, frame_timeout_s: float,
                 allow_fault_injection: bool, status_of):
        self.registry, self.originals, self.registrations = registry, originals, registrations
        self.operations, self.channels = operations, channels
        self.max_body_bytes, self.frame_timeout_s = max_body_bytes, frame_timeout_s
        self.allow_fault_injection = allow_fault_injection
        self._status_of = status_of
        self.table = {
            "status": self.status, "put": self.put, "get": self.get, "evict": self.evict,
            "register": self.register, "attach": self.attach, "restore": self.restore_json, "save": self.save,
            "cancel": self.cancel, "drain": self.drain, "acquire": self.acquire, "close": self.close,
            "channel": self.channel, "channel_keys": self.channel_keys,
        }

    def _authorize(self, h: dict, peer: PeerIdentity, *, for_new_work: bool = True) -> Registration:
        reg_id = protocol.field(h, "reg", int)
        secret_hex = protocol.field(h, "secret", str)
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError as exc:
            raise OwnershipError(f"registration {reg_id}: wrong secret") from exc
        return self.registry.authorize(reg_id, secret, peer, for_new_work=for_new_work)

    # ------------------------------------------------------------------ the service and its originals
    def status(self, h, body, conn):
        out = {**self._status_of(), "originals": self.originals.stats(),
               "open_ipc_mappings": len(self.registrations.device_mappings), "channels": self.channels.stats(),
               **self.registry.snapshot()}
        return out, b""

    def put(self, h, body, conn):
        fingerprint = _fingerprint(h)
        tensors = protocol.field(h, "tensors", dict)
        kv = protocol.unpack_tensor(tensors, body, "kv")
        positions = protocol.unpack_tensor(tensors, body, "positions")
        token_ids = protocol.unpack_tensor(tensors, body, "token_ids")
        return {"key": self.originals.put(kv, token_ids, positions, model_fingerprint=fingerprint)}, b""

    def get(self, h, body, conn):
        key = protocol.field(h, "key", str)
        seg = self.originals.get(key, model_fingerprint=_fingerprint(h))
        tensors = {"kv": seg.kv, "positions": seg.positions, "token_ids": seg.token_ids}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.max_body_bytes:  # an original saved or read from the store may be larger
            raise ProtocolError(f"key {key!r}: {nbytes} bytes do not fit a reply (max_body_bytes "
                                f"{self.max_body_bytes})")
        descr, payload = protocol.pack_tensors(tensors)
        return {"key": key, "tensors": descr}, payload

    def evict(self, h, body, conn):
        key = protocol.field(h, "key", str)
        if self.registry.source_held(key):
            raise OwnershipError(f"key {key!r}: held by a pending operation until its copy has drained")
        evicted = self.originals.evict(key)
        self.channels.forget(key)
        return {"key": key, "evicted": evicted}, b""

    # ------------------------------------------------------------------ registrations
    def register(self, h, body, conn):
        reg = self.registrations.register(h, conn.peer, conn.conn_id, conn.sock)
        return {"reg": reg.reg_id, "generation": reg.generation, "secret": reg.secret.hex()}, b""

    def attach(self, h, body, conn):
        reg = self._authorize(h, conn.peer)
        self.registry.attach(reg, conn.conn_id)
        return {"reg": reg.reg_id}, b""

    def close(self, h, body, conn):
        reg = self._authorize(h, conn.peer, for_new_work=False)
        timeout = protocol.timeout_field(h)  # checked before anything changes
        self.registry.close(reg)
        self.channels.stop(reg=reg, drain=False)  # no new work through them either; drained below
        self.registrations.closed(reg, conn.conn_id)
        try:
            self.registry.drain(self.registry.pending_ops(reg), timeout)
        except DrainError:
            pass  # stays closing: the reaper keeps waiting; the reply says what is still pending
        return {"reg": reg.reg_id, "freed": reg.state == "freed", "pending_ops": sorted(reg.ops)}, b""

    # ------------------------------------------------------------------ operations
    def restore_json(self, h, body, conn):
        raise ProtocolError(f"restore: sent as a binary frame since protocol version 3 (this service speaks "
                            f"{VERSION})")

    def save(self, h, body, conn):
        reg = self._authorize(h, conn.peer)
        inject = check_inject(protocol.field(h, "inject", dict, optional=True), self.allow_fault_injection)
        tensors = protocol.field(h, "tensors", dict)
        timeout = protocol.timeout_field(h)
        slots = protocol.unpack_int64(tensors, body, "slots")
        positions = protocol.unpack_int64(tensors, body, "positions")
        token_ids = protocol.unpack_int64(tensors, body, "token_ids")
        n = slots.shape[0]
        if bool((slots == -1).any()):
            raise LayoutError("slots: a save reads real slots only (-1 is not allowed)")
        if positions.shape[0] != n or token_ids.shape[0] != n:
            raise LayoutError(f"positions/token_ids: expected {n} entries (one per slot)")
        client_event = self.registrations.client_event(_hex(h, "wait_event", optional=True), reg, conn.conn_id)
        op, key = self.operations.save(reg, slots, token_ids, positions, inject=inject, timeout=timeout,
                                       client_event=client_event)
        return {"op": op.op_id, "state": op.state, "key": key}, b""

    def cancel(self, h, body, conn):
        reg = self._authorize(h, conn.peer, for_new_work=False)
        op = self.registry.cancel(reg, protocol.field(h, "op_id", int))
        return {"op": op.op_id, "state": op.state, "outcome": op.outcome}, b""

    def drain(self, h, body, conn):
        reg = self._authorize(h, conn.peer, for_new_work=False)
        ids = protocol.int_list(h, "ops", optional=True)
        timeout = protocol.timeout_field(h)
        if ids is None:  # every copy in flight (a channel's restores drain before their replies; close stops it)
            ops = [op for op in self.registry.pending_ops(reg) if self.channels.live(op) is None]
        else:
            ops = [self.registry.op(reg, i) for i in ids]
        self.registry.drain(ops, timeout)
        return {"drained": [op.op_id for op in ops]}, b""

    def acquire(self, h, body, conn):
        reg = self._authorize(h, conn.peer)
        blocks = self.registry.check_blocks(reg, protocol.int_list(h, "blocks"))
        timeout = protocol.timeout_field(h)
        ops = []
        for op in self.registry.pending_ops(reg, blocks):
            channel = self.channels.live(op)
            if channel is None:
                ops.append(op)
            else:  # a channel's restore in flight holds them until its completion: wait for its lock
                channel.barrier()
        self.registry.drain(ops, timeout)
        return {"blocks": sorted(blocks), "drained": [op.op_id for op in ops]}, b""

    # ------------------------------------------------------------------ channels (see .channel)
    def channel(self, h, body, conn):
        """Open a channel for a registration: its page and eventfds follow the frame (3 descriptors)."""
        nfds = protocol.field(h, "fds", int, optional=True, default=0)
        if not 0 <= nfds <= 3:
            raise ProtocolError(f"fds: {nfds} outside 0..3")
        fds = FdStream(conn.sock, nfds, self.frame_timeout_s)
        got: list[int] = []
        try:
            reg = self._authorize(h, conn.peer)
            if nfds != 3:
                raise ProtocolError("channel: expected 3 file descriptors (the page, the service's and the client's "
                                    "eventfd)")
            max_tokens = protocol.field(h, "max_tokens", int)
            event = _hex(h, "event")
            if event is None or len(event) != EVENT_HANDLE_BYTES:
                raise ProtocolError(f"event: a CUDA IPC event handle has {EVENT_HANDLE_BYTES} bytes")
            fds.read(lambda fd: got.append(os.dup(fd)), 3)
            channel = self.channels.open(reg, conn.conn_id, got, max_tokens, event)
            got = got[:1]  # the page's descriptor (mapped now); the channel owns the eventfds
        finally:
            fds.drain()
            for fd in got:
                os.close(fd)
        return {"channel": channel.op.op_id, "rows": ROWS, "max_items": jit()[0].MAX_ITEMS,
                "max_tokens": min(reg.num_slots, MAX_TOKENS), "shifted": channel.has_rope}, b""

    def channel_keys(self, h, body, conn):
        """Rows of a channel for the originals ``keys`` (``null`` for one the channel cannot read:
        not in the device tier, another shape): ``[row, generation, tokens]`` each."""
        reg = self._authorize(h, conn.peer)
        channel_id = protocol.field(h, "channel", int)
        keys = protocol.field(h, "keys", list)
        found = jit()
        max_items = found[0].MAX_ITEMS if found is not None else 0
        if not 0 < len(keys) <= max_items or any(type(k) is not str for k in keys):
            raise ProtocolError(f"keys: expected 1..{max_items} strings")
        return {"handles": self.channels.keys(reg, conn.conn_id, channel_id, keys)}, b""


__all__ = ["Connection", "Handlers"]
