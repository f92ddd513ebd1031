"""The fast lane: the usual restore served through a polled page of shared memory, compiled end to end.

Through the socket, a restore costs the service's and the client's Python on every request
(framing, parsing, authorisation, bounds checks, holds, the placement's preparation, completion,
reply): tens of microseconds on each side, more than the restore itself. A lane takes that path
out of Python for the restores it can serve: a client connection opens one per GPU registration
(``op: "lane"``, with a sealed memfd page and two eventfds passed over the authenticated socket),
looks up *rows* for the originals it restores (``op: "lane_keys"``: the service's device copies,
checked against the model fingerprint once), then each restore is written into the page and
served by the lane's thread in one compiled loop (:mod:`._lane_jit`): copied out of the page,
checked against the registration and the rows, the blocks held, the run table built, uploaded
and launched, the copy's completion event polled, the blocks released, the reply published.

What a lane serves: ``wait=True`` restores into a CUDA registration whose cache the run kernel's
compiled path covers, every item's slots increasing over the request (every token placed), items
all shifted (RoPE, the registration's spec) or none, the client's stream idle (nothing of its own
to wait for). Anything else — and any request the lane declines (a row replaced since the lookup,
a block held by another operation, a driver refusal) — goes through the socket as before, which
decides and names any error. A lane-served restore returns operation id 0: it has drained.

Ownership, as on the socket path: the loop holds the request's blocks in the registration's
holders (under the registration's lock, shared with the registry) from its checks until its
completion event has been seen, so other requests see them held; a lane is itself a pending
operation of its registration (kind ``"lane"``), drained by stopping it, so close, reaping and
service shutdown wait for it and release the memory only after. A completion that cannot be
observed (a failed event query) stops the lane with the request's blocks still held: the lane's
operation then drains only once its stream is seen idle. Rows are dropped (under the lock, after
any request in flight) when their original is put again, evicted or leaves the device tier.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import select
import sys
import threading
import time
import traceback
from collections import OrderedDict

import numpy as np
import torch

from kmesh_gpu.errors import ProtocolError, ServiceError

from .registry import Completion

ROWS = 256  # originals a lane can name at once (least recently looked up rows are reused)
MAX_LANES_PER_REGISTRATION = 8  # (one per client connection that restores into it, usually one)
MAX_TOKENS = 1 << 20  # tokens per request, at most (a page holds two int64 per token)
SERVICE_SPIN_S = 2e-3  # how long the lane's thread polls an idle page before it sleeps
CLIENT_SPIN_S = 2e-3  # how long a client polls for its reply before it sleeps


@functools.lru_cache(maxsize=1)
def jit():
    """``(_lane_jit, _atomics)``, or ``None`` where Numba cannot compile them here."""
    try:
        from . import _atomics, _lane_jit

        return _lane_jit, _atomics
    except Exception:
        return None


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=2)
def functions(cuda: bool) -> np.ndarray | None:
    """The loop's function table (``_lane_jit.F_*``): the driver's copy, record, launch, query and
    stream wait (0 without ``cuda``) and libc's ``write`` and ``clock_gettime``; ``None`` where not
    loadable."""
    try:
        libc = ctypes.CDLL(None)
        table = [0, 0, 0, 0, _address(libc.write), _address(libc.clock_gettime), 0]
        if cuda:
            drv = ctypes.CDLL("libcuda.so.1")
            table[:4] = [_address(getattr(drv, name)) for name in
                         ("cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuLaunchKernel", "cuEventQuery")]
            table[6] = _address(drv.cuStreamWaitEvent)
    except (OSError, AttributeError):
        return None
    out = np.array(table, dtype=np.int64)
    out.setflags(write=False)
    return out


def page_bytes(max_tokens: int) -> int:
    J = jit()[0]
    return -(-J.page_words(max_tokens) * 8 // mmap.PAGESIZE) * mmap.PAGESIZE


class Page:
    """A lane's shared page: ``words`` (int64) over a mapping of a sealed memfd."""

    def __init__(self, mm: mmap.mmap, max_tokens: int):
        self.mm, self.max_tokens = mm, max_tokens
        self.words = np.frombuffer(mm, dtype=np.int64)

    @classmethod
    def create(cls, max_tokens: int) -> tuple["Page", int]:
        """A new page and its memfd (the client's; sealed against growing and shrinking)."""
        J = jit()[0]
        nbytes = page_bytes(max_tokens)
        fd = os.memfd_create("kmesh-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            page = cls(mmap.mmap(fd, nbytes), max_tokens)
        except BaseException:
            os.close(fd)
            raise
        page.words[J.W_MAGIC] = J.MAGIC
        return page, fd

    @classmethod
    def adopt(cls, fd: int, max_tokens: int) -> "Page":
        """The service's mapping of a client's page: refused unless it is a memfd of the expected
        size sealed against shrinking (a page that shrank under the mapping would fault the
        service) and carries the magic word."""
        J = jit()[0]
        nbytes = page_bytes(max_tokens)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise ProtocolError(f"lane: the page is not a sealable memfd ({exc})") from exc
        if not seals & fcntl.F_SEAL_SHRINK or not seals & fcntl.F_SEAL_SEAL:
            raise ProtocolError("lane: the page must be sealed against shrinking (F_SEAL_SHRINK, F_SEAL_SEAL)")
        if size != nbytes:
            raise ProtocolError(f"lane: a page for {max_tokens} tokens has {nbytes} bytes, got {size}")
        page = cls(mmap.mmap(fd, nbytes), max_tokens)
        if int(page.words[J.W_MAGIC]) != J.MAGIC:
            page.close()
            raise ProtocolError("lane: the page does not carry this protocol's magic word")
        return page

    def close(self) -> None:
        self.words = None
        try:
            self.mm.close()
        except BufferError:  # a view still exported (a caller's): the mapping goes with it
            pass


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _wake(fd: int) -> None:
    try:
        os.write(fd, (1).to_bytes(8, "little"))
    except OSError:
        pass


def _sleep_on(fd: int, timeout: float) -> None:
    """Wait up to ``timeout`` s for the eventfd ``fd`` (non-blocking) and reset it."""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if ready:
        try:
            os.read(fd, 8)
        except (BlockingIOError, OSError):
            pass


def new_eventfd() -> int:
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def warm_up() -> None:
    """Compile (or load from Numba's cache) the lane's functions for the argument types the
    service and the client pass, without running a request (the loop is asked to stop first)."""
    found = jit()
    fns = functions(False)
    if found is None or fns is None:
        return
    J, A = found
    page, fd = Page.create(16)
    os.close(fd)
    efd = new_eventfd()
    try:
        i64 = np.int64

        def ro(a):
            a.setflags(write=False)
            return a

        st = np.zeros(J.STATE_WORDS, dtype=i64)
        st[J.S_STOP] = 1
        rows, lock = np.zeros((4, J.ROW_WORDS), dtype=i64), np.zeros(1, dtype=i64)
        vec, one, ts = np.zeros(64, dtype=i64), np.ones(1, dtype=i64), np.zeros(2, dtype=i64)
        consts = (vec.copy(), ro(np.zeros(4, dtype=i64)), ro(np.zeros(8, dtype=i64)))  # params, kernel, template
        J.serve(page.words, st, rows, vec.copy(), lock, fns, vec.copy(), 0, 0, 0, 0, 0, ro(np.zeros(2, dtype=i64)),
                *consts, *consts, True, vec.copy(), np.zeros(5 * J.MAX_ITEMS + 1, dtype=i64), vec.copy(), one, ts)
        J.send(page.words, vec.copy(), 0, 0, 0, vec.copy(), 1, fns, efd, one)
        A.put(page.words, J.W_STATE, 1)
        J.wait(page.words, 1, fns, 0, ts)
        J.set_row(lock, rows, 0, 0, 0, 0, 0)
        A.set_word(lock, st, J.S_OPEN, 0)
        A.take(lock)
        A.give(lock)
    finally:
        os.close(efd)
        page.close()


# ====================================================================== service side
class LaneCompletion(Completion):
    """A lane's operation completes once its thread has stopped (no request in flight), and, when
    it stopped stuck, once its stream is seen idle (the stream carries the lane's copies only)."""

    def __init__(self, lane: "ServiceLane"):
        self.lane = lane

    def wait(self, timeout: float | None) -> bool:
        lane = self.lane
        start = time.monotonic()
        lane.request_stop()
        if not lane.exited.wait(timeout):
            return False
        if not lane.stuck:
            return True
        pause = 1e-4
        while not lane.stream.query():  # raises on a device error: the registry counts a failed wait
            if timeout is not None and time.monotonic() - start >= timeout:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True


class ServiceLane:
    """One lane, in the service: its page, rows, table region, event, stream and thread.

    ``place_lanes``: ``{False: constants without RoPE, True: with}`` as ``_place_driver._lane``
    returns them (the second may be missing); ``kv_shape``: the cache's ``(L, H, D)``.
    """

    def __init__(self, reg, conn_id: int, page: Page, efd_svc: int, efd_cli: int, place_lanes: dict,
                 layer_base: np.ndarray, kv_shape: tuple, device_index: int, client_event=None,
                 spin_s: float = SERVICE_SPIN_S):
        J, _ = jit()
        self.reg, self.conn_id, self.page = reg, conn_id, page
        #: the client's interprocess event (opened here), which a request flagged AFTER_EVENT waits for
        self.client_event = client_event
        self.efd_svc, self.efd_cli = efd_svc, efd_cli
        self.device_index, self.kv_shape = device_index, kv_shape
        self.layer_base = layer_base
        plain = place_lanes[False]
        shifted = place_lanes.get(True) or plain
        self.has_rope = bool(place_lanes.get(True))
        self.want = plain[2]
        # (kernel, template, params) per kind
        self.consts = {False: (plain[3], plain[4], plain[5]), True: (shifted[3], shifted[4], shifted[5])}
        L, T = len(layer_base), page.max_tokens
        device = torch.device("cuda", device_index)
        with torch.cuda.device(device_index):
            self.host = torch.empty(L + 10 * T, dtype=torch.int64, pin_memory=True)
            self.dev = torch.empty(L + 10 * T, dtype=torch.int64, device=device)
            self.stream = torch.cuda.Stream(device=device)
            from kmesh_gpu._launch import DriverEvent

            self.event = DriverEvent.create()
        if self.event is None:
            raise ServiceError("lane: the driver did not create the lane's event")
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
            raise ServiceError("lane: the CUDA driver or libc functions are not loadable")
        self._lock = threading.Lock()  # rows (Python's side of them)
        #: the eventfds are written (wakes) and closed (release) under this lock: a wake after the
        #: release would write into whatever file took the descriptor's number since
        self._fd_lock = threading.Lock()
        self._released = False
        self._row_of: OrderedDict[str, int] = OrderedDict()  # key -> row, least recently looked up first
        self._refs: list = [None] * ROWS  # what each row's addresses point into, kept alive
        self._free = list(range(ROWS - 1, -1, -1))
        self._gen = 0
        self.retired: list = []  # rows dropped while the lane was stuck (a copy may still read them)
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
        self._thread = threading.Thread(target=self._run, name=f"kmesh-lane-{op.op_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        J, A = jit()
        from .sockets import name_native_thread

        name_native_thread(f"kmesh-lane-{self.op.op_id}")
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
                    _sleep_on(self.efd_svc, 0.25)
                    continue
                if code == J.STUCK:
                    self._stuck(int(self.st[J.S_NSTUCK]))
                break
        except BaseException:  # a bug: whatever this lane holds stays held until its stream is idle
            traceback.print_exc(file=sys.stderr)
            self._stuck(None)
        finally:
            A.put(page.words, J.W_STATE, 1)  # nothing published after W_REP will be answered
            _wake(self.efd_cli)
            self.exited.set()

    def _stuck(self, nb: int | None) -> None:
        reg = self.reg
        held = self.blocks[:nb].copy() if nb is not None else \
            np.flatnonzero(reg.holders == self.op.op_id).astype(np.int64)
        self.stuck = True
        self.op.blocks = held  # released by the registry when the lane's operation drains

    def request_stop(self) -> None:
        """Stop taking requests (a request in flight finishes first) and end the thread."""
        J, A = jit()
        if self.st[J.S_OPEN]:
            A.set_word(self.reg.lock, self.st, J.S_OPEN, 0)
        A.put(self.st, J.S_STOP, 1)
        with self._fd_lock:
            if not self._released:
                _wake(self.efd_svc)

    def barrier(self) -> None:
        """Return once no request of this lane is in flight (one that started has completed)."""
        _, A = jit()
        A.take(self.reg.lock)
        A.give(self.reg.lock)

    def shut(self) -> None:
        """No new request is taken from now on (close): requests in flight finish first."""
        J, A = jit()
        A.set_word(self.reg.lock, self.st, J.S_OPEN, 0)

    def release(self) -> None:
        """After the lane's operation drained: its descriptors, page, table region, event and rows'
        references, at once (the lane and its operation refer to each other: left to the garbage
        collector, the device memory would come back at some later collection)."""
        with self._fd_lock:
            if self._released:
                return
            self._released = True
            _close_all((self.efd_svc, self.efd_cli))
        self.page.close()
        with self._lock:
            self._refs = [None] * ROWS
            self._row_of.clear()
            self.retired.clear()
        self.host = self.host_np = self.dev = self.event = self.client_event = None

    # ------------------------------------------------------------------ rows
    def row(self, key: str, kv: torch.Tensor, positions: torch.Tensor, keep: tuple):
        """``(row, generation, tokens)`` naming ``kv`` (a device copy of the original ``key``, whose
        old positions are ``positions``) for requests; ``None`` when it is not one the lane can
        read (another shape, dtype, device or alignment). ``keep``: what must stay alive with it."""
        J, _ = jit()
        L, H, D = self.kv_shape
        s = kv.shape
        if len(s) != 5 or s[0] != 2 or s[1] != L or s[3] != H or s[4] != D or not kv.is_contiguous() \
                or kv.device.type != "cuda" or kv.device.index != self.device_index or kv.data_ptr() % 16:
            return None
        if kv.dtype is not self.want:
            from kmesh_gpu.place import storage_dtype

            if storage_dtype(kv.dtype) != self.want:
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


# ====================================================================== client side
class ClientLane:
    """A client's end of one lane (used under the client's connection lock)."""

    def __init__(self, reg_id: int, op_id: int, page: Page, efd_svc: int, efd_cli: int):
        J, _ = jit()
        self.reg_id, self.op_id, self.page = reg_id, op_id, page
        self.efd_svc, self.efd_cli = efd_svc, efd_cli
        self.handles: dict = {}  # (key, fingerprint) -> (row, generation, tokens)
        self.seq = 0
        self.items = np.zeros(3 * J.MAX_ITEMS, dtype=np.int64)
        self.srcs = np.zeros(2 * J.MAX_ITEMS, dtype=np.int64)
        self.one = np.ones(1, dtype=np.int64)
        self.ts = np.zeros(2, dtype=np.int64)
        self.fns = functions(False)
        self.spin_ns = int(CLIENT_SPIN_S * 1e9)
        self.closed = False
        self.shifted = False  # whether the service's lane applies the registration's RoPE spec
        #: this client's interprocess event, recorded before a request when its stream has work queued
        self.event = None

    def call(self, n: int, T: int, flags: int, deadline: float) -> int:
        """Publish the request in ``items``/``srcs`` and return its reply code (``_lane_jit``'s);
        :class:`ServiceError` when no reply came by ``deadline`` (the lane is then not used again:
        a late reply could be taken for the next request's)."""
        J, _ = jit()
        seq = self.seq + 1
        if J.send(self.page.words, self.items, n, T, flags, self.srcs, seq, self.fns, self.efd_svc, self.one) != 0:
            return J.MALFORMED
        self.seq = seq
        while True:
            code = J.wait(self.page.words, seq, self.fns, self.spin_ns, self.ts)
            if code != J.SLEEP:
                return code
            left = deadline - time.monotonic()
            if left <= 0:
                self.closed = True
                exc = ServiceError(f"lane {self.op_id}: no reply to a restore within the client's timeout; its copy "
                                   f"may still run, holding its blocks: drain operation {self.op_id} (the lane) "
                                   "before reusing them")
                exc.op_id = self.op_id
                raise exc
            _sleep_on(self.efd_cli, min(left, 0.25))

    def close(self) -> None:
        if self.closed is None:
            return
        self.closed = None
        _close_all((self.efd_svc, self.efd_cli))
        self.page.close()
