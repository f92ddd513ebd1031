"""The ownership and drain state machine with injected completions (no processes, no GPU)."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import DrainError, LayoutError, OwnershipError
from kmesh_host.service.registry import Completion, Finished, PeerIdentity, Registry

ME = PeerIdentity(pid=100, uid=1000, gid=1000)
OTHER = PeerIdentity(pid=200, uid=1000, gid=1000)


class ScriptedCompletion(Completion):
    """Finished only when the test says so; each wait may first be refused or fail."""

    def __init__(self, *script: str):
        self.done = False
        self.script = list(script)  # per wait: "refuse" -> DrainError, "raise" -> RuntimeError, else look
        self.waits = 0

    def wait(self, timeout):
        self.waits += 1
        action = self.script.pop(0) if self.script else "look"
        if action == "refuse":
            raise DrainError("wait refused")
        if action == "raise":
            raise RuntimeError("cudaErrorLaunchFailure")
        return self.done


class Memory:
    def __init__(self, name):
        self.name = name


@pytest.fixture
def layout():
    return KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_size=4,
                              dtype=torch.float32)


@pytest.fixture
def reg_env(layout):
    released = []
    registry = Registry(lambda reg: released.append(reg.memory.name))
    return registry, released


def _register(registry, layout, *, handle=b"h1", who=ME, instance=0):
    return registry.register(who, instance=instance, handle_key=handle, layout=layout, memory=Memory(handle))


def test_generations_and_same_handle(reg_env, layout):
    registry, released = reg_env
    a = _register(registry, layout)
    with pytest.raises(OwnershipError, match="already registration"):
        _register(registry, layout)  # the same live allocation twice
    assert registry.close(a) is True
    assert released == [b"h1"]
    b = _register(registry, layout)  # a later allocation with the same handle bytes
    assert b.generation > a.generation and b.reg_id != a.reg_id and b.secret != a.secret
    with pytest.raises(OwnershipError, match="closed"):
        registry.authorize(a.reg_id, a.secret, ME)
    assert registry.authorize(b.reg_id, b.secret, ME) is b


def test_secret_and_identity(reg_env, layout):
    registry, _ = reg_env
    a = _register(registry, layout, instance=3)
    with pytest.raises(OwnershipError, match="wrong secret"):
        registry.authorize(a.reg_id, b"\0" * 32, ME)
    with pytest.raises(OwnershipError, match="another client"):
        registry.authorize(a.reg_id, a.secret, OTHER)  # a leaked secret is not enough
    with pytest.raises(OwnershipError, match="unknown"):
        registry.authorize(999, a.secret, ME)


def test_replacement_client_gets_a_new_registration(reg_env, layout):
    registry, released = reg_env
    old = _register(registry, layout, handle=b"old", instance=5)
    registry.attach(old, conn_id=1)
    registry.connection_closed(1)  # the old worker died
    new = _register(registry, layout, handle=b"new", who=OTHER, instance=5)
    assert new.reg_id != old.reg_id
    for secret in (old.secret, new.secret):
        with pytest.raises(OwnershipError):
            registry.authorize(old.reg_id, secret, OTHER)
    assert released == [b"old"]


def test_bounds(reg_env, layout):
    registry, _ = reg_env
    reg = _register(registry, layout)
    assert registry.blocks_of_slots(reg, [0, 5, -1, 31]) == frozenset({0, 1, 7})
    for slots, match in (([32], "outside"), ([-2], "outside"), ([3, 3], "twice")):
        with pytest.raises(LayoutError, match=match):
            registry.blocks_of_slots(reg, slots)
    with pytest.raises(LayoutError, match="outside"):
        registry.check_blocks(reg, [0, 8])


def test_holds_until_physical_completion(reg_env, layout):
    registry, released = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", frozenset({1, 2}), ["src"])
    done = ScriptedCompletion()
    registry.submitted(op, done, outcome="ok")
    with pytest.raises(OwnershipError, match="held by operation"):
        registry.begin(reg, "restore", frozenset({2}), [])
    assert registry.source_held("src")
    with pytest.raises(DrainError, match="still running"):
        registry.drain([op], timeout=0)
    assert reg.held_blocks == {1: op.op_id, 2: op.op_id} and registry.source_held("src")
    done.done = True
    registry.drain([op], timeout=0)
    assert reg.held_blocks == {} and not registry.source_held("src") and not reg.ops
    assert released == []
    registry.begin(reg, "restore", frozenset({2}), [])  # free again


@pytest.mark.parametrize("first", ["refuse", "raise"])
def test_failed_first_wait_keeps_source_and_destination(reg_env, layout, first):
    registry, _ = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "save", frozenset({4}), ["dest-key"])
    done = ScriptedCompletion(first)
    done.done = True  # the work itself finished: only the wait misbehaves
    drained = []
    registry.submitted(op, done, outcome="failed", error="boom", on_drained=drained.append)
    with pytest.raises(DrainError):
        registry.drain([op], timeout=1.0)
    assert reg.held_blocks == {4: op.op_id} and registry.source_held("dest-key") and drained == []
    assert op.wait_failures == 1
    registry.drain([op], timeout=1.0)  # a later wait succeeds
    assert reg.held_blocks == {} and not registry.source_held("dest-key") and drained == [op]
    assert done.waits == 2


def test_cancel_is_not_completion(reg_env, layout):
    registry, _ = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", frozenset({0}), ["s"])
    done = ScriptedCompletion()
    registry.submitted(op, done, outcome="ok")
    registry.cancel(reg, op.op_id)
    assert op.outcome == "cancelled" and reg.held_blocks == {0: op.op_id}
    with pytest.raises(DrainError):
        registry.drain(registry.pending_ops(reg, [0]), timeout=0)
    done.done = True
    registry.drain(registry.pending_ops(reg, [0]), timeout=0)
    assert reg.held_blocks == {}


def test_nothing_submitted_releases_at_once(reg_env, layout):
    registry, _ = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", frozenset({0}), ["s"])
    registry.submitted(op, None, outcome="failed", error="validation")
    assert reg.held_blocks == {} and not reg.ops


def test_close_stops_new_work_and_waits(reg_env, layout):
    registry, released = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", frozenset({0}), [])
    done = ScriptedCompletion("refuse")
    registry.submitted(op, done, outcome="ok")
    assert registry.close(reg) is False
    with pytest.raises(OwnershipError, match="closing"):
        registry.begin(reg, "restore", frozenset({3}), [])
    with pytest.raises(OwnershipError, match="closing"):
        registry.authorize(reg.reg_id, reg.secret, ME)
    assert registry.authorize(reg.reg_id, reg.secret, ME, for_new_work=False) is reg
    done.done = True
    assert registry.reap() == [reg]  # the first wait was refused: still held
    assert released == []
    assert registry.reap() == []
    assert released == [b"h1"] and reg.state == "freed"
    assert registry.reap() == [] and released == [b"h1"]  # released exactly once


def test_dead_client_reaped_after_drain_others_unaffected(reg_env, layout):
    registry, released = reg_env
    dead = _register(registry, layout, handle=b"dead")
    alive = _register(registry, layout, handle=b"alive", who=OTHER)
    registry.attach(dead, 1)
    registry.attach(dead, 2)
    registry.attach(alive, 3)
    op = registry.begin(dead, "restore", frozenset({0}), ["s"])
    done = ScriptedCompletion("raise")
    registry.submitted(op, done, outcome="ok")
    assert registry.connection_closed(1) == []  # another connection of that client remains
    assert registry.connection_closed(2) == [dead]
    assert dead.state == "orphaned"
    for _ in range(3):
        registry.reap()
    assert released == [] and dead.held_blocks == {0: op.op_id}
    other_op = registry.begin(alive, "restore", frozenset({0}), ["s"])
    registry.submitted(other_op, None, outcome="ok")
    done.done = True
    registry.reap()
    assert released == [b"dead"] and not registry.source_held("s")
    assert registry.authorize(alive.reg_id, alive.secret, OTHER) is alive


def test_drain_waits_for_submission(reg_env, layout):
    registry, _ = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", frozenset({0}), [])
    with pytest.raises(DrainError, match="being submitted"):
        registry.drain([op], timeout=0.01)
    assert reg.held_blocks == {0: op.op_id}


def test_snapshot_lists_holds(reg_env, layout):
    registry, _ = reg_env
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", frozenset({2}), ["k"])
    registry.submitted(op, ScriptedCompletion(), outcome="ok")
    snap = registry.snapshot()
    assert snap["registrations"][0]["held_blocks"] == [2]
    assert snap["pending_ops"][0]["op"] == op.op_id and snap["held_sources"] == {"k": 1}


def test_a_drain_that_finds_the_operation_released_by_another_thread_waits_for_that_release(layout):
    """Two threads drain one operation (a close and the reaper): the one that finds it already
    drained returns only once the other's release has finished, registration freed included, so
    a close's reply can say "freed" (it said "pending" while the reaper was still freeing)."""
    import threading
    import time

    freeing = threading.Event()

    def slow_release(reg):
        freeing.set()
        time.sleep(0.3)

    registry = Registry(slow_release)
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", {1})
    registry.submitted(op, Finished(), outcome="ok")
    registry.close(reg)
    first = threading.Thread(target=registry.drain_one, args=(op, 30.0))
    first.start()
    assert freeing.wait(30)
    registry.drain_one(op, 30.0)  # drained already: waits for the first thread's release
    assert reg.state == "freed"
    first.join(30)
    # a second drain that runs out of time while that release runs says so (the release holds until told)
    releasing, let_go = threading.Event(), threading.Event()
    op2_registry = Registry(lambda r: (releasing.set(), let_go.wait(30)))
    reg2 = _register(op2_registry, layout, handle=b"h2")
    op2 = op2_registry.begin(reg2, "restore", {1})
    op2_registry.submitted(op2, Finished(), outcome="ok")
    op2_registry.close(reg2)
    t = threading.Thread(target=op2_registry.drain_one, args=(op2, 30.0))
    t.start()
    try:
        assert releasing.wait(30)
        with pytest.raises(DrainError, match="release still running"):
            op2_registry.drain_one(op2, 0.01)
    finally:
        let_go.set()
        t.join(30)
    assert reg2.state == "freed"


def test_a_close_while_another_thread_releases_the_last_operation_answers_freed(layout):
    """The reaper releases a registration's last operation (its callback still running) while a
    close comes: the close finds the operation, waits for that release and sees the registration
    freed (the operation used to leave the registration's list before its callback ran, and the
    close then answered "not freed" with nothing pending)."""
    import threading

    from kmesh_host.service.registry import Op

    in_callback, close_waits, let_go = threading.Event(), threading.Event(), threading.Event()
    registry = Registry(lambda reg: None)
    reg = _register(registry, layout)
    op = registry.begin(reg, "restore", {1})
    # the callback runs until the close is seen waiting for the release
    registry.submitted(op, Finished(), outcome="ok", on_drained=lambda o: (in_callback.set(), let_go.wait(30)))
    registry.close(reg)  # (a first close: the reaper now drains it)
    reaper = threading.Thread(target=registry.reap)
    reaper.start()
    try:
        assert in_callback.wait(30)
        pending = registry.pending_ops(reg)
        assert pending == [op]  # still listed while its release runs
        op.wait_released = lambda timeout: (close_waits.set(), Op.wait_released(op, timeout))[1]
        threading.Thread(target=lambda: close_waits.wait(30) and let_go.set(), daemon=True).start()
        registry.drain(pending, 30.0)
        assert close_waits.is_set() and reg.state == "freed"
    finally:
        let_go.set()
        reaper.join(30)
