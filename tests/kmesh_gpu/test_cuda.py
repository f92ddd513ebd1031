"""kmesh_gpu.cuda: driver calls on raw handles. Where there is no driver (this machine, or a driver
that is made to refuse: fault injection through the module's resolved function tables) every call
declines, queuing nothing, and says so; the compiled copy sequence is used with whatever driver
table it is given (a stand-in of tests.helpers.fake_driver here); on a GPU events and stream waits
order work exactly as torch's do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kmesh_gpu import cuda
from tests.helpers.fake_driver import FakeDriver


@pytest.fixture
def no_driver(monkeypatch):
    """As on a machine where libcuda is not loadable: every resolved driver function is missing."""
    monkeypatch.setattr(cuda, "_DRIVER", [(None, None, None, None)])
    monkeypatch.setattr(cuda, "_EVENT_FNS", [None])
    monkeypatch.setattr(cuda, "_DTOH", [None])
    monkeypatch.setattr(cuda, "_JIT", [None])


def test_every_call_declines_without_a_driver(no_driver):
    class Fn:
        ptr = 1234

    assert cuda.launch(Fn(), (1,), (32,), 0, (1, 2)) is False
    assert cuda.copy_htod(0, 0, 16, 0) is False and cuda.copy_dtoh(0, 0, 16, 0) is False
    assert cuda.copies_htod(np.zeros((1, 3), dtype=np.int64), 1, 0) == 0
    assert cuda.record_event(1, 0) is False and cuda.wait_event(0, 1) is False
    assert cuda.DriverEvent.create() is None and cuda.DriverEvent.recorded(0) is None
    assert cuda.stream_synchronize(0) is False
    assert cuda.event_query(1) is None and cuda.stream_query(0) is None
    assert cuda.compiled_driver() is None and cuda.warm_up() is False


def test_calls_decline_without_a_function_or_an_event_or_a_64_bit_value():
    """No CUfunction, event 0, or an argument over 63 bits: declined (the caller takes CuPy's or
    torch's path), whatever the machine."""

    class NoPtr:
        pass

    assert cuda.launch(NoPtr(), (1,), (32,), 0, (1, 2)) is False
    assert cuda.record_event(0, 0) is False and cuda.wait_event(0, 0) is False  # no event: refused

    class Fn:
        ptr = 1234

    if cuda._driver() is not None:  # a machine with libcuda: an argument over 63 bits is declined
        assert cuda.launch(Fn(), (1,), (32,), 0, (1 << 64,)) is False


def test_driver_event_declines_without_a_driver():
    if cuda._event_functions() is not None:
        pytest.skip("this machine has libcuda: covered by the GPU tests below")
    assert cuda.DriverEvent.create() is None
    assert cuda.stream_synchronize(0) is False


def test_copies_htod_uses_the_compiled_sequence_with_its_driver_table(monkeypatch):
    pytest.importorskip("kmesh_gpu._driver_jit", reason="needs Numba (a dependency)")
    from kmesh_gpu import _driver_jit

    drv = FakeDriver()
    monkeypatch.setattr(cuda, "_JIT", [(_driver_jit, drv.table())])
    src, dst = np.arange(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    rows = np.array([[dst.ctypes.data, src.ctypes.data, src.nbytes]], dtype=np.int64)
    assert cuda.copies_htod(rows, 1, 3) == 1
    assert np.array_equal(src, dst) and drv.kinds() == ["copy"]
    # a refusal: the copies before it are queued, the rest are the caller's
    drv = FakeDriver(refuse={"copy": 1})
    monkeypatch.setattr(cuda, "_JIT", [(_driver_jit, drv.table())])
    srcs = [np.full(4, i + 1, dtype=np.int64) for i in range(3)]
    dsts = [np.zeros(4, dtype=np.int64) for _ in range(3)]
    rows = np.array([[d.ctypes.data, s.ctypes.data, s.nbytes] for s, d in zip(srcs, dsts)], dtype=np.int64)
    assert cuda.copies_htod(rows, 3, 3) == 1
    assert np.array_equal(dsts[0], srcs[0]) and not dsts[1].any() and not dsts[2].any()


def test_the_compiled_driver_is_numba_s_where_it_compiles():
    """Numba is a dependency: the compiled sequences compile here; whether they are usable depends
    on libcuda being loadable (``compiled_driver`` and ``warm_up`` agree)."""
    pytest.importorskip("kmesh_gpu._driver_jit", reason="needs Numba (a dependency)")
    assert cuda.warm_up() is (cuda.compiled_driver() is not None)
    if cuda._event_functions() is None:
        assert cuda.compiled_driver() is None  # no libcuda: the ctypes path (which declines) serves


def _busy(stream: torch.cuda.Stream, ms: float = 50.0) -> None:
    """Queue about ``ms`` of device time on ``stream`` (a spin kernel)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 2e6))  # cycles at ~2 GHz


@pytest.mark.gpu
def test_driver_event_completes_after_the_work_before_its_record():
    stream = torch.cuda.Stream()
    _busy(stream)
    event = cuda.DriverEvent.recorded(stream.cuda_stream)
    assert event is not None and event.cuda_event
    assert event.query() is False  # the spin kernel is still running
    assert cuda.event_query(event.cuda_event) is False
    event.synchronize()
    assert event.query() is True and stream.query() and cuda.event_query(event.cuda_event) is True
    _busy(stream)
    assert cuda.stream_query(stream.cuda_stream) is False
    assert event.record(stream.cuda_stream) and cuda.event_query(event.cuda_event) is False
    event.synchronize()
    assert cuda.stream_query(stream.cuda_stream) is True
    # re-recorded on an idle stream: complete at once
    assert event.record(stream.cuda_stream) and (event.synchronize() or event.query())


@pytest.mark.gpu
def test_stream_synchronize_waits_for_queued_work():
    stream = torch.cuda.Stream()
    _busy(stream)
    assert not stream.query()
    assert cuda.stream_synchronize(stream.cuda_stream) is True
    assert stream.query()


@pytest.mark.gpu
def test_a_stream_waits_for_a_driver_event_recorded_on_another():
    """``wait_event``: work queued on one stream after the wait runs after the other stream's
    work before the record (a copy into a buffer another stream is still filling reads it full)."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    _busy(producer)
    with torch.cuda.stream(producer):
        src.fill_(9)
    event = cuda.DriverEvent.recorded(producer.cuda_stream)
    assert event is not None and cuda.wait_event(consumer.cuda_stream, event.cuda_event)
    with torch.cuda.stream(consumer):
        dst.copy_(src)
    consumer.synchronize()
    assert int(dst.min()) == 9


@pytest.mark.gpu
def test_copies_through_the_driver_land_on_the_device():
    host = torch.arange(1 << 12, dtype=torch.int64).pin_memory()
    dst = torch.zeros_like(host, device="cuda")
    back = torch.zeros_like(host).pin_memory()
    stream = torch.cuda.current_stream().cuda_stream
    rows = np.array([[dst.data_ptr(), host.data_ptr(), host.numel() * 8]], dtype=np.int64)
    assert cuda.copies_htod(rows, 1, stream) == 1
    assert cuda.copy_dtoh(back.data_ptr(), dst.data_ptr(), 8 * host.numel(), stream)
    assert cuda.stream_synchronize(stream)
    assert torch.equal(back, host)
    assert cuda.copy_htod(dst.data_ptr(), back.data_ptr(), 8, stream)


@pytest.mark.gpu
def test_driver_event_fences_a_host_buffer_until_its_copy_ran():
    """A host-tier buffer's fence given a driver event: closing the buffer waits for the copy."""
    from kmesh_host.direct_io import HostBuffer

    stream = torch.cuda.Stream()
    dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    with HostBuffer(1 << 20, pin=True) as host:
        host.tensor.fill_(7)
        _busy(stream)
        with torch.cuda.stream(stream):
            dst.copy_(host.tensor[: 1 << 20], non_blocking=True)
        event = cuda.DriverEvent.recorded(stream.cuda_stream)
        host.set_fence(event)
        assert not event.query()
    # closed: the fence was waited for before the pinned memory went away
    assert event.query() and int(dst[-1]) == 7


@pytest.mark.gpu
def test_a_dropped_driver_event_is_handed_out_again_and_orders_its_new_record():
    """A dropped DriverEvent's handle goes back to its context's pool: the next create() gets it,
    and a record made by the new owner is what queries and waits see (not the old one's)."""
    import gc

    stream = torch.cuda.Stream()
    old = cuda.DriverEvent.recorded(stream.cuda_stream)
    old.synchronize()
    handle = old.cuda_event
    del old
    gc.collect()
    new = cuda.DriverEvent.create()
    assert new is not None and new.cuda_event == handle  # recycled, no cuEventCreate
    _busy(stream)
    assert new.record(stream.cuda_stream)
    assert new.query() is False  # the new record, behind the spin kernel
    new.synchronize()
    assert new.query() is True and stream.query()
