"""The spawned service with clients over CPU shared memory: registration, restore, authorisation,
replacement clients, reallocation, close/drain and clients killed mid-request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kmesh_gpu import place_many
from kmesh_gpu.errors import DrainError, LayoutError, OwnershipError
from kmesh_host.service import CacheClient, CacheService, RestoreItem, ServiceConfig, SharedCache
from tests.helpers.service import (
    running_service,
    SPAWN,
    child_register_then_hang,
    child_use_leaked_secret,
    join_or_kill,
    registration_of,
    small_layout,
    small_rope,
    socket_dir,
    wait_for,
)

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


def _original(client, key, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, T, 2, 8, generator=g).to(torch.bfloat16)
    pos = torch.arange(T, dtype=torch.int64)
    client.put(key, kv, pos)
    return kv, pos


def _bits(t):
    return t.view(torch.uint8).clone()


def test_register_restore_matches_in_process(client, cache, layout, request):
    key = request.node.name
    rope = small_rope()
    kv, pos = _original(client, key)
    slots = [1, 2, 3, 9, 10, 30]
    new = [40, 41, 42, 43, 44, 45]
    reg = client.register(cache, layout, rope=rope)
    op = client.restore(reg, [RestoreItem(key, slots, new)])
    ref = layout.allocate(fill=POISON)
    place_many([kv], ref, layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
               new_positions=[torch.tensor(new)])
    assert torch.equal(_bits(cache.tensor), _bits(ref))  # bit-exact, and nothing outside the slots changed
    assert op > 0
    mine = registration_of(client.status(), reg.reg_id)
    assert mine["held_blocks"] == [] and mine["pending_ops"] == []
    assert client.close_registration(reg) is True


@pytest.mark.parametrize("item, match", [
    (RestoreItem("K", [0, 1, 2, 3, 4, 32]), "outside"),
    (RestoreItem("K", [0, 1, 2, 3, 4, -2]), "outside"),
    (RestoreItem("K", [0, 1, 2, 3, 4, 4]), "twice"),
    (RestoreItem("K", [0, 1, 2]), "expected 6 slots"),
    (RestoreItem("K", [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 4096]), "outside"),
    (RestoreItem("K", [0, 1, 2, 3, 4, 5], [0, 1]), "expected 6 positions"),
], ids=["slot-high", "slot-negative", "slot-duplicate", "too-few-slots", "position-high", "too-few-positions"])
def test_out_of_range_writes_nothing(client, cache, layout, request, item, match):
    key = request.node.name
    _original(client, key)
    reg = client.register(cache, layout, rope=small_rope())
    before = _bits(cache.tensor)
    item = RestoreItem(key, item.slots, item.new_positions)
    with pytest.raises(LayoutError, match=match):
        client.restore(reg, [item])
    with pytest.raises(LayoutError, match="outside"):
        client.acquire(reg, [8])
    assert torch.equal(_bits(cache.tensor), before)
    assert client.status()["healthy"]
    assert client.close_registration(reg) is True


def test_wrong_secret_and_other_identity(client, cache, layout, service):
    _original(client, "leaked-src", T=4)
    reg = client.register(cache, layout)
    before = _bits(cache.tensor)
    forged = type(reg)(reg.reg_id, reg.generation, "00" * 32, reg.layout, reg.handle, reg.cache)
    with pytest.raises(OwnershipError, match="wrong secret"):
        client.restore(forged, [("leaked-src", [0, 1, 2, 3])])
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
    kv, _ = _original(client, key, T=4)
    first = client.register(cache, layout, instance=1)
    with pytest.raises(OwnershipError, match="already registration"):
        client.register(cache, layout, instance=1)
    assert client.close_registration(first) is True
    second = client.register(cache, layout, instance=1)  # same handle bytes, same address
    assert second.generation > first.generation
    with pytest.raises(OwnershipError, match="closed"):
        client.restore(first, [(key, [0, 1, 2, 3])])
    client.restore(second, [(key, [0, 1, 2, 3])])
    assert client.close_registration(second) is True


def test_close_stops_new_work_and_waits_for_copies(client, cache, layout, request):
    key = request.node.name
    _original(client, key, T=4)
    reg = client.register(cache, layout)
    # The copy itself is done (CPU), but its first two waits are refused: not proof of completion.
    with pytest.raises(Exception) as info:
        client.restore(reg, [(key, [4, 5, 6, 7])], inject={"fail_after_submit": True, "refuse_waits": 2})
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
    proc = SPAWN.Process(target=child_register_then_hang, args=(service.socket_path, 7, 40, out))
    proc.start()
    try:
        info = out.get(timeout=60)
        # A sibling keeps working while the other client is alive, dies, and is reaped.
        key = request.node.name
        kv, _ = _original(client, key, T=4)
        mine = client.register(cache, layout)
        proc.kill()
        join_or_kill(proc, 10)
        st = wait_for(lambda: (lambda s: s if (registration_of(s, info["reg"]) or {}).get("state") == "orphaned"
                               else None)(client.status()), timeout=10)
        dead = registration_of(st, info["reg"])
        assert dead["pending_ops"] == [info["op"]] or dead["pending_ops"] == []
        client.restore(mine, [(key, [0, 1, 2, 3])])
        wait_for(lambda: registration_of(client.status(), info["reg"]) is None, timeout=30)
        assert client.status()["healthy"]
        assert client.close_registration(mine) is True
        # A replacement claiming the same instance number gets nothing of the old registration.
        with SharedCache(layout) as other:
            repl = client.register(other, layout, instance=7)
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
    _original(client, key, T=4)
    reg = client.register(cache, layout)
    op = client.restore(reg, [(key, [0, 1, 2, 3])], wait=False, inject={"refuse_waits": 1})
    with pytest.raises(DrainError, match="refused"):
        client.acquire(reg, [0])
    with pytest.raises(OwnershipError, match="held by operation"):
        client.restore(reg, [(key, [0, 1, 2, 3])])
    assert client.acquire(reg, [0]) == [op]
    client.restore(reg, [(key, [0, 1, 2, 3])])
    assert client.close_registration(reg) is True


def test_restore_from_segment_store(tmp_path, layout):
    """Originals not in host RAM come from the segment store (and stay retained in host RAM)."""
    from kmesh_host import ModelFingerprint, SegmentStore

    rope = small_rope()
    fp = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", rope.to_dict())
    kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
    pos = torch.arange(20, 24, dtype=torch.int64)
    key = SegmentStore(str(tmp_path / "store")).put(kv, torch.arange(4, dtype=torch.int64), pos, model_fingerprint=fp)
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), store_root=str(tmp_path / "store"))
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout, rope=rope)
            with pytest.raises(Exception, match="model_fingerprint"):
                c.restore(reg, [(key, [0, 1, 2, 3], [5, 6, 7, 8])])
            c.restore(reg, [(key, [0, 1, 2, 3], [5, 6, 7, 8])], model_fingerprint=fp.to_dict())
            ref = layout.allocate(fill=POISON)
            place_many([kv], ref, layout, [torch.tensor([0, 1, 2, 3])], rope=rope, old_positions=[pos],
                       new_positions=[torch.tensor([5, 6, 7, 8])])
            assert torch.equal(_bits(cache.tensor), _bits(ref))
            assert c.status()["sources"]["host_keys"] == 1
            assert c.close_registration(reg) is True


def test_restore_timings_are_opt_in_and_ordered(client, cache, layout, request):
    key = request.node.name
    _original(client, key)
    reg = client.register(cache, layout, rope=small_rope())
    item = RestoreItem(key, [1, 2, 3, 9, 10, 30], [40, 41, 42, 43, 44, 45])
    client.restore(reg, [item])
    assert client.last_timings is None  # off unless asked for
    client.drain(reg)
    client.restore(reg, [item], timings=True)
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
