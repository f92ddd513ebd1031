"""The ``direct`` route: KvikIO/cuFile reads straight into GPU memory, then the same verification
and placement as the host-staging route (:mod:`.host_staging`).

With GPUDirect Storage the storage DMA writes GPU memory; in KvikIO's (or cuFile's) compatibility
mode the bytes go through a host bounce buffer. The report labels the mechanism from positive
evidence only: a run is called GDS only when KvikIO is not in compatibility mode and the cuFile
driver reports GDS available; anything else is reported as a bounce-buffer copy, never as direct.
Where the device supports DMA-BUF, the destination is also exported as a DMA-BUF (the handle a
P2PDMA-capable storage driver writes GPU memory through) and the report says whether that worked
(``facts["dma_buf"]``); the export alone moves no bytes and changes no label.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

from kmesh_gpu.errors import BackendError, IntegrityError

from ..segment import check_fingerprint
from .contract import RestoreReport, RestoreResult
from .staging import layout_offsets
from .streams import Streams
from .verifier import Verifier, integrity_failure

_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def kvikio_module():
    """The kvikio package, or a typed refusal naming it."""
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
    treats as "not GDS". Raises BackendError without the kvikio package.
    """
    kvikio = kvikio_module()
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


def _sync(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def restore_direct(ctx, items) -> RestoreResult:
    """Restore ``items`` for the restorer ``ctx`` with KvikIO/cuFile reads straight into device
    memory (see the module docstring); ``RouteConfig.register_buffer`` registers the destination with
    cuFile (``cuFileBufRegister``) when GDS is active. The device is a CUDA one (the restorer checked)."""
    device, cfg, store = ctx.device, ctx.config, ctx.store
    kvikio = kvikio_module()
    facts = direct_facts(device)
    mechanism, is_direct = _direct_mechanism(facts)
    t0 = time.perf_counter()
    report = RestoreReport(path="in_process", route="direct", mechanism=mechanism, device=str(device),
                           direct_dma=is_direct, io_engine="kvikio thread pool", facts=facts)
    if is_direct:
        report.notes.append("cuFile can still fall back to POSIX per file when its own allow_compat_mode is "
                            "set and the filesystem is unsupported; cufile.log records such fallbacks")
    files, futures, registered, streams, verifier = [], [], None, None, None
    waited = 0  # reads whose completion this call has taken
    try:
        headers = [store.read_header(it.key) for it in items]
        for h in headers:
            check_fingerprint(h, ctx.model_fingerprint)
        ctx.placer.check(items, headers)
        offsets, total = layout_offsets(headers)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        if cfg.register_buffer and is_direct:
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
        streams = Streams(device)
        verifier = Verifier(cfg.verify, buffer, cfg.hash_backend, streams, trust_verified=False, objects=len(items))
        read_start = time.perf_counter()
        for it, header, off in zip(items, headers, offsets):
            f = kvikio.CuFile(store.local_path(it.key), "r")
            files.append(f)
            futures.append(f.pread(buffer[off: off + header.padded_length], header.padded_length,
                                   header.payload_offset))
        placement = ctx.placer.prepare(buffer, offsets, items, headers, streams)  # while kvikio reads
        for it, header, off, fut in zip(items, headers, offsets, futures):
            # A completed kvikio future means the bytes are in device memory.
            waited += 1
            got = fut.get()
            if got != header.padded_length:
                raise IntegrityError(f"segment {it.key}: read {got} of {header.padded_length} payload bytes "
                                     "(truncated file)")
            report.bytes_read += got
            verifier.landed(off, header)
        read_end = time.perf_counter()
        report.bytes_moved = report.bytes_read
        verify_s, bad = verifier.finish()
        if bad:
            raise integrity_failure(bad)
        placement.run()
        report.placed = True
        result = RestoreResult(report, buffer, offsets, headers)
        streams.join()
        streams.sync()
    finally:
        for fut in futures[waited:]:  # a failure while reads were in flight: they write the buffer until done
            try:
                fut.get()
            except Exception:  # noqa: BLE001 - the restore's own error is the one to report
                pass
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
    report.objects = len(items)
    report.verification = verifier.description if cfg.verify != "host" else "download + host tree-root"
    report.verified = dict(verifier.counts)
    report.timings = {"read_s": read_end - read_start, "verify_s": verify_s, "prepare_s": placement.seconds,
                      "restore_s": time.perf_counter() - t0}
    return result


__all__ = ["restore_direct", "direct_facts"]
