"""Memory handles: how a client's cache allocation crosses into the service process.

Kinds of handle (:class:`MemoryHandle`):

* ``"cuda_ipc"`` — ``cudaMalloc`` memory (what PyTorch's caching allocator hands out), exported
  by the client with CUDA IPC (``cudaIpcGetMemHandle`` through ``torch``'s storage sharing) and
  opened in the service with ``cupy.cuda.runtime.ipcOpenMemHandle``. The handle names the whole
  underlying allocation; ``offset`` locates the cache inside it.
* ``"shm"`` — a CPU cache in POSIX shared memory (:class:`SharedCache`), so that the whole
  service path runs on machines without a GPU.

* ``"cuda_vmm"`` — virtual-memory (``cuMemCreate``) allocations, PyTorch's expandable segments
  among them: each physical chunk under the cache exported as a POSIX file descriptor, sent over
  the socket after the register frame and mapped side by side in the service (:mod:`.vmm`).

Ownership: the client allocates and frees its cache. The service maps it
(:func:`.registrations.open_handle`) and unmaps it (``close``) only when the registry has released
the registration, that is after every copy into or out of it has physically finished.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from kmesh_gpu.errors import KmeshError, LayoutError, ProtocolError

HANDLE_KINDS = ("shm", "cuda_ipc", "cuda_vmm")
CUDA_IPC_HANDLE_BYTES = 64
#: the most chunks one virtual-memory registration may have (a 64 GiB cache in 2 MiB chunks is 32768)
MAX_CHUNKS = 1 << 16
_MAX_SHM_NAME = 250
_SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,249}")


@dataclass(frozen=True)
class MemoryHandle:
    """Descriptor of one exported cache allocation (sent to the service in the register request).

    Attributes:
        kind: ``"shm"``, ``"cuda_ipc"`` or ``"cuda_vmm"``.
        handle: shm: the segment name (UTF-8); cuda_ipc: the 64-byte ``cudaIpcMemHandle_t``;
            cuda_vmm: the sizes of the chunks under the cache (uint64 each, in address order).
        offset: byte offset of the cache tensor's first element inside the exported allocation
            (cuda_vmm: from the first chunk's start).
        nbytes: bytes of the cache tensor (``prod(layout.physical_shape) * itemsize``).
        device: CUDA device ordinal, ``-1`` for host memory.
    """

    kind: str
    handle: bytes
    offset: int
    nbytes: int
    device: int

    @property
    def key(self) -> bytes:
        """Identity bytes of the allocation (the registry adds a generation to it)."""
        return b"|".join((self.kind.encode(), self.handle, str(self.offset).encode(), str(self.nbytes).encode()))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "handle": self.handle.hex(), "offset": self.offset, "nbytes": self.nbytes,
                "device": self.device}

    @classmethod
    def from_dict(cls, d) -> "MemoryHandle":
        if not isinstance(d, dict):
            raise ProtocolError("memory: expected an object")
        kind = d.get("kind")
        if kind not in HANDLE_KINDS:
            raise ProtocolError(f"memory.kind: {kind!r} is not supported (supported: {HANDLE_KINDS})")
        try:
            raw = bytes.fromhex(d.get("handle", ""))
        except (TypeError, ValueError) as exc:
            raise ProtocolError("memory.handle: expected hex bytes") from exc
        ints = [d.get(k) for k in ("offset", "nbytes", "device")]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise ProtocolError("memory.offset/nbytes/device: expected integers")
        offset, nbytes, device = ints
        if offset < 0 or nbytes <= 0 or offset + nbytes > (1 << 50):
            raise ProtocolError(f"memory: offset {offset} / nbytes {nbytes} out of range")
        if kind == "shm" and (not 0 < len(raw) <= _MAX_SHM_NAME or device != -1):
            raise ProtocolError("memory: a shm handle is a non-empty name on device -1")
        if kind == "cuda_ipc" and (len(raw) != CUDA_IPC_HANDLE_BYTES or device < 0):
            raise ProtocolError(f"memory: a cuda_ipc handle is {CUDA_IPC_HANDLE_BYTES} bytes on a device >= 0")
        if kind == "cuda_vmm":
            if device < 0:
                raise ProtocolError("memory: a cuda_vmm handle is on a device >= 0")
            decode_sizes(raw)
        return cls(kind, raw, offset, nbytes, device)


def encode_sizes(sizes) -> bytes:
    """A ``cuda_vmm`` handle: the chunks' sizes, little-endian uint64 each, in address order."""
    return struct.pack(f"<{len(sizes)}Q", *sizes)


def decode_sizes(raw: bytes) -> list[int]:
    """The chunk sizes of a ``cuda_vmm`` handle, checked (:class:`ProtocolError` otherwise)."""
    if not raw or len(raw) % 8 or len(raw) // 8 > MAX_CHUNKS:
        raise ProtocolError(f"memory: a cuda_vmm handle is 1..{MAX_CHUNKS} uint64 chunk sizes, got {len(raw)} bytes")
    sizes = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
    if min(sizes) == 0 or sum(sizes) > (1 << 50):
        raise ProtocolError("memory: cuda_vmm chunk sizes must be positive and add up to at most 2**50 bytes")
    return sizes


def cache_nbytes(layout) -> int:
    return math.prod(layout.physical_shape) * torch.empty((), dtype=layout.dtype).element_size()


# ---------------------------------------------------------------------------------- client side
class SharedCache:
    """A CPU cache of ``layout`` in POSIX shared memory, registrable with the service.

    The creating client owns it: :meth:`close` unmaps and unlinks the segment. Drop every view of
    :attr:`tensor` first (the mapping cannot be closed while views are alive).
    """

    def __init__(self, layout, *, fill=None):
        self.layout = layout
        self.nbytes = cache_nbytes(layout)
        self._shm = shared_memory.SharedMemory(create=True, size=self.nbytes)
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.nbytes)
        self.tensor = flat.view(layout.dtype).reshape(layout.physical_shape)
        if fill is not None:
            self.tensor.view(layout.storage_dtype).fill_(fill)

    @property
    def handle(self) -> MemoryHandle:
        return MemoryHandle("shm", self._shm.name.encode(), 0, self.nbytes, -1)

    def close(self) -> None:
        if self._shm is None:
            return
        self.tensor = None
        shm, self._shm = self._shm, None
        try:
            shm.close()
        except BufferError as exc:
            shm.unlink()
            raise KmeshError("SharedCache.close: views of the cache tensor are still alive; the segment was "
                             "unlinked and is unmapped when they are dropped") from exc
        shm.unlink()

    def __enter__(self) -> "SharedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_cuda(tensor: torch.Tensor) -> MemoryHandle:
    """CUDA IPC handle of the ``cudaMalloc`` allocation holding ``tensor`` (contiguous, on a GPU).

    With CuPy: the allocation's base from ``cuMemGetAddressRange`` and ``cudaIpcGetMemHandle`` on
    it. Without: torch's own storage sharing, which also reports the offset (but parks the block in
    torch's IPC limbo when the tensor is freed, since the service never reports back to torch).
    """
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise LayoutError(f"cache: expected a contiguous CUDA tensor, got {tensor.device} "
                          f"contiguous={tensor.is_contiguous()}")
    nbytes = tensor.numel() * tensor.element_size()
    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    try:
        base, handle = _cupy_export(tensor.data_ptr(), device)
        return MemoryHandle("cuda_ipc", handle, tensor.data_ptr() - base, nbytes, device)
    except ImportError:
        pass
    storage = tensor.untyped_storage()
    # torch returns (device, handle, storage bytes, storage offset in its allocation, ref-counter
    # handle, ref-counter offset, event handle, event sync flag); only the first four matter here.
    dev, handle, _size, storage_offset, *_ = storage._share_cuda_()
    offset = int(storage_offset) + tensor.storage_offset() * tensor.element_size()
    return MemoryHandle("cuda_ipc", bytes(handle), offset, nbytes, int(dev))


def _cupy_export(ptr: int, device: int) -> tuple[int, bytes]:
    import ctypes

    import cupy

    with cupy.cuda.Device(device):
        libcuda = ctypes.CDLL("libcuda.so.1")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise LayoutError(f"cache: cuMemGetAddressRange failed with CUresult {rc}")
        handle = cupy.cuda.runtime.ipcGetMemHandle(base.value)
    return int(base.value), bytes(handle)


# ---------------------------------------------------------------------------------- service side
class Mapping(ABC):
    """The service's view of one registered allocation. ``tensor``: flat uint8 of ``nbytes``."""

    tensor: torch.Tensor

    @abstractmethod
    def close(self) -> None:
        """Unmap. Called once, after every operation on the registration has drained."""

    def identity(self, h: MemoryHandle) -> bytes:
        """What makes two registrations the same allocation (the registry refuses a second live one)."""
        return h.key

    def cache(self, layout) -> torch.Tensor:
        """The cache tensor seen through ``layout`` (``physical_shape``, ``layout.dtype``)."""
        return self.tensor.view(layout.dtype).reshape(layout.physical_shape)


class LayerMappings(Mapping):
    """The mappings of a per-layer registration (one allocation per layer), closed together."""

    def __init__(self, mappings: list[Mapping]):
        self.mappings = mappings
        self.tensor = None  # each layer's tensor is its own mapping's

    def close(self) -> None:
        for m in self.mappings:
            m.close()


class ShmMapping(Mapping):
    """Maps the client's segment directly from ``/dev/shm``: attaching through
    ``multiprocessing.shared_memory`` would enrol the segment with a resource tracker (shared with
    the parent under spawn) that may unlink memory the client owns."""

    def __init__(self, h: MemoryHandle):
        name = h.handle.decode("utf-8", errors="replace").lstrip("/")
        if not _SHM_NAME.fullmatch(name):
            raise ProtocolError(f"memory: {name!r} is not a shared-memory segment name")
        try:
            fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        except OSError as exc:
            raise ProtocolError(f"memory: cannot open shared memory {name!r}: {exc}") from exc
        try:
            st = os.fstat(fd)
            size = st.st_size
            # the segment itself, however its name is spelled ("/x", "//x", a hard link)
            self._file = (st.st_dev, st.st_ino)
            if h.offset + h.nbytes > size:
                raise LayoutError(f"memory: offset {h.offset} + nbytes {h.nbytes} exceeds the {size}-byte segment")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=h.nbytes, offset=h.offset)

    def identity(self, h: MemoryHandle) -> bytes:
        return b"shm|%d:%d|%d|%d" % (*self._file, h.offset, h.nbytes)

    def close(self) -> None:
        self.tensor = None
        try:
            self._mmap.close()
        except BufferError:
            # A view escaped (the service no longer writes through it): leave the mapping to
            # process exit rather than fail a release whose copies already drained.
            pass


def device_bytes(addr: int, nbytes: int, device: int) -> torch.Tensor:
    """A flat uint8 CUDA tensor over ``nbytes`` at ``addr``: memory this process mapped and does not
    own through the tensor (the mapping's owner unmaps it once the tensor is dropped)."""
    import cupy

    with cupy.cuda.Device(device):
        mem = cupy.cuda.UnownedMemory(addr, nbytes, owner=None, device_id=device)
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=f"cuda:{device}")


class CudaIpcMapping(Mapping):
    def __init__(self, h: MemoryHandle, table: "DeviceMappings"):
        self._table, self._key, self._device = table, h.handle, h.device
        base = table.open(h.handle, h.device)
        self.tensor = device_bytes(base + h.offset, h.nbytes, h.device)

    def close(self) -> None:
        self.tensor = None
        self._table.close(self._key, self._device)


class DeviceMappings:
    """CUDA IPC handles opened by this service process, reference-counted.

    A process may open one IPC handle only once; two registrations carved from one ``cudaMalloc``
    allocation share the mapping, which is closed when the last of them is released. One instance
    per service (no module-level state).
    """

    def __init__(self):
        self._open: dict[tuple[bytes, int], list] = {}

    def open(self, handle: bytes, device: int) -> int:
        entry = self._open.get((handle, device))
        if entry is None:
            import cupy

            with cupy.cuda.Device(device):
                try:
                    base = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                except cupy.cuda.runtime.CUDARuntimeError as exc:
                    raise ProtocolError(f"memory: cannot open the CUDA IPC handle: {exc}") from exc
            entry = [base, 0]
            self._open[(handle, device)] = entry
        entry[1] += 1
        return entry[0]

    def close(self, handle: bytes, device: int) -> None:
        entry = self._open.get((handle, device))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            import cupy

            del self._open[(handle, device)]
            with cupy.cuda.Device(device):
                cupy.cuda.runtime.ipcCloseMemHandle(entry[0])

    def __len__(self) -> int:
        return len(self._open)
