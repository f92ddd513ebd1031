"""The channel: the usual restore served through a polled page of shared memory, compiled end to end.

Through the socket, a restore costs the service's and the client's Python on every request
(framing, parsing, authorisation, bounds checks, holds, the placement's preparation, completion,
reply): tens of microseconds on each side, more than the restore itself. A channel takes that path
out of Python for the restores it can serve: a client connection opens one per GPU registration
(``op: "channel"``, with a sealed memfd page and two eventfds passed over the authenticated socket),
looks up *rows* for the originals it restores (``op: "channel_keys"``: the service's device copies,
checked against the registration's model fingerprint once), then each restore is written into the page and
served by the channel's thread in one compiled loop (:mod:`._channel_jit`): copied out of the page,
checked against the registration and the rows, the blocks held, the run table built, uploaded
and launched, the copy's completion event polled, the blocks released, the reply published.

What a channel serves: ``wait=True`` restores into a CUDA registration whose cache the run kernel's
compiled path covers, every item's slots increasing over the request (every token placed), items
all shifted (RoPE, the registration's spec) or none, the client's stream idle (nothing of its own
to wait for). Anything else — and any request the channel declines (a row replaced since the lookup,
a block held by another operation, a driver refusal) — goes through the socket as before, which
decides and names any error. A channel-served restore returns operation id 0: it has drained.

This module: the page and its wake-ups (shared by both ends) and the client's end
(:class:`ClientChannel`); the service's end is :mod:`.channel_service`.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import select
import time

import numpy as np

from kmesh_gpu.errors import ProtocolError, ServiceError

ROWS = 256  # originals a channel can name at once (least recently looked up rows are reused)
MAX_CHANNELS_PER_REGISTRATION = 8  # (one per client connection that restores into it, usually one)
MAX_TOKENS = 1 << 20  # tokens per request, at most (a page holds two int64 per token)
SERVICE_SPIN_S = 2e-3  # how long the channel's thread polls an idle page before it sleeps
CLIENT_SPIN_S = 2e-3  # how long a client polls for its reply before it sleeps


@functools.lru_cache(maxsize=1)
def jit():
    """``(_channel_jit, _atomics)``, or ``None`` where Numba cannot compile them here."""
    try:
        from . import _atomics, _channel_jit

        return _channel_jit, _atomics
    except Exception:
        return None


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=2)
def functions(cuda: bool) -> np.ndarray | None:
    """The loop's function table (``_channel_jit.F_*``): the driver's copy, record, launch, query and
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
    """A channel's shared page: ``words`` (int64) over a mapping of a sealed memfd."""

    def __init__(self, mm: mmap.mmap, max_tokens: int):
        self.mm, self.max_tokens = mm, max_tokens
        self.words = np.frombuffer(mm, dtype=np.int64)

    @classmethod
    def create(cls, max_tokens: int) -> tuple["Page", int]:
        """A new page and its memfd (the client's; sealed against growing and shrinking)."""
        J = jit()[0]
        nbytes = page_bytes(max_tokens)
        fd = os.memfd_create("kmesh-channel", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
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
            raise ProtocolError(f"channel: the page is not a sealable memfd ({exc})") from exc
        if not seals & fcntl.F_SEAL_SHRINK or not seals & fcntl.F_SEAL_SEAL:
            raise ProtocolError("channel: the page must be sealed against shrinking (F_SEAL_SHRINK, F_SEAL_SEAL)")
        if size != nbytes:
            raise ProtocolError(f"channel: a page for {max_tokens} tokens has {nbytes} bytes, got {size}")
        page = cls(mmap.mmap(fd, nbytes), max_tokens)
        if int(page.words[J.W_MAGIC]) != J.MAGIC:
            page.close()
            raise ProtocolError("channel: the page does not carry this protocol's magic word")
        return page

    def close(self) -> None:
        self.words = None
        try:
            self.mm.close()
        except BufferError:  # a view still exported (a caller's): the mapping goes with it
            pass


def close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def wake(fd: int) -> None:
    try:
        os.write(fd, (1).to_bytes(8, "little"))
    except OSError:
        pass


def sleep_on(fd: int, timeout: float) -> None:
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
    """Compile (or load from Numba's cache) the channel's functions for the argument types the
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
        # params, kernel, template: read-only, as a plan's CompiledLaunch holds them
        consts = (ro(np.zeros(11, dtype=i64)), ro(np.zeros(4, dtype=i64)), ro(np.zeros(8, dtype=i64)))
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


class ClientChannel:
    """A client's end of one channel (used under the client's connection lock)."""

    def __init__(self, reg_id: int, op_id: int, page: Page, efd_svc: int, efd_cli: int):
        J, _ = jit()
        self.reg_id, self.op_id, self.page = reg_id, op_id, page
        self.efd_svc, self.efd_cli = efd_svc, efd_cli
        self.handles: dict = {}  # key -> (row, generation, tokens)
        self.seq = 0
        self.items = np.zeros(3 * J.MAX_ITEMS, dtype=np.int64)
        self.srcs = np.zeros(2 * J.MAX_ITEMS, dtype=np.int64)
        self.one = np.ones(1, dtype=np.int64)
        self.ts = np.zeros(2, dtype=np.int64)
        self.fns = functions(False)
        self.spin_ns = int(CLIENT_SPIN_S * 1e9)
        self.closed = False
        self.shifted = False  # whether the service's channel applies the registration's RoPE spec
        #: this client's interprocess event, recorded before a request when its stream has work queued
        self.event = None

    def call(self, n: int, T: int, flags: int, deadline: float) -> int:
        """Publish the request in ``items``/``srcs`` and return its reply code (``_channel_jit``'s);
        :class:`ServiceError` when no reply came by ``deadline`` (the channel is then not used again:
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
                exc = ServiceError(f"channel {self.op_id}: no reply to a restore within the client's timeout; its copy "
                                   f"may still run, holding its blocks: drain operation {self.op_id} (the channel) "
                                   "before reusing them")
                exc.op_id = self.op_id
                raise exc
            sleep_on(self.efd_cli, min(left, 0.25))

    def close(self) -> None:
        if self.closed is None:
            return
        self.closed = None
        close_all((self.efd_svc, self.efd_cli))
        self.page.close()
