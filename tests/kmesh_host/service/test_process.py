"""The spawned service with clients over CPU shared memory: registration, restore, authorisation,
replacement clients, reallocation, close/drain and clients killed mid-request."""

from __future__ import annotations

import os
import subprocess
import zlib
import sys

import pytest
import torch

from kmesh_gpu import place_many
from kmesh_gpu.errors import DrainError, LayoutError, OwnershipError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from tests.kmesh_host.service.helpers import (
    SPAWN,
    child_register_then_hang,
    child_use_leaked_secret,
    fingerprint,
    item,
    join_or_kill,
    put_original,
    registration_of,
    running_service,
    small_layout,
    small_rope,
    socket_dir,
    wait_for,
)

FP = fingerprint()

POISON = 0x5A  # every byte of a fresh cache: anything unexpected written shows up


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.02) as svc:
        yield svc


@pytest.fixture
def client(service):
    with CacheClient(service.socket_path, timeout=60) as c:
        yield c


@pytest.fixture
def layout():
    return small_layout()


@pytest.fixture
def cache(layout):
    with SharedCache(layout, fill=POISON) as c:
        yield c


def _original(client, name, T=6, seed=0):
    """``(key, kv, positions)`` of a new original (its token ids derived from ``name``: one key per test)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, T, 2, 8, generator=g).to(torch.bfloat16)
    pos = torch.arange(T, dtype=torch.int64)
    tok = torch.arange(T, dtype=torch.int64) + zlib.crc32(name.encode())
    return put_original(client, kv, pos, tok), kv, pos


def _bits(t):
    return t.view(torch.uint8).clone()


def test_register_restore_matches_in_process(client, cache, layout, request):
    key = request.node.name
    rope = small_rope()
    key, kv, pos = _original(client, key)
    slots = [1, 2, 3, 9, 10, 30]
    new = [40, 41, 42, 43, 44, 45]
    reg = client.register(cache, layout, model_fingerprint=FP, rope=rope)
    op = client.restore(reg, [item(key, slots, new)])
    ref = layout.allocate(fill=POISON)
    place_many([kv], ref, layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
               new_positions=[torch.tensor(new)])
    assert torch.equal(_bits(cache.tensor), _bits(ref))  # bit-exact, and nothing outside the slots changed
    assert op > 0
    mine = registration_of(client.status(), reg.reg_id)
    assert mine["held_blocks"] == [] and mine["pending_ops"] == []
    assert client.close_registration(reg) is True


@pytest.mark.parametrize("slots, new, match", [
    ([0, 1, 2, 3, 4, 32], None, "outside"),
    ([0, 1, 2, 3, 4, -2], None, "outside"),
    ([0, 1, 2, 3, 4, 4], None, "twice"),
    ([0, 1, 2], None, "expected 6 slots"),
    ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 4096], "outside"),
    ([0, 1, 2, 3, 4, 5], [0, 1], "expected 6 positions"),
], ids=["slot-high", "slot-negative", "slot-duplicate", "too-few-slots", "position-high", "too-few-positions"])
def test_out_of_range_writes_nothing(client, cache, layout, request, slots, new, match):
    key, *_ = _original(client, request.node.name)
    reg = client.register(cache, layout, model_fingerprint=FP, rope=small_rope())
    before = _bits(cache.tensor)
    with pytest.raises(LayoutError, match=match):
        client.restore(reg, [item(key, slots, new)])
    with pytest.raises(LayoutError, match="outside"):
        client.acquire(reg, [8])
    assert torch.equal(_bits(cache.tensor), before)
    assert client.status()["healthy"]
    assert client.close_registration(reg) is True


def test_wrong_secret_and_other_identity(client, cache, layout, service):
    key, *_ = _original(client, "leaked-src", T=4)
    reg = client.register(cache, layout, model_fingerprint=FP)
    before = _bits(cache.tensor)
    forged = type(reg)(reg.reg_id, reg.generation, "00" * 32, reg.layout, reg.handle, reg.cache)
    with pytest.raises(OwnershipError, match="wrong secret"):
        client.restore(forged, [(key, [0, 1, 2, 3])])
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=child_use_leaked_secret, args=(service.socket_path, reg.reg_id, reg.secret, out))
    proc.start()
    try:
        verdict = out.get(timeout=60)
    finally:
        join_or_kill(proc)
    assert verdict.startswith("refused") and "another client" in verdict, verdict
    assert torch.equal(_bits(cache.tensor), before)
    assert client.close_registration(reg) is True


def test_same_address_reallocation(client, cache, layout, request):
    key = request.node.name
    key, kv, _ = _original(client, key, T=4)
    first = client.register(cache, layout, model_fingerprint=FP, instance=1)
    with pytest.raises(OwnershipError, match="already registration"):
        client.register(cache, layout, model_fingerprint=FP, instance=1)
    assert client.close_registration(first) is True
    second = client.register(cache, layout, model_fingerprint=FP, instance=1)  # same handle bytes, same address
    assert second.generation > first.generation
    with pytest.raises(OwnershipError, match="closed"):
        client.restore(first, [(key, [0, 1, 2, 3])])
    client.restore(second, [(key, [0, 1, 2, 3])])
    assert client.close_registration(second) is True


def test_close_stops_new_work_and_waits_for_copies(client, cache, layout, request):
    key = request.node.name
    key, *_ = _original(client, key, T=4)
    reg = client.register(cache, layout, model_fingerprint=FP)
    # The copy itself is done (CPU), but its waits are refused: not proof of completion. So many (the
    # reaper's every 0.02 s, ~2 s) that the checks below run while the registration is still closing.
    with pytest.raises(Exception) as info:
        client.restore(reg, [(key, [4, 5, 6, 7])], inject={"fail_after_submit": True, "refuse_waits": 100})
    op = info.value.op_id
    assert client.close_registration(reg, timeout=0) is False  # the close's own wait is refused
    with pytest.raises(OwnershipError, match="closing"):
        client.restore(reg, [(key, [0, 1, 2, 3])])
    st = client.status()
    assert registration_of(st, reg.reg_id)["state"] == "closing"
    with pytest.raises(OwnershipError, match="held by a pending operation"):
        client.evict(key)
    # The reaper's later wait succeeds; only then is the memory released.
    wait_for(lambda: registration_of(client.status(), reg.reg_id) is None)
    with pytest.raises(OwnershipError, match="closed"):
        client.drain(reg, [op])
    assert client.evict(key) is True


def test_client_killed_mid_request(client, cache, layout, service, request):
    out = SPAWN.Queue()
    # its operation's waits refused ~2 s (the reaper's every 0.02 s): the orphan is seen before it is reaped
    proc = SPAWN.Process(target=child_register_then_hang, args=(service.socket_path, 7, 100, out))
    proc.start()
    try:
        info = out.get(timeout=60)
        # A sibling keeps working while the other client is alive, dies, and is reaped.
        key = request.node.name
        key, kv, _ = _original(client, key, T=4)
        mine = client.register(cache, layout, model_fingerprint=FP)
        proc.kill()
        join_or_kill(proc, 10)
        st = wait_for(lambda: (lambda s: s if (registration_of(s, info["reg"]) or {}).get("state") == "orphaned"
                               else None)(client.status()), timeout=30)
        dead = registration_of(st, info["reg"])
        assert dead["pending_ops"] == [info["op"]] or dead["pending_ops"] == []
        client.restore(mine, [(key, [0, 1, 2, 3])])
        wait_for(lambda: registration_of(client.status(), info["reg"]) is None, timeout=30)
        assert client.status()["healthy"]
        assert client.close_registration(mine) is True
        # A replacement claiming the same instance number gets nothing of the old registration.
        with SharedCache(layout) as other:
            repl = client.register(other, layout, model_fingerprint=FP, instance=7)
            assert repl.reg_id != info["reg"]
            stale = type(repl)(info["reg"], info["reg"], info["secret"], layout, repl.handle, repl.cache)
            with pytest.raises(OwnershipError, match="reaped"):
                client.restore(stale, [(key, [0, 1, 2, 3])])
            assert client.close_registration(repl) is True
    finally:
        join_or_kill(proc, 10)
        if "info" in locals():
            try:
                os.unlink(os.path.join("/dev/shm", info["shm"].lstrip("/")))
            except FileNotFoundError:
                pass


def test_cli_status(service):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-m", "kmesh_vllm.cli", "status", "--socket", service.socket_path],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert '"healthy": true' in done.stdout
    gone = subprocess.run([sys.executable, "-m", "kmesh_vllm.cli", "status", "--socket",
                           service.socket_path + ".absent"], capture_output=True, text=True, timeout=120, env=env)
    assert gone.returncode == 1 and '"healthy": false' in gone.stdout


def test_drain_refused_then_granted_on_open_registration(client, cache, layout, request):
    key = request.node.name
    key, *_ = _original(client, key, T=4)
    reg = client.register(cache, layout, model_fingerprint=FP)
    op = client.restore(reg, [(key, [0, 1, 2, 3])], wait=False, inject={"refuse_waits": 1})
    with pytest.raises(DrainError, match="refused"):
        client.acquire(reg, [0])
    with pytest.raises(OwnershipError, match="held by operation"):
        client.restore(reg, [(key, [0, 1, 2, 3])])
    assert client.acquire(reg, [0]) == [op]
    client.restore(reg, [(key, [0, 1, 2, 3])])
    assert client.close_registration(reg) is True


def test_restore_from_segment_store(tmp_path, layout):
    """The service's originals are segments of its store (``ServiceConfig.store_root``): a segment
    ``SegmentStore.put`` wrote is restored by its key (read through the host tier and retained
    there), only into a registration of the model that saved it."""
    from kmesh_gpu.errors import FingerprintMismatch
    from kmesh_host import SegmentStore

    rope = small_rope()
    kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
    pos = torch.arange(20, 24, dtype=torch.int64)
    key = SegmentStore(str(tmp_path / "store")).put(kv, torch.arange(4, dtype=torch.int64), pos, model_fingerprint=FP)
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), store_root=str(tmp_path / "store"))
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c, SharedCache(layout, fill=POISON) as cache:
            other = c.register(cache, layout, model_fingerprint=fingerprint(architecture="LlamaForCausalLM"), rope=rope)
            with pytest.raises(FingerprintMismatch, match=key):
                c.restore(other, [(key, [0, 1, 2, 3], [5, 6, 7, 8])])
            assert c.close_registration(other) is True
            reg = c.register(cache, layout, model_fingerprint=FP, rope=rope)
            c.restore(reg, [(key, [0, 1, 2, 3], [5, 6, 7, 8])])
            ref = layout.allocate(fill=POISON)
            place_many([kv], ref, layout, [torch.tensor([0, 1, 2, 3])], rope=rope, old_positions=[pos],
                       new_positions=[torch.tensor([5, 6, 7, 8])])
            assert torch.equal(_bits(cache.tensor), _bits(ref))
            originals = c.status()["originals"]
            assert originals["host_keys"] == 1 and originals["store_private"] is False
            assert c.close_registration(reg) is True


def test_restore_timings_are_opt_in_and_ordered(client, cache, layout, request):
    key = request.node.name
    key, *_ = _original(client, key)
    reg = client.register(cache, layout, model_fingerprint=FP, rope=small_rope())
    one = item(key, [1, 2, 3, 9, 10, 30], [40, 41, 42, 43, 44, 45])
    client.restore(reg, [one])
    assert client.last_timings is None  # off unless asked for
    client.drain(reg)
    client.restore(reg, [one], timings=True)
    t = client.last_timings
    c, s = t["client"], t["service"]
    # One clock for both processes, but only causal orders are guaranteed: the client stamps "sent"
    # once sendmsg has returned, and the service may have read the request and stamped "received"
    # before that (it runs on another core, or first on this one).
    order = [c["start"], c["built"], s["received"], s["parsed"], s["validated"], s["resolved"],
             s["prepared"], s["launched"], s["completed"], s["reply_sent"], c["received"]]
    assert order == sorted(order)
    assert c["built"] <= c["sent"] <= c["received"]
    assert client.close_registration(reg) is True


def test_switch_interval_is_set_in_the_service_process_only():
    """``ServiceConfig.switch_interval_s`` is applied by the service's own process (status reports
    it); the process that started the service keeps its own."""
    mine = sys.getswitchinterval()
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), switch_interval_s=0.025)
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c:
            assert c.status()["switch_interval_s"] == pytest.approx(0.025)
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"))
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c:
            assert c.status()["switch_interval_s"] == pytest.approx(mine)
    assert sys.getswitchinterval() == mine
