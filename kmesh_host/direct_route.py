"""The ``direct`` route: KvikIO/cuFile reads straight into GPU memory, then the same verification
and placement as the host-staging route (:mod:`kmesh_host.routes`, whose module docstring describes
both routes and whose :func:`~kmesh_host.routes.restore` dispatches here).

The report says which mechanism moved the bytes: GPUDirect Storage only where cuFile runs with
nvidia-fs; KvikIO's compatibility mode (POSIX reads through a bounce buffer) is never labelled
direct. The destination is also exported as a DMA-BUF where the device supports it, and the report
says whether that worked.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

from kmesh_gpu.errors import BackendError, IntegrityError

from ._streams import _Streams
from .routes import (RestoreResult, RouteReport, _check_device, _check_placement, _check_targets,
                     _integrity_failure, _layout_offsets, _sync, _timed_placement, _Verifier)
from .segment import ModelFingerprint, check_fingerprint
from .store import SegmentStore

_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124

def _kvikio():
    try:
        import kvikio
    except ImportError as exc:
        raise BackendError("route 'direct' needs the kvikio package (KvikIO/cuFile); it is not installed") from exc
    return kvikio


def _device_attribute(attribute: int, ordinal: int) -> int | None:
    """A CUDA driver device attribute through libcuda (None where the driver cannot be asked)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        if lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev) != 0:
            return None
        return value.value
    except OSError:
        return None


def direct_facts(device: torch.device) -> dict:
    """What the platform offers the direct route, from the KvikIO/cuFile driver and the kernel.

    Targets KvikIO >= 25.04 (``kvikio.defaults.is_compat_mode_preferred``,
    ``kvikio.cufile_driver.get``); an older KvikIO gives ``"unknown"`` answers, which the route
    treats as "not GDS".
    """
    kvikio = _kvikio()
    facts: dict = {"kvikio_version": getattr(kvikio, "__version__", "unknown")}
    try:
        facts["kvikio_compat_mode"] = str(kvikio.defaults.get("compat_mode"))
        facts["kvikio_compat_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        facts["kvikio_compat_preferred"] = f"unknown ({type(exc).__name__})"
    try:
        import kvikio.cufile_driver as drv

        facts["gds_available"] = bool(drv.get("is_gds_available"))
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        facts["gds_available"] = f"unknown ({type(exc).__name__})"
    try:
        with open("/proc/modules") as f:
            facts["nvidia_fs_loaded"] = any(line.startswith("nvidia_fs ") for line in f)
    except OSError:
        facts["nvidia_fs_loaded"] = "unknown"
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    dmabuf = _device_attribute(_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, ordinal)
    facts["device_dmabuf_supported"] = None if dmabuf is None else bool(dmabuf)
    return facts


_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def _export_dmabuf(buffer: torch.Tensor) -> dict:
    """Export ``buffer``'s device memory as a DMA-BUF file descriptor (``cuMemGetHandleForAddressRange``),
    the handle a P2PDMA-capable storage driver needs to write GPU memory directly; the descriptor is
    closed again (the export is the capability check). The range is widened to whole host pages
    inside the buffer's own allocation. Returns ``{"exported": bool, ...}`` with the reason when not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemGetHandleForAddressRange
    except (OSError, AttributeError) as exc:
        return {"exported": False, "why": f"driver entry point unavailable ({exc})"}
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_ulonglong]
    page = 4096
    start = buffer.data_ptr() // page * page
    end = -(-(buffer.data_ptr() + buffer.numel()) // page) * page
    fd = ctypes.c_int(-1)
    rc = fn(ctypes.byref(fd), start, end - start, _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    if rc != 0 or fd.value < 0:
        return {"exported": False, "why": f"cuMemGetHandleForAddressRange returned CUresult {rc}"}
    os.close(fd.value)
    return {"exported": True, "bytes": end - start}


def _direct_mechanism(facts: dict) -> tuple[str, bool]:
    # Direct only on positive evidence: KvikIO resolved to cuFile and the driver reports GDS.
    if facts.get("kvikio_compat_preferred") is False and facts.get("gds_available") is True:
        path = "nvidia-fs" if facts.get("nvidia_fs_loaded") is True else \
            "kernel PCI P2PDMA (DMA-BUF capable device)" if facts.get("device_dmabuf_supported") else "cuFile"
        return f"cuFile GPUDirect Storage: storage DMA into GPU memory via {path}", True
    return ("KvikIO/cuFile compatibility mode: POSIX reads into a host bounce buffer, then a host-to-device "
            "copy (NOT direct)"), False


def restore_direct(store: SegmentStore, targets, *, model_fingerprint: ModelFingerprint, device="cuda",
                   cache=None, layout=None, rope=None, k_scale=None, verify: str = "device",
                   backend: str = "auto", hash_backend: str = "auto",
                   register_buffer: bool = True) -> RestoreResult:
    """Restore ``targets`` with KvikIO/cuFile reads straight into device memory (see :mod:`kmesh_host.routes`).

    Arguments as :func:`restore_host_staging`; ``register_buffer`` registers the destination with
    cuFile (``cuFileBufRegister``) when GDS is active. Needs CUDA and the kvikio package.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise BackendError(f"route 'direct' reads into GPU memory; device {device} is not a CUDA device")
    device = _check_device(device, "direct")  # before kvikio: no usable CUDA is the reason, not the package
    targets = _check_targets(targets)
    kvikio = _kvikio()
    facts = direct_facts(device)
    mechanism, is_direct = _direct_mechanism(facts)
    t0 = time.perf_counter()
    report = RouteReport(route="direct", mechanism=mechanism, device=str(device), direct_dma=is_direct,
                         io_engine="kvikio thread pool", facts=facts)
    if is_direct:
        report.notes.append("cuFile can still fall back to POSIX per file when its own allow_compat_mode is "
                            "set and the filesystem is unsupported; cufile.log records such fallbacks")
    files, registered, streams, verifier = [], None, None, None
    prepare_s = 0.0
    try:
        headers = [store.read_header(t.key) for t in targets]
        for h in headers:
            check_fingerprint(h, model_fingerprint)
        if cache is not None:
            _check_placement(targets, headers, rope)
        offsets, total = _layout_offsets(headers)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        if register_buffer and is_direct:
            try:
                from kvikio.buffer import memory_register
            except ImportError:
                report.notes.append("kvikio.buffer.memory_register unavailable: destination not registered")
            else:
                memory_register(buffer)
                registered = buffer
        report.facts["buffer_registered"] = registered is not None
        if facts.get("device_dmabuf_supported"):
            # the destination as a DMA-BUF: what a P2PDMA storage path would be handed; which path
            # actually moved the bytes is the mechanism above (never called direct without evidence)
            report.facts["dma_buf"] = _export_dmabuf(buffer)
        else:
            report.facts["dma_buf"] = {"exported": False, "why": "the device does not report DMA-BUF support"}
        # kvikio reads on its own threads into memory the current stream may still be using.
        _sync(device)
        streams = _Streams(device)
        verifier = _Verifier(verify, buffer, hash_backend, streams, trust_verified=False,
                             objects=len(targets))
        read_start = time.perf_counter()
        futures = []
        for target, header, off in zip(targets, headers, offsets):
            f = kvikio.CuFile(store.local_path(target.key), "r")
            files.append(f)
            futures.append(f.pread(buffer[off: off + header.padded_length], header.padded_length,
                                   header.payload_offset))
        # prepared while kvikio reads
        placement, prepare_s = _timed_placement(buffer, offsets, targets, headers, cache=cache, layout=layout,
                                                rope=rope, k_scale=k_scale, backend=backend, streams=streams)
        for target, header, off, fut in zip(targets, headers, offsets, futures):
            # A completed kvikio future means the bytes are in device memory.
            got = fut.get()
            if got != header.padded_length:
                raise IntegrityError(f"segment {target.key}: read {got} of {header.padded_length} payload bytes "
                                     "(truncated file)")
            report.bytes_read += got
            verifier.landed(off, header)
        read_end = time.perf_counter()
        report.bytes_moved = report.bytes_read
        verify_s, bad = verifier.finish()
        if bad:
            raise _integrity_failure(bad)
        if placement is not None:
            placement.run()
            report.placed = True
        result = RestoreResult(report, buffer, offsets, headers, placement and placement.kvs)
        streams.join()
        streams.sync()
    finally:
        if streams is not None:
            streams.join()
        if verifier is not None:
            verifier.settle()
        for f in files:
            f.close()
        if registered is not None:
            from kvikio.buffer import memory_deregister

            _sync(device)  # the digests and placement read the buffer
            memory_deregister(registered)
    report.objects = len(targets)
    report.verification = verifier.description if verify != "host" else "download + host tree-root"
    report.verified = dict(verifier.counts)
    report.timings = {"read_s": read_end - read_start, "verify_s": verify_s, "prepare_s": prepare_s,
                      "restore_s": time.perf_counter() - t0}
    return result


__all__ = ["restore_direct", "direct_facts"]
