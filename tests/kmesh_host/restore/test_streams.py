"""Where a restore's device work runs (kmesh_host/restore/streams.py): driver events on the caller's
stream, the route's streams joined back into the caller's, the cheap stream switch, and the CPU's
inline steps."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import cuda
from kmesh_host.restore.streams import CallerStream, Streams, on_stream, stream_ids


def test_on_the_cpu_every_step_runs_inline():
    streams = Streams(torch.device("cpu"))
    assert streams.copied() is None and streams.copy_handle() is None and streams.digest_side(None) is None
    with streams.on_copy(), streams.on_work(), streams.on_digest(None):
        pass
    streams.work_after(None)
    streams.join()
    streams.after_late_copies()
    streams.sync()


@pytest.mark.gpu
def test_caller_stream_records_driver_events():
    streams = CallerStream(torch.device("cuda"))
    event = streams.copied()
    assert isinstance(event, cuda.DriverEvent)
    streams.sync()
    assert event.query()


@pytest.mark.gpu
def test_the_routes_streams_start_after_the_caller_and_join_back_into_it():
    """Work queued on the copy, work and side streams starts after the caller's earlier work and
    the caller's stream waits for all of it after ``join``; ``on_stream`` switches torch's current
    stream and restores it."""
    caller = torch.cuda.current_stream()
    src = torch.full((1 << 22,), 3, dtype=torch.uint8, device="cuda")
    streams = Streams(torch.device("cuda"))
    assert isinstance(streams.start, cuda.DriverEvent)
    dst = torch.empty_like(src)
    with streams.on_copy():
        assert torch.cuda.current_stream() == streams.copy
        dst.copy_(src, non_blocking=True)
    assert torch.cuda.current_stream() == caller
    event = streams.copied()
    streams.work_after(event)
    with streams.on_digest(event):
        dst.add_(1)
    streams.join()
    out = dst.clone()  # on the caller's stream, after the join
    streams.sync()
    assert int(out.min()) == 4 == int(out.max())
    with on_stream(streams.work, stream_ids(streams.work)):
        assert torch.cuda.current_stream() == streams.work
    assert torch.cuda.current_stream() == caller
