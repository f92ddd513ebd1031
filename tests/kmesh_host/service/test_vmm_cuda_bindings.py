"""``kmesh_host.service.vmm.CudaVmm`` — the virtual-memory calls through ``cuda.bindings.driver`` —
run on CPU: the binding's real module, types and enums, with its driver functions replaced by
stand-ins that keep the driver's return conventions (``(CUresult, value...)`` tuples, handle and
pointer objects) on top of the host-memory stand-in of ``tests/kmesh_host/service/fake_vmm.py``. What this
proves is the wrapper's own code (argument types, tuple unpacking, error checks, the handle-type
test, reference counts, the primary context); what the real driver does with the calls is for the
GPU tests (``test_service_vmm_gpu.py``).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from kmesh_gpu.errors import LayoutError
from kmesh_host.service import vmm
from tests.kmesh_host.service.fake_vmm import GRANULARITY, FakeVmm
from tests.kmesh_host.service.helpers import small_layout

from cuda.bindings import driver as cu  # noqa: E402  (a dev dependency: make test installs it)

OK = cu.CUresult.CUDA_SUCCESS
BAD = cu.CUresult.CUDA_ERROR_INVALID_VALUE
FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class _Driver:
    """The driver functions CudaVmm calls, on a FakeVmm; each call is recorded by name."""

    def __init__(self, fake: FakeVmm):
        self.fake, self.calls, self.current = fake, [], None

    def _h(self, h):
        assert isinstance(h, cu.CUmemGenericAllocationHandle), type(h)
        return int(h)

    def _p(self, p):
        assert isinstance(p, cu.CUdeviceptr), type(p)
        return int(p)

    def install(self, monkeypatch):
        for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                     "cuMemRetainAllocationHandle", "cuMemRelease", "cuMemGetAllocationPropertiesFromHandle",
                     "cuMemGetAllocationGranularity", "cuMemExportToShareableHandle",
                     "cuMemImportFromShareableHandle", "cuMemCreate", "cuMemAddressReserve", "cuMemMap",
                     "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree"):
            real = getattr(self, name)

            def record(*args, _name=name, _real=real):
                self.calls.append(_name)
                return _real(*args)

            monkeypatch.setattr(cu, name, record)

    def cuInit(self, flags):
        return (OK,)

    def cuDeviceGet(self, ordinal):
        return OK, cu.CUdevice(ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):
        return OK, cu.CUcontext(0x1000 + int(dev))

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        return (OK,)

    def cuMemRetainAllocationHandle(self, addr):
        assert isinstance(addr, int)
        h = self.fake.retain(addr)
        return (OK, cu.CUmemGenericAllocationHandle(h)) if h is not None else (BAD, cu.CUmemGenericAllocationHandle(0))

    def cuMemRelease(self, h):
        self.fake.release(self._h(h))
        return (OK,)

    def cuMemGetAllocationPropertiesFromHandle(self, h):
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        if self.fake.exportable(self._h(h)):
            prop.requestedHandleTypes = FD
        return OK, prop

    def cuMemGetAllocationGranularity(self, prop, option):
        assert isinstance(prop, cu.CUmemAllocationProp)
        assert option == cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return OK, GRANULARITY

    def cuMemExportToShareableHandle(self, h, handle_type, flags):
        assert handle_type == FD and flags == 0
        try:
            return OK, self.fake.export_fd(self._h(h))
        except LayoutError:
            return cu.CUresult.CUDA_ERROR_NOT_PERMITTED, 0

    def cuMemImportFromShareableHandle(self, fd, handle_type):
        assert isinstance(fd, int) and handle_type == FD
        return OK, cu.CUmemGenericAllocationHandle(self.fake.import_fd(fd))

    def cuMemCreate(self, size, prop, flags):
        assert int(prop.requestedHandleTypes) & int(FD) and flags == 0
        assert prop.location.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        return OK, cu.CUmemGenericAllocationHandle(self.fake.create(size, prop.location.id))

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        assert self._p(addr) == 0 and flags == 0
        return OK, cu.CUdeviceptr(self.fake.reserve(size, alignment))

    def cuMemMap(self, ptr, size, offset, h, flags):
        assert offset == 0 and flags == 0
        self.fake.map(self._p(ptr), size, self._h(h))
        return (OK,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        self._p(ptr)
        assert count == len(descs) == 1
        assert descs[0].flags == cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        assert descs[0].location.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        return (OK,)

    def cuMemUnmap(self, ptr, size):
        self.fake.unmap(self._p(ptr), size)
        return (OK,)

    def cuMemAddressFree(self, ptr, size):
        self.fake.address_free(self._p(ptr), size)
        return (OK,)


class _OnHost(vmm.CudaVmm):
    """CudaVmm as it is, but its tensors on host memory (no CuPy or device here)."""

    def __init__(self, fake: FakeVmm):
        super().__init__()
        self._fake = fake

    def tensor(self, addr: int, nbytes: int, device: int) -> torch.Tensor:
        return self._fake.tensor(addr, nbytes, device)

    def synchronize(self, device: int) -> None:
        pass


@pytest.fixture
def shim(monkeypatch):
    fake = FakeVmm()
    drv = _Driver(fake)
    drv.install(monkeypatch)
    return fake, drv


def _layout():
    return small_layout(num_blocks=256)  # 2 layers x 256 blocks x 4 tokens x 2 heads x 8 dims x K/V, bf16: 128 KiB


def test_allocate_export_send_import_map_through_the_binding(shim):
    fake, drv = shim
    layout = _layout()
    client = _OnHost(fake)
    with vmm.VmmCache(layout, 0, chunk_bytes=GRANULARITY, fill=0, drv=client) as cache:
        assert drv.current == 0x1000  # the device's primary context made current first
        handle, chunks = vmm.export(cache.tensor, 0, client)
        assert handle.kind == "cuda_vmm" and vmm.decode_sizes(handle.handle) == [GRANULARITY] * 2
        assert all(isinstance(h, cu.CUmemGenericAllocationHandle) for h in chunks)
        a, b = socket.socketpair()
        try:
            vmm.send_fd_batches(a, client, chunks)
            vmm.release_all(client, chunks)
            service = _OnHost(fake)
            mapping = vmm.VmmMapping(handle, vmm.FdStream(b, len(chunks), 5.0), service)
            try:
                cache.tensor.view(torch.uint8).view(-1)[-3:] = torch.tensor([7, 8, 9], dtype=torch.uint8)
                assert mapping.tensor[-3:].tolist() == [7, 8, 9]  # one memory, two mappings
                mapping.tensor[:2] = 42
                assert cache.tensor.view(torch.uint8).view(-1)[:2].tolist() == [42, 42]
            finally:
                mapping.close()
        finally:
            a.close()
            b.close()
    assert fake.live_handles() == 0 and fake.mapped_ranges() == 0
    for name in ("cuMemCreate", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemMap",
                 "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree"):
        assert name in drv.calls


def test_cudamalloc_memory_is_not_vmm_and_a_chunk_without_fd_export_is_refused(shim):
    fake, _ = shim
    client = _OnHost(fake)
    assert vmm.export(torch.zeros(4096, dtype=torch.uint8), 0, client) is None  # retain fails: CUDA IPC then
    fake._exportable = False  # chunks created from here on lack descriptor export
    with vmm.VmmCache(_layout(), 0, chunk_bytes=GRANULARITY, fill=0, drv=client) as cache:
        with pytest.raises(LayoutError, match="file-descriptor export"):
            vmm.export(cache.tensor, 0, client)
    assert fake.live_handles() == 0


def test_driver_errors_are_typed_and_name_the_call(shim, monkeypatch):
    fake, _ = shim
    monkeypatch.setattr(cu, "cuMemAddressReserve", lambda *a: (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, cu.CUdeviceptr(0)))
    with pytest.raises(LayoutError, match="cuMemAddressReserve: CUDA_ERROR_OUT_OF_MEMORY"):
        vmm.VmmCache(_layout(), 0, drv=_OnHost(fake))


def test_unnamed_handle_type_combinations_fall_back_to_the_drivers_own_export(shim, monkeypatch):
    """A property read the binding cannot turn into its enum (a combination of handle types):
    exportability is then the driver's own answer to an export."""
    fake, _ = shim
    client = _OnHost(fake)
    with vmm.VmmCache(_layout(), 0, fill=0, drv=client) as cache:
        h = client.retain(cache.tensor.data_ptr())

        def unnamed(handle):
            raise ValueError("9 is not a valid CUmemAllocationHandleType")

        monkeypatch.setattr(cu, "cuMemGetAllocationPropertiesFromHandle", unnamed)
        assert client.exportable(h) is True
        fds_before = len(os.listdir("/proc/self/fd"))
        fake._chunks[int(h)][3] = False
        assert client.exportable(h) is False
        assert len(os.listdir("/proc/self/fd")) == fds_before  # the trial export's descriptor was closed
        client.release(h)
