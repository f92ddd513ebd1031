"""A minimal io_uring for file reads, through the raw system calls (ctypes; no binding needed).

Why: a thread-pool reader wakes one thread per queued chunk, and on an idle machine each wake-up
costs tens of microseconds before its read even reaches the disk. With io_uring the caller puts
every chunk read of a restore into the submission ring and makes one ``io_uring_enter`` call; the
kernel has them all at once, and one completion thread reaps them.

Scope: ``IORING_OP_READ`` (kernel 5.6+) and ``IORING_OP_NOP`` on x86-64 (its stores are not
reordered with other stores, which the ring protocol needs; elsewhere :func:`available` says no and
the thread pool serves). :class:`Ring` is the ring itself; :class:`UringReader` runs reads with a
completion callback each, handles short reads and errors, and keeps at most ``depth`` in flight.

The ring layout follows ``linux/io_uring.h``: the parameters struct the kernel fills at setup (its
``sq_off``/``cq_off`` say where head, tail, mask and the arrays sit in the mapped rings), 64-byte
submission entries, 16-byte completion entries.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import platform
import threading
import time
from typing import Callable

import numpy as np

_SYS_SETUP, _SYS_ENTER = 425, 426  # x86-64 system call numbers
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FEAT_SINGLE_MMAP = 1
_ENTER_GETEVENTS = 1
OP_NOP, OP_READ = 0, 22
_STOP = (1 << 64) - 1  # user_data of the NOP that wakes the completion thread to stop

#: tools set a list: :class:`UringReader` appends ``("submit", perf_counter, reads)`` per submission
#: and ``("wake", perf_counter at wake-up, completions reaped, perf_counter after their callbacks)``
#: per wake-up of its completion thread (``tools/probe_read_timeline.py``)
TRACE: list | None = None

_libc = None


def _syscall(*args) -> int:
    """A raw system call; returns its result or ``-errno``."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    rc = _libc.syscall(*[ctypes.c_long(a) for a in args])
    return -ctypes.get_errno() if rc < 0 else rc


class Ring:
    """One io_uring instance: ``entries`` submission slots, twice as many completion slots.

    Not thread-safe by itself: one thread submits at a time (:class:`UringReader` holds a lock),
    one thread reaps."""

    def __init__(self, entries: int = 64):
        params = (ctypes.c_uint32 * 30)()  # struct io_uring_params: 120 bytes
        fd = _syscall(_SYS_SETUP, entries, ctypes.addressof(params))
        if fd < 0:
            raise OSError(-fd, f"io_uring_setup: {os.strerror(-fd)}")
        self.fd = fd
        p = np.frombuffer(params, dtype=np.uint32).copy()
        self.sq_entries, self.cq_entries, features = int(p[0]), int(p[1]), int(p[5])
        sq_off, cq_off = p[10:20], p[20:30]  # io_sqring_offsets, io_cqring_offsets (u32 fields first)
        sq_size = int(sq_off[6]) + 4 * self.sq_entries  # array offset + u32 per entry
        cq_size = int(cq_off[5]) + 16 * self.cq_entries  # cqes offset + 16 bytes per entry
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            if features & _FEAT_SINGLE_MMAP:
                size = max(sq_size, cq_size)
                self._sq_map = self._cq_map = mmap.mmap(fd, size, flags=flags, prot=prot, offset=_OFF_SQ_RING)
            else:
                self._sq_map = mmap.mmap(fd, sq_size, flags=flags, prot=prot, offset=_OFF_SQ_RING)
                self._cq_map = mmap.mmap(fd, cq_size, flags=flags, prot=prot, offset=_OFF_CQ_RING)
            self._sqe_map = mmap.mmap(fd, 64 * self.sq_entries, flags=flags, prot=prot, offset=_OFF_SQES)
        except BaseException:
            os.close(fd)
            raise
        sq = np.frombuffer(self._sq_map, dtype=np.uint32)
        cq32 = np.frombuffer(self._cq_map, dtype=np.uint32)
        self._sq_head, self._sq_tail = sq[sq_off[0] // 4:], sq[sq_off[1] // 4:]
        self._sq_mask = int(sq[sq_off[2] // 4])
        self._sq_array = sq[sq_off[6] // 4: sq_off[6] // 4 + self.sq_entries]
        self._cq_head, self._cq_tail = cq32[cq_off[0] // 4:], cq32[cq_off[1] // 4:]
        self._cq_mask = int(cq32[cq_off[2] // 4])
        cqes = np.frombuffer(self._cq_map, dtype=np.uint8)[cq_off[5]: cq_off[5] + 16 * self.cq_entries]
        self._cqe_ud = cqes.view(np.uint64)[0::2]  # user_data
        self._cqe_res = cqes.view(np.int32)[2::4]  # res
        self._sqes = np.frombuffer(self._sqe_map, dtype=np.uint8).reshape(self.sq_entries, 64)
        self._sqe64 = self._sqes.view(np.uint64)  # [entries, 8]
        self._sqe32 = self._sqes.view(np.uint32)  # [entries, 16]
        self._pending = 0  # entries written, tail not yet moved
        self._unsubmitted = 0  # entries published (tail moved) that the kernel has not taken yet

    def space(self) -> int:
        """Free submission slots."""
        return self.sq_entries - (int(self._sq_tail[0]) - int(self._sq_head[0])) % (1 << 32) - self._pending

    def put(self, opcode: int, fd: int, offset: int, address: int, length: int, user_data: int) -> None:
        """Write one entry (the caller checked :meth:`space`); :meth:`submit` hands it over."""
        tail = (int(self._sq_tail[0]) + self._pending) % (1 << 32)
        i = tail & self._sq_mask
        e = self._sqes[i]
        e[:] = 0
        e[0] = opcode
        self._sqe32[i, 1] = fd & 0xFFFFFFFF  # bytes 4..7: fd
        self._sqe64[i, 1] = offset  # bytes 8..15
        self._sqe64[i, 2] = address  # bytes 16..23
        self._sqe32[i, 6] = length  # bytes 24..27
        self._sqe64[i, 4] = user_data  # bytes 32..39
        self._sq_array[i] = i
        self._pending += 1

    def submit(self) -> int:
        """Publish the written entries (one tail store, after the entries) and hand every published
        entry not yet taken to the kernel. Returns how many it took, or ``-errno``."""
        if self._pending:
            self._sq_tail[0] = (int(self._sq_tail[0]) + self._pending) % (1 << 32)
            self._unsubmitted += self._pending
            self._pending = 0
        if not self._unsubmitted:
            return 0
        for _ in range(1000):
            rc = _syscall(_SYS_ENTER, self.fd, self._unsubmitted, 0, 0, 0, 0)
            if rc >= 0:
                self._unsubmitted -= rc
                return rc
            if rc not in (-errno.EINTR, -errno.EAGAIN, -errno.EBUSY):
                return rc
            time.sleep(50e-6)
        return rc

    def wait(self) -> None:
        """Block (the GIL released) until at least one completion is there; submits nothing."""
        while _syscall(_SYS_ENTER, self.fd, 0, 1, _ENTER_GETEVENTS, 0, 0) == -errno.EINTR:
            pass

    def reap(self) -> list[tuple[int, int]]:
        """Every completion there now, as ``(user_data, res)``; frees their slots."""
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        out = []
        while head != tail:
            i = head & self._cq_mask
            out.append((int(self._cqe_ud[i]), int(self._cqe_res[i])))
            head = (head + 1) % (1 << 32)
        self._cq_head[0] = head
        return out

    def collect(self, count: int) -> dict[int, int]:
        """Wait for and reap ``count`` completions: ``{user_data: res}`` (for probes and tests)."""
        got: dict[int, int] = {}
        while len(got) < count:
            self.wait()
            got.update(self.reap())
        return got

    def close(self) -> None:
        if self.fd < 0:
            return
        # Our numpy views export the maps' buffers: while they live, mmap.close() raises BufferError
        # and each map keeps its dup() of the ring descriptor (and the kernel ring) open.
        self._sq_head = self._sq_tail = self._sq_array = self._cq_head = self._cq_tail = None
        self._cqe_ud = self._cqe_res = self._sqes = self._sqe64 = self._sqe32 = None
        for m in {id(x): x for x in (self._sq_map, self._cq_map, self._sqe_map)}.values():
            try:
                m.close()
            except BufferError:  # numpy views still alive: the mapping goes with them
                pass
        os.close(self.fd)
        self.fd = -1


_AVAILABLE: list = []


def available() -> tuple[bool, str]:
    """Whether io_uring reads work here (x86-64, the system calls allowed, IORING_OP_READ known),
    and why not. Tried once per process: a ring is set up and a NOP and a read of /proc/self/stat
    go through it."""
    if _AVAILABLE:
        return _AVAILABLE[0]
    result = (False, "")
    if platform.machine() not in ("x86_64", "AMD64"):
        result = (False, f"io_uring reads are used on x86-64 only (this is {platform.machine()})")
    else:
        ring = None
        try:
            ring = Ring(4)
            buf = ctypes.create_string_buffer(64)
            fd = os.open("/proc/self/stat", os.O_RDONLY)
            try:
                ring.put(OP_NOP, 0, 0, 0, 0, 1)
                ring.put(OP_READ, fd, 0, ctypes.addressof(buf), 64, 2)
                ring.submit()
                got = ring.collect(2)
            finally:
                os.close(fd)
            if got.get(1) == 0 and got.get(2, -1) > 0 and buf.raw[:1].isdigit():
                result = (True, "")
            else:
                result = (False, f"io_uring probe completions were {got}")
        except OSError as exc:
            result = (False, f"io_uring unavailable: {exc}")
        finally:
            if ring is not None:
                ring.close()
    _AVAILABLE.append(result)
    return result


class _Read:
    __slots__ = ("fd", "address", "length", "offset", "size", "done", "callback", "retry", "after")

    def __init__(self, fd, address, length, offset, size, callback, retry, after):
        self.fd, self.address, self.length, self.offset, self.size = fd, address, length, offset, size
        self.done, self.callback, self.retry, self.after = 0, callback, retry, after


class UringReader:
    """Reads through one ring, at most ``depth`` in flight; one thread reaps completions.

    :meth:`read` queues ``length`` bytes from ``fd`` at ``offset`` into host memory at ``address``;
    ``callback(nbytes, error)`` runs on the completion thread when the read is whole (``nbytes``
    short only at end of file) or failed. A failed read is retried once by ``retry()`` when given
    (a synchronous read that may, for one, reopen the file without O_DIRECT); its result or error
    is then reported. Reads queued beyond ``depth`` wait in order for a free slot.

    ``after()`` (optional, per read) runs on the completion thread once the callbacks of every read
    that one wake-up reaped have run, once per distinct hook: a caller whose reads complete
    together (a disk that completes a batch of reads at once) does its follow-up work once for the
    batch rather than once per read.
    """

    def __init__(self, depth: int = 16):
        self.depth = max(1, int(depth))
        self.ring = Ring(max(8, 1 << (self.depth + 1).bit_length()))
        self._lock = threading.Lock()
        self._ops: dict[int, _Read] = {}
        self._backlog: collections.deque = collections.deque()
        self._next = 1
        self._stopping = False
        self.callback_errors: list[BaseException] = []
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._reap, name="kmesh-uring", daemon=True)
        self._thread.start()

    def read(self, fd: int, address: int, length: int, offset: int, callback: Callable[[int, BaseException | None], None],
             *, size: int | None = None, retry: Callable[[], int] | None = None,
             after: Callable[[], None] | None = None) -> None:
        """Queue a read (see the class docstring); ``size``: the file's size, where a short read
        ends the read rather than asking for the rest (which O_DIRECT could not align)."""
        op = _Read(fd, address, length, offset, (1 << 63) if size is None else size, callback, retry, after)
        with self._lock:
            if self._stopping:
                raise RuntimeError("UringReader: closed")
            self._backlog.append(op)
            self._fill()

    def _fill(self) -> None:
        """Move queued reads into the ring while slots and depth allow, and submit (lock held)."""
        ring = self.ring
        moved = False
        while self._backlog and len(self._ops) < self.depth and ring.space() > 0:
            op = self._backlog.popleft()
            ud = self._next
            self._next += 1
            self._ops[ud] = op
            ring.put(OP_READ, op.fd, op.offset + op.done, op.address + op.done, op.length - op.done, ud)
            moved = True
        if moved or ring._unsubmitted:
            rc = ring.submit()
            if rc < 0:  # ring sizes rule out a full completion queue; anything else is a broken ring
                raise OSError(-rc, f"io_uring_enter: {os.strerror(-rc)}")
            if TRACE is not None:
                TRACE.append(("submit", time.perf_counter(), rc))

    def _reap(self) -> None:
        ring = self.ring
        while True:
            ring.wait()
            woke = time.perf_counter()
            finished = []
            with self._lock:
                for ud, res in ring.reap():
                    if ud == _STOP:
                        continue
                    op = self._ops.pop(ud, None)
                    if op is None:
                        continue
                    if res > 0 and op.done + res < op.length and op.offset + op.done + res < op.size:
                        # short before the end of the file: ask for the rest
                        op.done += res
                        self._backlog.appendleft(op)
                        continue
                    if res >= 0:
                        op.done += res
                    finished.append((op, res))
                self._fill()
            hooks = {}
            for op, res in finished:
                try:
                    self._finish(op, res)
                except BaseException as exc:  # a callback's own failure must not stop the reaper
                    self.callback_errors.append(exc)
                if op.after is not None:
                    hooks[id(op.after)] = op.after
            for hook in hooks.values():
                try:
                    hook()
                except BaseException as exc:
                    self.callback_errors.append(exc)
            if TRACE is not None and finished:
                TRACE.append(("wake", woke, len(finished), time.perf_counter()))
            with self._lock:
                if not self._ops and not self._backlog:
                    self._idle.notify_all()
                    if self._stopping:
                        return

    @staticmethod
    def _finish(op: _Read, res: int) -> None:
        if res >= 0:
            op.callback(op.done, None)
            return
        if op.retry is not None:
            try:
                n = op.retry()
            except BaseException as exc:
                op.callback(0, exc)
                return
            op.callback(n, None)
            return
        op.callback(op.done, OSError(-res, os.strerror(-res)))

    def close(self) -> None:
        """Wait for every queued read, then stop the completion thread and free the ring."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            while self._ops or self._backlog:
                self._idle.wait()
            self.ring.put(OP_NOP, 0, 0, 0, 0, _STOP)
            self.ring.submit()
        self._thread.join()
        self.ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Ring", "UringReader", "available", "OP_NOP", "OP_READ"]
