"""Virtual-memory (``cuMemCreate``) caches: exported as POSIX file descriptors, mapped by the service.

A cache allocated with the CUDA virtual memory API (PyTorch's expandable segments, a pool made of
``cuMemCreate`` chunks mapped side by side, :class:`VmmCache`) has no CUDA IPC handle. Each
physical allocation under it is exported instead (``cuMemExportToShareableHandle``, POSIX file
descriptor), the descriptors travel over the authenticated Unix socket (``SCM_RIGHTS``, in batches
of at most :data:`FDS_PER_MESSAGE`), and the service imports them, reserves a range of its own
address space and maps the chunks there side by side, as the client has them.

What crosses the socket (``MemoryHandle`` kind ``"cuda_vmm"``): ``handle`` is the chunks' sizes
(little-endian uint64 each, in address order), ``offset`` the cache's first byte counted from the
first chunk's start, ``nbytes`` the cache's size; the descriptors follow the register frame.

Only allocations created with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` among their requested
handle types can be exported; others are refused with a :class:`LayoutError` naming the fact.

The driver calls go through a small interface (:class:`CudaVmm`, on ``cuda.bindings``) so that a
stand-in can carry the same bookkeeping on host memory (``KMESH_VMM_DRIVER=module:attr``, used by
the CPU tests; never set in production).
"""

from __future__ import annotations

import importlib
import os
import socket
import threading

import torch

from kmesh_gpu.errors import KmeshError, LayoutError, ProtocolError

from .memory import MAX_CHUNKS, Mapping, MemoryHandle, cache_nbytes, decode_sizes, device_bytes, encode_sizes
from .sockets import FD_MARK, FDS_PER_MESSAGE, FdStream

__all__ = ["CudaVmm", "VmmCache", "VmmMapping", "driver", "export", "find_chunks", "release_all", "send_fd_batches"]

#: the walk that finds a chunk's edges gives up after this many granules on either side of the cache
_MAX_WALK = 1 << 22

_driver_lock = threading.Lock()
_driver = None


def driver():
    """This process's VMM driver: :class:`CudaVmm`, or the stand-in named by ``KMESH_VMM_DRIVER``."""
    global _driver
    with _driver_lock:
        if _driver is None:
            spec = os.environ.get("KMESH_VMM_DRIVER")
            if spec:
                module, _, attr = spec.partition(":")
                _driver = getattr(importlib.import_module(module), attr)()
            else:
                _driver = CudaVmm()
        return _driver


class CudaVmm:
    """The CUDA driver's virtual memory calls (``cuda.bindings.driver``), each checked.

    Handles are ``CUmemGenericAllocationHandle`` objects; addresses are ints.
    """

    requires_cuda = True

    def __init__(self):
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:  # pragma: no cover - the GPU machine has it
            raise KmeshError("cuda_vmm memory needs the cuda-bindings package (cuda.bindings.driver)") from exc
        self.cu = cu
        self._fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._contexts: dict[int, object] = {}

    def _ok(self, result, what: str):
        err, *rest = result
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise LayoutError(f"{what}: {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else rest

    def context(self, device: int) -> None:
        """Make ``device``'s primary context (torch's and CuPy's) current on this thread. The context
        is retained once per process and device and never released here: a release could destroy it
        under torch where torch has not used that device yet."""
        ctx = self._contexts.get(device)
        if ctx is None:
            self._ok(self.cu.cuInit(0), "cuInit")
            dev = self._ok(self.cu.cuDeviceGet(device), "cuDeviceGet")
            ctx = self._contexts.setdefault(device, self._ok(self.cu.cuDevicePrimaryCtxRetain(dev),
                                                              "cuDevicePrimaryCtxRetain"))
        self._ok(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def synchronize(self, device: int) -> None:
        torch.cuda.synchronize(device)

    def retain(self, addr: int):
        """The handle of the chunk mapped at ``addr``, or ``None`` where none is (not VMM memory)."""
        err, h = self.cu.cuMemRetainAllocationHandle(addr)
        return h if err == self.cu.CUresult.CUDA_SUCCESS else None

    def same(self, a, b) -> bool:
        return int(a) == int(b)

    def release(self, h) -> None:
        self._ok(self.cu.cuMemRelease(h), "cuMemRelease")

    def exportable(self, h) -> bool:
        try:
            prop = self._ok(self.cu.cuMemGetAllocationPropertiesFromHandle(h),
                            "cuMemGetAllocationPropertiesFromHandle")
            return bool(int(prop.requestedHandleTypes) & int(self._fd_type))
        except (ValueError, TypeError):  # a combination of handle types the binding has no enum member for
            try:
                os.close(self.export_fd(h))  # the driver's own answer
                return True
            except LayoutError:
                return False

    def granularity(self, h) -> int:
        prop = self._ok(self.cu.cuMemGetAllocationPropertiesFromHandle(h), "cuMemGetAllocationPropertiesFromHandle")
        flag = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._ok(self.cu.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))

    def export_fd(self, h) -> int:
        return int(self._ok(self.cu.cuMemExportToShareableHandle(h, self._fd_type, 0), "cuMemExportToShareableHandle"))

    def import_fd(self, fd: int):
        return self._ok(self.cu.cuMemImportFromShareableHandle(fd, self._fd_type), "cuMemImportFromShareableHandle")

    def _prop(self, device: int):
        """Device memory on ``device``, exportable as a POSIX file descriptor (what :class:`VmmCache` makes)."""
        prop = self.cu.CUmemAllocationProp()
        prop.type = self.cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = self._fd_type
        return prop

    def create(self, size: int, device: int):
        return self._ok(self.cu.cuMemCreate(size, self._prop(device), 0), "cuMemCreate")

    def granularity_for(self, device: int) -> int:
        flag = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._ok(self.cu.cuMemGetAllocationGranularity(self._prop(device), flag),
                            "cuMemGetAllocationGranularity"))

    def reserve(self, size: int, alignment: int) -> int:
        return int(self._ok(self.cu.cuMemAddressReserve(size, alignment, self.cu.CUdeviceptr(0), 0),
                            "cuMemAddressReserve"))

    def map(self, addr: int, size: int, h) -> None:
        self._ok(self.cu.cuMemMap(self.cu.CUdeviceptr(addr), size, 0, h, 0), "cuMemMap")

    def set_access(self, addr: int, size: int, device: int) -> None:
        desc = self.cu.CUmemAccessDesc()
        desc.location.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = self.cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._ok(self.cu.cuMemSetAccess(self.cu.CUdeviceptr(addr), size, [desc], 1), "cuMemSetAccess")

    def unmap(self, addr: int, size: int) -> None:
        self._ok(self.cu.cuMemUnmap(self.cu.CUdeviceptr(addr), size), "cuMemUnmap")

    def address_free(self, addr: int, size: int) -> None:
        self._ok(self.cu.cuMemAddressFree(self.cu.CUdeviceptr(addr), size), "cuMemAddressFree")

    def tensor(self, addr: int, nbytes: int, device: int) -> torch.Tensor:
        """A flat uint8 tensor over ``nbytes`` at ``addr`` (memory this process mapped; not owned)."""
        return device_bytes(addr, nbytes, device)


# ---------------------------------------------------------------------------------- client side
def find_chunks(drv, ptr: int, nbytes: int):
    """The chunks mapped under ``[ptr, ptr + nbytes)``: ``(first chunk's start, sizes, handles)``.

    Walks the range granule by granule (``cuMemRetainAllocationHandle`` returns the handle a chunk
    was mapped with, so equal handles mean one chunk), extending the first and last chunk past the
    cache's edges to their own. ``None`` when ``ptr`` is not VMM memory. The caller releases the
    handles (one reference each, :func:`release_all`). Raises :class:`LayoutError` for a hole, a
    chunk that cannot be exported as a file descriptor, or a walk past :data:`_MAX_WALK` granules.
    """
    first = drv.retain(ptr)
    if first is None:
        return None
    handles = [first]  # one reference each, handed to the caller or released here on failure
    try:
        g = drv.granularity(first)
        start, steps = ptr - ptr % g, 0
        while start >= g:  # back to the first chunk's start
            h = drv.retain(start - g)
            if h is None:
                break
            same = drv.same(h, first)
            drv.release(h)
            if not same:
                break
            start -= g
            steps += 1
            if steps > _MAX_WALK:
                raise LayoutError("cache: its virtual-memory chunk is too large to walk")
        sizes = []
        cur, cur_start, a, end = first, start, ptr - ptr % g + g, ptr + nbytes
        while True:
            h = drv.retain(a)
            if h is not None and drv.same(h, cur):
                drv.release(h)
            else:
                sizes.append(a - cur_start)  # the current chunk ends here
                if a >= end:
                    if h is not None:
                        drv.release(h)
                    break
                if h is None:
                    raise LayoutError(f"cache: nothing is mapped at byte {a - ptr} of the cache (a hole in its range)")
                handles.append(h)
                if len(handles) > MAX_CHUNKS:
                    raise LayoutError(f"cache: more than {MAX_CHUNKS} virtual-memory chunks")
                cur, cur_start = h, a
            a += g
            steps += 1
            if steps > 2 * _MAX_WALK:
                raise LayoutError("cache: its virtual-memory chunks are too large to walk")
        for h in handles:
            if not drv.exportable(h):
                raise LayoutError("cache: its virtual memory was created without POSIX file-descriptor export "
                                  "(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), so the service cannot map it")
        return start, sizes, handles
    except BaseException:
        release_all(drv, handles)
        raise


def send_fd_batches(sock: socket.socket, drv, handles) -> None:
    """Export each handle as a descriptor and send them after the register frame, in batches of
    :data:`FDS_PER_MESSAGE` (each batch's descriptors are closed here once sent)."""
    for i in range(0, len(handles), FDS_PER_MESSAGE):
        fds = []
        try:
            for h in handles[i:i + FDS_PER_MESSAGE]:
                fds.append(drv.export_fd(h))
            socket.send_fds(sock, [FD_MARK], fds)
        finally:
            for fd in fds:
                os.close(fd)


class VmmCache:
    """A CUDA cache of ``layout`` in virtual memory made of exportable chunks, registrable with the service.

    ``chunk_bytes``: each physical chunk's size (rounded up to the allocation granularity; default:
    one chunk for the whole cache). Several chunks mapped side by side are what PyTorch's expandable
    segments and chunked pools make. The creating client owns the memory: :meth:`close` unmaps and
    frees it (drop every view of :attr:`tensor` first, and close the registration before).
    """

    def __init__(self, layout, device: int = 0, *, chunk_bytes: int | None = None, fill=None, drv=None):
        self.layout = layout
        self.device = int(device)
        self.nbytes = cache_nbytes(layout)
        self.driver = drv or driver()
        if self.driver.requires_cuda:
            self.driver.context(self.device)
        g = self.driver.granularity_for(self.device)
        chunk = -(-int(chunk_bytes or self.nbytes) // g) * g
        self.total = -(-self.nbytes // chunk) * chunk
        self._addr = self.driver.reserve(self.total, g)
        self._mapped, self._handles = 0, []
        try:
            while self._mapped < self.total:
                h = self.driver.create(chunk, self.device)
                self._handles.append(h)
                self.driver.map(self._addr + self._mapped, chunk, h)
                self._mapped += chunk
            self.driver.set_access(self._addr, self.total, self.device)
        except BaseException:
            self._free()
            raise
        flat = self.driver.tensor(self._addr, self.nbytes, self.device)
        self.tensor = flat.view(layout.dtype).reshape(layout.physical_shape)
        if fill is not None:
            self.tensor.view(layout.storage_dtype).fill_(fill)

    def _free(self) -> None:
        if self._mapped:
            self.driver.unmap(self._addr, self._mapped)
            self._mapped = 0
        for h in self._handles:
            self.driver.release(h)
        self._handles = []
        if self._addr is not None:
            self.driver.address_free(self._addr, self.total)
            self._addr = None

    def close(self) -> None:
        if self._addr is None:
            return
        self.driver.synchronize(self.device)  # no kernel may still use the memory
        self.tensor = None
        self._free()

    def __enter__(self) -> "VmmCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export(tensor: torch.Tensor, device: int, drv=None):
    """``(MemoryHandle, handles)`` for a tensor in VMM memory (the handles: one reference each,
    released by :func:`release_all`), or ``None`` where it is not VMM memory."""
    drv = drv or driver()
    if drv.requires_cuda:
        drv.context(device)
    ptr = tensor.data_ptr()
    nbytes = tensor.numel() * tensor.element_size()
    found = find_chunks(drv, ptr, nbytes)
    if found is None:
        return None
    start, sizes, handles = found
    return MemoryHandle("cuda_vmm", encode_sizes(sizes), ptr - start, nbytes, device), handles


def release_all(drv, handles) -> None:
    for h in handles:
        drv.release(h)


# ---------------------------------------------------------------------------------- service side
class VmmMapping(Mapping):
    """The service's mapping of a client's VMM cache: the chunks imported from their descriptors
    and mapped side by side in an address range reserved here. :meth:`close` unmaps and frees it.

    Identity: the descriptors' files (device and inode) with the offset and size, so the same
    export registered twice is one allocation; a chunk exported anew may come as another file, in
    which case the registry's duplicate check does not see it (each registration maps its own copy
    of the chunks' mappings either way, so nothing is shared between them).
    """

    def __init__(self, h, fds: FdStream, drv=None):
        sizes = decode_sizes(h.handle)
        if fds.left < len(sizes):
            raise ProtocolError(f"memory: {len(sizes)} chunks need as many file descriptors, {max(fds.left, 0)} of "
                                f"{fds.count} announced are left")
        if h.offset + h.nbytes > sum(sizes):
            raise LayoutError(f"memory: offset {h.offset} + nbytes {h.nbytes} exceeds the {sum(sizes)} bytes of "
                              f"its chunks")
        self.driver = drv or driver()
        self._total, self._addr, self._mapped = sum(sizes), None, 0
        handles, files = [], []

        def on_fd(fd):
            st = os.fstat(fd)
            files.append(b"%d:%d" % (st.st_dev, st.st_ino))
            handles.append(self.driver.import_fd(fd))

        try:
            if self.driver.requires_cuda:  # before the imports (the caller drains the descriptors if this fails)
                self.driver.context(h.device)
            fds.read(on_fd, len(sizes))
            self._identity = b"cuda_vmm|%d|%s|%d|%d" % (h.device, b",".join(files), h.offset, h.nbytes)
            g = max(self.driver.granularity(x) for x in handles)
            if any(s % g for s in sizes):
                raise LayoutError(f"memory: chunk sizes must be multiples of the allocation granularity {g}")
            self._addr = self.driver.reserve(self._total, g)
            for x, size in zip(handles, sizes):
                self.driver.map(self._addr + self._mapped, size, x)
                self._mapped += size
            self.driver.set_access(self._addr, self._total, h.device)
            self.tensor = self.driver.tensor(self._addr + h.offset, h.nbytes, h.device)
        except BaseException as exc:
            self._unmap()
            if isinstance(exc, KmeshError) or not isinstance(exc, Exception):
                raise
            raise ProtocolError(f"memory: cannot map the cuda_vmm cache ({type(exc).__name__}: {exc})") from exc
        finally:
            for x in handles:  # a mapping keeps its chunk alive; the imports' own references go now
                self.driver.release(x)

    def identity(self, h) -> bytes:
        return self._identity

    def _unmap(self) -> None:
        if self._mapped:
            self.driver.unmap(self._addr, self._mapped)
            self._mapped = 0
        if self._addr is not None:
            self.driver.address_free(self._addr, self._total)
            self._addr = None

    def close(self) -> None:
        self.tensor = None
        self._unmap()
