"""kmesh_gpu._driver_jit: the compiled driver-call sequences make exactly the driver calls of the
Python path, in order, with the C argument widths of the driver's prototypes, and stop at the
first refusal. On CPU the "driver" is a set of C callbacks (ctypes) that record their calls; on a
GPU the placement through these calls is bit-identical to the torch/CuPy path."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kmesh_gpu import _host_tables, _launch
from tests.helpers.fake_driver import FakeDriver

dj = pytest.importorskip("kmesh_gpu._driver_jit", reason="needs Numba (a dependency)")

C = ctypes


def _copy_rows(srcs, dsts):
    return np.array([[d.ctypes.data, s.ctypes.data, s.nbytes] for s, d in zip(srcs, dsts)], dtype=np.int64)


def test_copies_are_queued_in_order_then_the_event_is_recorded():
    drv = FakeDriver()
    srcs = [np.arange(i * 10, i * 10 + 5 + i, dtype=np.int64) for i in range(3)]
    dsts = [np.zeros_like(s) for s in srcs]
    assert dj.copies(drv.table(), _copy_rows(srcs, dsts), 3, 77, 55) == 3
    assert [c[0] for c in drv.calls] == ["copy", "copy", "copy", "record"]
    assert [c[3] for c in drv.calls[:3]] == [s.nbytes for s in srcs] and drv.calls[0][4] == 77
    assert drv.calls[3][1:] == (55, 77)
    for s, d in zip(srcs, dsts):
        assert np.array_equal(s, d)


def test_copies_stop_at_the_first_refusal_and_record_nothing():
    drv = FakeDriver(refuse={"copy": 1})
    srcs = [np.full(4, i + 1, dtype=np.int64) for i in range(3)]
    dsts = [np.zeros_like(s) for s in srcs]
    assert dj.copies(drv.table(), _copy_rows(srcs, dsts), 3, 5, 9) == 1
    assert [c[0] for c in drv.calls] == ["copy", "copy"]  # the third is not tried, no record
    assert np.array_equal(dsts[0], srcs[0]) and not dsts[2].any()
    drv = FakeDriver(refuse={"record": 0})
    assert dj.copies(drv.table(), _copy_rows(srcs, dsts), 3, 5, 9) == -1  # all queued, no fence
    assert dj.copies(FakeDriver().table(), _copy_rows(srcs, dsts), 3, 5, 0) == 3  # event 0: no record


def _table_inputs(slots, counts, *, rope_positions=None):
    T = len(slots)
    starts = np.cumsum([0, *counts]).astype(np.int64)
    ptrs = np.array([1 << 20, 1 << 30, 1 << 40][:len(counts)], dtype=np.int64)
    # row, N, cap, S, P, kst1, kst3, koff, vst1, vst3, voff
    params = np.array([512, 16, 16, 256, 4096, 4096, 256, 0, 4096, 256, 2048], dtype=np.int64)
    pos = np.zeros(0, dtype=np.int64) if rope_positions is None else rope_positions
    return np.asarray(slots, dtype=np.int64), starts, ptrs, params, pos, T


def test_build_upload_builds_the_compiled_builders_table_and_uploads_just_it():
    sl, starts, ptrs, params, pos, T = _table_inputs(list(range(20, 50)) + list(range(100, 110)), [25, 15])
    head = 6
    host = np.full(head + 7 * T, -7, dtype=np.int64)
    device = np.zeros_like(host)
    drv = FakeDriver()
    R = dj.build_upload(drv.table(), sl, starts, ptrs, params, True, pos, host[head:].reshape(T, 7), head,
                        host.ctypes.data, device.ctypes.data, 31, 41)
    ref = np.zeros((T, 7), dtype=np.int64)
    assert R == _host_tables.builder()(sl, starts, ptrs, params, True, pos, ref) and R > 0
    assert np.array_equal(host[head:head + 7 * R].reshape(R, 7), ref[:R])
    assert [c[0] for c in drv.calls] == ["copy", "record"]
    assert drv.calls[0][1:] == (device.ctypes.data, host.ctypes.data, 8 * (head + 7 * R), 31)
    assert drv.calls[1][1:] == (41, 31)
    assert np.array_equal(device[:head + 7 * R], host[:head + 7 * R]) and not device[head + 7 * R:].any()


@pytest.mark.parametrize("case", ["skipped token", "not increasing", "runs too short", "copy refused",
                                  "record refused"])
def test_build_upload_declines_with_a_code_and_queues_nothing_it_should_not(case):
    slots = list(range(40))
    refuse = {}
    if case == "skipped token":
        slots[3] = -1
    elif case == "not increasing":
        slots[5], slots[6] = slots[6], slots[5]
    elif case == "runs too short":
        slots = list(range(0, 80, 2))  # every token its own run
    elif case == "copy refused":
        refuse = {"copy": 0}
    else:
        refuse = {"record": 0}
    sl, starts, ptrs, params, pos, T = _table_inputs(slots, [40])
    host = np.zeros(7 * T, dtype=np.int64)
    drv = FakeDriver(refuse)
    R = dj.build_upload(drv.table(), sl, starts, ptrs, params, True, pos, host.reshape(T, 7), 0, host.ctypes.data,
                        host.ctypes.data, 1, 2)
    expected = {"skipped token": (_host_tables.SLOT_RANGE, []),
                "not increasing": (_host_tables.NOT_INCREASING, []),
                "runs too short": (dj.RUNS_DO_NOT_PAY, []),
                "copy refused": (dj.COPY_REFUSED, ["copy"]),
                "record refused": (dj.RECORD_REFUSED, ["copy", "record"])}[case]
    assert (R, [c[0] for c in drv.calls]) == expected


def test_launch_passes_each_argument_by_address_and_the_grid_as_32_bit_values():
    drv = FakeDriver()
    values = [5, -1, 1 << 40, (1 << 31) - 1]
    args = np.zeros(2 * len(values), dtype=np.int64)
    args[:4] = values
    grid = np.array([70000, 2, 1], dtype=np.int64)
    block = np.array([256, 1, 1], dtype=np.int64)
    assert dj.launch(drv.table(), 1234, grid, block, 99, args, 4) == 0
    (kind, fn, g, b, shmem, stream, params, extra), = drv.calls
    assert (kind, fn, g, b, shmem, stream, extra) == ("launch", 1234, (70000, 2, 1), (256, 1, 1), 0, 99, 0)
    got = [C.cast(params[i], C.POINTER(C.c_int64))[0] for i in range(4)]
    assert got == values
    assert C.cast(params[1], C.POINTER(C.c_int32))[0] == -1  # a 32-bit parameter reads the low half
    assert dj.launch(FakeDriver(refuse={"launch": 0}).table(), 1, grid, block, 0, args, 4) == 1


def test_copies_htod_declines_when_switched_off(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", False)
    rows = np.zeros((1, 3), dtype=np.int64)
    assert _launch.copies_htod(rows, 1, 0) == 0


def test_copies_htod_uses_the_compiled_sequence_with_the_driver_table(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(_launch, "_JIT", [(dj, drv.table())])
    src, dst = np.arange(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    assert _launch.copies_htod(_copy_rows([src], [dst]), 1, 3) == 1
    assert np.array_equal(src, dst) and [c[0] for c in drv.calls] == ["copy"]


# ---------------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("with_rope", [False, True], ids=["copy", "rope"])
def test_placement_through_driver_calls_matches_the_torch_and_cupy_path(monkeypatch, with_rope):
    import importlib

    from kmesh_gpu import _place_driver

    place_mod = importlib.import_module("kmesh_gpu.place")
    assert _launch.driver_jit() is not None, "the GPU machine has libcuda and Numba"
    layout, rope, T, kvs, flat_slots, old, new = _flat_case(with_rope, torch.Generator().manual_seed(3))
    slots = _split(flat_slots, T)
    kw = dict(rope=rope, old_positions=_split(old, T), new_positions=_split(new, T)) if with_rope else {}
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(_place_driver, "ENABLED", enabled)
        cache = layout.allocate(fill=0, device="cuda")
        launch = place_mod.prepare_place_many(kvs, cache, layout, slots, backend="cupy", **kw)
        assert (launch.tables.get("driver_launch") is not None) == enabled
        launch.run()
        launch.run()  # a launch may run again (benchmarks time run() alone)
        torch.cuda.synchronize()
        out[enabled] = cache.clone()
    reference = layout.allocate(fill=0, device="cuda")
    place_mod.place_many(kvs, reference, layout, slots, backend="torch", **kw)
    assert torch.equal(out[True].view(torch.uint8), out[False].view(torch.uint8))
    assert torch.equal(out[True].view(torch.uint8), reference.view(torch.uint8))


def small_ring_case(monkeypatch, seed: int):
    """A 1 MiB table ring (fresh, for every cache's facts) and four placements of 2048 tokens whose
    tables (~160 KiB each) it holds six at a time: ``(place module, layout, cache, kvs, slots)``."""
    import importlib

    from kmesh_gpu import KVLayout, _table_ring

    place_mod = importlib.import_module("kmesh_gpu.place")
    monkeypatch.setattr(_table_ring, "RING_BYTES", 1 << 20)
    monkeypatch.setattr(_table_ring, "_RINGS", {})
    for f in place_mod._FACTS.values():
        f.ring, f.lane = None, None
    L, H, D, N, T = 2, 2, 128, 16, 2048
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=512, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.float16)
    gen = torch.Generator().manual_seed(seed)
    kvs = [torch.randn(2, L, T, H, D, generator=gen).to(torch.float16).cuda() for _ in range(4)]
    slots = [torch.arange(i * T, (i + 1) * T, dtype=torch.int64) for i in range(4)]
    return place_mod, layout, layout.allocate(fill=0, device="cuda"), kvs, slots


@pytest.mark.gpu
def test_many_placements_wrap_the_table_ring_and_stay_exact(monkeypatch):
    """More tables than the ring holds at once, each uploaded behind a slow kernel: the ring declines
    (the torch path serves) rather than overwrite a table still being copied, and every placement
    lands exactly."""
    place_mod, layout, cache, kvs, slots = small_ring_case(monkeypatch, 8)
    declined = 0
    for rounds in range(3):
        torch.cuda._sleep(int(20e6))  # ~10 ms: the uploads queued behind it stay pending
        for kv, s in zip(kvs, slots):
            launch = place_mod.prepare_place_many([kv], cache, layout, [s], backend="cupy")
            declined += launch.tables.get("driver_launch") is None
            launch.run()
    torch.cuda.synchronize()
    assert declined > 0  # the ring ran out of free regions while the kernel spun
    expected = layout.allocate(fill=0, device="cuda")
    place_mod.place_many(kvs, expected, layout, slots, backend="torch")
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_prepare_flat_declines_a_cache_off_the_gpu():
    from kmesh_gpu import KVLayout, _place_driver

    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16)
    assert _place_driver.prepare_flat([kv], layout.allocate(fill=0), layout, (16,), np.arange(16)) is None


def _split(values: np.ndarray, counts) -> list:
    """One int64 array over all items as per-item CPU tensors."""
    return list(torch.split(torch.from_numpy(values), counts))


def _flat_case(with_rope: bool, gen):
    from kmesh_gpu import KVLayout, RopeSpec

    L, H, D, N = 3, 2, 64, 16
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=40, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16)
    rope = RopeSpec(D, D, 1e6, True, 4096, torch.bfloat16) if with_rope else None
    T = (40, 24, 57)
    kvs = [torch.randn(2, L, t, H, D, generator=gen).to(torch.bfloat16).cuda() for t in T]
    slots = np.arange(30, 30 + sum(T), dtype=np.int64)
    old = np.random.default_rng(1).integers(0, 4096, sum(T)).astype(np.int64) if with_rope else None
    new = np.random.default_rng(2).integers(0, 4096, sum(T)).astype(np.int64) if with_rope else None
    return layout, rope, T, kvs, slots, old, new


@pytest.mark.gpu
@pytest.mark.parametrize("with_rope", [False, True], ids=["copy", "rope"])
def test_prepare_flat_places_what_prepare_place_many_places(with_rope):
    import importlib

    from kmesh_gpu import _place_driver

    place_mod = importlib.import_module("kmesh_gpu.place")
    layout, rope, T, kvs, slots, old, new = _flat_case(with_rope, torch.Generator().manual_seed(4))
    cache = layout.allocate(fill=0x3C, device="cuda")
    launch = _place_driver.prepare_flat(kvs, cache, layout, T, slots, rope=rope, old_positions=old,
                                        new_positions=new)
    assert launch is not None and launch.tables["driver_launch"] is not None
    launch.run()
    kw = dict(rope=rope, old_positions=_split(old, T), new_positions=_split(new, T)) if with_rope else {}
    expected = layout.allocate(fill=0x3C, device="cuda")
    place_mod.place_many(kvs, expected, layout, _split(slots, T), backend="torch", **kw)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["counts", "int32 slots", "unaligned item", "position out of range",
                                  "positions missing"])
def test_prepare_flat_declines_what_it_does_not_cover(case):
    from kmesh_gpu import _place_driver

    layout, rope, T, kvs, slots, old, new = _flat_case(True, torch.Generator().manual_seed(5))
    if case == "counts":
        T = (40, 24, 56)
    elif case == "int32 slots":
        slots = slots.astype(np.int32)
    elif case == "unaligned item":
        flat = torch.empty(kvs[1].numel() + 1, dtype=torch.bfloat16, device="cuda")
        kvs[1] = flat[1:].view(kvs[1].shape).copy_(kvs[1])  # 2 bytes off a 16-byte boundary
    elif case == "position out of range":
        new = new.copy()
        new[7] = 4096
    else:
        old = None
    cache = layout.allocate(fill=0, device="cuda")
    assert _place_driver.prepare_flat(kvs, cache, layout, T, slots, rope=rope, old_positions=old,
                                      new_positions=new) is None
    torch.cuda.synchronize()
    assert not cache.view(torch.uint8).any()  # nothing was placed
