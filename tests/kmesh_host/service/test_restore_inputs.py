"""The restore hot path's shortcuts give the same frames, results and errors as the general path:
per-item arrays on the wire, remembered item tables (client and service), remembered item checks
on a registration, the operation's submission gate, and the vectorised slot check."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

from kmesh_gpu import KVLayout, place_many
from kmesh_gpu.errors import DrainError, LayoutError, ProtocolError
from kmesh_host.restore import RestoreItem
from kmesh_host.service import CacheClient, SharedCache, protocol, restore_wire
from kmesh_host.service.transports import int64_array as _int64
from kmesh_host.service.transports import wire_array as _wire_array
from kmesh_host.service.registry import Finished, PeerIdentity, Registry
from tests.kmesh_host.service.helpers import fingerprint, put_original, running_service, small_layout, small_rope

SECRET = bytes(range(32))
EVENT = bytes(range(100, 164))


def _joined(parts) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def _split(frame: bytes):
    _, _, flags, header_len, body_len = protocol.PREFIX.unpack_from(frame)
    p = protocol.PREFIX.size
    buf = bytearray(frame[p:])
    view = memoryview(buf)
    return view[:header_len], view[header_len:]


# ---------------------------------------------------------------------------------- wire
ITEMS = [("a", [0, 1], [10, 11]), ("bé", [4, 5, -1], None), ("c", [9], [40])]


@pytest.mark.parametrize("extra", [{}, {"wait": False, "timeout": 2.5, "timings": True}, {"wait_event": EVENT},
                                   {"inject": {"spin_cycles": 3}}],
                         ids=["plain", "flags", "event", "extras"])
def test_per_item_arrays_give_the_same_frame_as_joined_ones(extra):
    keys = tuple(k for k, _, _ in ITEMS)
    slot_counts = tuple(len(s) for _, s, _ in ITEMS)
    position_counts = tuple(None if p is None else len(p) for _, _, p in ITEMS)
    slots = [np.array(s, dtype=np.int64) for _, s, _ in ITEMS]
    new = [np.array(p, dtype=np.int64) for _, _, p in ITEMS if p is not None]
    req = restore_wire.RestoreRequest(7, 3, SECRET, keys, slot_counts, position_counts, np.concatenate(slots),
                                  np.concatenate(new), **extra)
    general = _joined(restore_wire.encode_restore(req))
    items = restore_wire.restore_items(keys, slot_counts, position_counts)
    fast = restore_wire.restore_frame(items, 7, 3, SECRET, slots + new, **extra)
    assert _joined(fast) == general
    assert all(isinstance(p, np.ndarray) for p in fast[1:])  # the arrays are sent as they are, not copied
    got = restore_wire.decode_restore(*_split(general))
    assert got.keys == keys and got.position_counts == position_counts
    assert np.array_equal(got.slots, req.slots) and np.array_equal(got.new_positions, req.new_positions)


def test_frame_refuses_arrays_that_do_not_match_the_items():
    items = restore_wire.restore_items(("a",), (2,), (2,))
    with pytest.raises(ProtocolError, match="arrays"):
        restore_wire.restore_frame(items, 1, 1, SECRET, [np.zeros(2, dtype=np.int64)])
    with pytest.raises(ProtocolError, match="secret"):
        restore_wire.restore_frame(items, 1, 1, b"short", [np.zeros(4, dtype=np.int64)])


def test_many_items_are_joined_into_few_buffers():
    n = 3 * restore_wire._MAX_PARTS
    keys = tuple(f"k{i}" for i in range(n))
    arrays = [np.array([2 * i, 2 * i + 1], dtype=np.int64) for i in range(n)]
    items = restore_wire.restore_items(keys, (2,) * n, (None,) * n)
    parts = restore_wire.restore_frame(items, 1, 1, SECRET, arrays)
    assert len(parts) == 2
    got = restore_wire.decode_restore(*_split(_joined(parts)))
    assert np.array_equal(got.slots, np.arange(2 * n))
    a, b = socket.socketpair()
    with a, b:  # and they go out in one sendmsg
        protocol.send_parts(a, parts)
        b.settimeout(5)
        flags, buf, body = protocol.read_frame(b)
        assert flags == protocol.FLAG_BINARY and bytes(body) == np.arange(2 * n).tobytes()


def test_remembered_item_tables_decode_like_new_ones():
    req = restore_wire.RestoreRequest(7, 3, SECRET, ("x", "y"), (2, 1), (None, 1), np.array([0, 1, 2]), np.array([5]))
    frame = _joined(restore_wire.encode_restore(req))
    first, second = (restore_wire.decode_restore(*_split(frame)) for _ in range(2))
    for got in (first, second):
        assert (got.keys, got.slot_counts, got.position_counts) == (("x", "y"), (2, 1), (None, 1))
        assert got.slots.tolist() == [0, 1, 2] and got.new_positions.tolist() == [5]
        assert got.slots.flags.writeable
    header, body = _split(frame)
    # the same item table with a body that does not fit it: still refused, with the same message
    with pytest.raises(ProtocolError, match="body: 16 bytes"):
        restore_wire.decode_restore(header, body[:-16])
    # a table that failed never counts as seen
    bad = bytearray(header)
    bad[restore_wire.RESTORE_REQUEST.size + 24] = 0xFF  # first key byte: not UTF-8
    for _ in range(2):
        with pytest.raises(ProtocolError, match="UTF-8"):
            restore_wire.decode_restore(memoryview(bad), body)


# ---------------------------------------------------------------------------------- client inputs
@pytest.mark.parametrize("values", [
    [3, 4, 5], (3, 4, 5), np.array([3, 4, 5]), np.array([3, 4, 5], dtype=np.int32), torch.tensor([3, 4, 5]),
    torch.tensor([3, 9, 4, 9, 5])[::2], np.array([3, 9, 4, 9, 5])[::2], np.array([3, 4, 5], dtype=">i8"),
], ids=["list", "tuple", "int64", "int32", "tensor", "strided-tensor", "strided-array", "big-endian"])
def test_client_index_inputs_give_the_same_bytes(values):
    a = _int64("slots", values)
    assert a.dtype == np.dtype("<i8") and a.flags.c_contiguous and a.tobytes() == np.array([3, 4, 5]).tobytes()


@pytest.mark.parametrize("values, match", [
    (torch.tensor([1, 2], dtype=torch.int32), "int64"), (torch.zeros(2, 2, dtype=torch.int64), "int64"),
    ([[0, 1]], "flat"), (["x"], "integers"), (5, "flat"),
    (torch.tensor([1, 0, 2]).to_sparse(), "strided"),
], ids=["tensor-int32", "tensor-2d", "nested", "strings", "scalar", "sparse-tensor"])
def test_client_index_input_errors(values, match):
    with pytest.raises(LayoutError, match=match):
        _int64("slots", values)
    with pytest.raises(LayoutError, match=match):
        _wire_array("slots", values, [])


@pytest.mark.parametrize("values", [
    torch.tensor([3, 4, 5]), torch.arange(8)[2:5] + 1, torch.tensor([3, 9, 4, 9, 5])[::2], torch.tensor([], dtype=torch.int64),
    [3, 4, 5], np.array([3, 4, 5], dtype=np.int32),
], ids=["tensor", "offset-view", "strided-tensor", "empty-tensor", "list", "int32-array"])
def test_wire_arrays_give_the_bytes_of_the_general_conversion(values):
    keep = []
    buf, count = _wire_array("slots", values, keep)
    want = _int64("slots", values)
    assert count == want.shape[0] and memoryview(buf).nbytes == want.nbytes
    assert bytes(memoryview(buf).cast("B")) == want.tobytes()
    # a contiguous int64 tensor is sent from its own memory and kept alive by the caller's list
    viewed = isinstance(values, torch.Tensor) and values.is_contiguous() and values.numel() > 0
    assert (keep == [values]) if viewed else keep == []
    if viewed:
        values[0] = 42
        assert bytes(memoryview(buf).cast("B"))[:8] == np.int64(42).tobytes()


def test_byte_views_give_the_same_frame_as_arrays_also_when_joined():
    n = 3 * restore_wire._MAX_PARTS
    keys = tuple(f"k{i}" for i in range(n))
    tensors = [torch.tensor([2 * i, 2 * i + 1]) for i in range(n)]
    arrays = [t.numpy() for t in tensors]
    keep = []
    views = [_wire_array("slots", t, keep)[0] if i % 2 else arrays[i] for i, t in enumerate(tensors)]
    for m in (3, n):  # few items (one buffer each) and many (joined into one)
        items = restore_wire.restore_items(keys[:m], (2,) * m, (None,) * m)
        assert _joined(restore_wire.restore_frame(items, 1, 1, SECRET, views[:m])) == \
            _joined(restore_wire.restore_frame(items, 1, 1, SECRET, arrays[:m]))


# ---------------------------------------------------------------------------------- registry
@pytest.fixture
def registry_and_reg():
    layout = KVLayout.from_vllm("NHD", num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_size=4,
                                dtype=torch.float32)
    registry = Registry(lambda reg: None)
    reg = registry.register(PeerIdentity(1, 1, 1), instance=0, handle_key=b"h", layout=layout, memory=None)
    return registry, reg


def _reference_blocks(slots, num_slots, block_size):
    s = np.asarray(slots, dtype=np.int64)
    if ((s < -1) | (s >= num_slots)).any():
        return "range"
    valid = s[s >= 0]
    if np.unique(valid).size != valid.size:
        return "twice"
    return np.unique(valid // block_size).tolist()


def test_slot_check_matches_a_plain_reference(registry_and_reg):
    registry, reg = registry_and_reg
    rng = np.random.default_rng(5)
    for trial in range(400):
        n = int(rng.integers(0, 24))
        slots = rng.integers(-3 if trial % 4 == 0 else -1, reg.num_slots + (2 if trial % 5 == 0 else 0), n)
        if trial % 3 == 0:  # mostly distinct
            slots = rng.permutation(reg.num_slots)[:n] - (rng.random(n) < 0.2)
        want = _reference_blocks(slots, reg.num_slots, reg.block_size)
        if isinstance(want, str):
            with pytest.raises(LayoutError, match="outside" if want == "range" else "twice"):
                registry.block_ids_of_slots(reg, slots)
        else:
            got = registry.block_ids_of_slots(reg, slots)
            assert got.dtype == np.int64 and got.tolist() == want, slots


def test_submission_gate(registry_and_reg):
    registry, reg = registry_and_reg
    op = registry.begin(reg, "restore", np.array([1, 2], dtype=np.int64), ["k"])
    assert op.wait_submitted(0) is False
    with pytest.raises(DrainError, match="being submitted"):
        registry.drain([op], timeout=0)
    waiter = threading.Thread(target=registry.drain, args=([op], None))
    waiter.start()  # blocks until the submission is recorded
    registry.submitted(op, Finished(), outcome="ok")
    waiter.join(60)
    assert not waiter.is_alive() and op.state == "drained" and reg.held_blocks == {}
    assert op.wait_submitted(0) is True
    registry.drain([op], timeout=0)  # again: nothing left to do
    assert not registry.source_held("k")


# ---------------------------------------------------------------------------------- live service
@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.02, receive_spin_s=2e-3) as svc:
        yield svc


def _reference(layout, rope, kvs, plan, fill=0x5A):
    ref = layout.allocate(fill=fill)
    for kv, (slots, new) in zip(kvs, plan):
        if new is None:
            place_many([kv], ref, layout, [torch.tensor(slots)])
        else:
            place_many([kv], ref, layout, [torch.tensor(slots)], rope=rope, old_positions=[torch.arange(4)],
                       new_positions=[torch.tensor(new)])
    return ref


@pytest.mark.parametrize("kind", ["lists", "tuples", "tensors", "arrays", "strided", "generated"])
def test_every_input_kind_restores_the_same_bits(service, kind, request):
    layout, rope = small_layout(), small_rope()
    g = torch.Generator().manual_seed(11)
    kvs = [torch.randn(2, 2, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    plan = [([0, 1, 2, 3], [9, 10, 11, 12]), ([8, -1, 10, 11], None)]

    keys = ["", ""]  # the originals' keys, known once put (below)

    def conv(v):
        if v is None or kind in ("lists", "tuples"):
            return v
        if kind == "tensors":
            return torch.tensor(v)
        if kind == "arrays":
            return np.array(v, dtype=np.int32)
        return torch.tensor([x for x in v for _ in (0, 1)])[::2]  # a strided view

    def build():
        if kind == "generated":
            def fresh():  # each item's tensors made as it is asked for and referenced by nothing else:
                for k, (s, p) in zip(keys, plan):  # the client must keep them alive until it has sent them
                    t = torch.tensor(s)
                    yield RestoreItem(k, t, None if p is None else torch.tensor(p))
                    del t
                    torch.full((64,), -7, dtype=torch.int64)  # reuses freed memory, if any was freed
            return fresh()
        items = [(k, conv(s), conv(p)) if p is not None or kind != "tuples" else (k, s)
                 for k, (s, p) in zip(keys, plan)]
        if kind in ("tensors", "strided"):  # int64 tensors: the restore contract's own items
            items = [RestoreItem(*it) for it in items]
        return items

    with SharedCache(layout, fill=0x5A) as cache, CacheClient(service.socket_path, timeout=60) as client:
        keys[:] = [put_original(client, kv) for kv in kvs]
        reg = client.register(cache, layout, model_fingerprint=fingerprint(), rope=rope)
        items = build()
        for _ in range(2):  # the second request reuses what the first one's items were checked and encoded as
            client.restore(reg, build() if kind == "generated" else items)
        assert torch.equal(cache.tensor.view(torch.uint8), _reference(layout, rope, kvs, plan).view(torch.uint8))
        assert client.close_registration(reg) is True


def test_remembered_item_checks_are_per_item_list(service, request):
    """The checks of a restore's items are remembered per item list: the same positions of another
    original (another shape) are checked again and refused, and a third original of the first shape
    is restored from its own bytes."""
    layout = small_layout()
    g = torch.Generator().manual_seed(2)
    first = torch.randn(2, 2, 4, 2, 8, generator=g).to(torch.bfloat16)
    second = torch.randn(2, 2, 4, 2, 8, generator=g).to(torch.bfloat16)
    with SharedCache(layout, fill=0x5A) as cache, CacheClient(service.socket_path, timeout=60) as client:
        reg = client.register(cache, layout, model_fingerprint=fingerprint())
        key = put_original(client, first)
        client.restore(reg, [(key, [4, 5, 6, 7])])
        assert torch.equal(cache.tensor.view(torch.uint8), _reference(layout, None, [first], [([4, 5, 6, 7], None)])
                           .view(torch.uint8))
        short = put_original(client, torch.zeros(2, 2, 3, 2, 8, dtype=torch.bfloat16))
        before = cache.tensor.view(torch.uint8).clone()
        with pytest.raises(LayoutError, match="expected 3 slots"):
            client.restore(reg, [(short, [4, 5, 6, 7])])
        assert torch.equal(cache.tensor.view(torch.uint8), before)  # nothing written
        other = put_original(client, second)
        client.restore(reg, [(other, [4, 5, 6, 7])])
        assert torch.equal(cache.tensor.view(torch.uint8), _reference(layout, None, [second], [([4, 5, 6, 7], None)])
                           .view(torch.uint8))
        client.restore(reg, [(key, [4, 5, 6, 7])])  # remembered: the first original's own bytes again
        assert torch.equal(cache.tensor.view(torch.uint8), _reference(layout, None, [first], [([4, 5, 6, 7], None)])
                           .view(torch.uint8))
        assert client.close_registration(reg) is True


class _Header:
    """What a restore's checks read of an original's header."""

    def __init__(self, T):
        self.shape, self.torch_dtype = (2, 1, T, 1, 4), torch.float32
        self.positions_int64 = torch.arange(T)


def test_remembered_item_checks_keep_no_header_alive(registry_and_reg):
    import gc
    import weakref
    from types import SimpleNamespace

    from kmesh_host.service.restores import item_plan

    _, reg = registry_and_reg
    dest = SimpleNamespace(rope=None, layout=reg.layout, num_positions=None, item_plans={})
    header = _Header(3)
    req = restore_wire.RestoreRequest(1, reg.reg_id, SECRET, ("k",), (3,), (None,), np.arange(3), np.zeros(0, np.int64))
    plan = item_plan(dest, reg, req, [header])
    assert item_plan(dest, reg, req, [header]) is plan  # remembered for the same item list
    other = restore_wire.RestoreRequest(1, reg.reg_id, SECRET, ("k2",), (3,), (None,), np.arange(3),
                                        np.zeros(0, np.int64))
    assert item_plan(dest, reg, other, [_Header(3)]) is not plan  # another key: checked again
    gone = weakref.ref(header)
    del header
    gc.collect()
    assert gone() is None
    with pytest.raises(LayoutError, match="expected 3 slots"):
        item_plan(dest, reg, restore_wire.RestoreRequest(1, reg.reg_id, SECRET, ("k3",), (2,), (None,), np.arange(2),
                                                         np.zeros(0, np.int64)), [_Header(3)])
