"""Per-layer registrations: one allocation per layer (what vLLM allocates for its KV caches), each
mapped on its own in the service and placed into as a per-layer list. On CPU with shared memory and
with the host-memory stand-in for virtual-memory chunks; the CUDA twin is in
``test_service_layers_gpu.py`` (``-m gpu``).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from kmesh_gpu import KVLayout, gather, place_many
from kmesh_gpu.errors import KmeshError, LayoutError, ProtocolError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from kmesh_host.service import vmm
from tests.kmesh_host.service.fake_vmm import GRANULARITY, FakeVmm
from tests.kmesh_host.service.helpers import fingerprint_of, put_original, registration_of, small_rope, socket_dir

L = 3


def _layout(num_blocks: int = 8) -> KVLayout:
    return KVLayout.from_vllm("NHD", num_layers=L, num_blocks=num_blocks, block_size=16, num_kv_heads=2, head_size=8,
                              dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def service():
    with pytest.MonkeyPatch.context() as mp, socket_dir() as d:
        mp.setenv("KMESH_VMM_DRIVER", "tests.kmesh_host.service.fake_vmm:FakeVmm")
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), receive_spin_s=0.0,
                            reap_interval_s=0.02, frame_timeout_s=1.0)
        with CacheService(cfg) as svc:
            yield svc


def _segment(seed: int, t: int = 20):
    kv = torch.randn(2, L, t, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return kv, torch.arange(t, dtype=torch.int64)


def _maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("kmesh-fake-vmm" in line for line in f)


def test_per_layer_shared_memory_restores_as_in_process_and_as_one_allocation(service):
    layout, rope = _layout(), small_rope()
    view = layout.per_layer()
    kv, pos = _segment(1)
    slots, new = list(range(40, 60)), list(range(300, 320))
    layers = [SharedCache(view, fill=0) for _ in range(L)]
    whole = SharedCache(layout, fill=0)
    try:
        with CacheClient(service.socket_path) as c:
            key = put_original(c, kv, pos, fp=fingerprint_of(layout))
            reg = c.register(layers, layout, model_fingerprint=fingerprint_of(layout), rope=rope)
            assert isinstance(reg.handle, list) and len(reg.handle) == L
            described = registration_of(c.status(), reg.reg_id)
            assert described["memory"] == "shm" and described["num_blocks"] == layout.num_blocks
            c.restore(reg, [(key, slots, new)])
            whole_reg = c.register(whole, layout, model_fingerprint=fingerprint_of(layout), rope=rope)
            c.restore(whole_reg, [(key, slots, new)])
            ref = [torch.zeros(view.physical_shape, dtype=torch.bfloat16) for _ in range(L)]
            place_many([kv], [ref], layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
                       new_positions=[torch.tensor(new)])
            got = [x.tensor for x in layers]
            for i in range(L):
                assert torch.equal(got[i].view(torch.uint8), ref[i].view(torch.uint8)), i
            at = torch.tensor(slots)
            assert torch.equal(gather(got, layout, at).view(torch.uint8), gather(whole.tensor, layout, at).view(torch.uint8))
            # a save reads the layers back into a new original
            saved_key = c.save(reg, slots, slots, new)
            seg = c.get(saved_key, model_fingerprint=fingerprint_of(layout))
            saved, saved_pos = seg.kv, seg.positions
            assert torch.equal(saved.view(torch.uint8), gather(got, layout, at).view(torch.uint8))
            assert saved_pos.tolist() == new
            # bounds are the registration's, as for one allocation
            with pytest.raises(KmeshError):
                c.restore(reg, [(key, list(range(layout.num_slots - 5, layout.num_slots + 15)))])
            assert c.close_registration(reg) is True and c.close_registration(whole_reg) is True
    finally:
        del got
        for x in layers + [whole]:
            x.close()


def test_per_layer_virtual_memory_in_chunks(service):
    drv = FakeVmm()
    layout = _layout(num_blocks=160)  # 1 KiB a block and layer: each layer 2.5 chunks (3 mapped)
    view = layout.per_layer()
    kv, pos = _segment(2)
    slots = list(range(layout.num_slots - 20, layout.num_slots))
    caches = [vmm.VmmCache(view, chunk_bytes=GRANULARITY, fill=0, drv=drv) for _ in range(L)]
    ref = [SharedCache(view, fill=0) for _ in range(L)]
    try:
        chunks = sum(c.total // GRANULARITY for c in caches)
        with CacheClient(service.socket_path) as c:
            key = put_original(c, kv, pos, fp=fingerprint_of(layout))
            reg = c.register(caches, layout, model_fingerprint=fingerprint_of(layout))
            assert registration_of(c.status(), reg.reg_id)["memory"] == "cuda_vmm"
            assert _maps(service.pid) == chunks
            ref_reg = c.register(ref, layout, model_fingerprint=fingerprint_of(layout))
            c.restore(reg, [(key, slots)])
            c.restore(ref_reg, [(key, slots)])
            for a, b in zip(caches, ref):
                assert torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8))
            assert bool(caches[-1].tensor.view(torch.uint8).any())
            assert c.close_registration(reg) is True and c.close_registration(ref_reg) is True
            assert _maps(service.pid) == 0
    finally:
        for x in caches + ref:
            x.close()
    assert drv.live_handles() == 0


@pytest.fixture
def shm_layers():
    """A layout and one shared-memory allocation per layer (and one whole-cache allocation)."""
    layout = _layout()
    layers = [SharedCache(layout.per_layer()) for _ in range(L)]
    whole = SharedCache(layout)
    yield layout, layers, whole
    for x in layers + [whole]:
        x.close()


def test_client_refuses_a_wrong_number_of_layers_or_a_wrong_shape(service, shm_layers):
    layout, layers, whole = shm_layers
    with CacheClient(service.socket_path) as c:
        with pytest.raises(LayoutError, match="3 layers"):
            c.register(layers[:2], layout, model_fingerprint=fingerprint_of(layout))
        with pytest.raises(LayoutError, match=r"cache\[1\]"):
            c.register([layers[0], torch.zeros(4), layers[2]], layout, model_fingerprint=fingerprint_of(layout))
        with pytest.raises(LayoutError, match=r"cache\[0\]"):
            c.register([whole] + layers[1:], layout, model_fingerprint=fingerprint_of(layout))
        assert c.status()["healthy"] is True


def test_one_allocation_given_for_two_layers_is_refused(service, shm_layers):
    layout, layers, _ = shm_layers
    with CacheClient(service.socket_path) as c:
        with pytest.raises(LayoutError, match="same memory"):
            c.register([layers[0], layers[1], layers[0]], layout, model_fingerprint=fingerprint_of(layout))
        st = c.status()
        assert st["healthy"] is True and not st["registrations"]


def _send_one_fd(sock) -> None:
    fd = os.memfd_create("kmesh-fake-vmm")
    try:
        socket.send_fds(sock, [vmm.FD_MARK], [fd])
    finally:
        os.close(fd)


def _raw(c, header: dict, send=None):
    return c._call(dict(header), after=send)


@pytest.mark.parametrize("case", ["both", "neither", "not a list", "empty", "two layers", "short layer",
                                  "mixed devices", "fds for shm"])
def test_malformed_per_layer_registers_are_typed_errors(service, shm_layers, case):
    layout, layers, _ = shm_layers
    memories = [x.handle.to_dict() for x in layers]
    header = {"op": "register", "layout": layout.to_dict(), "layers": memories,
              "model_fingerprint": fingerprint_of(layout).to_dict()}
    send = None
    if case == "both":
        header["memory"] = memories[0]
    elif case == "neither":
        del header["layers"]
    elif case == "not a list":
        header["layers"] = memories[0]
    elif case == "empty":
        header["layers"] = []
    elif case == "two layers":
        header["layers"] = memories[:2]
    elif case == "short layer":
        header["layers"] = [dict(memories[0], nbytes=memories[0]["nbytes"] - 2)] + memories[1:]
    elif case == "mixed devices":
        header["layers"] = [dict(memories[0], kind="cuda_ipc", handle="00" * 64, device=0)] + memories[1:]
    elif case == "fds for shm":
        header["fds"] = 1
        send = _send_one_fd
    with CacheClient(service.socket_path) as c:
        with pytest.raises((ProtocolError, LayoutError)):
            _raw(c, header, send)
        st = c.status()  # the same connection answers
        assert st["healthy"] is True and not st["registrations"]


def test_per_layer_vmm_with_descriptors_beyond_its_chunks_is_refused_and_nothing_kept(service):
    drv = FakeVmm()
    layout = _layout(num_blocks=16)
    view = layout.per_layer()
    caches = [vmm.VmmCache(view, chunk_bytes=GRANULARITY, fill=0, drv=drv) for _ in range(L)]
    try:
        parts = [vmm.export(x.tensor, 0, drv) for x in caches]
        header = {"op": "register", "layout": layout.to_dict(), "layers": [p[0].to_dict() for p in parts],
                  "fds": sum(len(p[1]) for p in parts) + 2, "model_fingerprint": fingerprint_of(layout).to_dict()}

        def send(sock):
            for _, chunks in parts:
                vmm.send_fd_batches(sock, drv, chunks)
            fds = [os.memfd_create("kmesh-fake-vmm") for _ in range(2)]
            try:
                socket.send_fds(sock, [vmm.FD_MARK], fds)
            finally:
                for fd in fds:
                    os.close(fd)

        try:
            with CacheClient(service.socket_path) as c:
                with pytest.raises(ProtocolError, match="beyond"):
                    _raw(c, header, send)
                st = c.status()
                assert st["healthy"] is True and not st["registrations"]
        finally:
            for _, chunks in parts:
                vmm.release_all(drv, chunks)
        assert _maps(service.pid) == 0
    finally:
        for x in caches:
            x.close()
    assert drv.live_handles() == 0
