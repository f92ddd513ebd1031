"""Virtual-memory caches (``cuda_vmm``): finding the chunks under a cache, exporting them as file
descriptors over the socket, and the service mapping them side by side, on CPU with a stand-in for
the driver's calls on host memory (``tests/kmesh_host/service/fake_vmm.py``: memfds mapped into reserved
address ranges, so client and service really share the chunks' pages). The same path on a GPU
with ``cuMemCreate`` memory: ``test_service_vmm_gpu.py`` (``-m gpu``).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import KmeshError, LayoutError, ProtocolError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from kmesh_host.service import vmm
from tests.kmesh_host.service.fake_vmm import GRANULARITY, FakeVmm
from tests.kmesh_host.service.helpers import (SPAWN, child_register_vmm_then_hang, fingerprint, join_or_kill,
                                              put_original, registration_of, small_layout, small_rope, socket_dir,
                                              wait_for)

FAKE = "tests.kmesh_host.service.fake_vmm:FakeVmm"


def _layout(num_blocks: int) -> KVLayout:
    # K and V x 2 layers x 16 tokens x 2 heads x 8 dims of bf16: 2 KiB per block
    return KVLayout.from_vllm("NHD", num_layers=2, num_blocks=num_blocks, block_size=16, num_kv_heads=2, head_size=8,
                              dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------- finding the chunks
def test_chunks_under_a_cache_in_address_order_with_their_offset():
    drv = FakeVmm()
    with vmm.VmmCache(_layout(1024), chunk_bytes=GRANULARITY, fill=0, drv=drv) as cache:  # 2 MiB in 32 chunks
        flat = cache.tensor.view(torch.uint8).view(-1)
        h, chunks = vmm.export(flat, 0, drv)
        try:
            assert h.kind == "cuda_vmm" and h.offset == 0 and h.nbytes == cache.nbytes
            assert vmm.decode_sizes(h.handle) == [GRANULARITY] * 32 and len(chunks) == 32
            assert len(set(chunks)) == 32
        finally:
            vmm.release_all(drv, chunks)
        # a view that starts inside chunk 3 and ends inside chunk 6: whole chunks 3..6, its offset in them
        view = flat[3 * GRANULARITY + 100:6 * GRANULARITY + 7]
        h, chunks = vmm.export(view, 0, drv)
        try:
            assert vmm.decode_sizes(h.handle) == [GRANULARITY] * 4 and h.offset == 100 and h.nbytes == view.numel()
        finally:
            vmm.release_all(drv, chunks)
        # ending exactly on a chunk's edge takes no chunk beyond it
        h, chunks = vmm.export(flat[:2 * GRANULARITY], 0, drv)
        vmm.release_all(drv, chunks)
        assert vmm.decode_sizes(h.handle) == [GRANULARITY] * 2
    assert drv.live_handles() == 0 and drv.mapped_ranges() == 0  # every retained reference released


def test_one_large_chunk_is_found_whole_from_a_view_inside_it():
    drv = FakeVmm()
    with vmm.VmmCache(_layout(1024), fill=0, drv=drv) as cache:  # one 2 MiB chunk
        view = cache.tensor.view(torch.uint8).view(-1)[5 * GRANULARITY + 3:5 * GRANULARITY + 4099]
        h, chunks = vmm.export(view, 0, drv)
        vmm.release_all(drv, chunks)
        assert vmm.decode_sizes(h.handle) == [cache.total] and h.offset == 5 * GRANULARITY + 3
    assert drv.live_handles() == 0


def test_memory_that_is_not_vmm_is_left_to_cuda_ipc():
    assert vmm.export(torch.zeros(1024, dtype=torch.uint8), 0, FakeVmm()) is None


def test_chunks_without_descriptor_export_are_refused_and_nothing_is_kept():
    drv = FakeVmm(exportable=False)
    with vmm.VmmCache(_layout(64), chunk_bytes=GRANULARITY, fill=0, drv=drv) as cache:
        live = drv.live_handles()
        with pytest.raises(LayoutError, match="file-descriptor export"):
            vmm.export(cache.tensor, 0, drv)
        assert drv.live_handles() == live and drv.released > 0
    assert drv.live_handles() == 0


def test_a_hole_in_the_range_is_refused():
    drv = FakeVmm()
    with vmm.VmmCache(_layout(128), chunk_bytes=GRANULARITY, fill=0, drv=drv) as cache:
        flat = cache.tensor.view(torch.uint8).view(-1)
        drv.unmap(cache._addr + GRANULARITY, GRANULARITY)  # chunk 1 unmapped: its range stays reserved
        cache._mapped = 0  # (VmmCache.close unmaps the rest by range)
        with pytest.raises(LayoutError, match="hole"):
            vmm.export(flat[:3 * GRANULARITY], 0, drv)
        drv.unmap(cache._addr, cache.total)
    assert drv.mapped_ranges() == 0


def test_chunk_sizes_are_validated_as_they_arrive():
    with pytest.raises(ProtocolError):
        vmm.decode_sizes(b"")
    with pytest.raises(ProtocolError):
        vmm.decode_sizes(b"\x00" * 7)
    with pytest.raises(ProtocolError):
        vmm.decode_sizes(vmm.encode_sizes([GRANULARITY, 0]))
    with pytest.raises(ProtocolError):
        vmm.decode_sizes(vmm.encode_sizes([1 << 49, 1 << 49, 1]))
    with pytest.raises(ProtocolError):
        vmm.decode_sizes(b"\x01" + b"\x00" * 7 * 1 + b"\x00" * 8 * vmm.MAX_CHUNKS)


# ---------------------------------------------------------------------------------- through the service
@pytest.fixture(scope="module")
def vmm_service():
    with pytest.MonkeyPatch.context() as mp, socket_dir() as d:
        mp.setenv("KMESH_VMM_DRIVER", FAKE)  # the spawned service process maps with the stand-in
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), receive_spin_s=0.0,
                            reap_interval_s=0.02, frame_timeout_s=1.0)
        with CacheService(cfg) as svc:
            yield svc


def _chunks_held(pid: int) -> tuple[int, int]:
    """(descriptors, mappings) of the stand-in's chunks a process holds (a leak shows here)."""
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += "kmesh-fake-vmm" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        maps = sum("kmesh-fake-vmm" in line for line in f)
    return fds, maps


@pytest.mark.parametrize("chunks", [1, 40, 300])  # 300: two batches of descriptors (253 + 47)
def test_restore_into_a_vmm_cache_lands_in_the_clients_pages(vmm_service, chunks):
    drv = FakeVmm()
    layout = _layout(chunks * GRANULARITY // 2048)
    rope = small_rope()
    kv = torch.randn(2, 2, 20, 2, 8, generator=torch.Generator().manual_seed(chunks)).to(torch.bfloat16)
    slots = list(range(layout.num_slots - 20, layout.num_slots))  # the last chunk's blocks
    with CacheClient(vmm_service.socket_path) as c, \
            vmm.VmmCache(layout, chunk_bytes=GRANULARITY, fill=0, drv=drv) as cache, \
            SharedCache(layout, fill=0) as ref:
        key = put_original(c, kv)
        reg = c.register(cache, layout, model_fingerprint=fingerprint(), rope=rope)
        described = registration_of(c.status(), reg.reg_id)
        assert described["state"] == "open" and described["memory"] == "cuda_vmm"
        assert _chunks_held(vmm_service.pid)[1] == chunks  # every chunk mapped there
        c.restore(reg, [(key, slots, list(range(100, 120)))])
        ref_reg = c.register(ref, layout, model_fingerprint=fingerprint(), rope=rope)  # the same, into shared memory
        assert registration_of(c.status(), ref_reg.reg_id)["memory"] == "shm"
        c.restore(ref_reg, [(key, slots, list(range(100, 120)))])
        assert torch.equal(cache.tensor.view(torch.uint8), ref.tensor.view(torch.uint8))
        assert bool(cache.tensor.view(torch.uint8).any())
        assert c.close_registration(reg) is True and c.close_registration(ref_reg) is True
        assert _chunks_held(vmm_service.pid) == (0, 0)  # unmapped once the registration was released
        del reg, ref_reg
    assert drv.live_handles() == 0


def _raw_register(c, layout, memory: dict, fds: int, send=None):
    header = {"op": "register", "memory": memory, "layout": layout.to_dict(), "instance": 0, "fds": fds,
              "model_fingerprint": fingerprint().to_dict()}
    return c._call(header, after=send)


def test_descriptors_announced_but_not_sent_are_a_typed_error_and_the_connection_stays_usable(vmm_service):
    layout = _layout(32)
    memory = {"kind": "cuda_vmm", "handle": vmm.encode_sizes([GRANULARITY]).hex(), "offset": 0,
              "nbytes": 2 * 2 * 32 * 16 * 2 * 8 * 2, "device": 0}
    with CacheClient(vmm_service.socket_path) as c:
        with pytest.raises(ProtocolError, match="did not arrive"):
            _raw_register(c, layout, memory, 1)
        assert c.status()["healthy"] is True  # the same connection, in step


def _send_memfds(n: int):
    def send(sock):
        fds = []
        for _ in range(n):
            fd = os.memfd_create("kmesh-fake-vmm")
            os.ftruncate(fd, GRANULARITY)
            fds.append(fd)
        try:
            socket.send_fds(sock, [vmm.FD_MARK], fds)
        finally:
            for fd in fds:
                os.close(fd)
    return send


@pytest.mark.parametrize("case", ["more fds than chunks", "fds for shm memory", "bad layout", "nbytes too large"])
def test_refused_register_reads_its_descriptors_and_keeps_none(vmm_service, case):
    layout = _layout(32)
    nbytes = 2 * 2 * 32 * 16 * 2 * 8 * 2
    memory = {"kind": "cuda_vmm", "handle": vmm.encode_sizes([GRANULARITY]).hex(), "offset": 0, "nbytes": nbytes,
              "device": 0}
    fds = 1
    if case == "more fds than chunks":
        fds = 2
    elif case == "fds for shm memory":
        memory = {"kind": "shm", "handle": b"kmesh-none".hex(), "offset": 0, "nbytes": nbytes, "device": -1}
    elif case == "bad layout":
        layout = small_layout()
    elif case == "nbytes too large":
        memory["offset"] = GRANULARITY - 16  # its bytes run past the one chunk
    with CacheClient(vmm_service.socket_path) as c:
        with pytest.raises(KmeshError):
            _raw_register(c, layout, memory, fds, _send_memfds(fds))
        st = c.status()  # the same connection answers: the descriptors were read, not left in the stream
        assert st["healthy"] is True and not st["registrations"]
    assert _chunks_held(vmm_service.pid) == (0, 0)


def test_absurd_descriptor_counts_are_refused(vmm_service):
    layout = _layout(32)
    memory = {"kind": "cuda_vmm", "handle": vmm.encode_sizes([GRANULARITY]).hex(), "offset": 0,
              "nbytes": 2 * 2 * 32 * 16 * 2 * 8 * 2, "device": 0}
    with CacheClient(vmm_service.socket_path) as c:
        for fds in (-1, vmm.MAX_CHUNKS + 1):
            with pytest.raises(ProtocolError, match="fds"):
                _raw_register(c, layout, memory, fds)
            assert c.status()["healthy"] is True


def test_connection_lost_before_the_descriptors_keeps_nothing_and_the_service_serves_on(vmm_service):
    """A client that announces descriptors and disconnects before sending them: the register fails
    (nothing to reply to), nothing is mapped or kept, and other clients are served."""
    layout = _layout(32)
    memory = {"kind": "cuda_vmm", "handle": vmm.encode_sizes([GRANULARITY] * 3).hex(), "offset": 0,
              "nbytes": 2 * 2 * 32 * 16 * 2 * 8 * 2, "device": 0}

    def send_one_batch_then_close(sock):  # one descriptor of three, then the connection ends
        _send_memfds(1)(sock)
        sock.shutdown(socket.SHUT_WR)

    with CacheClient(vmm_service.socket_path) as c:
        with pytest.raises(KmeshError):
            _raw_register(c, layout, memory, 3, send_one_batch_then_close)
    with CacheClient(vmm_service.socket_path) as other:
        st = other.status()
        assert st["healthy"] is True and not st["registrations"]
    assert _chunks_held(vmm_service.pid) == (0, 0)


def test_killed_worker_with_a_vmm_registration_is_reaped_and_its_chunks_unmapped(vmm_service):
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=child_register_vmm_then_hang, args=(vmm_service.socket_path, 5, out))
    proc.start()
    try:
        got = out.get(timeout=60)
        assert _chunks_held(vmm_service.pid)[1] == 5
    finally:
        proc.kill()
        join_or_kill(proc)
    with CacheClient(vmm_service.socket_path) as c:
        wait_for(lambda: registration_of(c.status(), got["reg"]) is None)
    wait_for(lambda: _chunks_held(vmm_service.pid) == (0, 0))


def test_descriptors_nobody_announced_never_stay_in_the_service(vmm_service):
    """Descriptors sent outside a register that announced them: on a frame's own bytes, or as a
    batch of their own between frames. The kernel closes them when the service reads those bytes
    without asking for descriptors; a batch between frames breaks the framing, so that connection
    is closed with a typed error, and the service serves on."""
    with CacheClient(vmm_service.socket_path) as c:
        _send_memfds(3)(c._sock)  # a stray batch before the next frame
        with pytest.raises(KmeshError):
            c.status()
    from kmesh_host.service import protocol

    with CacheClient(vmm_service.socket_path) as c:
        fds = [os.memfd_create("kmesh-fake-vmm") for _ in range(2)]
        try:  # a status frame with descriptors on its own bytes
            socket.send_fds(c._sock, [protocol.encode({"op": "status", "id": 1})], fds)
        finally:
            for fd in fds:
                os.close(fd)
        flags, buf, body = protocol.read_frame(c._sock)
        assert protocol.decode_header(memoryview(buf)[:len(buf) - len(body)])["ok"] is True
    with CacheClient(vmm_service.socket_path) as c:
        assert c.status()["healthy"] is True
    wait_for(lambda: _chunks_held(vmm_service.pid) == (0, 0))
