"""The tree-root verifier (kmesh_host/restore/verifier.py) on its own: bad modes, ``settle``'s waits
(every root event and the gate's, a device error there not replacing the restore's own), and the
checks on the CPU. Its use by the routes: test_host_staging.py, test_host_staging_paths.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kmesh_gpu.errors import LayoutError
from kmesh_host import SegmentStore
from kmesh_host.restore.staging import layout_offsets
from kmesh_host.restore.verifier import VERIFY_MODES, Verifier
from tests.helpers.tier import put_segments


class InlineStreams:
    """The CPU's streams: every step inline."""

    work = None

    def on_digest(self, event):
        return contextlib.nullcontext()

    def on_work(self):
        return contextlib.nullcontext()

    def digests_done(self):
        pass


def landed_buffer(store, keys):
    headers = [store.read_header(k) for k in keys]
    offsets, total = layout_offsets(headers)
    buffer = torch.zeros(total, dtype=torch.uint8)
    for k, h, o in zip(keys, headers, offsets):
        with open(store.local_path(k), "rb") as f:
            f.seek(h.payload_offset)
            buffer[o:o + h.padded_length] = torch.frombuffer(bytearray(f.read(h.padded_length)), dtype=torch.uint8)
    return buffer, headers, offsets


def test_a_bad_mode_is_refused_naming_it():
    with pytest.raises(LayoutError, match="verify"):
        Verifier("sha256", torch.zeros(8, dtype=torch.uint8), "auto", InlineStreams(), trust_verified=True)
    assert VERIFY_MODES == ("device", "device-batched", "host", "none")


@pytest.mark.parametrize("mode", ["device", "device-batched", "host"])
def test_roots_are_compared_once_and_a_bad_object_is_named(tmp_path, mode):
    """Objects landed on the device side (no lease: the direct route's case) are checked by their
    tree roots; a flipped byte names exactly that object."""
    store = SegmentStore(tmp_path / "s")
    keys = put_segments(store, 3)
    buffer, headers, offsets = landed_buffer(store, keys)
    buffer[offsets[1] + 100] ^= 0x01
    v = Verifier(mode, buffer, "auto", InlineStreams(), trust_verified=False, objects=3)
    for o, h in zip(offsets, headers):
        v.landed(o, h)
    seconds, bad = v.finish()
    assert bad == [keys[1]] and seconds >= 0
    assert sum(v.counts.values()) == 3


def test_every_settle_waits_for_each_root_event_and_the_gate():
    class Event:
        def __init__(self, fail=False):
            self.fail, self.waited = fail, 0

        def synchronize(self):
            self.waited += 1
            if self.fail:
                raise RuntimeError("CUDA error: injected")

    v = Verifier("device", torch.zeros(8, dtype=torch.uint8), "auto", None, trust_verified=True)
    v.settle()  # nothing queued: nothing to wait for
    v._root_events = [Event(), Event(fail=True), Event()]
    v._gate_done = Event(fail=True)
    v.settle()
    assert [e.waited for e in v._root_events] == [1, 1, 1] and v._gate_done.waited == 1
