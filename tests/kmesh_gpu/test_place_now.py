"""kmesh_gpu._driver_jit.place_now and kmesh_gpu._place_driver.place_now: a placement gathered,
tabulated, uploaded and launched in one compiled call, fenced after the kernel.

On CPU the driver is the stand-in of ``tests.helpers.fake_driver``: the tests check the gathered
indices, the run table against the compiled builder's, the calls made in order with their
arguments, and that each refusal stops the sequence with its code. On a GPU the placement is
bit-identical to the torch path, also across many placements that wrap the table ring behind a
slow kernel, and every input it does not cover is declined with nothing placed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kmesh_gpu import _host_tables
from tests.helpers.fake_driver import FakeDriver

dj = pytest.importorskip("kmesh_gpu._driver_jit", reason="needs Numba (a dependency)")

L = 3
COUNT = 7  # the template's argument count (as the run kernel's, shortened)


def _ro(values) -> np.ndarray:
    a = np.array(values, dtype=np.int64)
    a.setflags(write=False)
    return a


class Case:
    """Two items (25 and 15 tokens) with slots, old and new positions as separate host arrays."""

    def __init__(self, *, rope: bool = True, slots=None, units: int = 4):
        self.counts = [25, 15]
        self.T = T = sum(self.counts)
        sl = np.asarray(slots if slots is not None else list(range(20, 45)) + list(range(100, 115)), dtype=np.int64)
        rng = np.random.default_rng(0)
        self.slots = [sl[:25].copy(), sl[25:].copy()]
        self.olds = [rng.integers(0, 4096, c).astype(np.int64) for c in self.counts]
        self.news = [rng.integers(0, 4096, c).astype(np.int64) for c in self.counts]
        arrays = (*self.olds, *self.news, *self.slots) if rope else self.slots
        self.srcs = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
        self.rope = rope
        self.layer_base = _ro([1 << 32, (1 << 32) + 4096, (1 << 32) + 8192])
        self.starts = _ro([0, 25, T])
        self.ptrs = np.array([1 << 20, 1 << 30], dtype=np.int64)
        # row, N, cap, S, P, kst1, kst3, koff, vst1, vst3, voff
        self.params = np.array([512, 16, 16, 256, 4096, 4096, 256, 0, 4096, 256, 2048], dtype=np.int64)
        self.o = 32  # the region's first int64 in the ring
        self.ring = np.full(self.o + L + 10 * T + 64, -7, dtype=np.int64)
        self.host = self.ring.ctypes.data + 8 * self.o
        self.device = np.zeros(L + 10 * T, dtype=np.int64)
        self.kernel = _ro([1234, 1, units, COUNT])
        self.template = _ro([0, 0, 0, 0, 0, L, 0] + [0] * COUNT)  # (runs, positions, bases, R, T, L, lg)

    def run(self, drv: FakeDriver):
        return dj.place_now(drv.table(), self.srcs, self.layer_base, self.starts, self.ptrs, self.params, True,
                            self.ring, self.o, self.host, self.device.ctypes.data, 17, 29, self.kernel, self.template)

    def region(self) -> np.ndarray:
        return self.ring[self.o:self.o + L + 10 * self.T]

    def reference(self):
        """The run table the compiled builder makes from the same indices, and its R."""
        T = self.T
        pos = np.concatenate(self.olds + self.news) if self.rope else np.zeros(0, dtype=np.int64)
        out = np.zeros((T, 7), dtype=np.int64)
        R = _host_tables.builder()(np.concatenate(self.slots), np.asarray(self.starts), self.ptrs, self.params, True,
                                   pos, out)
        return R, out[:R]


def _grid(R: int, units: int) -> tuple[int, int]:
    """(layers per warp group, blocks of 8 warps) as the run kernel's plan (_place_driver._launch_plan)."""
    groups = min(L, max(1, -(-units // R)))
    lg = -(-L // groups)
    return lg, -(-(R * -(-L // lg)) // 8)


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "copy"])
def test_place_now_gathers_builds_uploads_launches_then_fences(rope):
    case = Case(rope=rope)
    drv = FakeDriver(arg_count=COUNT)
    R = case.run(drv)
    ref_R, ref_runs = case.reference()
    assert R == ref_R > 0
    T, h = case.T, case.region()
    assert np.array_equal(h[:L], case.layer_base)
    if rope:
        assert np.array_equal(h[L:L + 2 * T], np.concatenate(case.olds + case.news))
    else:
        assert not h[L:L + 2 * T].any()  # never read without RoPE
    assert np.array_equal(h[L + 2 * T:L + 3 * T], np.concatenate(case.slots))
    runs_at = L + 3 * T
    assert np.array_equal(h[runs_at:runs_at + 7 * R].reshape(R, 7), ref_runs)
    # the fence comes after the kernel: it covers the device table the kernel reads, not just the upload
    assert drv.kinds() == ["copy", "launch", "record"]
    dev = case.device.ctypes.data
    assert drv.calls[0][1:] == (dev, case.host, 8 * (runs_at + 7 * R), 17)
    assert drv.calls[2][1:] == (29, 17)
    assert np.array_equal(case.device[:runs_at + 7 * R], h[:runs_at + 7 * R])  # just the table went up
    assert not case.device[runs_at + 7 * R:].any()
    _, fn, grid, block, shmem, stream, _, extra = drv.calls[1]
    lg, blocks = _grid(R, 4)
    assert (fn, grid, block, shmem, stream, extra) == (1234, (blocks, 1, 1), (256, 1, 1), 0, 17, 0)
    assert drv.launch_args == [[dev + 8 * runs_at, dev + 8 * L, dev, R, T, L, lg]]


@pytest.mark.parametrize("units", [1, 5, 10_000])
def test_place_now_spreads_layers_over_warps_as_the_launch_plan(units):
    case = Case(units=units)
    drv = FakeDriver(arg_count=COUNT)
    R = case.run(drv)
    lg, blocks = _grid(R, units)
    assert drv.calls[1][2] == (blocks, 1, 1) and drv.launch_args[0][6] == lg


@pytest.mark.parametrize("case_name, refuse, code, calls", [
    ("not increasing", {}, _host_tables.NOT_INCREASING, []),
    ("slot out of range", {}, _host_tables.SLOT_RANGE, []),
    ("position out of range", {}, _host_tables.POSITION_RANGE, []),
    ("runs too short", {}, dj.RUNS_DO_NOT_PAY, []),
    ("copy refused", {"copy": 0}, dj.COPY_REFUSED, ["copy"]),
    ("launch refused", {"launch": 0}, dj.LAUNCH_REFUSED, ["copy", "launch"]),
    ("fence refused", {"record": 0}, dj.UNFENCED, ["copy", "launch", "record"]),
])
def test_place_now_stops_at_what_it_does_not_cover_or_the_driver_refuses(case_name, refuse, code, calls):
    slots = list(range(20, 45)) + list(range(100, 115))
    if case_name == "not increasing":
        slots[5], slots[6] = slots[6], slots[5]
    elif case_name == "slot out of range":
        slots[-1] = 256
    elif case_name == "runs too short":
        slots = list(range(0, 80, 2))  # every token its own run
    case = Case(slots=slots)
    if case_name == "position out of range":
        case.news[1][3] = 4096
    drv = FakeDriver(refuse, arg_count=COUNT)
    assert case.run(drv) == code
    assert drv.kinds() == calls


def test_place_now_declines_off_the_gpu():
    from kmesh_gpu import KVLayout, _place_driver

    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16)
    assert not _place_driver.place_now([kv.data_ptr()], [tuple(kv.shape)], kv.dtype, layout.allocate(fill=0), layout,
                                       [torch.arange(16)])


# ---------------------------------------------------------------------------------- on the GPU
def _gpu_case(with_rope: bool, seed: int):
    from tests.kmesh_gpu.test_driver_jit import _flat_case, _split

    layout, rope, T, kvs, slots, old, new = _flat_case(with_rope, torch.Generator().manual_seed(seed))
    staging = torch.cat([kv.reshape(-1) for kv in kvs])  # the items back to back, as a restore stages them
    addresses, at = [], staging.data_ptr()
    for kv in kvs:
        addresses.append(at)
        at += kv.numel() * kv.element_size()
    kw = dict(rope=rope, old_positions=_split(old, T), new_positions=_split(new, T)) if with_rope else {}
    return layout, kvs, staging, addresses, _split(slots, T), kw


@pytest.mark.gpu
@pytest.mark.parametrize("with_rope", [False, True], ids=["copy", "rope"])
def test_place_now_places_what_the_torch_path_places(with_rope):
    import importlib

    from kmesh_gpu import _place_driver

    place_mod = importlib.import_module("kmesh_gpu.place")
    layout, kvs, staging, addresses, slots, kw = _gpu_case(with_rope, 11)
    cache = layout.allocate(fill=0x2A, device="cuda")
    for _ in range(2):  # again: the lane's constants are reused from the cache's facts
        assert _place_driver.place_now(addresses, [tuple(kv.shape) for kv in kvs], kvs[0].dtype, cache, layout, slots,
                                       **kw)
    expected = layout.allocate(fill=0x2A, device="cuda")
    place_mod.place_many(kvs, expected, layout, slots, backend="torch", **kw)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_place_now_behind_a_slow_kernel_wraps_the_ring_without_overwriting_a_table_in_use(monkeypatch):
    """More placements than the ring holds at once, queued behind a spinning kernel: a region (and its
    device mirror, which the kernel reads) is not handed out again before the kernel that reads it
    has run, so the ring declines (the caller's other path serves) and every placement lands."""
    from kmesh_gpu import _place_driver
    from tests.kmesh_gpu.test_driver_jit import small_ring_case

    place_mod, layout, cache, kvs, slots = small_ring_case(monkeypatch, 9)
    declined = 0
    for _ in range(3):
        torch.cuda._sleep(int(20e6))  # ~10 ms: the kernels queued behind it stay pending
        for kv, s in zip(kvs, slots):
            if not _place_driver.place_now([kv.data_ptr()], [tuple(kv.shape)], kv.dtype, cache, layout, [s]):
                declined += 1
                place_mod.place_many([kv], cache, layout, [s], backend="cupy")
    torch.cuda.synchronize()
    assert declined > 0  # the ring ran out of free regions while the kernel spun
    expected = layout.allocate(fill=0, device="cuda")
    place_mod.place_many(kvs, expected, layout, slots, backend="torch")
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["not increasing", "skipped token", "int32 slots", "unaligned item",
                                  "position out of range", "warp backend", "shape"])
def test_place_now_declines_what_it_does_not_cover_and_places_nothing(case):
    from kmesh_gpu import _place_driver

    layout, kvs, staging, addresses, slots, kw = _gpu_case(True, 12)
    shapes = [tuple(kv.shape) for kv in kvs]
    backend = "auto"
    if case == "not increasing":
        s = slots[0].clone()
        s[[3, 4]] = s[[4, 3]]
        slots[0] = s
    elif case == "skipped token":
        slots[1] = slots[1].clone()
        slots[1][2] = -1
    elif case == "int32 slots":
        slots[2] = slots[2].to(torch.int32)
    elif case == "unaligned item":
        addresses[1] += 2
    elif case == "position out of range":
        kw["new_positions"][0] = kw["new_positions"][0].clone()
        kw["new_positions"][0][0] = 4096
    elif case == "warp backend":
        backend = "warp"
    else:
        shapes[1] = (2, layout.num_layers + 1) + shapes[1][2:]
    cache = layout.allocate(fill=0, device="cuda")
    assert not _place_driver.place_now(addresses, shapes, kvs[0].dtype, cache, layout, slots, backend=backend, **kw)
    torch.cuda.synchronize()
    assert not cache.view(torch.uint8).any()  # nothing was placed
