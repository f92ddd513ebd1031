"""kmesh_gpu.compiled.build_runs (the run kernel's table, built in one compiled pass) against the
NumPy reference of tests/helpers/runs_reference.py: random restores with skipped tokens, unsorted
and duplicate slots, empty items, caps below and above the block size, positions out of range on
skipped tokens (accepted) and on placed ones (refused), and runs too short to pay."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.runs_reference import run_split, run_table, token_loop_split

compiled = pytest.importorskip("kmesh_gpu.compiled", reason="needs Numba (a dependency)")

COLS = compiled.RUN_COLS


def _params(N: int, cap: int, S: int, P: int, row: int = 512) -> np.ndarray:
    # row, N, cap, S, P, kst1, kst3, koff, vst1, vst3, voff: K and V in different block arrangements
    return np.array([row, N, cap, S, P, 4096, 64, 0, 2048, 128, 1 << 20], dtype=np.int64)


def _build(sl, counts, params, check_distinct, pos=None):
    sl = np.asarray(sl, dtype=np.int64)
    starts = np.cumsum([0, *counts]).astype(np.int64)
    ptrs = (np.arange(len(counts), dtype=np.int64) + 1) << 30
    pos = np.zeros(0, dtype=np.int64) if pos is None else np.asarray(pos, dtype=np.int64)
    out = np.full((max(sl.size, 1), COLS), -7, dtype=np.int64)
    R = compiled.build_runs(sl, starts, ptrs, params, check_distinct, pos, out[:sl.size])
    ref_R, ref = run_table(sl, starts, ptrs, params, check_distinct, pos)
    return R, out[:max(R, 0)], ref_R, ref


def test_a_fixed_restore_splits_into_its_runs():
    """Runs end at a skipped token, a slot jump, a block boundary, an item boundary and at cap."""
    slots = [32, 33, 34, 35, -1, 36, 37, 47, 48, 49, 5, 6, 7] + list(range(64, 104)) + list(range(128, 256))
    counts = [12, 41, 128]
    R, out, ref_R, ref = _build(slots, counts, _params(16, 16, 256, 1), True)
    assert R == ref_R == 17
    assert [tuple(r) for r in out[:9, :2].tolist()] == [(0, 4), (5, 2), (7, 1), (8, 2), (10, 2), (12, 1),
                                                       (13, 16), (29, 16), (45, 8)]
    assert out[9:, 1].tolist() == [16] * 8 and out[9:, 0].tolist() == list(range(53, 181, 16))
    assert np.array_equal(out, ref)
    assert not out[:, 6].any()  # one destination cache: its layer-base index is 0
    # cap 3 < N: every run at most 3 long, every placed token in one
    R, out, ref_R, ref = _build(slots, counts, _params(16, 3, 256, 1), True)
    assert R == ref_R and out[:, 1].max() == 3 and out[:, 1].sum() == sum(s >= 0 for s in slots)
    assert np.array_equal(out, ref)


def test_nothing_placed_is_zero_runs():
    params = _params(16, 8, 64, 1)
    for slots, counts in (([-1, -1], [2]), ([], [0]), ([], [0, 0]), ([-1, -1, -1], [0, 3, 0])):
        R, out, ref_R, _ = _build(slots, counts, params, True)
        assert R == ref_R == 0
    # no items at all
    out = np.zeros((1, COLS), dtype=np.int64)
    z = np.zeros(0, dtype=np.int64)
    assert compiled.build_runs(z, np.zeros(1, dtype=np.int64), z, params, True, z, out[:0]) == 0


def test_the_reference_split_equals_a_token_loop():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(0, 60))
        N, cap = int(rng.choice([4, 5, 12, 16])), int(rng.choice([1, 3, 8, 16, 32]))
        if rng.random() < 0.3:
            sl = rng.integers(-1, 120, n)
        else:
            sl = np.arange(n) + int(rng.integers(0, 40))
            sl[rng.random(n) < 0.1] = -1
        item = np.sort(rng.integers(0, 4, n))
        first, length = run_split(sl.astype(np.int64), item, N, cap)
        assert [list(r) for r in zip(first.tolist(), length.tolist())] == token_loop_split(sl, item, N, cap)


def _random_case(rng, kind: str):
    N = int(rng.choice([1, 4, 5, 12, 16]))
    cap = int(rng.choice([1, 3, 8, 16, 32]))
    B = int(rng.integers(8, 40))
    S, P = N * B, 4096
    counts = [int(c) for c in rng.integers(0, 30, int(rng.integers(1, 5)))]
    if rng.random() < 0.3:
        counts.insert(int(rng.integers(0, len(counts) + 1)), 0)  # an empty item
    T = sum(counts)
    start = int(rng.integers(0, max(1, S - T)))
    sl = (np.arange(T, dtype=np.int64) + start) % S
    if kind == "scattered":
        sl = rng.choice(S, T, replace=False).astype(np.int64) if T <= S else sl
    elif kind == "unsorted":
        sl = rng.permutation(sl)
    elif kind == "duplicate" and T > 1:
        sl[int(rng.integers(1, T))] = sl[int(rng.integers(0, T))]
    elif kind == "bad-slot" and T:
        sl[int(rng.integers(0, T))] = int(rng.choice([S, S + 5, -2, -(1 << 40), 1 << 62]))
    if rng.random() < 0.4 and T:  # skipped tokens
        sl[rng.random(T) < 0.2] = -1
    pos = rng.integers(0, P, 2 * T).astype(np.int64)
    if kind == "bad-position-skipped" and T:
        t = int(rng.integers(0, T))
        sl[t] = -1
        pos[t + int(rng.integers(0, 2)) * T] = int(rng.choice([P, -1, 1 << 50]))
    elif kind == "bad-position" and T:
        placed = np.flatnonzero(sl >= 0)
        if placed.size:
            t = int(rng.choice(placed))
            pos[t + int(rng.integers(0, 2)) * T] = int(rng.choice([P, -1, 1 << 50]))
    return sl, counts, _params(N, cap, S, P), pos if rng.random() < 0.7 else None


KINDS = ["runs", "scattered", "unsorted", "duplicate", "bad-slot", "bad-position-skipped", "bad-position"]


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_builder_equals_the_reference_on_random_restores(kind):
    rng = np.random.default_rng(KINDS.index(kind) + 100)
    seen = {}
    for _ in range(300):
        sl, counts, params, pos = _random_case(rng, kind)
        check = bool(rng.random() < 0.75)
        R, out, ref_R, ref = _build(sl, counts, params, check, pos)
        assert R == ref_R, (kind, sl.tolist(), counts, params.tolist(), check)
        if R > 0:
            assert np.array_equal(out, ref)
        seen[R if R <= 0 else "runs"] = seen.get(R if R <= 0 else "runs", 0) + 1
    want = {"runs": "runs", "scattered": compiled.RUNS_DO_NOT_PAY, "unsorted": "runs",
            "duplicate": compiled.DUPLICATE_SLOT, "bad-slot": compiled.SLOT_RANGE,
            "bad-position-skipped": "runs", "bad-position": compiled.POSITION_RANGE}[kind]
    assert seen.get(want, 0) >= 20, seen  # the case this kind is about was exercised


def test_duplicates_are_refused_only_when_checked():
    """A gather reads a slot twice harmlessly (not checked); a placement would race (checked)."""
    params = _params(16, 2, 256, 1)  # cap 2: short runs pay, whatever the split
    for sl in ([3, 4, 5, 3], [10, 11, 12, 11, 12, 13], [40, 7, 40]):
        R, out, ref_R, ref = _build(sl, [len(sl)], params, False)
        assert R == ref_R > 0 and np.array_equal(out, ref)
        assert out[:, 1].sum() == len(sl)  # every token read, the repeated ones too
        assert _build(sl, [len(sl)], params, True)[0] == compiled.DUPLICATE_SLOT
    # distinct but decreasing: accepted either way, runs where the slots allow them
    R, out, ref_R, ref = _build([20, 21, 22, 5, 6, 7, 0], [7], params, True)
    assert R == ref_R == 5 and np.array_equal(out, ref)  # 20-21 | 22 | 5 | 6-7 | 0


def test_positions_are_checked_for_placed_tokens_only():
    params = _params(16, 2, 256, 64)
    sl = [0, 1, -1, 3]
    good = [0, 1, 2, 3, 10, 11, 12, 13]
    assert _build(sl, [4], params, True, good)[0] > 0
    for at in (2, 6):  # the skipped token's old, then new position
        pos = list(good)
        pos[at] = 64
        assert _build(sl, [4], params, True, pos)[0] > 0
    for at, value in ((0, 64), (3, -1), (5, 1 << 40), (7, 64)):
        pos = list(good)
        pos[at] = value
        assert _build(sl, [4], params, True, pos)[0] == compiled.POSITION_RANGE
    # the first offending token decides: a bad slot before a bad position, and the other way round
    assert _build([0, 300, 2, 3], [4], params, True, [0, 1, 2, 99, 0, 0, 0, 0])[0] == compiled.SLOT_RANGE
    assert _build([0, 1, 2, 300], [4], params, True, [0, 99, 2, 3, 0, 0, 0, 0])[0] == compiled.POSITION_RANGE


@pytest.mark.parametrize("cap", [1, 3, 4, 8, 16, 32])
def test_caps_below_and_above_the_block_size(cap):
    """N = 8: a cap below it splits runs at its multiples (also one that does not divide N); at or
    above it, runs end at block boundaries only."""
    N = 8
    params = _params(N, cap, 8 * N, 1)
    sl = list(range(3, 3 + 40))
    R, out, ref_R, ref = _build(sl, [25, 15], params, True)
    first, _ = run_split(np.asarray(sl), np.repeat([0, 1], [25, 15]), N, cap)
    if 2 * len(sl) < cap * first.size:
        assert R == ref_R == compiled.RUNS_DO_NOT_PAY
        return
    assert R == ref_R == first.size and np.array_equal(out, ref)
    lengths = out[:, 1]
    assert lengths.max() <= min(cap, N) and lengths.sum() == len(sl)
    starts = np.asarray(sl)[out[:, 0]]
    ends = starts + lengths - 1
    assert not ((starts // N) != (ends // N)).any()  # no run crosses a block
    if cap < N:
        assert not ((starts // cap) != (ends // cap)).any()  # nor a multiple of cap


def test_runs_too_short_do_not_pay():
    params = _params(16, 16, 256, 1)
    assert _build(list(range(0, 80, 2)), [40], params, True)[0] == compiled.RUNS_DO_NOT_PAY  # a run per token
    assert _build(list(range(8)) + [-1] * 40, [48], params, True)[0] == 1  # skipped tokens do not count
