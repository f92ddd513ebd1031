"""Batched SHA-256 and the kmesh-tree-sha256/v1 digest on the device where the bytes are.

Public functions (DESIGN §3; the format is specified in docs/tree-sha256.md):

- :func:`sha256_batched` — many independent messages per launch, equal to ``hashlib.sha256``.
- :func:`tree_digests` — kmesh-tree-sha256/v1 roots of many objects; equal to
  ``kmesh_host.tree_digest``. CuPy: the whole tree of every object in one launch (a thread per
  leaf; the last child to finish a node hashes it, up to the root record); Warp: one batched launch
  per tree level for all objects at once, then one launch for the root records.
- :func:`verify_tree_roots` — checks restored objects where they landed against stored roots and
  raises :class:`IntegrityError` naming the first bad object (only 32 bytes per object come back).

Backends: ``"cupy"`` (CUDA, ``csrc/sha256.cu``: the fast path), ``"warp"`` (CPU and CUDA, the same
kernel logic; how CI checks it on CPU), ``"host"`` (hashlib on the CPU, the reference; ``"torch"`` is
accepted as its other name, as elsewhere in ``kmesh_gpu`` the reference backend is called).
``"auto"`` picks cupy for CUDA tensors when CuPy has a device, else warp, and host for CPU tensors.

Launches go to torch's current stream on the data's device, so they are ordered after the copies
that produced the data; the returned digests are ready for any later work on that stream. Nothing in
these calls waits for the device or copies results back (CuPy tree: plan tables go up through pinned
memory, asynchronously, once per stream).

Repeated CuPy tree calls: once a call's (offsets, lengths, leaf_size, fanout) values have passed every
check, they are remembered with their plan; the same values again (numpy or CPU torch int64[N], or a
list of ints) over a contiguous CUDA uint8 tensor holding enough bytes skip the conversions and checks
and cost one output allocation and one launch (``_tree_fast``, ``_StreamLauncher``).
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import torch

from . import _backend, cuda
# the tree's format constants and its host-side plans (kept importable from here: see __all__)
from ._sha_plans import (_THREADS, DEFAULT_FANOUT, DEFAULT_LEAF_SIZE, TREE_DOMAIN, TREE_FORMAT, _FusedPlan, _fused_plan,
                         _Level, _tree_plan, _TreePlan, root_header)
from .errors import BackendError, IntegrityError, LayoutError

# Parameter ranges every v1 implementation accepts (docs/tree-sha256.md §Parameters).
MAX_LEAF_SIZE = 1 << 30
MAX_FANOUT = 1 << 24

BACKENDS = ("host", "warp", "cupy")
_WARP_MAX_BYTES = (1 << 31) - 1                      # Warp indexes arrays with int32
_I64 = np.dtype(np.int64)


# ----------------------------------------------------------------------------------------------
# Parameters and arguments
# ----------------------------------------------------------------------------------------------

def check_tree_params(leaf_size, fanout) -> None:
    """Raise :class:`IntegrityError` unless (leaf_size, fanout) are valid v1 parameters."""
    if type(leaf_size) is not int or not 64 <= leaf_size <= MAX_LEAF_SIZE or leaf_size % 64:
        raise IntegrityError(f"{TREE_FORMAT}: leaf_size must be a multiple of 64 in "
                             f"[64, {MAX_LEAF_SIZE}], got {leaf_size!r}")
    if type(fanout) is not int or not 2 <= fanout <= MAX_FANOUT:
        raise IntegrityError(f"{TREE_FORMAT}: fanout must be an integer in [2, {MAX_FANOUT}], "
                             f"got {fanout!r}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)} on {x.device}"
    if isinstance(x, np.ndarray):
        return f"numpy {x.dtype}{list(x.shape)}"
    return type(x).__name__


def _as_data(data) -> torch.Tensor:
    """``data`` as a contiguous 1-D torch uint8 tensor (numpy and bytes-like are viewed, not copied)."""
    if isinstance(data, torch.Tensor):
        if data.dtype is not torch.uint8 or data.dim() != 1:
            raise LayoutError(f"data: expected uint8[M], got {_describe(data)}")
        if not data.is_contiguous():
            raise LayoutError(f"data: expected a contiguous uint8[M] tensor, got stride {data.stride()}")
        return data
    if not isinstance(data, np.ndarray):
        try:
            view = memoryview(data)
            if view.format.lstrip("@=<>!") == "O":   # a numpy object array's pointers, not bytes
                raise TypeError
            data = np.frombuffer(view.cast("B"), dtype=np.uint8)
        except (TypeError, ValueError):
            raise LayoutError(f"data: expected a uint8[M] torch tensor, numpy array or bytes-like, "
                              f"got {_describe(data)}") from None
    if data.dtype != np.uint8 or data.ndim != 1:
        raise LayoutError(f"data: expected uint8[M], got {_describe(data)}")
    if not data.flags.c_contiguous:
        raise LayoutError("data: expected a contiguous uint8[M] array")
    with warnings.catch_warnings():                  # read-only buffers: we never write to data
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _as_index(x, name: str) -> np.ndarray:
    """``x`` (torch or numpy int64[N], any device; or a sequence of ints) as a host int64 array."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1 or (x.dtype is not _I64 and x.dtype != np.int64):
            raise LayoutError(f"{name}: expected int64[N], got {_describe(x)}")
        return x
    if isinstance(x, torch.Tensor):
        if x.dtype is not torch.int64 or x.dim() != 1:
            raise LayoutError(f"{name}: expected int64[N], got {_describe(x)}")
        if x.is_cpu and not x.requires_grad:
            return x.numpy()                         # a view: no copy, no extra torch op
        return x.detach().cpu().numpy()              # device offsets: one small download
    if isinstance(x, (list, tuple)) and all(type(v) is int for v in x):
        try:
            return np.asarray(x, dtype=np.int64).reshape(-1)
        except OverflowError:
            raise LayoutError(f"{name}: a value lies outside int64") from None
    raise LayoutError(f"{name}: expected int64[N] (torch, numpy or a list of ints), got {_describe(x)}")


def _index_error(offs: np.ndarray, lens: np.ndarray, size: int) -> LayoutError | None:
    """The first thing wrong with the messages, in a fixed order (the error each call raises)."""
    if int(offs.min()) < 0:
        i = int(np.argmin(offs))
        return LayoutError(f"offsets: expected >= 0, got offsets[{i}] = {int(offs[i])}")
    if int(lens.min()) < 0:
        i = int(np.argmin(lens))
        return LayoutError(f"lengths: expected >= 0, got lengths[{i}] = {int(lens[i])}")
    over = np.nonzero(offs > size - lens)[0]         # offs + lens > size, without int64 overflow
    if over.size:
        i = int(over[0])
        return LayoutError(f"offsets/lengths: message {i} = data[{int(offs[i])}:"
                           f"{int(offs[i]) + int(lens[i])}] runs past the end of data (M={size})")
    return None


_SMALL_N = 32                                        # up to here Python beats numpy's per-call overhead


def _messages(data, offsets, lengths) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    t = _as_data(data)
    offs = _as_index(offsets, "offsets")
    lens = _as_index(lengths, "lengths")
    n = offs.shape[0]
    if lens.shape[0] != n:
        raise LayoutError(f"offsets and lengths: expected the same shape, got int64{list(offs.shape)} "
                          f"and int64{list(lens.shape)}")
    if n:
        size = t.numel()
        if n <= _SMALL_N:                            # the common case: a few objects, checked in Python
            ol, ll = offs.tolist(), lens.tolist()
            ok = min(ol) >= 0 and min(ll) >= 0 and all(o + m <= size for o, m in zip(ol, ll))
        else:
            ok = not ((offs < 0).any() or (lens < 0).any() or (offs > size - lens).any())
        if not ok:
            raise _index_error(offs, lens, size)
        if not offs.flags.c_contiguous:
            offs = np.ascontiguousarray(offs)
        if not lens.flags.c_contiguous:
            lens = np.ascontiguousarray(lens)
    return t, offs, lens


def _resolve(backend: str, device: torch.device) -> str:
    if backend == "torch":
        backend = "host"
    if backend == "auto":
        if device.type == "cuda":
            if _backend.has_cupy():
                return "cupy"
            return "warp" if _backend.has_warp() else "host"
        return "host"
    if backend not in BACKENDS:
        raise BackendError(f"backend: expected one of {BACKENDS + ('auto',)}, got {backend!r}")
    if backend == "cupy":
        if device.type != "cuda":
            raise BackendError(f"backend 'cupy' needs CUDA tensors, got data on {device}")
        if not _backend.has_cupy():
            raise BackendError("backend 'cupy' requested but cupy (with a CUDA device) is unavailable")
    if backend == "warp":
        if not _backend.has_warp():
            raise BackendError("backend 'warp' requested but the warp-lang package is not installed")
    if device.type not in ("cpu", "cuda"):
        raise BackendError(f"sha256: unsupported device {device}")
    return backend


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------

def _host_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().numpy())


def _host_batched(t, offs, lens) -> np.ndarray:
    view = _host_view(t)
    out = np.empty((offs.size, 32), dtype=np.uint8)
    for i, (o, n) in enumerate(zip(offs.tolist(), lens.tolist())):
        out[i] = np.frombuffer(hashlib.sha256(view[o:o + n]).digest(), np.uint8)
    return out


def _host_level(src: memoryview, lvl: _Level, out: np.ndarray) -> None:
    h = hashlib.sha256
    for o in range(lvl.n_obj):
        base, size, dst = int(lvl.src_off[o]), int(lvl.src_bytes[o]), int(lvl.out_off[o])
        for j in range(int(lvl.starts[o + 1] - lvl.starts[o])):
            begin = j * lvl.piece
            msg = src[base + begin:base + min(size, begin + lvl.piece)]
            out[dst + 32 * j:dst + 32 * j + 32] = np.frombuffer(h(msg).digest(), np.uint8)


def _host_tree(t, plan: _TreePlan) -> np.ndarray:
    data = _host_view(t)
    buf = np.zeros(plan.total_bytes, dtype=np.uint8)
    buf[:plan.host_bytes.size] = plan.host_bytes
    for lvl in plan.levels:
        _host_level(data if lvl.from_data else memoryview(buf), lvl, buf)
    out = np.empty(32 * plan.root.n_obj, dtype=np.uint8)
    _host_level(memoryview(buf), plan.root, out)
    return out.reshape(-1, 32)


def _upload(host: np.ndarray, dst: torch.Tensor) -> None:
    """Copy host bytes into the front of device buffer ``dst`` without a host-device sync."""
    if host.size == 0:
        return
    if not dst.is_cuda:                              # CPU stand-ins (tests): a plain copy
        dst[:host.size].copy_(torch.from_numpy(host.copy()))
        return
    staging = torch.empty(host.size, dtype=torch.uint8, pin_memory=True)
    staging.numpy()[:] = host
    dst[:host.size].copy_(staging, non_blocking=True)    # the caching host allocator keeps it alive


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    # A zero-size tensor may have a null pointer; every message is then empty and nothing is read.
    return t if t.numel() else torch.zeros(16, dtype=torch.uint8, device=t.device)


class _CupyLauncher:
    """Launches ``csrc/sha256.cu`` kernels on torch's current stream of the data's device."""

    def __init__(self, device: torch.device):
        import cupy

        from ._jit import cupy_stream

        self.cupy = cupy
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        handle = torch.cuda.current_stream(self.index).cuda_stream
        self.handle = handle
        self.stream = cupy_stream(handle, self.index) if handle else cupy.cuda.Stream.null

    def __call__(self, kernel_name: str, n_threads: int, args: tuple) -> None:
        if n_threads <= 0:
            return
        from ._jit import get_kernel

        kernel = get_kernel("sha256.cu", kernel_name, device_id=self.index)
        grid = (n_threads + _THREADS - 1) // _THREADS
        with self.cupy.cuda.Device(self.index), self.stream:
            kernel((grid,), (_THREADS,), args)


def _ptr(t: torch.Tensor, byte_offset: int = 0) -> np.uint64:
    return np.uint64(t.data_ptr() + byte_offset)


def _cupy_batched(t, offs, lens, out) -> None:
    n = offs.size
    index = torch.empty(2 * n, dtype=torch.int64, device=t.device)
    _upload(np.concatenate((offs, lens)).view(np.uint8), index.view(torch.uint8))
    data = _nonempty(t)
    _CupyLauncher(t.device)("kmesh_sha256_batched", n, (_ptr(data), _ptr(index), _ptr(index, 8 * n), _ptr(out),
                                             np.int64(n)))


_FUSED_MAX_BYTES = 256 << 20                         # batches at least this large take the per-level path
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_LAUNCHERS: dict[tuple[int, int], "_StreamLauncher"] = {}
_LAUNCHER_PLANS = 64                                 # plans prepared per launcher before it forgets them


def _fused_counters(device: torch.device, index: int, stream: int, n: int) -> torch.Tensor:
    """A zeroed counter buffer kept per device and stream, which every fused launch leaves zero again."""
    key = (index, stream)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        # Zeroed on this stream, so ordered before the launch; the old buffer goes back to the
        # caching allocator, which hands it only to later work on this stream.
        c = torch.zeros(max(1024, 2 * n), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


_stream_handle = cuda.current_stream  # torch's current stream as a raw handle (no Stream object)
_RESET = np.int32(1)
_BLOCK = (_THREADS,)


class _StreamLauncher:
    """Everything the fused tree launch needs on one (device, stream), resolved once.

    The CuPy function object and stream, the self-resetting counters (``_COUNTERS``), a digest scratch
    buffer, and per plan a device copy of its table with the launch arguments that do not change from
    call to call. Launches on one stream run in order, so consecutive calls may share the scratch and
    counters; another stream gets its own launcher. A call then costs one output allocation, two pointers
    and the launch itself.
    """

    __slots__ = ("index", "handle", "device", "fn", "stream", "getdev", "device_ctx", "scratch",
                 "counters_ptr", "prepared", "tables")

    def __init__(self, index: int, handle: int, device: torch.device):
        self.index, self.handle, self.device = index, handle, device
        self.scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self.counters_ptr = 0
        self.prepared: dict[_FusedPlan, tuple] = {}
        self.tables: dict[_FusedPlan, torch.Tensor] = {}
        self._bind()

    def _bind(self) -> None:
        import cupy

        from ._jit import cupy_stream, get_kernel

        kernel = get_kernel("sha256.cu", "kmesh_sha256_tree_fused", device_id=self.index)
        with cupy.cuda.Device(self.index):
            # RawKernel -> the device's Function, which takes the stream as an argument (no stream
            # context to enter and leave per call).
            self.fn = getattr(kernel, "kernel", kernel)
        self.stream = cupy_stream(self.handle, self.index) if self.handle else cupy.cuda.Stream.null
        self.getdev = cupy.cuda.runtime.getDevice
        self.device_ctx = cupy.cuda.Device

    def prepare(self, plan: _FusedPlan) -> tuple:
        """The constant middle of the argument tuple for ``plan`` (uploads its table, grows buffers)."""
        ctr = _fused_counters(self.device, self.index, self.handle, plan.n_counters)
        need = 32 * max(1, plan.n_slots)
        grown = self.scratch.numel() < need
        if grown:
            # Allocated on this lane's stream: the old buffer's memory is only handed to later work on it.
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.uint8,
                                       device=self.device)
        if grown or ctr.data_ptr() != self.counters_ptr or len(self.prepared) >= _LAUNCHER_PLANS:
            self.prepared.clear()                    # pointers into replaced buffers
            self.tables.clear()
            self.counters_ptr = ctr.data_ptr()
        table = torch.empty(plan.table.size, dtype=torch.int64, device=self.device)
        _upload(plan.table.view(np.uint8), table.view(torch.uint8))   # on this stream, no sync
        mid = (np.uint64(table.data_ptr()), np.int64(plan.n_obj), np.int64(plan.n_leaves),
               np.int64(plan.leaf_size), np.int64(plan.fanout), np.uint64(self.scratch.data_ptr()),
               np.uint64(ctr.data_ptr()))
        self.tables[plan] = table
        self.prepared[plan] = mid
        return mid

    def run(self, data: torch.Tensor, plan: _FusedPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch the fused tree of ``plan`` over ``data`` (non-empty, on this launcher's device)."""
        mid = self.prepared.get(plan)
        if mid is None:
            mid = self.prepare(plan)
        if out is None:
            out = data.new_empty((plan.n_obj, 32))   # a fresh tensor per call, on the current stream
        args = (np.uint64(data.data_ptr()),) + mid + (np.uint64(out.data_ptr()), _RESET)
        if self.getdev() == self.index:
            if not cuda.launch(self.fn, plan.grid, _BLOCK, self.handle, args):
                self.fn(plan.grid, _BLOCK, args, stream=self.stream)
        else:
            with self.device_ctx(self.index):
                self.fn(plan.grid, _BLOCK, args, stream=self.stream)
        return out


def _launcher(t: torch.Tensor) -> _StreamLauncher:
    index = t.get_device()
    handle = _stream_handle(index)
    launcher = _LAUNCHERS.get((index, handle))
    if launcher is None:
        launcher = _LAUNCHERS[(index, handle)] = _StreamLauncher(index, handle, t.device)
    return launcher


def _cupy_tree_fused(t, plan: _FusedPlan, out, leaf_size: int, fanout: int) -> None:
    if (leaf_size, fanout) != (plan.leaf_size, plan.fanout):
        raise BackendError(f"fused plan for ({plan.leaf_size}, {plan.fanout}) used with ({leaf_size}, {fanout})")
    _launcher(t).run(_nonempty(t), plan, out)


# Validated calls: (offsets key, lengths key, leaf_size, fanout) -> their fused plan. A key is the
# index values themselves (bytes of an int64[N] array, or a tuple of Python ints), entered only after
# the call passed every check, so the same values again with enough payload bytes need no checks.
_VALIDATED: dict[tuple, _FusedPlan] = {}
_VALIDATED_MAX = 256


def _key_part(x):
    """A hashable copy of index values ``x`` when it is of a fast-path kind, else None.

    numpy ``int64[N]`` and CPU torch ``int64[N]`` give their bytes; a list or tuple of Python ints
    gives a tuple (bools and numpy integers compare equal to ints, so their lists are refused)."""
    tx = type(x)
    if tx is np.ndarray:
        return x.tobytes() if x.dtype is _I64 and x.ndim == 1 else None
    if tx is torch.Tensor:
        if x.dtype is torch.int64 and x.is_cpu and not x.requires_grad and x.dim() == 1:
            return x.numpy().tobytes()
        return None
    if tx is list or tx is tuple:
        for v in x:
            if type(v) is not int:
                return None
        return tuple(x)
    return None


def _remember(offsets, lengths, leaf_size: int, fanout: int, plan: _FusedPlan) -> None:
    ko = _key_part(offsets)
    kl = _key_part(lengths) if ko is not None else None
    if kl is None:
        return
    if len(_VALIDATED) >= _VALIDATED_MAX:
        del _VALIDATED[next(iter(_VALIDATED))]       # the oldest
    _VALIDATED[(ko, kl, leaf_size, fanout)] = plan


def _tree_fast(data, offsets, lengths, leaf_size, fanout):
    """:func:`tree_digests` by CuPy for a call seen before, or None (then the full path decides).

    Taken when ``data`` is a contiguous CUDA ``uint8[M]`` tensor, the (offsets, lengths, leaf_size,
    fanout) values passed every check before, and ``data`` holds the ``end`` bytes they need: no
    conversion, no validation beyond that, no plan work; one allocation and one launch.
    """
    if type(leaf_size) is not int or type(fanout) is not int or type(data) is not torch.Tensor:
        return None
    ko = _key_part(offsets)
    if ko is None:
        return None
    kl = _key_part(lengths)
    if kl is None:
        return None
    plan = _VALIDATED.get((ko, kl, leaf_size, fanout))
    if (plan is None or data.dtype is not torch.uint8 or data.dim() != 1 or not data.is_contiguous()
            or data.numel() < plan.end or data.numel() == 0):
        return None
    index = data.get_device()
    if index < 0:
        return None
    launcher = _LAUNCHERS.get((index, _stream_handle(index)))
    return (launcher or _launcher(data)).run(data, plan)


def _tree_launch(data: torch.Tensor, offsets, lengths, leaf_size: int, fanout: int, stream: int,
                 out: torch.Tensor) -> bool:
    """The roots of a call :func:`tree_digests` made before with these offsets, lengths and
    parameters on the raw stream ``stream`` (its checks passed, its plan and launch arguments are
    ready there) into ``out`` by one launch there; ``False``, with nothing launched, otherwise."""
    if type(offsets) is not tuple or type(lengths) is not tuple or type(data) is not torch.Tensor \
            or type(out) is not torch.Tensor:
        return False
    plan = _VALIDATED.get((offsets, lengths, leaf_size, fanout))
    # the launch writes 32 bytes per object from out's first byte and reads data's bytes from its
    # first: both must be what tree_digests accepts (the full path checks, and names, anything else)
    if (plan is None or data.dtype is not torch.uint8 or data.dim() != 1 or not data.is_contiguous()
            or data.numel() < plan.end or out.dtype is not torch.uint8 or out.dim() != 2
            or out.shape[0] != plan.n_obj or out.shape[1] != 32 or not out.is_contiguous()
            or out.device != data.device):
        return False
    launcher = _LAUNCHERS.get((data.get_device(), stream))
    if launcher is None or plan not in launcher.prepared:
        return False
    launcher.run(data, plan, out)
    return True


def _cupy_tree(t, plan: _TreePlan, out) -> None:
    """The one-launch-per-level path (large batches, ``_FUSED_MAX_BYTES``)."""
    buf = torch.empty(plan.total_bytes, dtype=torch.uint8, device=t.device)
    front = plan.device_bytes(t.device)
    buf[:front.numel()].copy_(front)
    launch = _CupyLauncher(t.device)
    data = _nonempty(t)
    for lvl in plan.levels:
        src = data if lvl.from_data else buf
        launch("kmesh_sha256_tree_level", lvl.n_msgs,
               (_ptr(src), np.int64(lvl.piece), _ptr(buf, 8 * lvl.table_at), np.int64(lvl.n_obj),
                np.int64(lvl.n_msgs), _ptr(buf)))
    r = plan.root
    launch("kmesh_sha256_tree_level", r.n_msgs,
           (_ptr(buf), np.int64(r.piece), _ptr(buf, 8 * r.table_at), np.int64(r.n_obj),
            np.int64(r.n_msgs), _ptr(out)))


class _WarpLauncher:
    """Runs the Warp kernels (``_sha256_warp``) on the data's device, on torch's current stream."""

    def __init__(self, device: torch.device):
        from . import _sha256_warp

        self.k = _sha256_warp
        self.wp = _sha256_warp.wp
        self.device = _backend.warp_device(device)
        self.stream = self.wp.stream_from_torch(device) if device.type == "cuda" else None
        self.consts = (_sha256_warp.initial_state(), _sha256_warp.round_constants(self.device))

    def array(self, t: torch.Tensor, dtype):
        if t.numel() > _WARP_MAX_BYTES:
            raise BackendError(f"backend 'warp' indexes with int32: {t.numel()} bytes is too large, "
                               f"use backend 'cupy' or 'host'")
        return self.wp.array(ptr=t.data_ptr(), shape=(t.numel(),), dtype=dtype, device=self.device)

    def launch(self, kernel, dim: int, inputs: list) -> None:
        if dim > 0:
            self.wp.launch(kernel, dim=dim, inputs=inputs, device=self.device, stream=self.stream)


def _warp_batched(t, offs, lens, out) -> None:
    w = _WarpLauncher(t.device)
    index = torch.from_numpy(np.concatenate((offs, lens))).to(t.device)
    n = offs.size
    w.launch(w.k.sha256_batched_kernel, n,
             [w.array(_nonempty(t), w.wp.uint8), w.array(index[:n], w.wp.int64),
              w.array(index[n:], w.wp.int64), *w.consts, w.array(out.view(-1), w.wp.uint8)])
    if t.device.type == "cpu":
        w.wp.synchronize_device(w.device)


def _warp_tree(t, plan: _TreePlan, out) -> None:
    w = _WarpLauncher(t.device)
    buf = torch.empty(plan.total_bytes, dtype=torch.uint8, device=t.device)
    buf[:plan.host_bytes.size].copy_(torch.from_numpy(plan.host_bytes.copy()))
    buf_u8 = w.array(buf, w.wp.uint8)
    table = w.array(buf[:8 * (plan.host_bytes.size // 8)].view(torch.int64), w.wp.int64)
    data = w.array(_nonempty(t), w.wp.uint8)
    for lvl in plan.levels + (plan.root,):
        src = data if lvl.from_data else buf_u8
        dst = w.array(out.view(-1), w.wp.uint8) if lvl is plan.root else buf_u8
        w.launch(w.k.sha256_tree_level_kernel, lvl.n_msgs,
                 [src, lvl.piece, table, lvl.table_at, lvl.n_obj, *w.consts, dst])
    if t.device.type == "cpu":
        w.wp.synchronize_device(w.device)
    # On CUDA, buf may be freed as soon as this returns: torch's caching allocator hands its memory
    # only to later work on the same stream, which runs after these launches.


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def sha256_batched(data, offsets, lengths, *, backend: str = "auto") -> torch.Tensor:
    """SHA-256 of many messages of one byte buffer; equal to ``hashlib.sha256`` for every length.

    Args:
        data: ``uint8[M]`` — a contiguous 1-D torch tensor (CPU or CUDA), or on the CPU a numpy
            array or any bytes-like object (viewed, not copied).
        offsets: ``int64[N]`` — byte offset of message ``i`` in ``data`` (torch on any device,
            numpy, or a list of ints).
        lengths: ``int64[N]`` — byte length of message ``i``; ``offsets[i] + lengths[i] <= M``.
            Messages may overlap and may be empty.
        backend: ``"auto"``, ``"cupy"``, ``"warp"`` or ``"host"`` (module docstring).

    Returns:
        ``uint8[N, 32]`` torch tensor on ``data``'s device (CPU for numpy/bytes input): row ``i``
        is the digest of ``data[offsets[i]:offsets[i] + lengths[i]]``.

    Raises:
        LayoutError: an argument has the wrong dtype, shape, or a message leaves ``data``.
        BackendError: the backend is unknown or unavailable for ``data``'s device.
    """
    t, offs, lens = _messages(data, offsets, lengths)
    kind = _resolve(backend, t.device)
    n = offs.size
    if kind == "host" or n == 0:
        digests = _host_batched(t, offs, lens) if n else np.empty((0, 32), np.uint8)
        return torch.from_numpy(digests).to(t.device)
    out = torch.empty((n, 32), dtype=torch.uint8, device=t.device)
    if kind == "cupy":
        _cupy_batched(t, offs, lens, out)
    else:
        _warp_batched(t, offs, lens, out)
    return out


def tree_digests(data, offsets, lengths, *, leaf_size: int = DEFAULT_LEAF_SIZE, fanout: int = DEFAULT_FANOUT,
                 backend: str = "auto", out: torch.Tensor | None = None, stream: int | None = None) -> torch.Tensor:
    """kmesh-tree-sha256/v1 roots of many objects (docs/tree-sha256.md); CuPy: one launch in all.

    Args:
        data, offsets, lengths: as in :func:`sha256_batched`; object ``i`` is
            ``data[offsets[i]:offsets[i] + lengths[i]]`` (may be empty).
        leaf_size: bytes per leaf, a multiple of 64 in [64, 2**30] (default 4096).
        fanout: digests per inner node, in [2, 2**24] (default 64).
        backend: as in :func:`sha256_batched`.
        out: optional ``uint8[N, 32]`` destination (contiguous, on ``data``'s device).
        stream: optional raw CUDA stream handle to queue the work on instead of torch's current
            stream. A call repeated on that stream with the same offsets and lengths (as tuples of
            ints) and parameters, into ``out``, is one launch and nothing else: the restore routes
            digest objects from a reader's completion thread this way.

    Returns:
        ``uint8[N, 32]`` torch tensor on ``data``'s device (``out`` when given): row ``i`` equals
        ``kmesh_host.tree_digest(object_i, leaf_size=leaf_size, fanout=fanout)``.

    Raises:
        LayoutError, BackendError: as in :func:`sha256_batched`.
        IntegrityError: ``leaf_size`` or ``fanout`` is not a valid v1 parameter.
    """
    if stream is not None:
        if type(stream) is not int or stream < 0:
            raise LayoutError(f"stream: expected a raw CUDA stream handle (an int >= 0), got {stream!r}")
        if type(data) is not torch.Tensor or data.get_device() < 0:
            raise LayoutError(f"stream: given for data that is not a CUDA tensor ({_describe(data)}); a stream "
                              f"orders CUDA work")
        if out is not None and (backend == "auto" or backend == "cupy") \
                and _tree_launch(data, offsets, lengths, leaf_size, fanout, stream, out):
            return out
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=data.device)):
            return tree_digests(data, offsets, lengths, leaf_size=leaf_size, fanout=fanout, backend=backend, out=out)
    if backend == "auto" or backend == "cupy":
        got = _tree_fast(data, offsets, lengths, leaf_size, fanout)
        if got is not None:                          # a call seen (and checked) before: launch only
            return _into(got, out)
    check_tree_params(leaf_size, fanout)
    t, offs, lens = _messages(data, offsets, lengths)
    kind = _resolve(backend, t.device)
    if offs.size == 0:
        return _into(torch.empty((0, 32), dtype=torch.uint8, device=t.device), out)
    if kind == "cupy":
        # Large batches are throughput-bound: there the per-level launches keep more warps busy
        # (1 GiB: 538 against 417 GB/s on an H200); small ones are latency-bound (12 MiB: one launch
        # 0.195 ms against 0.264 ms of device time).
        path = "levels" if int(lens.sum()) >= _FUSED_MAX_BYTES else "fused"
        if out is not None and (out.dtype != torch.uint8 or tuple(out.shape) != (offs.size, 32)
                                or not out.is_contiguous() or out.device != t.device):
            raise LayoutError(f"out: expected a contiguous uint8[{offs.size}, 32] on {t.device}, got {_describe(out)}")
        return _tree_digests_cupy(t, offs, lens, leaf_size, fanout, path, key=(offsets, lengths), out=out)
    plan = _tree_plan(offs.tobytes(), lens.tobytes(), leaf_size, fanout)
    if kind == "host":
        return _into(torch.from_numpy(_host_tree(t, plan)).to(t.device), out)
    got = torch.empty((offs.size, 32), dtype=torch.uint8, device=t.device)
    _warp_tree(t, plan, got)
    return _into(got, out)


def _into(got: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return got
    if out.dtype != torch.uint8 or out.shape != got.shape or out.device != got.device:
        raise LayoutError(f"out: expected uint8{list(got.shape)} on {got.device}, got {_describe(out)}")
    out.copy_(got)
    return out


def _tree_digests_cupy(t, offs, lens, leaf_size: int, fanout: int, path: str, *, key=None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The CuPy tree digest by ``path`` ("fused" or "levels"); arguments already checked. ``key``: the
    caller's (offsets, lengths) as given, remembered as validated for the fast path (fused)."""
    if out is None:
        out = t.new_empty((offs.size, 32))
    if path == "fused":
        plan = _fused_plan(offs.tobytes(), lens.tobytes(), leaf_size, fanout)
        _cupy_tree_fused(t, plan, out, leaf_size, fanout)
        if key is not None:
            _remember(key[0], key[1], leaf_size, fanout, plan)
    else:
        _cupy_tree(t, _tree_plan(offs.tobytes(), lens.tobytes(), leaf_size, fanout), out)
    return out


def _tree_digests_by_path(data, offsets, lengths, *, path: str, leaf_size: int = DEFAULT_LEAF_SIZE,
                          fanout: int = DEFAULT_FANOUT) -> torch.Tensor:
    """:func:`tree_digests` with backend "cupy" by a named path ("fused" or "levels") whatever the
    size (tests of both paths, ``perf/run_sha256.py``'s comparison of the two)."""
    if path not in ("fused", "levels"):
        raise BackendError(f"path: expected 'fused' or 'levels', got {path!r}")
    check_tree_params(leaf_size, fanout)
    t, offs, lens = _messages(data, offsets, lengths)
    _resolve("cupy", t.device)
    if offs.size == 0:
        return torch.empty((0, 32), dtype=torch.uint8, device=t.device)
    return _tree_digests_cupy(t, offs, lens, leaf_size, fanout, path, key=(offsets, lengths))


def _as_roots(expected_roots, n: int, device: torch.device) -> torch.Tensor:
    if isinstance(expected_roots, (torch.Tensor, np.ndarray)):
        roots = torch.as_tensor(expected_roots)
        if roots.dtype != torch.uint8 or tuple(roots.shape) != (n, 32):
            raise LayoutError(f"expected_roots: expected uint8[N={n}, 32], got {_describe(expected_roots)}")
        return roots.to(device)
    rows = list(expected_roots)
    if len(rows) != n or any(not isinstance(r, (bytes, bytearray)) or len(r) != 32 for r in rows):
        raise LayoutError(f"expected_roots: expected {n} digests of 32 bytes each")
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(n, 32).to(device)


def verify_tree_roots(data, offsets, lengths, expected_roots, *, names=None,
                      leaf_size: int = DEFAULT_LEAF_SIZE, fanout: int = DEFAULT_FANOUT,
                      backend: str = "auto") -> None:
    """Check objects where they landed against their stored kmesh-tree-sha256/v1 roots.

    The roots are computed on ``data``'s device (:func:`tree_digests`) and compared there; only one
    flag per object is copied back, never the payload.

    Args:
        data, offsets, lengths, leaf_size, fanout, backend: as in :func:`tree_digests`.
        expected_roots: ``uint8[N, 32]`` (torch on any device, or numpy) or a sequence of N 32-byte
            ``bytes`` — the roots stored with the objects.
        names: optional sequence of N names used in the error message (default ``object i``).

    Raises:
        IntegrityError: some object's root differs; the message names the first such object and
            counts the others. The stored format keeps only the root, so the bad leaf is not known.
        LayoutError, BackendError: as in :func:`tree_digests`.
    """
    got = tree_digests(data, offsets, lengths, leaf_size=leaf_size, fanout=fanout, backend=backend)
    n = got.shape[0]
    if names is not None and len(names) != n:
        raise LayoutError(f"names: expected {n} names, got {len(names)}")
    want = _as_roots(expected_roots, n, got.device)
    bad = torch.nonzero((got != want).any(dim=1)).flatten().cpu().tolist()
    if bad:
        first = bad[0]
        label = repr(names[first]) if names is not None else f"object {first}"
        others = f" (and {len(bad) - 1} more of {n})" if len(bad) > 1 else ""
        raise IntegrityError(
            f"{TREE_FORMAT} mismatch for {label}{others}: computed root {bytes(got[first].cpu().tolist()).hex()}"
            f", stored {bytes(want[first].cpu().tolist()).hex()}")


__all__ = ["BACKENDS", "DEFAULT_FANOUT", "DEFAULT_LEAF_SIZE", "MAX_FANOUT", "MAX_LEAF_SIZE", "TREE_DOMAIN",
           "TREE_FORMAT", "check_tree_params", "root_header", "sha256_batched", "tree_digests", "verify_tree_roots"]
