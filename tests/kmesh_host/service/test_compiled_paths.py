"""Which path of :mod:`kmesh_host.service._compiled` served: adversarial differential checks of the
Numba-compiled host passes against their NumPy/Python paths, which must agree exactly: the restore
slot check (through ``restores.restore_blocks``, compiled vs. the NumPy path with the compiled
functions switched off), the block reservation (``Registry.begin``) and release
(``Registry._release``) on the holders array. (The run-table builder's own checks moved with it to
``tests/kmesh_gpu/test_compiled.py``.)
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import LayoutError, OwnershipError
from kmesh_host.service import _compiled, restores
from kmesh_host.service.registry import Finished, PeerIdentity, Registry

I64 = np.iinfo(np.int64)


# ================================================================== restore slot check
class _Reg:
    reg_id = 3

    def __init__(self, num_slots: int, block_size: int):
        self.num_slots, self.block_size = num_slots, block_size


def _outcome(fn):
    try:
        return ("ok", fn().tolist())
    except LayoutError as exc:
        return ("LayoutError", str(exc))
    except Exception as exc:  # any other type is itself a disagreement
        return (type(exc).__name__, str(exc))


def _request(items, positions, position_counts):
    slots = np.concatenate(items) if items else np.zeros(0, dtype=np.int64)
    pos = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    body = bytearray(np.concatenate([slots, pos]).astype("<i8").tobytes())  # as the server's frame buffer
    values = np.frombuffer(body, dtype="<i8")
    n = slots.size
    return types.SimpleNamespace(values=values, slots=values[:n], new_positions=values[n:],
                                 position_counts=position_counts, slot_counts=tuple(len(x) for x in items))


def _random_item(rng, S, N):
    cnt = int(rng.choice([0, 1, 1, 2, 3, 5, 9]))
    mode = int(rng.integers(0, 7))
    if mode == 0:  # a run, maybe across blocks, maybe at either bound
        start = int(rng.choice([0, S - cnt, S - cnt + 1, -1, int(rng.integers(0, max(S, 1)))]))
        return np.arange(start, start + cnt, dtype=np.int64)
    if mode == 1:  # sorted distinct in range
        return np.sort(rng.choice(S, size=min(cnt, S), replace=False)).astype(np.int64)
    if mode == 2:  # anything near the range
        return rng.integers(-2, S + 2, size=cnt).astype(np.int64)
    if mode == 3:  # -1 skips among sorted slots
        x = np.sort(rng.choice(S, size=min(cnt, S), replace=False)).astype(np.int64)
        x[rng.random(x.size) < 0.3] = -1
        return x
    if mode == 4:  # int64 extremes
        x = np.sort(rng.choice(S, size=min(cnt, S), replace=False)).astype(np.int64)
        if x.size:
            x[int(rng.integers(0, x.size))] = int(rng.choice([I64.min, I64.max, I64.min + 1, I64.max - 1]))
        return x
    if mode == 5:  # unsorted distinct
        return rng.permutation(S)[:cnt].astype(np.int64)
    # duplicates within the item
    x = np.sort(rng.integers(0, S, size=cnt)).astype(np.int64)
    return x


def _random_positions(rng, T, P):
    x = rng.integers(0, max(P, 1), size=T).astype(np.int64)
    r = rng.random()
    if T and r < 0.15:
        x[int(rng.integers(0, T))] = int(rng.choice([-1, P, P + 1, I64.min, I64.max]))
    return x


def test_restore_check_compiled_and_numpy_paths_agree_exactly(compiled, monkeypatch):
    rng = np.random.default_rng(41)
    cases = []
    for _ in range(3000):
        N = int(rng.choice([1, 2, 3, 4, 5, 16]))
        S = N * int(rng.integers(1, 10))
        reg = _Reg(S, N)
        n = int(rng.integers(1, 5))
        items = [_random_item(rng, S, N) for _ in range(n)]
        if rng.random() < 0.3:  # items apart in range, in a random order (the compiled path sorts them)
            base = np.sort(rng.choice(S, size=min(S, sum(len(x) for x in items)), replace=False)).astype(np.int64)
            cuts = np.cumsum([0] + [len(x) for x in items])
            items = [base[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if a <= base.size]
            items = [items[i] for i in rng.permutation(len(items))]
        P = int(rng.choice([0, 1, 7, 64]))
        shifted = [bool(P and rng.random() < 0.5) for _ in items]
        positions = [_random_positions(rng, len(x), P) for x, s in zip(items, shifted) if s]
        position_counts = tuple(len(x) if s else None for x, s in zip(items, shifted))
        cases.append((reg, items, positions, position_counts, P or None))
    results = {}
    for label in ("compiled", "numpy"):
        if label == "numpy":
            monkeypatch.setattr(_compiled, "compiled", lambda: None)
        out = []
        for reg, items, positions, position_counts, P in cases:
            req = _request(items, positions, position_counts)
            plan = restores.ItemPlan([], req.slot_counts, position_counts, P, reg)
            out.append(_outcome(lambda: restores.restore_blocks(Registry, reg, req, plan)))
        results[label] = out
    ok = sum(r[0] == "ok" for r in results["compiled"])
    assert ok > 300 and len(cases) - ok > 300
    for case, a, b in zip(cases, results["compiled"], results["numpy"]):
        assert a == b, case
        assert a[0] in ("ok", "LayoutError"), (case, a)


def test_restore_check_blocks_are_the_reference_and_compiled_declines_all_unusual(compiled):
    """Each accepted request's blocks are the sorted unique ``slot // N``; every usual request
    (in range, no -1, increasing per item, items apart, positions in range) is accepted."""
    rng = np.random.default_rng(42)
    accepted = 0
    for _ in range(3000):
        N = int(rng.choice([1, 3, 4, 7]))
        S = N * int(rng.integers(1, 8))
        items = [_random_item(rng, S, N) for _ in range(int(rng.integers(1, 4)))]
        slots = np.concatenate(items)
        P = int(rng.choice([0, 5]))
        pos = _random_positions(rng, int(rng.integers(0, 4)) if P else 0, P)
        values = np.concatenate([slots, pos]).astype(np.int64)
        starts = np.cumsum([0, *[len(x) for x in items]], dtype=np.int64)
        out = np.full(slots.size, -7, dtype=np.int64)
        got = compiled.restore_blocks(values, starts, np.array([S, N, P], dtype=np.int64), out)
        nonempty = sorted([x for x in items if len(x)], key=lambda x: int(x[0]))
        usual = (bool(((slots >= 0) & (slots < S)).all()) and bool(((pos >= 0) & (pos < P)).all())
                 and all((np.diff(x) > 0).all() for x in nonempty)
                 and all(a[-1] < b[0] for a, b in zip(nonempty, nonempty[1:])))
        if usual:
            accepted += 1
            assert got >= 0 and out[:got].tolist() == np.unique(slots // N).tolist()
            assert (out[got:] == -7).all()  # nothing written past the count
        else:
            assert got == _compiled.UNUSUAL
    assert accepted > 300


def test_restore_check_bad_shapes_give_a_code_not_an_access(compiled):
    params = np.array([16, 4, 10], dtype=np.int64)
    values = np.arange(6, dtype=np.int64)
    out = np.empty(6, dtype=np.int64)
    # no items at all (n = -1) is unusual; no slots (n = 0 or one empty item): the body is positions
    assert compiled.restore_blocks(values, np.zeros(0, dtype=np.int64), params, out) == _compiled.UNUSUAL
    assert compiled.restore_blocks(values, np.array([0], dtype=np.int64), params, out) == 0
    assert compiled.restore_blocks(values, np.array([0, 0], dtype=np.int64), params, out) == 0
    # starts == [0, 6]: values 0..5 are slots, blocks 0 and 1
    for starts in ([0, -1], [0, 7], [0, 3, 1], [0, 2, 9], [1, 6], [0, I64.max], [0, I64.min]):
        assert compiled.restore_blocks(values, np.array(starts, dtype=np.int64), params, out) == _compiled.UNUSUAL
    for params_bad in ([16, 0, 10], [16, -4, 10], [16, I64.min, 10]):
        assert compiled.restore_blocks(values, np.array([0, 6], dtype=np.int64),
                                       np.array(params_bad, dtype=np.int64), out) == _compiled.UNUSUAL
    # slot exactly at the bound (16) and one below (15); positions at bound 10 and 9
    v = np.array([14, 15, 9], dtype=np.int64)
    assert compiled.restore_blocks(v, np.array([0, 2], dtype=np.int64), params, out) == 1 and out[0] == 3
    v = np.array([15, 16, 9], dtype=np.int64)
    assert compiled.restore_blocks(v, np.array([0, 2], dtype=np.int64), params, out) == _compiled.UNUSUAL
    v = np.array([14, 15, 10], dtype=np.int64)
    assert compiled.restore_blocks(v, np.array([0, 2], dtype=np.int64), params, out) == _compiled.UNUSUAL


def test_restore_check_wrong_dtype_or_layout_is_refused_by_the_signature(compiled):
    params = np.array([16, 4, 0], dtype=np.int64)
    out = np.empty(4, dtype=np.int64)
    starts = np.array([0, 2], dtype=np.int64)
    for values in (np.array([0, 1], dtype=np.int32), np.arange(4, dtype=np.int64)[::2],
                   np.array([0, 1], dtype=np.float64)):
        with pytest.raises(TypeError):
            compiled.restore_blocks(values, starts, params, out)


# ================================================================== reservation and release
def _registry():
    layout = KVLayout.from_vllm("NHD", num_layers=1, num_blocks=12, block_size=2, num_kv_heads=1, head_size=4,
                                dtype=torch.float32)
    registry = Registry(lambda reg: None)
    reg = registry.register(PeerIdentity(1, 1, 1), instance=0, handle_key=b"h", layout=layout, memory=None)
    return registry, reg


def _random_blocks(rng, nb):
    """In-contract block arguments of ``begin``: sets, or sorted unique arrays of various dtypes and
    layouts (int64 C-contiguous takes the compiled path; the others decline to NumPy)."""
    chosen = np.unique(rng.integers(0, nb, size=int(rng.integers(0, 5)))).astype(np.int64)
    kind = int(rng.integers(0, 6))
    if kind == 0:
        return set(chosen.tolist())
    if kind == 1:
        return chosen.astype(np.int32)
    if kind == 2 and chosen.size:  # non-contiguous int64
        spread = np.repeat(chosen, 2)
        return spread[::2]
    if kind == 3:
        return chosen.astype(np.uint64) if chosen.size else chosen
    return chosen


def _trace(seed, use_compiled, monkeypatch):
    with monkeypatch.context() as m:
        if not use_compiled:
            m.setattr(_compiled, "compiled", lambda: None)
        rng = np.random.default_rng(seed)
        registry, reg = _registry()
        nb = reg.holders.shape[0]
        trace, live = [], []
        for _ in range(60):
            if live and rng.random() < 0.4:
                op = live.pop(int(rng.integers(0, len(live))))
                registry.submitted(op, None, outcome="ok")  # nothing submitted: releases now
                trace.append(("release", op.op_id, reg.holders.tolist()))
                continue
            blocks = _random_blocks(rng, nb)
            before = reg.holders.copy()
            try:
                op = registry.begin(reg, "restore", blocks, ["k"])
            except (LayoutError, OwnershipError) as exc:
                assert (reg.holders == before).all()  # no partial reservation
                trace.append(("refused", type(exc).__name__, str(exc), reg.holders.tolist()))
            else:
                live.append(op)
                trace.append(("begun", op.op_id, reg.holders.tolist()))
        for op in live:
            registry.submitted(op, None, outcome="ok")
        assert not reg.holders.any() and not reg.ops
        return trace


def test_begin_and_release_compiled_and_numpy_traces_agree(compiled, monkeypatch):
    refused = 0
    for seed in range(60):
        a = _trace(seed, True, monkeypatch)
        b = _trace(seed, False, monkeypatch)
        assert a == b, seed
        refused += sum(t[0] == "refused" for t in a)
    assert refused > 50


def test_compiled_reserve_leaves_nothing_when_the_last_block_is_held(compiled):
    for n in (1, 2, 7, 200):
        holders = np.zeros(n + 1, dtype=np.int64)
        holders[n] = 5  # the very last block wanted is held
        blocks = np.arange(n + 1, dtype=np.int64)
        assert compiled.reserve(holders, blocks, 9) == n
        assert holders[:n].tolist() == [0] * n and holders[n] == 5
        # an out-of-range id at the very end, after free ones: nothing held either
        holders[n] = 0
        bad = np.append(blocks, n + 1)
        assert compiled.reserve(holders, bad, 9) == _compiled.OUT_OF_RANGE and not holders.any()
        for extreme in (I64.min, I64.max, -1):
            bad[-1] = extreme
            assert compiled.reserve(holders, bad, 9) == _compiled.OUT_OF_RANGE and not holders.any()


def test_registry_begin_refusal_names_the_same_holder_and_keeps_op_ids(compiled, monkeypatch):
    msgs = []
    for use in (True, False):
        with monkeypatch.context() as m:
            if not use:
                m.setattr(_compiled, "compiled", lambda: None)
            registry, reg = _registry()
            op1 = registry.begin(reg, "restore", np.array([2, 3], dtype=np.int64))
            with pytest.raises(OwnershipError) as exc:
                registry.begin(reg, "restore", np.array([0, 1, 3, 11], dtype=np.int64))
            with pytest.raises(LayoutError, match="outside"):
                registry.begin(reg, "restore", np.array([0, 12], dtype=np.int64))
            with pytest.raises(LayoutError, match="outside"):
                registry.begin(reg, "restore", np.array([-1, 0], dtype=np.int64))
            assert reg.held_blocks == {2: op1.op_id, 3: op1.op_id}
            op2 = registry.begin(reg, "restore", np.array([11], dtype=np.int64))
            assert op2.op_id == op1.op_id + 1  # refusals take no op id
            msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] and "[3]" in msgs[0]


def test_release_frees_only_the_ops_own_blocks_on_both_paths(compiled, monkeypatch):
    for use in (True, False):
        with monkeypatch.context() as m:
            if not use:
                m.setattr(_compiled, "compiled", lambda: None)
            registry, reg = _registry()
            op = registry.begin(reg, "restore", np.array([1, 4, 5], dtype=np.int64))
            reg.holders[4] = 77  # a foreign holder (defensive semantics: it stays)
            registry.submitted(op, Finished(), outcome="ok")
            registry.drain([op], timeout=1)
            assert reg.holders.tolist() == [0] * 4 + [77] + [0] * 7
            assert op.op_id not in reg.ops


def test_compiled_release_counts_foreign_and_out_of_range(compiled):
    rng = np.random.default_rng(43)
    for _ in range(3000):
        n = int(rng.integers(1, 9))
        holders = rng.choice([0, 3, 9], size=n).astype(np.int64)
        blocks = rng.integers(-2, n + 2, size=int(rng.integers(0, 6))).astype(np.int64)  # dupes, unsorted
        want = holders.copy()
        foreign = 0
        for b in blocks.tolist():
            if 0 <= b < n and want[b] == 9:
                want[b] = 0
            else:
                foreign += 1
        assert compiled.release(holders, blocks, 9) == foreign and holders.tolist() == want.tolist()
