"""Segment format: fingerprint, schema, encoding, padding, digests, key derivation."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest
import torch

from kmesh_host import LayoutError, ModelFingerprint, tree_digest
from kmesh_host.segment import (
    FORMAT_VERSION,
    PAYLOAD_ALIGNMENT,
    decode_header,
    encode_segment,
    payload_bytes,
    read_schema_head,
)

ROPE = {"base": 1_000_000.0, "rotary_dim": 64, "is_neox_style": True, "scaling": {"type": "none"}}


def fingerprint(dtype="bfloat16", L=2, H=2, D=8, rope=ROPE):
    return ModelFingerprint("Qwen2ForCausalLM", L, H, D, dtype, rope)


def make_kv(shape=(2, 2, 5, 2, 8), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def test_fingerprint_digest_is_stable_and_order_independent():
    a = ModelFingerprint("Qwen2ForCausalLM", 24, 2, 64, torch.bfloat16, {"base": 1e6, "rotary_dim": 64})
    b = ModelFingerprint("Qwen2ForCausalLM", 24, 2, 64, "bfloat16", {"rotary_dim": 64, "base": 1e6})
    assert a == b and hash(a) == hash(b)
    assert a.digest() == b.digest() and len(a.digest()) == 64
    assert a.dtype == "bfloat16"
    assert a.rope_dict() == {"base": 1e6, "rotary_dim": 64}
    assert ModelFingerprint.from_dict(a.to_dict()) == a
    c = ModelFingerprint("Qwen2ForCausalLM", 24, 2, 64, "bfloat16", {"base": 1e4, "rotary_dim": 64})
    assert c.digest() != a.digest()
    assert any("rope" in d for d in a.differences(c))


@pytest.mark.parametrize("bad", [
    dict(architecture=""), dict(num_layers=0), dict(head_size=True), dict(dtype="int32"),
    dict(rope=[1, 2]), dict(rope={"base": float("nan")}), dict(rope={"x": object()}),
], ids=lambda d: next(iter(d)))
def test_fingerprint_rejects_bad_fields(bad):
    args = dict(architecture="Llama", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", rope={})
    args.update(bad)
    with pytest.raises(LayoutError):
        ModelFingerprint(**args)


def _parse(data: pa.Buffer):
    offset, padded = read_schema_head(memoryview(data)[:65536], "t", data.size)
    return decode_header(data, "t", payload_offset=offset, padded_length=padded)


@pytest.mark.parametrize("T", [1, 5, 300], ids=lambda t: f"T{t}")
def test_encoding_layout_digests_and_plain_pyarrow(T):
    fp = fingerprint()
    kv = make_kv((2, 2, T, 2, 8))
    tok = torch.arange(100, 100 + T)
    pos = torch.arange(7, 7 + T)
    key, data = encode_segment(kv, tok, pos, model_fingerprint=fp)
    h = _parse(data)
    assert h.key == key and h.shape == (2, 2, T, 2, 8) and h.dtype == "bfloat16"
    assert h.payload_offset % PAYLOAD_ALIGNMENT == 0
    assert h.padded_length % 4096 == 0 and h.padded_length >= h.payload_length == kv.numel() * 2
    payload = np.frombuffer(data, dtype=np.uint8)[h.payload_offset: h.payload_offset + h.padded_length]
    raw = kv.view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(payload[: raw.size], raw)
    assert not payload[raw.size:].any()
    assert h.sha256 == hashlib.sha256(payload.tobytes()).digest()
    assert h.tree_root == tree_digest(payload.tobytes())
    # Plain pyarrow reads it: one batch, one row, the documented columns.
    table = pa.ipc.open_file(data).read_all()
    assert table.num_rows == 1
    row = table.to_pylist()[0]
    assert row["format"] == "kmesh-segment" and row["version"] == FORMAT_VERSION and row["key"] == key
    assert row["token_ids"] == tok.tolist() and row["positions"] == pos.tolist()
    assert row["fingerprint"]["architecture"] == "Qwen2ForCausalLM"
    assert row["payload"] == payload.tobytes()
    assert table.schema.metadata[b"kmesh.payload_offset"] == f"{h.payload_offset:016d}".encode()
    # version 2: the payload is one large_binary value; its padded length is in the metadata
    assert h.version == FORMAT_VERSION == 2 and table.schema.field("payload").type == pa.large_binary()
    assert table.schema.metadata[b"kmesh.payload_bytes"] == f"{h.padded_length:016d}".encode()
    assert table.schema.metadata[b"kmesh.version"] == b"2"


@pytest.mark.parametrize("case", ["aligned-contiguous", "needs-padding", "non-contiguous"])
def test_payload_bytes_views_or_copies_once(case):
    """The payload is kv's own bytes when nothing is to be padded or reordered, else one zero-padded copy."""
    kv = make_kv((2, 2, 64, 2, 8))                                   # 4096 bytes
    if case == "needs-padding":
        kv = make_kv((2, 2, 5, 2, 8))
    elif case == "non-contiguous":
        kv = make_kv((2, 64, 2, 2, 8)).transpose(1, 2)
    out, n = payload_bytes(kv, 4096)
    raw = kv.contiguous().view(torch.uint8).reshape(-1).numpy()
    assert n == raw.size and out.size == -(-n // 4096) * 4096
    assert np.array_equal(out[:n], raw) and not out[n:].any()
    assert np.shares_memory(out, kv.view(torch.uint8).numpy()) == (case == "aligned-contiguous")


def test_alignment_rounds_on_a_stand_in_give_the_file_of_real_rounds():
    """encode_segment settles the layout on a one-chunk stand-in, then writes the payload once; the
    file is the one that rounds on the real payload give (segment_craft's way)."""
    from tests.helpers.segment_craft import craft

    fp = fingerprint()
    for T, chunk in ((1, 512), (5, 4096), (300, 4096), (1000, 1 << 20)):
        kv = make_kv((2, 2, T, 2, 8), seed=T)
        key, data = encode_segment(kv, torch.arange(T), torch.arange(T) + 1, model_fingerprint=fp, chunk_size=chunk)
        k2, crafted, offset = craft(kv, torch.arange(T), torch.arange(T) + 1, fp, chunk_size=chunk)
        assert key == k2 and bytes(data) == bytes(crafted) and _parse(data).payload_offset == offset


def test_fingerprint_check_remembers_only_the_object_that_passed():
    """check_fingerprint skips the comparison for the very object a header last passed with; any
    other object, equal or not, is compared, so a mismatch is never missed."""
    from kmesh_host import FingerprintMismatch
    from kmesh_host.segment import check_fingerprint

    fp = fingerprint()
    h = _parse(encode_segment(make_kv(), torch.arange(5), torch.arange(5), model_fingerprint=fp)[1])
    check_fingerprint(h, fp)
    check_fingerprint(h, fp)
    with pytest.raises(FingerprintMismatch):
        check_fingerprint(h, fingerprint(L=3))
    check_fingerprint(h, fingerprint())  # equal, another object: compared, passes
    with pytest.raises(FingerprintMismatch):
        check_fingerprint(h, fingerprint(H=4))
    with pytest.raises(LayoutError):
        check_fingerprint(h, "not a fingerprint")


def test_key_is_content_derived():
    fp = fingerprint()
    kv = make_kv()
    k1, _ = encode_segment(kv, torch.arange(5), torch.arange(5), model_fingerprint=fp)
    k2, _ = encode_segment(kv.clone(), torch.arange(5, dtype=torch.int32), torch.arange(5), model_fingerprint=fp)
    assert k1 == k2
    k3, _ = encode_segment(kv, torch.arange(5), torch.arange(1, 6), model_fingerprint=fp)
    k4, _ = encode_segment(make_kv(seed=1), torch.arange(5), torch.arange(5), model_fingerprint=fp)
    k5, _ = encode_segment(kv, torch.arange(5), torch.arange(5), model_fingerprint=fingerprint(rope={"base": 1.0}))
    assert len({k1, k3, k4, k5}) == 4


@pytest.mark.parametrize("case", ["shape", "dtype", "tokens", "positions", "ndim", "fp8"])
def test_encode_rejects_inputs_that_do_not_fit(case):
    fp = fingerprint()
    kv, tok, pos = make_kv(), torch.arange(5), torch.arange(5)
    if case == "shape":
        kv = make_kv((2, 3, 5, 2, 8))
    elif case == "dtype":
        kv = kv.float()
    elif case == "tokens":
        tok = torch.arange(4)
    elif case == "positions":
        pos = torch.arange(5).float()
    elif case == "ndim":
        kv = kv[0]
    elif case == "fp8":
        kv = make_kv(dtype=torch.uint8)
    with pytest.raises(LayoutError):
        encode_segment(kv, tok, pos, model_fingerprint=fp)


def test_fp8_as_uint8_or_float8_matches_an_fp8_fingerprint():
    fp = fingerprint("float8_e4m3fn")
    raw = make_kv(dtype=torch.uint8)
    k_u8, _ = encode_segment(raw, torch.arange(5), torch.arange(5), model_fingerprint=fp)
    k_f8, data = encode_segment(raw.view(torch.float8_e4m3fn), torch.arange(5), torch.arange(5),
                                model_fingerprint=fp)
    assert k_u8 != k_f8  # the stored dtype is part of the content
    assert _parse(data).dtype == "float8_e4m3fn"
