"""Helpers for the cache service tests: a short socket path, the small layout, RoPE spec and model
fingerprint the tests share, child processes, joins that never hang.

Child-process targets live here (a module spawned children can import by name).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import time

import torch

from tests.helpers.waiting import settle, wait_for  # noqa: F401  (the service tests wait with these)

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


def small_layout(dtype=torch.bfloat16, *, num_blocks: int = 8, block_size: int = 4, num_layers: int = 2,
                 num_kv_heads: int = 2, head_size: int = 8):
    from kmesh_gpu import KVLayout

    return KVLayout.from_vllm("NHD", num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                              num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)


def small_rope(dtype=torch.bfloat16, head_size: int = 8):
    from kmesh_gpu import RopeSpec

    return RopeSpec(head_size, head_size, 10000.0, True, 4096, dtype)


def fingerprint(num_layers: int = 2, num_kv_heads: int = 2, head_size: int = 8, dtype: str = "bfloat16",
                architecture: str = "Qwen2ForCausalLM"):
    """The model fingerprint of the tests' segments (of :func:`small_layout`'s geometry by default)."""
    from kmesh_host import ModelFingerprint

    return ModelFingerprint(architecture, num_layers, num_kv_heads, head_size, dtype,
                            small_rope(head_size=head_size).to_dict())


def fingerprint_of(layout, architecture: str = "Qwen2ForCausalLM"):
    """The model fingerprint of a layout's geometry and dtype."""
    L, _, H, _, D = layout.sizes
    return fingerprint(L, H, D, str(layout.dtype).removeprefix("torch."), architecture)


def put_original(client, kv: torch.Tensor, positions=None, token_ids=None, fp=None) -> str:
    """``client.put`` of ``kv`` (positions 0..T-1 and token ids 0..T-1 unless given); returns the key."""
    T = kv.shape[2]
    positions = torch.arange(T, dtype=torch.int64) if positions is None else torch.as_tensor(positions)
    token_ids = torch.arange(T, dtype=torch.int64) if token_ids is None else torch.as_tensor(token_ids)
    if fp is None:
        fp = fingerprint(kv.shape[1], kv.shape[3], kv.shape[4], str(kv.dtype).removeprefix("torch."))
    return client.put(kv, token_ids, positions, model_fingerprint=fp)


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
    key = put_original(c, kv, token_ids=torch.arange(4) + os.getpid())  # a key of this process's own
    reg = c.register(cache, layout, model_fingerprint=fingerprint(), instance=instance)
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
    from tests.kmesh_host.service.fake_vmm import GRANULARITY, FakeVmm

    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=chunks * GRANULARITY // 2048, block_size=16,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    cache = VmmCache(layout, chunk_bytes=GRANULARITY, fill=0, drv=FakeVmm())
    c = CacheClient(socket_path, timeout=30)
    reg = c.register(cache, layout, model_fingerprint=fingerprint())
    out.put({"reg": reg.reg_id})
    time.sleep(600)


@contextlib.contextmanager
def running_service(*, reap_interval_s: float, receive_spin_s: float | None = None, **config):
    """A spawned cache service with fault injection allowed, in a private socket directory (its
    private store beside the socket)."""
    from kmesh_host.service import CacheService, ServiceConfig

    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            reap_interval_s=reap_interval_s, receive_spin_s=receive_spin_s, **config)
        with CacheService(cfg) as svc:
            yield svc


def item(key: str, slots, new_positions=None) -> tuple:
    """A restore item as ``CacheClient.restore`` takes it besides ``kmesh_host.restore.RestoreItem``:
    ``(key, slots[, new_positions])`` with slots and positions in any integer form."""
    return (key, slots) if new_positions is None else (key, slots, new_positions)
