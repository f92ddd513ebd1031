"""kmesh_gpu._launch's driver events and stream waits: they decline cleanly where there is no driver,
and on a GPU they order work exactly as torch's events and synchronisation do."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import _launch


def test_driver_event_and_stream_wait_decline_when_switched_off(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", False)
    assert _launch.DriverEvent.create() is None
    assert _launch.DriverEvent.recorded(0) is None
    assert _launch.stream_synchronize(0) is False
    assert _launch.event_query(1) is None and _launch.stream_query(0) is None


def test_driver_event_declines_without_a_driver():
    if _launch._event_functions() is not None:
        pytest.skip("this machine has libcuda: covered by the GPU tests below")
    assert _launch.DriverEvent.create() is None
    assert _launch.stream_synchronize(0) is False


def _busy(stream: torch.cuda.Stream, ms: float = 50.0) -> None:
    """Queue about ``ms`` of device time on ``stream`` (a spin kernel)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 2e6))  # cycles at ~2 GHz


@pytest.mark.gpu
def test_driver_event_completes_after_the_work_before_its_record():
    stream = torch.cuda.Stream()
    _busy(stream)
    event = _launch.DriverEvent.recorded(stream.cuda_stream)
    assert event is not None and event.cuda_event
    assert event.query() is False  # the spin kernel is still running
    assert _launch.event_query(event.cuda_event) is False
    event.synchronize()
    assert event.query() is True and stream.query() and _launch.event_query(event.cuda_event) is True
    _busy(stream)
    assert _launch.stream_query(stream.cuda_stream) is False
    assert event.record(stream.cuda_stream) and _launch.event_query(event.cuda_event) is False
    event.synchronize()
    assert _launch.stream_query(stream.cuda_stream) is True
    # re-recorded on an idle stream: complete at once
    assert event.record(stream.cuda_stream) and (event.synchronize() or event.query())


@pytest.mark.gpu
def test_stream_synchronize_waits_for_queued_work():
    stream = torch.cuda.Stream()
    _busy(stream)
    assert not stream.query()
    assert _launch.stream_synchronize(stream.cuda_stream) is True
    assert stream.query()


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
        event = _launch.DriverEvent.recorded(stream.cuda_stream)
        host.set_fence(event)
        assert not event.query()
    # closed: the fence was waited for before the pinned memory went away
    assert event.query() and int(dst[-1]) == 7


@pytest.mark.gpu
def test_caller_stream_records_driver_events():
    from kmesh_host._streams import _CallerStream

    streams = _CallerStream(torch.device("cuda"))
    event = streams.copied()
    assert isinstance(event, _launch.DriverEvent)
    streams.sync()
    assert event.query()


@pytest.mark.gpu
def test_a_dropped_driver_event_is_handed_out_again_and_orders_its_new_record():
    """A dropped DriverEvent's handle goes back to its context's pool: the next create() gets it,
    and a record made by the new owner is what queries and waits see (not the old one's)."""
    import gc

    stream = torch.cuda.Stream()
    old = _launch.DriverEvent.recorded(stream.cuda_stream)
    old.synchronize()
    handle = old.cuda_event
    del old
    gc.collect()
    new = _launch.DriverEvent.create()
    assert new is not None and new.cuda_event == handle  # recycled, no cuEventCreate
    _busy(stream)
    assert new.record(stream.cuda_stream)
    assert new.query() is False  # the new record, behind the spin kernel
    new.synchronize()
    assert new.query() is True and stream.query()
