"""A stand-in for the CUDA virtual memory driver calls of ``kmesh_host.service.vmm``, on host memory.

Physical chunks are memfds, address ranges are ``PROT_NONE`` reservations of this process's address
space, mapping a chunk is ``mmap(MAP_FIXED | MAP_SHARED)`` of its memfd into a reservation, and an
exported chunk is a duplicate of its memfd. So a client and a service process that exchange
descriptors over the socket really share the chunks' pages, as two processes mapping one
``cuMemCreate`` allocation share its device memory; and the bookkeeping the real driver enforces
(handles mapped and released, the handle behind each mapped address, the granularity) is kept here.

Selected in a service process with ``KMESH_VMM_DRIVER=tests.kmesh_host.service.fake_vmm:FakeVmm``; a client
passes an instance to ``VmmCache(drv=...)``.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading

import torch

from kmesh_gpu.errors import LayoutError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED, _MAP_NORESERVE, _PROT_NONE = 0x10, 0x4000, 0

GRANULARITY = 64 << 10


def _mmap(addr, size, prot, flags, fd=-1) -> int:
    got = _libc.mmap(addr, size, prot, flags, fd, 0)
    if got in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return got


class FakeVmm:
    requires_cuda = False

    def __init__(self, *, exportable: bool = True):
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._chunks: dict[int, list] = {}  # handle -> [memfd, size, references, exportable]
        self._mapped: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self._exportable = exportable
        self.released = 0

    # --------------------------------------------------------------- what a test may look at
    def live_handles(self) -> int:
        with self._lock:
            return len(self._chunks)

    def mapped_ranges(self) -> int:
        with self._lock:
            return len(self._mapped)

    # --------------------------------------------------------------- the driver's calls
    def context(self, device: int) -> None:
        pass

    def synchronize(self, device: int) -> None:
        pass

    def _new(self, fd: int, size: int, exportable: bool) -> int:
        h = next(self._ids)
        self._chunks[h] = [fd, size, 1, exportable]
        return h

    def create(self, size: int, device: int) -> int:
        fd = os.memfd_create("kmesh-fake-vmm")
        os.ftruncate(fd, size)
        with self._lock:
            return self._new(fd, size, self._exportable)

    def granularity_for(self, device: int) -> int:
        return GRANULARITY

    def granularity(self, h) -> int:
        return GRANULARITY

    def retain(self, addr: int):
        with self._lock:
            for start, (size, h) in self._mapped.items():
                if start <= addr < start + size:
                    self._chunks[h][2] += 1
                    return h
        return None

    def same(self, a, b) -> bool:
        return a == b

    def release(self, h) -> None:
        with self._lock:
            chunk = self._chunks.get(h)
            if chunk is None:
                raise LayoutError(f"release of unknown handle {h}")
            chunk[2] -= 1
            self.released += 1
            if chunk[2] == 0:
                os.close(chunk[0])
                del self._chunks[h]

    def exportable(self, h) -> bool:
        with self._lock:
            return self._chunks[h][3]

    def export_fd(self, h) -> int:
        with self._lock:
            fd, _, _, exportable = self._chunks[h]
        if not exportable:
            raise LayoutError("export of a chunk created without file-descriptor export")
        return os.dup(fd)

    def import_fd(self, fd: int):
        size = os.fstat(fd).st_size
        with self._lock:
            return self._new(os.dup(fd), size, True)

    def reserve(self, size: int, alignment: int) -> int:
        # over-reserve, then keep an aligned window
        raw = _mmap(None, size + alignment, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        start = -(-raw // alignment) * alignment
        if start > raw:
            _libc.munmap(raw, start - raw)
        tail = raw + size + alignment - (start + size)
        if tail:
            _libc.munmap(start + size, tail)
        return start

    def map(self, addr: int, size: int, h) -> None:
        with self._lock:
            fd, chunk_size, _, _ = self._chunks[h]
            if size != chunk_size:
                raise LayoutError(f"map of {size} bytes of a {chunk_size}-byte chunk")
            _mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd)
            self._chunks[h][2] += 1  # the mapping's reference
            self._mapped[addr] = (size, h)

    def set_access(self, addr: int, size: int, device: int) -> None:
        pass

    def unmap(self, addr: int, size: int) -> None:
        with self._lock:
            gone = [(a, *self._mapped.pop(a)) for a in [a for a in self._mapped if addr <= a < addr + size]]
        for a, s, h in gone:  # the range stays reserved until address_free
            _mmap(a, s, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE)
            self.release(h)

    def address_free(self, addr: int, size: int) -> None:
        _libc.munmap(addr, size)

    def tensor(self, addr: int, nbytes: int, device: int) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
