"""kmesh_gpu._driver_jit: the compiled driver-call sequences make exactly the driver calls of the
Python path, in order, with the C argument widths of the driver's prototypes, and stop at the
first refusal with its code. The "driver" is the stand-in of tests.helpers.fake_driver (C callbacks
through ctypes that log every call and can refuse one), so all of this runs on CPU; placements
through these calls on a GPU are in test_plan_paths.py.

``place_now`` (a placement gathered, tabulated, uploaded and launched in one call, fenced after the
kernel): the gathered indices, the run table against kmesh_gpu.compiled.build_runs', the calls in
order with their arguments, the launch plan, and each refusal's code."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.helpers.fake_driver import FakeDriver

dj = pytest.importorskip("kmesh_gpu._driver_jit", reason="needs Numba (a dependency)")
compiled = pytest.importorskip("kmesh_gpu.compiled", reason="needs Numba (a dependency)")

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


# row, N, cap, S, P, kst1, kst3, koff, vst1, vst3, voff
PARAMS = np.array([512, 16, 16, 256, 4096, 4096, 256, 0, 4096, 256, 2048], dtype=np.int64)


def _table_inputs(slots, counts, *, rope_positions=None):
    T = len(slots)
    starts = np.cumsum([0, *counts]).astype(np.int64)
    ptrs = np.array([1 << 20, 1 << 30, 1 << 40][:len(counts)], dtype=np.int64)
    pos = np.zeros(0, dtype=np.int64) if rope_positions is None else rope_positions
    return np.asarray(slots, dtype=np.int64), starts, ptrs, PARAMS.copy(), pos, T


def _reference(sl, starts, ptrs, params, pos):
    out = np.zeros((len(sl), 7), dtype=np.int64)
    R = compiled.build_runs(np.asarray(sl, dtype=np.int64), starts, ptrs, params, True, pos, out)
    return R, out[:max(R, 0)]


def test_build_upload_builds_the_compiled_builders_table_and_uploads_just_it():
    sl, starts, ptrs, params, pos, T = _table_inputs(list(range(20, 50)) + list(range(100, 110)), [25, 15])
    head = 6
    host = np.full(head + 7 * T, -7, dtype=np.int64)
    device = np.zeros_like(host)
    drv = FakeDriver()
    R = dj.build_upload(drv.table(), sl, starts, ptrs, params, pos, host[head:].reshape(T, 7), head,
                        host.ctypes.data, device.ctypes.data, 31, 41)
    ref_R, ref = _reference(sl, starts, ptrs, params, pos)
    assert R == ref_R > 0
    assert np.array_equal(host[head:head + 7 * R].reshape(R, 7), ref)
    assert [c[0] for c in drv.calls] == ["copy", "record"]
    assert drv.calls[0][1:] == (device.ctypes.data, host.ctypes.data, 8 * (head + 7 * R), 31)
    assert drv.calls[1][1:] == (41, 31)
    assert np.array_equal(device[:head + 7 * R], host[:head + 7 * R]) and not device[head + 7 * R:].any()


@pytest.mark.parametrize("case", ["skipped token", "not increasing", "everything skipped", "duplicate slot",
                                  "slot out of range", "runs too short", "copy refused", "record refused"])
def test_build_upload_uploads_what_it_covers_and_stops_with_a_code_otherwise(case):
    """Skipped tokens and slots that are not increasing are tabulated and uploaded; a slot written
    twice, out of range, or runs a token long stop with the builder's code, nothing queued; a
    refused copy or record stops with its own code."""
    slots = list(range(40))
    refuse = {}
    if case == "skipped token":
        slots[3] = -1
    elif case == "not increasing":
        slots = list(range(16, 40)) + list(range(16))
    elif case == "everything skipped":
        slots = [-1] * 40
    elif case == "duplicate slot":
        slots[30] = slots[2]
    elif case == "slot out of range":
        slots[-1] = 256
    elif case == "runs too short":
        slots = list(range(0, 80, 2))  # every token its own run
    elif case == "copy refused":
        refuse = {"copy": 0}
    else:
        refuse = {"record": 0}
    sl, starts, ptrs, params, pos, T = _table_inputs(slots, [40])
    host = np.zeros(7 * T, dtype=np.int64)
    device = np.zeros_like(host)
    drv = FakeDriver(refuse)
    R = dj.build_upload(drv.table(), sl, starts, ptrs, params, pos, host.reshape(T, 7), 0, host.ctypes.data,
                        device.ctypes.data, 1, 2)
    ref_R, ref = _reference(sl, starts, ptrs, params, pos)
    expected = {"duplicate slot": (compiled.DUPLICATE_SLOT, []),
                "slot out of range": (compiled.SLOT_RANGE, []),
                "runs too short": (compiled.RUNS_DO_NOT_PAY, []),
                "everything skipped": (0, []),
                "copy refused": (dj.COPY_REFUSED, ["copy"]),
                "record refused": (dj.RECORD_REFUSED, ["copy", "record"])}.get(case)
    if expected is None:  # covered: built, uploaded, fenced
        assert R == ref_R > 0 and drv.kinds() == ["copy", "record"]
        assert np.array_equal(host[:7 * R].reshape(R, 7), ref) and np.array_equal(device[:7 * R], host[:7 * R])
    else:
        assert (R, drv.kinds()) == expected
        assert ref_R == (R if R not in (dj.COPY_REFUSED, dj.RECORD_REFUSED) else ref_R)


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


# ---------------------------------------------------------------------------------- place_now
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
        self.rope = rope
        self.layer_base = _ro([1 << 32, (1 << 32) + 4096, (1 << 32) + 8192])
        self.starts = _ro([0, 25, T])
        self.ptrs = np.array([1 << 20, 1 << 30], dtype=np.int64)
        self.params = PARAMS.copy()
        self.o = 32  # the region's first int64 in the ring
        self.ring = np.full(self.o + L + 10 * T + 64, -7, dtype=np.int64)
        self.host = self.ring.ctypes.data + 8 * self.o
        self.device = np.zeros(L + 10 * T, dtype=np.int64)
        self.kernel = _ro([1234, 1, units, COUNT])
        self.template = _ro([0, 0, 0, 0, 0, L, 0] + [0] * COUNT)  # (runs, positions, bases, R, T, L, lg)

    def run(self, drv: FakeDriver):
        arrays = (*self.olds, *self.news, *self.slots) if self.rope else self.slots
        srcs = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
        return dj.place_now(drv.table(), srcs, self.layer_base, self.starts, self.ptrs, self.params, self.ring,
                            self.o, self.host, self.device.ctypes.data, 17, 29, self.kernel, self.template)

    def region(self) -> np.ndarray:
        return self.ring[self.o:self.o + L + 10 * self.T]

    def reference(self):
        """The run table the compiled builder makes from the same indices, and its R."""
        pos = np.concatenate(self.olds + self.news) if self.rope else np.zeros(0, dtype=np.int64)
        return _reference(np.concatenate(self.slots), np.asarray(self.starts), self.ptrs, self.params, pos)


def _grid(R: int, units: int) -> tuple[int, int]:
    """(layers per warp group, blocks of 8 warps) as the run kernel's launch plan (kmesh_gpu.plan)."""
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


@pytest.mark.parametrize("case_name", ["not increasing", "skipped token"])
def test_place_now_places_unsorted_slots_and_skipped_tokens(case_name):
    """Slots that are not increasing (distinct) and skipped tokens, whose positions are not read
    (out of range here), are placed in the one call, with the compiled builder's table."""
    if case_name == "not increasing":  # the second item's slots before the first's
        slots = list(range(100, 125)) + list(range(20, 35))
    else:
        slots = list(range(20, 45)) + list(range(100, 115))
        slots[24] = slots[39] = -1
    case = Case(slots=slots)
    if case_name == "skipped token":
        case.olds[0][24] = -5
        case.news[1][14] = 1 << 40
    drv = FakeDriver(arg_count=COUNT)
    R = case.run(drv)
    ref_R, ref_runs = case.reference()
    assert R == ref_R > 0 and drv.kinds() == ["copy", "launch", "record"]
    runs_at = L + 3 * case.T
    assert np.array_equal(case.region()[runs_at:runs_at + 7 * R].reshape(R, 7), ref_runs)


@pytest.mark.parametrize("case_name, refuse, code, calls", [
    ("duplicate slot", {}, compiled.DUPLICATE_SLOT, []),
    ("slot out of range", {}, compiled.SLOT_RANGE, []),
    ("position out of range", {}, compiled.POSITION_RANGE, []),
    ("runs too short", {}, compiled.RUNS_DO_NOT_PAY, []),
    ("everything skipped", {}, 0, []),
    ("copy refused", {"copy": 0}, dj.COPY_REFUSED, ["copy"]),
    ("launch refused", {"launch": 0}, dj.LAUNCH_REFUSED, ["copy", "launch"]),
    ("fence refused", {"record": 0}, dj.UNFENCED, ["copy", "launch", "record"]),
])
def test_place_now_stops_at_what_it_does_not_cover_or_the_driver_refuses(case_name, refuse, code, calls):
    slots = list(range(20, 45)) + list(range(100, 115))
    if case_name == "duplicate slot":
        slots[30] = slots[5]
    elif case_name == "slot out of range":
        slots[-1] = 256
    elif case_name == "runs too short":
        slots = list(range(0, 80, 2))  # every token its own run
    elif case_name == "everything skipped":
        slots = [-1] * 40
    case = Case(slots=slots)
    if case_name == "position out of range":
        case.news[1][3] = 4096
    drv = FakeDriver(refuse, arg_count=COUNT)
    assert case.run(drv) == code
    assert drv.kinds() == calls


def test_the_warm_up_compiles_the_signatures_the_plan_calls_with():
    """``cuda.warm_up`` compiles the sequences at import for the argument types kmesh_gpu.plan
    passes (read-only item starts, run parameters, layer bases and launch constants), so a first
    restore compiles nothing more (seconds, with the GIL held)."""
    import numba
    import torch

    from kmesh_gpu import KVLayout, PlacementPlan, _table_ring, _tables

    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    f = PlacementPlan(layout.allocate(fill=0), layout)._f
    starts = _tables._token_index((16, 8), f.row)[0]  # as the plan passes them
    params = f.run_params(16)
    ring = _table_ring.TableRing(1 << 16, pin=False, new_event=lambda: None).a64
    fns = np.zeros(3, dtype=np.int64)
    fns.setflags(write=False)  # driver_table()'s array
    ro = np.zeros(14, dtype=np.int64)
    ro.setflags(write=False)  # the kernel's constants and packed arguments (_place_cupy.driver_template)
    ptrs, n = _tables._i64([1 << 20, 1 << 21]), 0
    upload = (fns, ring[10:34], starts, ptrs, params, ring[:48], ring[100:268].reshape(24, 7), n, n, n, n, n)
    now = (fns, ptrs, f.layer_base, starts, ptrs, params, ring, n, n, n, n, n, ro, ro)
    assert tuple(numba.typeof(a) for a in upload) in dj.build_upload.signatures
    assert tuple(numba.typeof(a) for a in now) in dj.place_now.signatures
