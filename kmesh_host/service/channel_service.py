"""The service's end of the shared-memory channel (see :mod:`.channel`): one thread per channel
running the compiled loop (:mod:`._channel_jit`), and the table of open channels with the two
requests that serve them (``channel``, ``channel_keys``).

Ownership, as on the socket path: the loop holds the request's blocks in the registration's
holders (under the registration's lock, shared with the registry) from its checks until its
completion event has been seen, so other requests see them held; a channel is itself a pending
operation of its registration (kind ``"channel"``), drained by stopping it, so close, reaping and
service shutdown wait for it and release the memory only after. A completion that cannot be
observed (a failed event query) stops the channel with the request's blocks still held: the
channel's operation then drains only once its stream is seen idle. Rows are dropped (under the
lock, after any request in flight) when their original is evicted or leaves the device tier.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import OrderedDict

import numpy as np
import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import DrainError, OwnershipError, ProtocolError, ServiceError
from kmesh_gpu.layout import storage_dtype

from .channel import (MAX_CHANNELS_PER_REGISTRATION, MAX_TOKENS, ROWS, SERVICE_SPIN_S, Page, close_all, functions,
                      jit, sleep_on, wake)
from .originals import Originals, release_all
from .registrations import open_event
from .registry import Completion, Registry
from .restore_wire import EVENT_HANDLE_BYTES
from .sockets import name_native_thread


class ChannelCompletion(Completion):
    """A channel's operation completes once its thread has stopped (no request in flight), and, when
    it stopped stuck, once its stream is seen idle (the stream carries the channel's copies only)."""

    def __init__(self, channel: "ServiceChannel"):
        self.channel = channel

    def wait(self, timeout: float | None) -> bool:
        channel = self.channel
        start = time.monotonic()
        channel.request_stop()
        if not channel.exited.wait(timeout):
            return False
        if not channel.stuck:
            return True
        pause = 1e-4
        while not channel.stream.query():  # raises on a device error: the registry counts a failed wait
            if timeout is not None and time.monotonic() - start >= timeout:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True


class ServiceChannel:
    """One channel, in the service: its page, rows, table region, event, stream and thread.

    ``launches``: ``{False: the registration's plain plan's CompiledLaunch, True: its shifted
    plan's}`` (the second may be missing: no RoPE spec, or one the run kernel does not apply).
    """

    def __init__(self, reg, conn_id: int, page: Page, efd_svc: int, efd_cli: int, launches: dict,
                 client_event=None, spin_s: float = SERVICE_SPIN_S):
        J, _ = jit()
        self.reg, self.conn_id, self.page = reg, conn_id, page
        #: the client's interprocess event (opened here), which a request flagged AFTER_EVENT waits for
        self.client_event = client_event
        self.efd_svc, self.efd_cli = efd_svc, efd_cli
        plain = launches[False]
        shifted = launches.get(True) or plain
        self.has_rope = launches.get(True) is not None
        self.device_index, self.kv_shape, self.layer_base = plain.device_index, plain.kv_shape, plain.layer_base
        self.want = plain.storage_dtype
        # (kernel, template, params) per kind
        self.consts = {False: (plain.kernel, plain.template, plain.params),
                       True: (shifted.kernel, shifted.template, shifted.params)}
        device_index = self.device_index
        L, T = len(self.layer_base), page.max_tokens
        device = torch.device("cuda", device_index)
        with torch.cuda.device(device_index):
            self.host = torch.empty(L + 10 * T, dtype=torch.int64, pin_memory=True)
            self.dev = torch.empty(L + 10 * T, dtype=torch.int64, device=device)
            self.stream = torch.cuda.Stream(device=device)
            self.event = cuda.DriverEvent.create()
        if self.event is None:
            raise ServiceError("channel: the driver did not create the channel's event")
        self.host_np = self.host.numpy()
        self.st = np.zeros(J.STATE_WORDS, dtype=np.int64)
        self.st[J.S_OPEN] = 1
        self.st[J.S_SPIN_NS] = int(spin_s * 1e9)
        self.st[J.S_EFD_CLI] = efd_cli
        self.rows = np.zeros((ROWS, J.ROW_WORDS), dtype=np.int64)
        self.blocks = np.zeros(T, dtype=np.int64)
        self.scratch = np.zeros(5 * J.MAX_ITEMS + 1, dtype=np.int64)
        self.args = np.zeros(2 * max(int(self.consts[k][0][3]) for k in (False, True)), dtype=np.int64)
        self.one = np.ones(1, dtype=np.int64)
        self.ts = np.zeros(2, dtype=np.int64)
        self.fns = functions(True)
        if self.fns is None:
            raise ServiceError("channel: the CUDA driver or libc functions are not loadable")
        self._lock = threading.Lock()  # rows (Python's side of them)
        #: the eventfds are written (wakes) and closed (release) under this lock: a wake after the
        #: release would write into whatever file took the descriptor's number since
        self._fd_lock = threading.Lock()
        self._released = False
        self._row_of: OrderedDict[str, int] = OrderedDict()  # key -> row, least recently looked up first
        self._refs: list = [None] * ROWS  # what each row's addresses point into, kept alive
        self._free = list(range(ROWS - 1, -1, -1))
        self._gen = 0
        self.retired: list = []  # rows dropped while the channel was stuck (a copy may still read them)
        self.op = None
        self.stuck = False
        self.exited = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def served(self) -> int:
        return int(self.st[jit()[0].S_SERVED])

    @property
    def declined(self) -> int:
        return int(self.st[jit()[0].S_DECLINED])

    def start(self, op) -> None:
        self.op = op
        self.st[jit()[0].S_OP] = op.op_id
        self._thread = threading.Thread(target=self._run, name=f"kmesh-chan-{op.op_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        J, A = jit()
        name_native_thread(f"kmesh-chan-{self.op.op_id}")
        reg, page, c = self.reg, self.page, self.consts
        try:
            torch.cuda.set_device(self.device_index)
            self.stream.query()  # the device's context current on this thread: the loop's driver calls use it
            client_event = self.client_event.cuda_event if self.client_event is not None else 0
            args = (page.words, self.st, self.rows, reg.holders, reg.lock, self.fns, self.host_np,
                    self.host.data_ptr(), self.dev.data_ptr(), self.stream.cuda_stream, self.event.cuda_event,
                    client_event, self.layer_base, c[True][2], c[True][0], c[True][1], c[False][2], c[False][0], c[False][1],
                    self.has_rope, self.blocks, self.scratch, self.args, self.one, self.ts)
            while True:
                code = J.serve(*args)
                if code == J.IDLE:
                    sleep_on(self.efd_svc, 0.25)
                    continue
                if code == J.STUCK:
                    self._stuck(int(self.st[J.S_NSTUCK]))
                break
        except BaseException:  # a bug: whatever this channel holds stays held until its stream is idle
            traceback.print_exc(file=sys.stderr)
            self._stuck(None)
        finally:
            A.put(page.words, J.W_STATE, 1)  # nothing published after W_REP will be answered
            wake(self.efd_cli)
            self.exited.set()

    def _stuck(self, nb: int | None) -> None:
        reg = self.reg
        held = self.blocks[:nb].copy() if nb is not None else \
            np.flatnonzero(reg.holders == self.op.op_id).astype(np.int64)
        self.stuck = True
        self.op.blocks = held  # released by the registry when the channel's operation drains

    def request_stop(self) -> None:
        """Stop taking requests (a request in flight finishes first) and end the thread."""
        J, A = jit()
        if self.st[J.S_OPEN]:
            A.set_word(self.reg.lock, self.st, J.S_OPEN, 0)
        A.put(self.st, J.S_STOP, 1)
        with self._fd_lock:
            if not self._released:
                wake(self.efd_svc)

    def barrier(self) -> None:
        """Return once no request of this channel is in flight (one that started has completed)."""
        _, A = jit()
        A.take(self.reg.lock)
        A.give(self.reg.lock)

    def shut(self) -> None:
        """No new request is taken from now on (close): requests in flight finish first."""
        J, A = jit()
        A.set_word(self.reg.lock, self.st, J.S_OPEN, 0)

    def release(self) -> None:
        """After the channel's operation drained: its descriptors, page, table region, event and rows'
        references, at once (the channel and its operation refer to each other: left to the garbage
        collector, the device memory would come back at some later collection)."""
        with self._fd_lock:
            if self._released:
                return
            self._released = True
            close_all((self.efd_svc, self.efd_cli))
        self.page.close()
        with self._lock:
            self._refs = [None] * ROWS
            self._row_of.clear()
            self.retired.clear()
        self.host = self.host_np = self.dev = self.event = self.client_event = None

    # ------------------------------------------------------------------ rows
    def row(self, key: str, kv: torch.Tensor, positions: torch.Tensor, keep: tuple):
        """``(row, generation, tokens)`` naming ``kv`` (a device copy of the original ``key``, whose
        old positions are ``positions``) for requests; ``None`` when it is not one the channel can
        read (another shape, dtype, device or alignment). ``keep``: what must stay alive with it."""
        J, _ = jit()
        L, H, D = self.kv_shape
        s = kv.shape
        if len(s) != 5 or s[0] != 2 or s[1] != L or s[3] != H or s[4] != D or not kv.is_contiguous() \
                or kv.device.type != "cuda" or kv.device.index != self.device_index or kv.data_ptr() % 16:
            return None
        if kv.dtype is not self.want and storage_dtype(kv.dtype) != self.want:
            return None
        count = int(s[2])
        if count < 1:
            return None
        pos = positions
        if pos.dtype != torch.int64 or pos.device.type != "cpu" or not pos.is_contiguous() or pos.dim() != 1:
            pos = pos.to(device="cpu", dtype=torch.int64).contiguous()
        if pos.shape != (count,):
            return None
        with self._lock:
            r = self._row_of.get(key)
            if r is not None and self._refs[r][0] is kv:
                self._row_of.move_to_end(key)
                return r, int(self.rows[r, J.G_GEN]), count
            if r is not None:
                self._drop(key)
            if not self._free:
                self._drop(next(iter(self._row_of)))
            r = self._free.pop()
            self._gen += 1
            J.set_row(self.reg.lock, self.rows, r, self._gen, kv.data_ptr(), count, pos.data_ptr())
            self._refs[r] = (kv, pos, keep)
            self._row_of[key] = r
            return r, self._gen, count

    def forget(self, key: str) -> None:
        """Drop the row of ``key`` (after any request in flight that reads it has finished)."""
        with self._lock:
            if key in self._row_of:
                self._drop(key)

    def _drop(self, key: str) -> None:
        J, _ = jit()
        r = self._row_of.pop(key)
        J.set_row(self.reg.lock, self.rows, r, 0, 0, 0, 0)
        if self.stuck:
            self.retired.append(self._refs[r])
        self._refs[r] = None
        self._free.append(r)


class Channels:
    """The service's open channels, by their operation id, and the two requests that serve them:
    ``channel`` (open one: :meth:`open`) and ``channel_keys`` (rows for originals: :meth:`keys`).

    A channel is a pending operation of its registration (kind ``"channel"``): drained by stopping
    it, so close, reaping and service shutdown wait for it. ``drain_timeout_s``: how long stopping
    the channels of a connection that ended waits for each.
    """

    def __init__(self, registry: Registry, originals: Originals, *, backend: str, drain_timeout_s: float):
        self.registry, self.originals = registry, originals
        self.backend, self.drain_timeout_s = backend, drain_timeout_s
        self._lock = threading.Lock()
        self._open: dict[int, ServiceChannel] = {}

    # ------------------------------------------------------------------ channel
    def open(self, reg, conn_id: int, fds: list[int], max_tokens: int, event_raw: bytes) -> ServiceChannel:
        """Open a channel of ``reg`` on connection ``conn_id`` over the client's page and eventfds
        (``fds``: page, the service's eventfd, the client's; the channel owns the eventfds once
        this returns, the caller closes the page's descriptor)."""
        dest = reg.destination
        if jit() is None or not dest.on_cuda:
            raise ServiceError("channel: not available for this registration (GPU registrations, with Numba, only)")
        with self._lock:
            if sum(x.reg is reg for x in self._open.values()) >= MAX_CHANNELS_PER_REGISTRATION:
                raise ServiceError(f"channel: registration {reg.reg_id} has {MAX_CHANNELS_PER_REGISTRATION} "
                                   "channels open already (each is a thread and a table region of the service)")
        want = min(reg.num_slots, MAX_TOKENS)
        if max_tokens != want:
            raise ProtocolError(f"channel.max_tokens: expected {want} for registration {reg.reg_id}, got {max_tokens}")
        if self.backend not in ("auto", "cupy"):
            raise ServiceError("channel: the run kernel's compiled driver path is not available in this service")
        with torch.cuda.device(dest.device_index):
            plain = dest.plain.compiled_launch()
            shifted = dest.shifted.compiled_launch() if dest.shifted is not None else None
        if plain is None:
            raise ServiceError("channel: this registration's cache is not one the run kernel's compiled path serves")
        if len(event_raw) != EVENT_HANDLE_BYTES:
            raise ProtocolError(f"event: a CUDA IPC event handle has {EVENT_HANDLE_BYTES} bytes, got {len(event_raw)}")
        client_event = open_event(dest.device, event_raw, "event")
        page = Page.adopt(fds[0], max_tokens)
        try:
            channel = ServiceChannel(reg, conn_id, page, fds[1], fds[2], {False: plain, True: shifted}, client_event)
        except BaseException:
            page.close()
            raise
        op = self.registry.begin(reg, "channel", np.empty(0, dtype=np.int64))
        self.registry.submitted(op, ChannelCompletion(channel), outcome="ok", keepalive=[channel],
                                on_drained=self._drained)
        with self._lock:
            self._open[op.op_id] = channel
        channel.start(op)
        return channel

    # ------------------------------------------------------------------ channel_keys
    def keys(self, reg, conn_id: int, channel_id: int, keys: list) -> list:
        """Rows of a channel for the originals ``keys`` (``None`` for one the channel cannot read: over
        the device budget, another shape): ``[row, generation, tokens]`` each. The registration's
        fingerprint is checked here, once per original and channel."""
        with self._lock:
            channel = self._open.get(channel_id)
        if channel is None or channel.reg is not reg or channel.conn_id != conn_id:
            raise OwnershipError(f"channel {channel_id}: not open on this connection for registration {reg.reg_id}")
        dest = reg.destination
        originals = self.originals
        copies = originals.device.get_many(keys, dest.device)
        missing = [i for i, c in enumerate(copies) if c is None]
        if missing:
            leases = originals.lease_many([keys[i] for i in missing], dest.model_fingerprint)
            try:
                for i, lease in zip(missing, leases):
                    copies[i] = originals.device.add(keys[i], lease, dest.device)
            finally:
                release_all(leases)  # (each upload fenced its lease)
        originals.check([c for c in copies if c is not None], dest.model_fingerprint)
        out = []
        for key, copy in zip(keys, copies):
            got = None
            if copy is not None:
                if not copy.uploaded:
                    copy.ready.synchronize()
                    copy.uploaded = True
                got = channel.row(key, copy.kv, copy.header.positions_int64, copy)
                # an evict (or the device tier letting the copy go) after the lookup above: its row is dropped
                if got is not None and originals.device.current(key, dest.device) is not copy:
                    channel.forget(key)
                    got = None
            out.append(list(got) if got is not None else None)
        return out

    # ------------------------------------------------------------------ lifetime
    def live(self, op):
        """The channel whose operation ``op`` is, unless it is stuck (then it drains like a copy)."""
        if op.kind != "channel":
            return None
        with self._lock:
            channel = self._open.get(op.op_id)
        return channel if channel is not None and not channel.stuck else None

    def _drained(self, op) -> None:
        with self._lock:
            channel = self._open.pop(op.op_id, None)
        if channel is not None:
            channel.release()

    def stop(self, *, conn_id: int | None = None, reg=None, drain: bool = True) -> None:
        """Stop the channels opened on connection ``conn_id`` (and drain them), or shut those of ``reg``."""
        with self._lock:
            channels = [x for x in self._open.values() if (conn_id is not None and x.conn_id == conn_id)
                        or (reg is not None and x.reg is reg)]
        for channel in channels:
            if not drain:
                channel.shut()
                continue
            try:
                self.registry.drain_one(channel.op, self.drain_timeout_s)
            except DrainError:  # stuck: it stays pending, holding its blocks, until a later drain succeeds
                pass
            except Exception:
                traceback.print_exc(file=sys.stderr)

    def forget(self, key: str) -> None:
        """Drop the rows naming ``key`` in every channel (its device copy went)."""
        with self._lock:
            channels = list(self._open.values())
        for channel in channels:
            channel.forget(key)

    def stats(self) -> dict:
        with self._lock:
            channels = list(self._open.values())
        return {"open": len(channels), "served": sum(x.served for x in channels),
                "declined": sum(x.declined for x in channels), "stuck": sum(x.stuck for x in channels)}
