"""The cache service: a separate process that owns the shared originals and writes client memory.

:class:`~.process.CacheService` (parent side, a context manager) starts the service in a process
created with ``multiprocessing`` *spawn* (never fork: the parent may hold CUDA state and threads) and
stops it; :func:`~.process.run_foreground` runs the same service in the calling process (``kmesh
serve``). Socket set-up and peer checks: :mod:`.sockets`.

Inside the service, one thread per connection reads requests (:mod:`.protocol`), checks the peer
(``SO_PEERCRED``: same uid as the service), authorises every registration-bound request by peer pid
and per-registration secret (:mod:`.registry`), bounds-checks every slot and block against the
registered layout, and only then reserves the blocks and submits copies:

* ``restore``: shared original (host RAM) -> its device copy (uploaded on first use and kept, see
  :class:`~.sources.DeviceOriginals`) -> ``kmesh_gpu.place_many`` (RoPE shift) into the client's
  blocks, on the registration's stream, which first waits for the client's event;
* ``save``: the client's blocks -> ``kmesh_gpu.gather`` -> pinned host buffer, published as an
  original only once the copy has drained.

Each submission ends with a CUDA event (CPU copies are finished when they return); the operation's
source and destination stay held until a wait on that event succeeds (``drain``, ``acquire``, a
synchronous request, ``close`` or the reaper for clients that went away).

Fixed cost per request is kept small because a restore's own work is a millisecond or two: a
restore and its reply are fixed-layout binary frames (:func:`.protocol.decode_restore`) whose int64
index arrays are used in place (split into per-item views in one call), checked and reserved in
one compiled pass each (:mod:`._compiled`; the NumPy path, one sort for bounds and duplicates,
decides unusual requests and errors), against one array of block holders per registration; what
a registration's items need beyond their arrays is derived once per distinct item list; the
client's interprocess event is opened once per connection and registration and re-recorded by the
client for every request; originals stay on the device and a request's are looked up under one
lock; the registration's stream is made current with torch's plain setters rather than its
context managers (which look up the current device several times per use), and a synchronous
request's completion event is recorded again by the registration's next copy; a lone request's completion is polled briefly before a blocking wait,
and so is an idle connection's next request (``receive_spin_s``), while concurrent requests wait
blocking so that waiting threads leave the CPU to the working ones.

Fault injection (``allow_fault_injection=True`` only; tests): a request may carry ``inject``:
``{"spin_cycles": int}`` queues a spin kernel ahead of its copy, ``{"fail_after_submit": true}``
fails the request after its copy was submitted, ``{"refuse_waits": n}`` refuses the first ``n``
waits on its completion.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from kmesh_gpu import _launch  # driver-level event records and stream waits
from kmesh_gpu.errors import DrainError, KmeshError, LayoutError, OwnershipError, ProtocolError, ServiceError

from .._streams import _ids, on_stream
from . import _compiled, protocol
from . import lane as _lane
from .completions import CudaEventCompletion, RefusingCompletion
from .memory import DeviceMappings, LayerMappings, MemoryHandle, open_handle
from .registry import Completion, Finished, PeerIdentity, Registry
from .restore_plan import _item_plan, _restore_blocks
from .sockets import bind_socket, check_peer, name_native_thread, peer_identity
from .sources import DeviceOriginals, HostOriginals, SourceSegment, StoreSource, TieredSource, check_segment


@dataclass(frozen=True)
class ServiceConfig:
    """Configuration of one cache service.

    Attributes:
        socket_path: the Unix socket. Its directory is created with mode 0700 when missing; an
            existing directory must belong to this user and already be private.
        store_root: segment store root for originals not in host RAM (``None``: host tier only).
        host_budget_bytes: bytes of originals the host tier may hold.
        device_budget_bytes: bytes of device copies of originals kept per GPU (0: upload the
            originals for every restore instead).
        max_body_bytes: the largest binary body a message may carry.
        frame_timeout_s: once a frame has begun, each read must progress within this time.
        max_connections: connections beyond this are refused.
        reap_interval_s: how often closing and orphaned registrations are checked for completion.
        shutdown_drain_s: on stop, how long to keep waiting for pending copies before exiting.
        backend: the ``kmesh_gpu`` placement backend (``"auto"`` by default).
        allow_fault_injection: honour ``inject`` fields (tests only).
        completion_spin_s: how long a lone request polls its copy's completion event before it
            sleeps in a blocking wait (a sleeping thread wakes at the OS timer's granularity, later
            than a restore's copy finishes); requests with others in flight do not poll.
        receive_spin_s: how long a connection polls for its next request, while no request is in
            flight anywhere in the service, before it sleeps in ``recv`` (the same wake-up latency,
            on the way in: a client that restores back to back sends its next request within about
            a millisecond). ``None``: 2 ms where the machine has cores to spare
            (:func:`.protocol.spin_default`), else 0.
        switch_interval_s: the service process's ``sys.setswitchinterval`` (``None``: Python's
            default, 5 ms): how long a thread waiting for the GIL lets the holder run before it
            asks for it. Applied by ``kmesh serve`` and :class:`.CacheService`'s process only.
    """

    socket_path: str
    store_root: str | None = None
    host_budget_bytes: int = 1 << 30
    device_budget_bytes: int = 1 << 30
    max_body_bytes: int = protocol.DEFAULT_MAX_BODY_BYTES
    frame_timeout_s: float = 10.0
    max_connections: int = 256
    reap_interval_s: float = 0.05
    shutdown_drain_s: float = 30.0
    backend: str = "auto"
    allow_fault_injection: bool = False
    completion_spin_s: float = 2e-3
    receive_spin_s: float | None = None
    switch_interval_s: float | None = None


class InjectedFault(KmeshError):
    """A failure requested by a test through ``inject``."""


_FINISHED = Finished()  # stateless: one for every synchronous (host memory) copy
_NO_FAULTS: dict = {}  # never modified
#: completion events a registration keeps for reuse (as many as it has had requests at once)
_EVENTS_KEPT = 8
#: how long a registration waits for the start-up warm-up before compiling what it needs itself
_WARM_WAIT_S = 300.0
_place_module = None


def _place():
    """``kmesh_gpu.place``, imported on first use (a client importing this package never needs it)."""
    global _place_module
    if _place_module is None:
        _place_module = importlib.import_module("kmesh_gpu.place")
    return _place_module


def _place_driver():
    """``kmesh_gpu._place_driver`` (its ``prepare_flat``), imported with :func:`_place`."""
    return _place()._place_driver


# ---------------------------------------------------------------------------------- the service
def _check_layers_apart(tensors, identities) -> None:
    """A per-layer registration's allocations must be distinct memory: the same allocation twice
    (equal identities, however it was mapped here) or overlapping address ranges would have two
    layers written into one place."""
    seen = {}
    for i, ident in enumerate(identities):
        if ident in seen:
            raise LayoutError(f"layers[{i}]: the same memory as layers[{seen[ident]}]")
        seen[ident] = i
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(tensors))
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise LayoutError(f"layers[{j}]: overlaps layers[{i}]")


class _Service:
    """Everything that runs inside the service process."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.uid = os.getuid()
        self.started = time.time()
        self.cuda = torch.cuda.is_available()
        store = StoreSource(config.store_root) if config.store_root else None
        self.sources = TieredSource(HostOriginals(config.host_budget_bytes, pin=self.cuda), store)
        host = self.sources.host
        self.device_originals = DeviceOriginals(config.device_budget_bytes,
                                                is_current=lambda key, seg: host.get_many((key,))[0] is seg,
                                                on_drop=self._forget_in_lanes)
        #: open fast lanes by their operation id (see .lane)
        self._lanes: dict[int, _lane.ServiceLane] = {}
        self.device_mappings = DeviceMappings()
        self.registry = Registry(self._release_memory)
        self._stop = threading.Event()
        self._conn_ids = itertools.count(1)
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._saving: set[str] = set()
        # placements: prepared from the request body's arrays as they are, or per item (the rest)
        self._counters = {"requests": 0, "errors": 0, "internal_errors": 0, "refused_peers": 0,
                          "placements_one_array": 0, "placements_per_item": 0}
        self._inflight = 0  # requests being handled now (under _lock)
        # conn id -> {reg id: (IPC handle bytes, the client's event opened here)}; each connection's
        # thread alone reads and fills its own entry
        self._conn_events: dict[int, dict] = {}
        #: set once the compiled host paths (and, with CUDA, the placement's compiled driver calls)
        #: are compiled or loaded from Numba's cache (see :meth:`_warm_up`)
        self._warm = threading.Event()
        self._warm_up_s: float | None = None
        self._warming = False  # a warm-up was started (by start(); a service used without it has none)
        self._listener: socket.socket | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._listener = bind_socket(self.config.socket_path)
        self._listener.settimeout(0.2)
        self._warming = True
        for target, name in ((self._warm_up, "kmesh-warmup"), (self._accept_loop, "kmesh-accept"),
                             (self._reap_loop, "kmesh-reaper")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _warm_up(self) -> None:
        """Compile (or load from Numba's on-disk cache) what registrations and restores run, as the
        service starts: Numba's import and a cold compile take seconds, with the GIL held, and done
        by the first registration they stalled that client and every other connection meanwhile.
        A registration that comes earlier waits for this (see :meth:`_register`)."""
        name_native_thread("kmesh-warmup")
        start = time.monotonic()
        try:
            _compiled.compiled()
            if self.cuda:
                _launch.driver_jit()
                _lane.warm_up()
        except Exception:  # each has its own fallback when called again; report and go on
            traceback.print_exc(file=sys.stderr)
        finally:
            self._warm_up_s = round(time.monotonic() - start, 3)
            self._warm.set()

    def stop(self) -> None:
        """Stop accepting, end connections, then drain every pending copy before releasing memory."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        try:
            os.unlink(self.config.socket_path)
        except FileNotFoundError:
            pass
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=self.config.shutdown_drain_s)
        for reg in self.registry.registrations():
            self.registry.close(reg)
        deadline = time.monotonic() + self.config.shutdown_drain_s
        while time.monotonic() < deadline:
            try:
                if not self.registry.reap(timeout=0.05):
                    break
            except Exception:  # reported; the pass went on for the others, and so do we
                traceback.print_exc(file=sys.stderr)
            time.sleep(0.01)
        left = self.registry.registrations()
        if left:
            print(f"kmesh serve: exiting with {len(left)} registrations whose copies never drained",
                  file=sys.stderr)

    def _accept_loop(self) -> None:
        name_native_thread("kmesh-accept")
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn_id = next(self._conn_ids)
            t = threading.Thread(target=self._serve_connection, args=(conn, conn_id), name=f"kmesh-conn-{conn_id}",
                                 daemon=True)
            with self._lock:
                too_many = len(self._conns) >= self.config.max_connections
                if not too_many:
                    self._conns[conn_id] = conn
                    self._conn_events[conn_id] = {}
                    self._threads = [x for x in self._threads if x.is_alive()]
                    self._threads.append(t)
            if too_many:
                self._refuse(conn, ServiceError(f"too many connections (limit {self.config.max_connections})"))
                continue
            t.start()

    def _refuse(self, conn: socket.socket, exc: KmeshError) -> None:
        try:
            conn.settimeout(1.0)
            protocol.send_message(conn, protocol.error_reply(None, exc))
        except OSError:
            pass
        conn.close()

    def _reap_loop(self) -> None:
        name_native_thread("kmesh-reaper")
        while not self._stop.wait(self.config.reap_interval_s):
            try:
                self.registry.reap(timeout=0.0)
            except Exception:  # one registration's failure must not stop reaping for every client
                traceback.print_exc(file=sys.stderr)

    def _release_memory(self, reg) -> None:
        reg.memory.close()

    # ------------------------------------------------------------------ one connection
    def _serve_connection(self, conn: socket.socket, conn_id: int) -> None:
        name_native_thread(f"kmesh-conn-{conn_id}")
        try:
            try:
                peer = peer_identity(conn)
                check_peer(peer, self.uid)
            except (OSError, KmeshError) as exc:
                with self._lock:
                    self._counters["refused_peers"] += 1
                self._refuse(conn, exc if isinstance(exc, KmeshError) else ProtocolError(str(exc)))
                return
            max_body, frame_timeout = self.config.max_body_bytes, self.config.frame_timeout_s
            receive_spin = protocol.spin_default(self.config.receive_spin_s, 2e-3)
            while not self._stop.is_set():
                try:
                    flags, raw, body = protocol.read_frame(
                        conn, max_body_bytes=max_body, frame_timeout=frame_timeout,
                        spin_s=receive_spin if self._inflight == 0 else 0.0, spin_while=self._nothing_in_flight)
                    received = time.monotonic_ns()
                    header_raw = memoryview(raw)[:len(raw) - len(body)]
                    header = None if flags & protocol.FLAG_BINARY else protocol.decode_header(header_raw)
                except protocol.ConnectionClosed:
                    return
                except protocol.FatalFrameError as exc:
                    self._count("errors")
                    self._send(conn, protocol.error_reply(None, exc))
                    return
                except ProtocolError as exc:
                    self._count("errors")
                    if not self._send(conn, protocol.error_reply(None, exc)):
                        return
                    continue
                except OSError:
                    return
                if header is None:
                    frame = self._serve_binary(header_raw, body, peer, conn_id, received)
                    try:
                        conn.sendall(frame)
                    except OSError:
                        return
                    continue
                reply, reply_body = self._serve_json(header, body, peer, conn_id)
                if not self._send(conn, reply, reply_body):
                    return
        finally:
            with self._lock:
                self._conns.pop(conn_id, None)
                self._conn_events.pop(conn_id, None)  # ops that waited on one keep it in their keepalive
            conn.close()
            self._stop_lanes(conn_id=conn_id)
            self.registry.connection_closed(conn_id)

    def _send(self, conn, header: dict, body: bytes = b"") -> bool:
        try:
            frame = protocol.encode(header, body, max_body_bytes=self.config.max_body_bytes)
        except ProtocolError as exc:  # a reply that cannot be framed: a typed error, the connection kept
            self._count("errors")
            rid = header.get("id")
            frame = protocol.encode(protocol.error_reply(rid if type(rid) is int else None, exc))
        try:
            conn.sendall(frame)
            return True
        except OSError:
            return False

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _dispatch(self, rid, run, *args):
        """Run one request's handler ``run(*args)``: ``(True, its result)``, or ``(False, the typed
        error reply)`` when it raised (the service keeps serving either way)."""
        lock = self._lock
        with lock:
            self._counters["requests"] += 1
            self._inflight += 1
        try:
            return True, run(*args)
        except KmeshError as exc:
            self._count("errors")
            reply = protocol.error_reply(rid, exc)
            if getattr(exc, "op_id", None) is not None:
                reply["error"]["op"] = exc.op_id
            return False, reply
        except Exception as exc:  # a bug or a device failure: report it typed, keep serving
            self._count("internal_errors")
            traceback.print_exc(file=sys.stderr)
            return False, protocol.error_reply(rid, ServiceError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            with lock:
                self._inflight -= 1

    def _serve_json(self, h: dict, body, peer: PeerIdentity, conn_id: int) -> tuple[dict, bytes]:
        rid = h.get("id")
        if type(rid) is not int:
            rid = None
        op = h.get("op")
        handler = _HANDLERS.get(op) if type(op) is str else None

        def run():
            if handler is None:
                raise ProtocolError(f"op: unknown operation {op!r}")
            return handler(self, h, body, peer, conn_id)

        ok, result = self._dispatch(rid, run)
        if not ok:
            return result, b""
        out, reply_body = result
        return {"id": rid, "ok": True, **out}, reply_body

    def _serve_binary(self, raw, body, peer: PeerIdentity, conn_id: int, received: int) -> bytes:
        """Answer a binary frame (a restore request): its binary reply, or a JSON error frame."""
        try:
            req = protocol.decode_restore(raw, body)
        except ProtocolError as exc:
            self._count("errors")
            return protocol.encode(protocol.error_reply(protocol.binary_request_id(raw), exc))
        # opt-in per-request timing: monotonic ns, system-wide on Linux
        stamps = {"received": received, "parsed": time.monotonic_ns()} if req.timings else None
        ok, result = self._dispatch(req.request_id, self.restore, req, peer, conn_id, stamps)
        if not ok:
            return protocol.encode(result)
        if stamps is not None:
            stamps["reply_sent"] = time.monotonic_ns()  # handed to the socket right after
        return protocol.encode_restore_reply(req.request_id, result.op_id, result.state, stamps)

    # ------------------------------------------------------------------ helpers
    def _authorize(self, h: dict, peer: PeerIdentity, *, for_new_work: bool = True):
        reg_id = protocol.field(h, "reg", int)
        secret_hex = protocol.field(h, "secret", str)
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError as exc:
            raise OwnershipError(f"registration {reg_id}: wrong secret") from exc
        return self.registry.authorize(reg_id, secret, peer, for_new_work=for_new_work)

    def _inject(self, inject: dict | None) -> dict:
        inject = inject or {}
        if inject and not self.config.allow_fault_injection:
            raise ProtocolError("inject: fault injection is disabled in this service")
        for k, v in inject.items():
            if k not in ("spin_cycles", "fail_after_submit", "refuse_waits"):
                raise ProtocolError(f"inject: unknown fault {k!r}")
            if k == "fail_after_submit" and type(v) is not bool:
                raise ProtocolError("inject.fail_after_submit: expected a bool")
            if k != "fail_after_submit" and (type(v) is not int or not 0 <= v < 1 << 62):
                raise ProtocolError(f"inject.{k}: expected an int in 0..2^62")
        return inject

    @staticmethod
    def _event_handle(h: dict) -> bytes | None:
        """A JSON request's ``wait_event`` (hex) as bytes."""
        event_hex = protocol.field(h, "wait_event", str, optional=True)
        if not event_hex:
            return None
        try:
            return bytes.fromhex(event_hex)
        except ValueError as exc:
            raise ProtocolError("wait_event: expected hex bytes") from exc

    def _client_event(self, raw: bytes | None, reg, conn_id: int):
        """The client's interprocess event whose IPC handle is ``raw`` (``None`` when absent or for
        host memory), opened once per connection and registration: the client re-records the same
        event before each request, and a connection carries one request at a time, so the service's
        stream wait (made before the reply) always sees the record of this request."""
        if not raw or not reg.extra["on_cuda"]:
            return None
        if len(raw) != 64:
            raise ProtocolError(f"wait_event: a CUDA IPC event handle has 64 bytes, got {len(raw)}")
        events = self._conn_events.get(conn_id)
        entry = None if events is None else events.get(reg.reg_id)
        if entry is not None and entry[0] == raw:
            return entry[1]
        try:
            event = torch.cuda.Event.from_ipc_handle(reg.extra["device"], raw)
        except RuntimeError as exc:
            raise ProtocolError(f"wait_event: cannot open the CUDA IPC event handle: {exc}") from exc
        if events is not None:
            events[reg.reg_id] = (raw, event)
        return event

    def _nothing_in_flight(self) -> bool:
        return self._inflight == 0

    def _alone(self) -> bool:
        """No other request is being handled (the completion poll's condition to go on polling)."""
        return self._inflight <= 1

    def _submit(self, reg, op, inject: dict, enqueue, *, client_event=None, on_drained=None) -> None:
        """Run ``enqueue(keepalive)`` on the registration's stream and record what was submitted.

        Whatever ``enqueue`` managed to queue is covered by the completion recorded afterwards, also
        when it raised part-way: a failed request is still drained, never resubmitted.
        """
        keepalive: list = []
        error: BaseException | None = None
        completion: Completion
        extra = reg.extra
        if extra["on_cuda"]:
            stream, index = extra["stream"], extra["device_index"]
            # What ``with torch.cuda.device(index), torch.cuda.stream(stream)`` does, for a fraction of
            # its Python cost (those resolve the current device several times and build Stream
            # objects): making a stream current also makes its device current (torch's raw setter,
            # as kmesh_host._streams does); afterwards the device's previous stream and the
            # thread's previous device are put back.
            prev_device = torch.cuda.current_device()
            switch = on_stream(stream, extra["stream_ids"])
            switch.__enter__()
            try:
                try:
                    if client_event is not None:
                        # The client's earlier writes/reads of these blocks come first. Where they
                        # have already finished (the event's last record, made for this request, has
                        # completed) the stream does not wait: a device-side wait on an
                        # interprocess event delays the copy by tens of microseconds even then.
                        if not _launch.event_query(client_event.cuda_event):
                            if not _launch.wait_event(stream.cuda_stream, client_event.cuda_event):
                                stream.wait_event(client_event)
                        keepalive.append(client_event)
                    if inject and inject.get("spin_cycles"):
                        torch.cuda._sleep(int(inject["spin_cycles"]))
                    enqueue(keepalive)
                    if inject and inject.get("fail_after_submit"):
                        raise InjectedFault("injected failure after the copy was submitted")
                except BaseException as exc:
                    error = exc
                finally:
                    try:  # an event of an earlier copy that has drained (see restore), else a new one
                        done = extra["free_events"].pop()
                    except IndexError:
                        done = torch.cuda.Event(blocking=True)
                    if not _launch.record_event(done.cuda_event, stream.cuda_stream):  # a new one: torch creates it
                        done.record(stream)
            finally:
                switch.__exit__(None, None, None)
                if prev_device != index:
                    torch.cuda.set_device(prev_device)
            completion = CudaEventCompletion(done, spin_s=self.config.completion_spin_s if self._inflight <= 1 else 0.0,
                                             spin_while=self._alone)
        else:
            try:
                enqueue(keepalive)
                if inject and inject.get("fail_after_submit"):
                    raise InjectedFault("injected failure after the copy was submitted")
            except BaseException as exc:
                error = exc
            completion = _FINISHED
        if inject and inject.get("refuse_waits"):
            completion = RefusingCompletion(completion, int(inject["refuse_waits"]))
        if error is None:
            self.registry.submitted(op, completion, outcome="ok", keepalive=keepalive, on_drained=on_drained)
            return
        self.registry.submitted(op, completion, outcome="failed", error=str(error), keepalive=keepalive,
                                on_drained=on_drained)
        if not isinstance(error, KmeshError):
            error = ServiceError(f"copy failed after submission: {type(error).__name__}: {error}")
        error.op_id = op.op_id
        raise error

    def _finish(self, op, wait: bool, timeout: float | None):
        """Drain ``op`` when the request waits for its copy; returns it."""
        if wait:
            try:
                self.registry.drain_one(op, timeout)
            except DrainError as exc:
                exc.op_id = op.op_id
                raise
        return op

    # ------------------------------------------------------------------ handlers
    def op_status(self, h, body, peer, conn_id):
        snap = self.registry.snapshot()
        with self._lock:
            counters = dict(self._counters)
            connections = len(self._conns)
        out = {"healthy": not self._stop.is_set() and self._listener is not None, "pid": os.getpid(),
               "protocol_version": protocol.VERSION, "uptime_s": round(time.time() - self.started, 3),
               "socket": self.config.socket_path, "cuda": self.cuda, "connections": connections,
               "fault_injection": self.config.allow_fault_injection, "counters": counters,
               "sources": {**self.sources.stats(), **self.device_originals.stats()},
               "open_ipc_mappings": len(self.device_mappings), "switch_interval_s": sys.getswitchinterval(),
               "warm": self._warm.is_set(), "warm_up_s": self._warm_up_s, "lanes": self._lane_stats(), **snap}
        if self.cuda and torch.cuda.is_initialized():
            out["device_memory_allocated"] = torch.cuda.memory_allocated()
        return out, b""

    def op_put(self, h, body, peer, conn_id):
        key = protocol.field(h, "key", str)
        tensors = protocol.field(h, "tensors", dict)
        kv = protocol.unpack_tensor(tensors, body, "kv")
        positions = protocol.unpack_tensor(tensors, body, "positions")
        token_ids = protocol.unpack_tensor(tensors, body, "token_ids") if "token_ids" in tensors else None
        check_segment(kv, positions, token_ids)
        with self._lock:
            if key in self._saving:
                raise OwnershipError(f"key {key!r}: a save into it is still pending")
        self.sources.put(key, SourceSegment(kv, positions, token_ids))
        return {"key": key}, b""

    def op_get(self, h, body, peer, conn_id):
        key = protocol.field(h, "key", str)
        seg = self.sources.get(key, model_fingerprint=protocol.field(h, "model_fingerprint", dict, optional=True))
        tensors = {"kv": seg.kv, "positions": seg.positions}
        if seg.token_ids is not None:
            tensors["token_ids"] = seg.token_ids
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.config.max_body_bytes:  # an original saved or read from the store may be larger
            raise ProtocolError(f"key {key!r}: {nbytes} bytes do not fit a reply (max_body_bytes "
                                f"{self.config.max_body_bytes})")
        descr, payload = protocol.pack_tensors(tensors)
        return {"key": key, "tensors": descr}, payload

    def op_evict(self, h, body, peer, conn_id):
        key = protocol.field(h, "key", str)
        if self.registry.source_held(key):
            raise OwnershipError(f"key {key!r}: held by a pending operation until its copy has drained")
        # The host tier first: a restore that looked the key up before this evict and uploads it
        # after the drop below finds it no longer current and keeps no device copy of it.
        evicted = self.sources.delete(key)
        self.device_originals.drop(key)
        self._forget_in_lanes(key)
        return {"key": key, "evicted": evicted}, b""

    def op_register(self, h, body, peer, conn_id):
        # descriptors announced by the request (cuda_vmm chunks) follow its frame on the socket:
        # read by the mapping, or drained here when the request fails before, so the stream stays in step
        from .vmm import MAX_CHUNKS, FdStream

        nfds = protocol.field(h, "fds", int, optional=True, default=0)
        if not 0 <= nfds <= MAX_CHUNKS:
            raise ProtocolError(f"fds: {nfds} outside 0..{MAX_CHUNKS}")
        with self._lock:
            sock = self._conns.get(conn_id)
        fds = FdStream(sock, nfds, self.config.frame_timeout_s)
        try:
            return self._register(h, peer, conn_id, fds)
        finally:
            fds.drain()

    def _register(self, h, peer, conn_id, fds):
        from kmesh_gpu import KVLayout, RopeSpec

        # one allocation holding every layer ("memory"), or one per layer ("layers", in layer order:
        # what vLLM allocates), each mapped on its own
        whole, layers = h.get("memory"), h.get("layers")
        if (whole is None) == (layers is None):
            raise ProtocolError("register: expected exactly one of 'memory' (one allocation) and 'layers' "
                                "(one allocation per layer)")
        if layers is not None and (not isinstance(layers, list) or not layers):
            raise ProtocolError("layers: expected a non-empty list of memory descriptions")
        handles = [MemoryHandle.from_dict(protocol.field(h, "memory", dict))] if layers is None else \
            [MemoryHandle.from_dict(d) for d in layers]
        kind, device = handles[0].kind, handles[0].device
        if any(x.device != device for x in handles):
            raise ProtocolError("layers: every layer's memory must be on one device")
        if fds.count and not any(x.kind == "cuda_vmm" for x in handles):
            raise ProtocolError(f"fds: {fds.count} file descriptors announced for {kind!r} memory")
        layout_d = protocol.field(h, "layout", dict)
        rope_d = protocol.field(h, "rope", dict, optional=True)
        try:
            layout = KVLayout.from_dict(layout_d)
            rope = RopeSpec.from_dict(rope_d) if rope_d is not None else None
        except KmeshError:
            raise
        except (ValueError, TypeError, OverflowError) as exc:
            raise LayoutError(f"layout/rope: malformed description ({type(exc).__name__}: {exc})") from exc
        instance = protocol.field(h, "instance", int, optional=True, default=0)
        if layers is not None and len(handles) != layout.num_layers:
            raise LayoutError(f"layers: {len(handles)} allocations for a layout of {layout.num_layers} layers")
        view = layout if layers is None else layout.per_layer()  # what each allocation holds
        need = math.prod(view.physical_shape) * torch.empty((), dtype=layout.dtype).element_size()
        for i, x in enumerate(handles):
            if x.nbytes != need:
                where = "memory" if layers is None else f"layers[{i}]"
                raise LayoutError(f"{where}.nbytes: {x.nbytes} bytes registered, the layout's physical shape "
                                  f"{list(view.physical_shape)} of {layout.dtype} needs {need}")
        if rope is not None and rope.head_size != layout.head_size:
            raise LayoutError(f"rope: head_size {rope.head_size} differs from the layout's D={layout.head_size}")
        # compiled (or loaded) by the warm-up as the service started: waited for here rather than
        # compiled again in parallel, and not left to the registration's first restore
        if self._warming:
            self._warm.wait(_WARM_WAIT_S)
        _compiled.compiled()
        mappings = []
        try:
            for x in handles:
                mappings.append(open_handle(x, self.device_mappings, fds))
            if not fds.done:
                raise ProtocolError(f"fds: {fds.left} file descriptors announced beyond the chunks of the memory")
            mapping = mappings[0] if layers is None else LayerMappings(mappings)
            cache = mapping.cache(layout) if layers is None else [m.cache(view) for m in mappings]
            if layers is not None:
                _check_layers_apart(cache, [m.identity(x) for m, x in zip(mappings, handles)])
            first = cache if layers is None else cache[0]
            # looked up once: a tensor's device is a new object at every ask
            extra = {"cache": cache, "device": first.device, "rope": rope, "on_cuda": first.device.type == "cuda",
                     "per_layer": layers is not None,
                     "num_positions": None if rope is None else int(rope.num_positions)}
            if first.device.type == "cuda":
                _launch.driver_jit()  # the compiled driver calls of placement, loaded before the first restore
                extra["stream"] = torch.cuda.Stream(device=first.device)
                extra["stream_ids"] = _ids(extra["stream"])
                extra["device_index"] = first.device.index
                extra["free_events"] = []  # completion events to record again (see restore)
            identity = mapping.identity(handles[0]) if layers is None else \
                b"%s|layers|" % kind.encode() + b"|".join(m.identity(x) for m, x in zip(mappings, handles))
            reg = self.registry.register(peer, instance=instance, handle_key=identity, layout=layout,
                                         memory=mapping, extra=extra)
        except BaseException:
            for m in mappings:
                m.close()
            raise
        self.registry.attach(reg, conn_id)
        return {"reg": reg.reg_id, "generation": reg.generation, "secret": reg.secret.hex()}, b""

    def op_attach(self, h, body, peer, conn_id):
        reg = self._authorize(h, peer)
        self.registry.attach(reg, conn_id)
        return {"reg": reg.reg_id}, b""

    def op_restore(self, h, body, peer, conn_id):
        raise ProtocolError(f"restore: sent as a binary frame since protocol version 3 (this service speaks "
                            f"{protocol.VERSION})")

    def restore(self, req: protocol.RestoreRequest, peer, conn_id, stamps=None):
        """A decoded restore request: checks, reserves, submits and (``req.wait``) drains; returns the Op."""
        reg = self.registry.authorize(req.reg_id, req.secret, peer)
        inject = self._inject(req.inject) if req.inject else _NO_FAULTS
        keys = req.keys
        segs = self.sources.get_many(keys, model_fingerprint=req.model_fingerprint)
        plan = _item_plan(reg, req, segs)
        pos = req.new_positions
        blocks = _restore_blocks(self.registry, reg, req, plan)
        client_event = self._client_event(req.wait_event, reg, conn_id) if req.wait_event is not None else None
        op = self.registry.begin(reg, "restore", blocks, keys)
        if stamps is not None:
            stamps["validated"] = time.monotonic_ns()
        extra = reg.extra

        def enqueue(keepalive):
            if extra["on_cuda"]:
                device = extra["device"]
                kvs = []
                for seg, copy in zip(segs, self.device_originals.get_many(keys, segs, device)):
                    if copy is None:  # over the device budget: upload for this request only
                        kv = seg.kv.to(device, non_blocking=True)
                    else:
                        if not copy.uploaded:
                            self.device_originals.order_after_upload(copy, extra["stream"])
                        kv = copy.kv
                    kvs.append(kv)
                keepalive.extend(kvs)
            else:
                kvs = [seg.kv for seg in segs]
            if stamps is not None:
                stamps["resolved"] = time.monotonic_ns()
            cache, layout, backend = extra["cache"], reg.layout, self.config.backend
            shifted, plain = plan.shifted, plan.plain
            launch = None
            if extra["on_cuda"] and backend in ("auto", "cupy") and not (shifted and plain):
                # the usual request: the body's index arrays as they are, one compiled preparation
                # (into one registered allocation, or a list of per-layer ones)
                launch = _place_driver().prepare_flat(
                    kvs, cache, layout, plan.counts, req.slots, rope=extra["rope"] if shifted else None,
                    old_positions=plan.old_positions(segs) if shifted else None,
                    new_positions=pos if shifted else None)
            if launch is not None:
                launches = [launch]
                self._count("placements_one_array")
            else:
                launches = self._split_launches(req, plan, segs, kvs, extra, reg)
                self._count("placements_per_item")
            if stamps is not None:
                stamps["prepared"] = time.monotonic_ns()
            for launch in launches:
                launch.run()
            if stamps is not None:
                stamps["launched"] = time.monotonic_ns()

        self._submit(reg, op, inject, enqueue, client_event=client_event)
        if req.wait:
            self._finish(op, True, req.timeout)
            completion = op.completion
            # Its copy has finished: the event may serve the registration's next copy (creating
            # and destroying an event per request costs more than recording one again).
            if type(completion) is CudaEventCompletion and len(extra["free_events"]) < _EVENTS_KEPT:
                extra["free_events"].append(completion.event)
        if stamps is not None:
            stamps["completed"] = time.monotonic_ns()
        return op

    def _split_launches(self, req, plan, segs, kvs, extra, reg) -> list:
        """The placement's launches from per-item index tensors (shifted and plain items apart):
        views of the request's body (the frame's buffer is the op's own), every item's slots,
        then the shifted items' new positions, split in one call."""
        values = req.values if req.values is not None else np.concatenate((req.slots, req.new_positions))
        index = torch.from_numpy(values).split_with_sizes(plan.split_sizes)
        prepare_place_many = _place().prepare_place_many
        cache, layout, backend = extra["cache"], reg.layout, self.config.backend
        shifted, plain, n = plan.shifted, plan.plain, len(segs)
        launches = []
        if shifted:
            if plain:
                kv_s, slot_s = [kvs[i] for i in shifted], [index[i] for i in shifted]
            else:
                kv_s, slot_s = kvs, list(index[:n])
            launches.append(prepare_place_many(
                kv_s, cache if not extra["per_layer"] else [cache] * len(kv_s), layout, slot_s, rope=extra["rope"],
                old_positions=[segs[i].positions for i in shifted], new_positions=list(index[n:]), backend=backend,
                _slots_checked=True))
        if plain:
            launches.append(prepare_place_many([kvs[i] for i in plain],
                                               cache if not extra["per_layer"] else [cache] * len(plain), layout,
                                               [index[i] for i in plain], backend=backend, _slots_checked=True))
        return launches

    def op_save(self, h, body, peer, conn_id):
        from kmesh_gpu import gather

        reg = self._authorize(h, peer)
        inject = self._inject(protocol.field(h, "inject", dict, optional=True))
        key = protocol.field(h, "key", str)
        tensors = protocol.field(h, "tensors", dict)
        wait = protocol.field(h, "wait", bool, optional=True, default=True)
        timeout = protocol.timeout_field(h)
        slot_t = protocol.unpack_int64(tensors, body, "slots")
        positions = protocol.unpack_int64(tensors, body, "positions")
        token_ids = protocol.unpack_int64(tensors, body, "token_ids", optional=True)
        n = slot_t.shape[0]
        if bool((slot_t == -1).any()):
            raise LayoutError("slots: a save reads real slots only (-1 is not allowed)")
        if positions.shape[0] != n or (token_ids is not None and token_ids.shape[0] != n):
            raise LayoutError(f"positions/token_ids: expected {n} entries (one per slot)")
        blocks = self.registry.block_ids_of_slots(reg, slot_t)
        client_event = self._client_event(self._event_handle(h), reg, conn_id)
        with self._lock:
            if key in self._saving or self.sources.host.contains(key):
                raise OwnershipError(f"key {key!r}: already present or being saved; originals are immutable")
            self._saving.add(key)
        try:
            op = self.registry.begin(reg, "save", blocks, [key])
        except BaseException:
            with self._lock:
                self._saving.discard(key)
            raise
        cache, layout = reg.extra["cache"], reg.layout
        host_box: list = []
        publish_errors: list = []

        def enqueue(keepalive):
            kv = gather(cache, layout, slot_t, backend=self.config.backend)
            if reg.extra["on_cuda"]:
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                host.copy_(kv, non_blocking=True)
                keepalive.extend((kv, host))
            else:
                host = kv
            host_box.append(host)

        def publish(drained_op):
            # Runs once the copy has physically finished; a failed or cancelled save is only freed.
            try:
                if drained_op.outcome == "ok" and host_box:
                    self.sources.put(key, SourceSegment(host_box[0], positions, token_ids))
            except KmeshError as exc:  # told to the save's requester (if it waits), not to whoever drained
                drained_op.error = f"not published: {exc}"
                publish_errors.append(exc)
            finally:
                host_box.clear()
                with self._lock:
                    self._saving.discard(key)

        self._submit(reg, op, inject, enqueue, client_event=client_event, on_drained=publish)
        op = self._finish(op, wait, timeout)
        if publish_errors:
            publish_errors[0].op_id = op.op_id
            raise publish_errors[0]
        return {"op": op.op_id, "state": op.state}, b""

    def op_cancel(self, h, body, peer, conn_id):
        reg = self._authorize(h, peer, for_new_work=False)
        op = self.registry.cancel(reg, protocol.field(h, "op_id", int))
        return {"op": op.op_id, "state": op.state, "outcome": op.outcome}, b""

    def op_drain(self, h, body, peer, conn_id):
        reg = self._authorize(h, peer, for_new_work=False)
        ids = protocol.int_list(h, "ops", optional=True)
        if ids is None:  # every copy in flight; a lane's restores drain before their replies (it is stopped by close)
            ops = [op for op in self.registry.pending_ops(reg) if self._live_lane(op) is None]
        else:
            ops = [self.registry.op(reg, i) for i in ids]
        self.registry.drain(ops, protocol.timeout_field(h))
        return {"drained": [op.op_id for op in ops]}, b""

    def op_acquire(self, h, body, peer, conn_id):
        reg = self._authorize(h, peer)
        blocks = self.registry.check_blocks(reg, protocol.int_list(h, "blocks"))
        timeout = protocol.timeout_field(h)
        ops = []
        for op in self.registry.pending_ops(reg, blocks):
            lane = self._live_lane(op)
            if lane is None:
                ops.append(op)
            else:  # a lane's restore in flight holds them until its completion: wait for its lock
                lane.barrier()
        self.registry.drain(ops, timeout)
        return {"blocks": sorted(blocks), "drained": [op.op_id for op in ops]}, b""

    def op_close(self, h, body, peer, conn_id):
        reg = self._authorize(h, peer, for_new_work=False)
        timeout = protocol.timeout_field(h)  # checked before anything changes
        self.registry.close(reg)
        self._stop_lanes(reg=reg, drain=False)  # no new work through them either; drained below
        events = self._conn_events.get(conn_id)
        if events is not None:
            events.pop(reg.reg_id, None)
        try:
            self.registry.drain(self.registry.pending_ops(reg), timeout)
        except DrainError:
            pass  # stays closing: the reaper keeps waiting; the reply says what is still pending
        freed = reg.state == "freed"
        return {"reg": reg.reg_id, "freed": freed, "pending_ops": sorted(reg.ops)}, b""

    # ------------------------------------------------------------------ fast lanes (see .lane)
    def op_lane(self, h, body, peer, conn_id):
        """Open a fast lane for a registration: its page and eventfds follow the frame (3 descriptors)."""
        from .vmm import FdStream

        nfds = protocol.field(h, "fds", int, optional=True, default=0)
        if not 0 <= nfds <= 3:
            raise ProtocolError(f"fds: {nfds} outside 0..3")
        with self._lock:
            sock = self._conns.get(conn_id)
        fds = FdStream(sock, nfds, self.config.frame_timeout_s)
        got: list[int] = []
        try:
            reg = self._authorize(h, peer)
            if nfds != 3:
                raise ProtocolError("lane: expected 3 file descriptors (the page, the service's and the client's eventfd)")
            fds.read(lambda fd: got.append(os.dup(fd)), 3)
            lane = self._open_lane(reg, conn_id, got, h)
            got = got[:1]  # the page's descriptor (mapped now); the lane owns the eventfds
        finally:
            fds.drain()
            for fd in got:
                os.close(fd)
        return {"lane": lane.op.op_id, "rows": _lane.ROWS, "max_items": _lane.jit()[0].MAX_ITEMS,
                "shifted": lane.has_rope}, b""

    def _open_lane(self, reg, conn_id: int, fds: list[int], h: dict):
        extra = reg.extra
        found = _lane.jit()
        if found is None or not extra["on_cuda"]:
            raise ServiceError("lane: not available for this registration (GPU registrations, with Numba, only)")
        with self._lock:
            if sum(x.reg is reg for x in self._lanes.values()) >= _lane.MAX_LANES_PER_REGISTRATION:
                raise ServiceError(f"lane: registration {reg.reg_id} has {_lane.MAX_LANES_PER_REGISTRATION} lanes "
                                   "open already (each is a thread and a table region of the service)")
        want = min(reg.num_slots, _lane.MAX_TOKENS)
        max_tokens = protocol.field(h, "max_tokens", int)
        if max_tokens != want:
            raise ProtocolError(f"lane.max_tokens: expected {want} for registration {reg.reg_id}, got {max_tokens}")
        from kmesh_gpu import _place_driver

        state = _place_driver._state()
        P = _place_driver._place()
        if state is None or not (P._FAST and P._COMPILED and P._RUNS and _place_driver.ENABLED and _launch.ENABLED) \
                or self.config.backend not in ("auto", "cupy"):
            raise ServiceError("lane: the run kernel's compiled driver path is not available in this service")
        cache, layout, rope = extra["cache"], reg.layout, extra["rope"]
        lanes, facts = {}, None
        with torch.cuda.device(extra["device_index"]):
            for shifted in (False, True) if rope is not None else (False,):
                f = P._facts(cache, layout, rope if shifted else None, "cache")
                lanes[shifted] = _place_driver._lane(f, layout, rope if shifted else None, state) \
                    if f is not None and f.ok else False
                facts = facts or f
        if not lanes[False]:
            raise ServiceError("lane: this registration's cache is not one the run kernel's compiled path serves")
        event_hex = protocol.field(h, "event", str)
        try:
            raw = bytes.fromhex(event_hex)
        except ValueError as exc:
            raise ProtocolError("event: expected hex bytes") from exc
        if len(raw) != protocol.EVENT_HANDLE_BYTES:
            raise ProtocolError(f"event: a CUDA IPC event handle has {protocol.EVENT_HANDLE_BYTES} bytes, got {len(raw)}")
        try:
            client_event = torch.cuda.Event.from_ipc_handle(extra["device"], raw)
        except RuntimeError as exc:
            raise ProtocolError(f"event: cannot open the CUDA IPC event handle: {exc}") from exc
        page = _lane.Page.adopt(fds[0], max_tokens)
        try:
            lane = _lane.ServiceLane(reg, conn_id, page, fds[1], fds[2], lanes, facts.layer_base, facts.kv_shape,
                                     extra["device_index"], client_event)
        except BaseException:
            page.close()
            raise
        op = self.registry.begin(reg, "lane", np.empty(0, dtype=np.int64))
        self.registry.submitted(op, _lane.LaneCompletion(lane), outcome="ok", keepalive=[lane],
                                on_drained=self._lane_drained)
        with self._lock:
            self._lanes[op.op_id] = lane
        lane.start(op)
        return lane

    def op_lane_keys(self, h, body, peer, conn_id):
        """Rows of a lane for the originals ``keys`` (``null`` for one the lane cannot read: not in
        the device tier, another shape): ``[row, generation, tokens]`` each."""
        reg = self._authorize(h, peer)
        lane_id = protocol.field(h, "lane", int)
        with self._lock:
            lane = self._lanes.get(lane_id)
        if lane is None or lane.reg is not reg or lane.conn_id != conn_id:
            raise OwnershipError(f"lane {lane_id}: not open on this connection for registration {reg.reg_id}")
        keys = protocol.field(h, "keys", list)
        if not 0 < len(keys) <= _lane.jit()[0].MAX_ITEMS or any(type(k) is not str for k in keys):
            raise ProtocolError(f"keys: expected 1..{_lane.jit()[0].MAX_ITEMS} strings")
        segs = self.sources.get_many(keys, model_fingerprint=protocol.field(h, "model_fingerprint", dict,
                                                                             optional=True))
        device = reg.extra["device"]
        copies = self.device_originals.get_many(keys, segs, device)
        host = self.sources.host
        out = []
        for key, seg, copy in zip(keys, segs, copies):
            got = None
            if copy is not None:
                if not copy.uploaded:
                    copy.ready.synchronize()
                    copy.uploaded = True
                got = lane.row(key, copy.kv, seg.positions, (seg, copy))
                # an evict (or the tier letting the copy go) after the lookup above: its row is dropped
                if got is not None and (host.get_many((key,))[0] is not seg
                                        or self.device_originals.current(key, device) is not copy):
                    lane.forget(key)
                    got = None
            out.append(list(got) if got is not None else None)
        return {"handles": out}, b""

    def _live_lane(self, op):
        """The lane whose operation ``op`` is, unless it is stuck (then it drains like a copy)."""
        if op.kind != "lane":
            return None
        with self._lock:
            lane = self._lanes.get(op.op_id)
        return lane if lane is not None and not lane.stuck else None

    def _lane_drained(self, op) -> None:
        with self._lock:
            lane = self._lanes.pop(op.op_id, None)
        if lane is not None:
            lane.release()

    def _stop_lanes(self, *, conn_id: int | None = None, reg=None, drain: bool = True) -> None:
        """Stop the lanes opened on connection ``conn_id`` (and drain them), or shut those of ``reg``."""
        with self._lock:
            lanes = [x for x in self._lanes.values() if (conn_id is not None and x.conn_id == conn_id)
                     or (reg is not None and x.reg is reg)]
        for lane in lanes:
            if not drain:
                lane.shut()
                continue
            try:
                self.registry.drain_one(lane.op, self.config.shutdown_drain_s)
            except DrainError:  # stuck: it stays pending, holding its blocks, until a later drain succeeds
                pass
            except Exception:
                traceback.print_exc(file=sys.stderr)

    def _forget_in_lanes(self, key: str) -> None:
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.forget(key)

    def _lane_stats(self) -> dict:
        with self._lock:
            lanes = list(self._lanes.values())
        return {"open": len(lanes), "served": sum(x.served for x in lanes),
                "declined": sum(x.declined for x in lanes), "stuck": sum(x.stuck for x in lanes)}


_HANDLERS = {
    "status": _Service.op_status, "put": _Service.op_put, "get": _Service.op_get, "evict": _Service.op_evict,
    "register": _Service.op_register, "attach": _Service.op_attach, "restore": _Service.op_restore,
    "save": _Service.op_save, "cancel": _Service.op_cancel, "drain": _Service.op_drain,
    "acquire": _Service.op_acquire, "close": _Service.op_close, "lane": _Service.op_lane,
    "lane_keys": _Service.op_lane_keys,
}
