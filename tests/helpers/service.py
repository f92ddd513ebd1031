"""Helpers for the cache service tests: a short socket path, child processes, joins that never hang.

Child-process targets live here (a module spawned children can import by name).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import time

import torch

SPAWN = mp.get_context("spawn")


@contextlib.contextmanager
def socket_dir():
    """A fresh directory for a socket. Unix socket paths are limited to ~107 bytes, and pytest's
    tmp_path can be longer, so the socket lives in a short directory under /tmp instead."""
    d = tempfile.mkdtemp(prefix="kms-")
    try:
        yield d
    finally:
        for root, dirs, files in os.walk(d, topdown=False):
            for f in files:
                os.unlink(os.path.join(root, f))
            for x in dirs:
                os.rmdir(os.path.join(root, x))
        os.rmdir(d)


def join_or_kill(proc, timeout: float = 30.0) -> int | None:
    """Join ``proc`` within ``timeout``; kill it if it is still running. Returns its exit code."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    return proc.exitcode


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy (returned) or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def small_layout(dtype=torch.bfloat16, *, num_blocks: int = 8, block_size: int = 4, num_layers: int = 2,
                 num_kv_heads: int = 2, head_size: int = 8):
    from kmesh_gpu import KVLayout

    return KVLayout.from_vllm("NHD", num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                              num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)


def small_rope(dtype=torch.bfloat16, head_size: int = 8):
    from kmesh_gpu import RopeSpec

    return RopeSpec(head_size, head_size, 10000.0, True, 4096, dtype)


def registration_of(status: dict, reg_id: int) -> dict | None:
    for r in status["registrations"]:
        if r["reg"] == reg_id:
            return r
    return None


# ---------------------------------------------------------------------------------- children
def child_use_leaked_secret(socket_path: str, reg_id: int, secret: str, out) -> None:
    """Another process presents a registration's id and secret it did not register."""
    from kmesh_gpu.errors import OwnershipError
    from kmesh_host.service import CacheClient
    from kmesh_host.service.client import Registration

    try:
        with CacheClient(socket_path, timeout=30) as c:
            fake = Registration(reg_id, reg_id, secret, small_layout(), None, torch.empty(0))
            try:
                c.restore(fake, [("leaked-src", [0, 1, 2, 3])])
                out.put("accepted")
            except OwnershipError as exc:
                out.put(f"refused: {exc}")
    except Exception as exc:
        out.put(f"error: {type(exc).__name__}: {exc}")


def child_register_then_hang(socket_path: str, instance: int, refuse_waits: int, out) -> None:
    """A worker that registers, leaves an operation pending, starts another request and hangs
    half-way through sending it (the test kills it there)."""
    from kmesh_host.service import CacheClient, SharedCache
    from kmesh_host.service import protocol

    layout = small_layout()
    cache = SharedCache(layout, fill=0)
    c = CacheClient(socket_path, timeout=30)
    kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
    key = f"hang-{os.getpid()}"
    c.put(key, kv, torch.arange(4))
    reg = c.register(cache, layout, instance=instance)
    inject = {"refuse_waits": refuse_waits} if refuse_waits else None
    op = c.restore(reg, [(key, [0, 1, 2, 3])], wait=False, inject=inject)
    frame = protocol.encode({"op": "status", "id": 99})
    c._sock.sendall(frame[: len(frame) // 2])
    out.put({"reg": reg.reg_id, "secret": reg.secret, "op": op, "shm": cache.handle.handle.decode(), "key": key})
    time.sleep(600)


def child_register_vmm_then_hang(socket_path: str, chunks: int, out) -> None:
    """A worker that registers a virtual-memory cache of ``chunks`` chunks (the host-memory
    stand-in driver) and hangs with it registered (the test kills it)."""
    from kmesh_gpu import KVLayout
    from kmesh_host.service import CacheClient
    from kmesh_host.service.vmm import VmmCache
    from tests.helpers.fake_vmm import GRANULARITY, FakeVmm

    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=chunks * GRANULARITY // 2048, block_size=16,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    cache = VmmCache(layout, chunk_bytes=GRANULARITY, fill=0, drv=FakeVmm())
    c = CacheClient(socket_path, timeout=30)
    reg = c.register(cache, layout)
    out.put({"reg": reg.reg_id})
    time.sleep(600)


@contextlib.contextmanager
def running_service(*, reap_interval_s: float, receive_spin_s: float | None = None):
    """A spawned cache service with fault injection allowed, in a private socket directory."""
    from kmesh_host.service import CacheService, ServiceConfig

    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            reap_interval_s=reap_interval_s, receive_spin_s=receive_spin_s)
        with CacheService(cfg) as svc:
            yield svc
