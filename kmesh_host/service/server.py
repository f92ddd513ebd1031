"""The cache service: a separate process that owns the shared originals and writes client memory.

:class:`~.process.CacheService` (parent side, a context manager) starts the service in a process
created with ``multiprocessing`` *spawn* (never fork: the parent may hold CUDA state and threads) and
stops it; :func:`~.process.run_foreground` runs the same service in the calling process (``kmesh
serve``). Socket set-up and peer checks: :mod:`.sockets`.

This module is the service's connections: the accept loop, one thread per connection that reads
requests (:mod:`.protocol`, :mod:`.restore_wire`), checks the peer (``SO_PEERCRED``: same uid as
the service) and dispatches each request (:mod:`.handlers` for JSON requests, :mod:`.restores` for
the binary restore), the reaper of closing and orphaned registrations, and the start-up warm-up.
What a request does is decided by the components it reaches:

* :mod:`.originals` — the segment store, the host tier over it, the device copies;
* :mod:`.registrations` — client memory mapped here as typed destinations;
* :mod:`.registry` — ownership: who may write what, and what stays held until it drained;
* :mod:`.operations`, :mod:`.restores` — copies submitted on a registration's stream;
* :mod:`.channel_service` — the shared-memory channels.

A lone request's completion is polled briefly before a blocking wait, and so is an idle
connection's next request (``receive_spin_s``), while concurrent requests wait blocking so that
waiting threads leave the CPU to the working ones.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import KmeshError, ProtocolError, ServiceError

from . import _compiled, channel, protocol, restore_wire
from .channel_service import Channels
from .handlers import Connection, Handlers
from .operations import Activity, Operations
from .originals import Originals
from .registrations import WARM_WAIT_S, Registrations
from .registry import Registry
from .restores import Restores
from .sockets import bind_socket, check_peer, name_native_thread, peer_identity, prepare_socket_dir


@dataclass(frozen=True)
class ServiceConfig:
    """Configuration of one cache service.

    Attributes:
        socket_path: the Unix socket. Its directory is created with mode 0700 when missing; an
            existing directory must belong to this user and already be private.
        store_root: the segment store the originals live in (a path or ``pyarrow.fs`` URI; shared
            with ``SegmentStore`` users and in-process restorers: one key space). ``None``: a
            private store in a new directory inside the socket's private directory, removed when
            the service stops.
        host_budget_bytes: bytes of host buffers the host tier of originals may hold.
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


class _Service:
    """Everything that runs inside the service process (see the module docstring)."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.uid = os.getuid()
        self.started = time.time()
        self.cuda = torch.cuda.is_available()
        self._stop = threading.Event()
        self._conn_ids = itertools.count(1)
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        #: set once the compiled host paths (and, with CUDA, the placement's compiled driver calls)
        #: are compiled or loaded from Numba's cache (see :meth:`_warm_up`)
        self._warm = threading.Event()
        self._warm_up_s: float | None = None
        self._warming = False  # a warm-up was started (by start(); a service used without it has none)
        self._listener: socket.socket | None = None
        private = None
        if config.store_root is None:  # the private store lives in the socket's private directory
            prepare_socket_dir(config.socket_path)
            private = os.path.dirname(os.path.abspath(config.socket_path))
        self.activity = Activity()
        self.originals = Originals(config.store_root, private_dir=private, host_budget_bytes=config.host_budget_bytes,
                                   device_budget_bytes=config.device_budget_bytes, pin=self.cuda,
                                   on_drop=self._device_copy_dropped)
        self.registry = Registry(Registrations.release_memory)
        self.registrations = Registrations(self.registry, backend=config.backend,
                                           frame_timeout_s=config.frame_timeout_s, wait_warm=self._wait_warm)
        self.operations = Operations(self.registry, self.originals, self.activity,
                                     completion_spin_s=config.completion_spin_s)
        self.channels = Channels(self.registry, self.originals, backend=config.backend,
                                 drain_timeout_s=config.shutdown_drain_s)
        self.restores = Restores(self.registry, self.originals, self.registrations, self.operations, self.activity,
                                 allow_fault_injection=config.allow_fault_injection)
        self.handlers = Handlers(self.registry, self.originals, self.registrations, self.operations, self.channels,
                                 max_body_bytes=config.max_body_bytes, frame_timeout_s=config.frame_timeout_s,
                                 allow_fault_injection=config.allow_fault_injection, status_of=self._status)

    def _device_copy_dropped(self, key: str) -> None:
        self.channels.forget(key)

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
        A registration that comes earlier waits for this (see :meth:`_wait_warm`)."""
        name_native_thread("kmesh-warmup")
        start = time.monotonic()
        try:
            _compiled.compiled()
            if self.cuda:
                cuda.warm_up()
                channel.warm_up()
        except Exception:  # each has its own fallback when called again; report and go on
            traceback.print_exc(file=sys.stderr)
        finally:
            self._warm_up_s = round(time.monotonic() - start, 3)
            self._warm.set()

    def _wait_warm(self) -> None:
        if self._warming:
            self._warm.wait(WARM_WAIT_S)

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
        self.originals.close()  # (buffers still leased by undrained copies are not freed)

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
                    self.registrations.connection_opened(conn_id)
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

    # ------------------------------------------------------------------ one connection
    def _serve_connection(self, conn: socket.socket, conn_id: int) -> None:
        name_native_thread(f"kmesh-conn-{conn_id}")
        activity = self.activity
        try:
            try:
                peer = peer_identity(conn)
                check_peer(peer, self.uid)
            except (OSError, KmeshError) as exc:
                activity.count("refused_peers")
                self._refuse(conn, exc if isinstance(exc, KmeshError) else ProtocolError(str(exc)))
                return
            connection = Connection(conn_id, conn, peer)
            max_body, frame_timeout = self.config.max_body_bytes, self.config.frame_timeout_s
            receive_spin = protocol.spin_default(self.config.receive_spin_s, 2e-3)
            while not self._stop.is_set():
                try:
                    flags, raw, body = protocol.read_frame(
                        conn, max_body_bytes=max_body, frame_timeout=frame_timeout,
                        spin_s=receive_spin if activity.inflight == 0 else 0.0,
                        spin_while=activity.nothing_in_flight)
                    received = time.monotonic_ns()
                    header_raw = memoryview(raw)[:len(raw) - len(body)]
                    header = None if flags & protocol.FLAG_BINARY else protocol.decode_header(header_raw)
                except protocol.ConnectionClosed:
                    return
                except protocol.FatalFrameError as exc:
                    activity.count("errors")
                    self._send(conn, protocol.error_reply(None, exc))
                    return
                except ProtocolError as exc:
                    activity.count("errors")
                    if not self._send(conn, protocol.error_reply(None, exc)):
                        return
                    continue
                except OSError:
                    return
                if header is None:
                    frame = self._serve_binary(header_raw, body, connection, received)
                    try:
                        conn.sendall(frame)
                    except OSError:
                        return
                    continue
                reply, reply_body = self._serve_json(header, body, connection)
                if not self._send(conn, reply, reply_body):
                    return
        finally:
            try:
                self.registrations.connection_closed(conn_id)
                conn.close()
                self.channels.stop(conn_id=conn_id)
                self.registry.connection_closed(conn_id)
            finally:  # counted until its registrations' fate is decided (a status shows it gone after)
                with self._lock:
                    self._conns.pop(conn_id, None)

    def _send(self, conn, header: dict, body: bytes = b"") -> bool:
        try:
            frame = protocol.encode(header, body, max_body_bytes=self.config.max_body_bytes)
        except ProtocolError as exc:  # a reply that cannot be framed: a typed error, the connection kept
            self.activity.count("errors")
            rid = header.get("id")
            frame = protocol.encode(protocol.error_reply(rid if type(rid) is int else None, exc))
        try:
            conn.sendall(frame)
            return True
        except OSError:
            return False

    def _dispatch(self, rid, run, *args):
        """Run one request's handler ``run(*args)``: ``(True, its result)``, or ``(False, the typed
        error reply)`` when it raised (the service keeps serving either way)."""
        activity = self.activity
        lock = activity.lock
        with lock:
            activity.counters["requests"] += 1
            activity.inflight += 1
        try:
            return True, run(*args)
        except KmeshError as exc:
            activity.count("errors")
            reply = protocol.error_reply(rid, exc)
            if getattr(exc, "op_id", None) is not None:
                reply["error"]["op"] = exc.op_id
            return False, reply
        except Exception as exc:  # a bug or a device failure: report it typed, keep serving
            activity.count("internal_errors")
            traceback.print_exc(file=sys.stderr)
            return False, protocol.error_reply(rid, ServiceError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            with lock:
                activity.inflight -= 1

    def _serve_json(self, h: dict, body, connection: Connection) -> tuple[dict, bytes]:
        rid = h.get("id")
        if type(rid) is not int:
            rid = None
        op = h.get("op")
        handler = self.handlers.table.get(op) if type(op) is str else None

        def run():
            if handler is None:
                raise ProtocolError(f"op: unknown operation {op!r}")
            return handler(h, body, connection)

        ok, result = self._dispatch(rid, run)
        if not ok:
            return result, b""
        out, reply_body = result
        return {"id": rid, "ok": True, **out}, reply_body

    def _serve_binary(self, raw, body, connection: Connection, received: int) -> bytes:
        """Answer a binary frame (a restore request): its binary reply, or a JSON error frame."""
        try:
            req = restore_wire.decode_restore(raw, body)
        except ProtocolError as exc:
            self.activity.count("errors")
            return protocol.encode(protocol.error_reply(restore_wire.binary_request_id(raw), exc))
        # opt-in per-request timing: monotonic ns, system-wide on Linux
        stamps = {"received": received, "parsed": time.monotonic_ns()} if req.timings else None
        ok, result = self._dispatch(req.request_id, self.restores.restore, req, connection.peer, connection.conn_id,
                                    stamps)
        if not ok:
            return protocol.encode(result)
        if stamps is not None:
            stamps["reply_sent"] = time.monotonic_ns()  # handed to the socket right after
        return restore_wire.encode_restore_reply(req.request_id, result.op_id, result.state, stamps)

    # ------------------------------------------------------------------ status
    def _status(self) -> dict:
        with self.activity.lock:
            counters = dict(self.activity.counters)
        with self._lock:
            connections = len(self._conns)
        out = {"healthy": not self._stop.is_set() and self._listener is not None, "pid": os.getpid(),
               "protocol_version": protocol.VERSION, "uptime_s": round(time.time() - self.started, 3),
               "socket": self.config.socket_path, "cuda": self.cuda, "connections": connections,
               "fault_injection": self.config.allow_fault_injection, "counters": counters,
               "switch_interval_s": sys.getswitchinterval(), "warm": self._warm.is_set(),
               "warm_up_s": self._warm_up_s}
        if self.cuda and torch.cuda.is_initialized():
            out["device_memory_allocated"] = torch.cuda.memory_allocated()
        return out
