"""The staging buffer's layout and the restorer's spare staging buffers (kmesh_host/restore/staging.py)."""

from __future__ import annotations

import torch

from kmesh_gpu import StagedSegments
from kmesh_host import SegmentStore
from kmesh_host.direct_io import ALIGN
from kmesh_host.restore.staging import SpareStaging, kv_views, layout_offsets, offsets_of, staged_segments
from tests.helpers.tier import put_segments


def test_offsets_are_aligned_and_the_buffer_holds_every_object():
    offsets, total = offsets_of([1, ALIGN, ALIGN + 1, 0])
    assert offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN] and total == 4 * ALIGN
    assert offsets_of([]) == ([], ALIGN)


def test_staged_segments_and_views_address_the_same_bytes(tmp_path):
    store = SegmentStore(tmp_path / "s")
    keys = put_segments(store, 3)
    headers = [store.read_header(k) for k in keys]
    offsets, total = layout_offsets(headers)
    buffer = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    staged = staged_segments(buffer, headers, offsets)
    assert isinstance(staged, StagedSegments) and staged.offsets == tuple(offsets)
    assert staged.token_counts == tuple(h.num_tokens for h in headers) and staged.dtype == headers[0].torch_dtype
    for view, h, o in zip(kv_views(buffer, headers, offsets), headers, offsets):
        assert view.shape == h.shape and view.data_ptr() == buffer.data_ptr() + o
        assert torch.equal(view.view(torch.uint8), h.kv_view(buffer[o:o + h.padded_length]).view(torch.uint8))


def test_spare_staging_buffers_are_taken_once_per_stream_and_size_and_bounded():
    """A spare goes to the first taker of its device, stream and size and to no one else; a taker
    of another size frees it; at most ``MAX`` are kept; a stocked slot is not replaced (the buffers
    are made on the GPU there, on the CPU here)."""
    spares = SpareStaging()
    cpu = torch.device("cpu")
    spares.stock(cpu, 0, 11, 4096)
    kept = spares.kept()[(0, 11)]
    spares.stock(cpu, 0, 11, 8192)  # already stocked: kept as it is
    assert spares.kept()[(0, 11)] is kept and kept.numel() == 4096 and kept.dtype == torch.uint8
    assert spares.take(0, 12, 4096) is None and spares.take(1, 11, 4096) is None  # other stream/device
    assert spares.take(0, 11, 4096) is kept
    assert spares.take(0, 11, 4096) is None  # taken once
    spares.stock(cpu, 0, 11, 4096)
    assert spares.take(0, 11, 8192) is None and (0, 11) not in spares.kept()  # another size frees it
    for s in range(SpareStaging.MAX + 3):
        spares.stock(cpu, 0, s, 4096)
    assert len(spares.kept()) == SpareStaging.MAX
    assert spares.drop() == SpareStaging.MAX and spares.kept() == {}
