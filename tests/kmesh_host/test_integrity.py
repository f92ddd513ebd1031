"""Host digests: whole-object SHA-256 and kmesh-tree-sha256/v1 (the published test vectors, an
independent straight implementation, thread-count independence), digest records and verification."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from kmesh_host import IntegrityError, LayoutError, TREE_FORMAT, sha256, tree_digest
from kmesh_host.integrity import (
    ObjectDigests,
    check_tree_format,
    object_digests,
    verify_object,
    verify_sha256,
    verify_tree_digest,
)


def _straight_tree(payload: bytes, leaf_size: int = 4096, fanout: int = 64) -> bytes:
    """The definition in docs/tree-sha256.md, written as plainly as possible."""
    h = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    n = max(1, -(-len(payload) // leaf_size))
    level = [h(payload[i * leaf_size:(i + 1) * leaf_size]) for i in range(n)]
    while len(level) > 1:
        level = [h(b"".join(level[i:i + fanout])) for i in range(0, len(level), fanout)]
    header = b"kmesh-tree-sha256/v1\x00" + struct.pack("<QII", len(payload), leaf_size, fanout)
    return h(header + level[0])


def _pattern(n: int) -> bytes:
    return (np.arange(n) % 251).astype(np.uint8).tobytes()


# (payload, leaf_size, fanout, root) exactly as published in docs/tree-sha256.md
VECTORS = [
    (b"", 4096, 64, "f827070984949eaa357cb8a7e4c45ce7259243db2560daf8d3e7e0253d2bedaf"),
    (b"abc", 4096, 64, "398a25fb50c8654504e0d6d09fe5bfbcef547aae922bf26ab8b8bd5a13da343e"),
    (b"abc", 64, 2, "7f7a07bd14c3579ae81f636c02c74e51011da0690a77dad47d86c9098328e4bc"),
    (_pattern(4096), 4096, 64, "af7629c03b698e8de4c66180f7d33b1821f2c4a61c27c2779adca0f04b782cdb"),
    (_pattern(4097), 4096, 64, "6e3d7b9f2060d615cbece6ba01bf910d2bc5e6d137e435e41a9c5dc5817a7045"),
    (_pattern(262144), 4096, 64, "14560865f57b863cdd70874415db8797aadf3118752d52284832cdbd86cb4cde"),
    (_pattern(262145), 4096, 64, "800b9993b578bc6dbebf18a50347c1ab8d7cd4efc4b16bd74b8dc212729f2039"),
    (_pattern(3 << 20), 4096, 64, "da0d3cb026178532c98bbac5d151c301effaecb63ae89497bda3a99686a2918a"),
    (_pattern(200), 64, 2, "4af2d850cec5c2e4c6e43d26b02e1ab1d44cf4c4eaecdd235f4fd81726820765"),
]


@pytest.mark.parametrize("payload,leaf,fanout,root", VECTORS,
                         ids=[f"{len(v[0])}B-leaf{v[1]}-fan{v[2]}" for v in VECTORS])
def test_published_vectors(payload, leaf, fanout, root):
    assert tree_digest(payload, leaf_size=leaf, fanout=fanout).hex() == root
    assert _straight_tree(payload, leaf, fanout).hex() == root


def test_docs_list_the_same_vectors():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "tree-sha256.md").read_text()
    for _, _, _, root in VECTORS:
        assert root in doc


@pytest.mark.parametrize("leaf,fanout", [(64, 2), (128, 3), (4096, 64)])
def test_boundary_lengths_match_the_definition(leaf, fanout):
    rng = np.random.default_rng(leaf + fanout)
    span = leaf * fanout
    for n in sorted({0, 1, 55, 56, 63, 64, 119, 120, leaf - 1, leaf, leaf + 1, span - 1, span, span + 1,
                     span * fanout + 1 if span * fanout < 1 << 21 else span + 3}):
        payload = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tree_digest(payload, leaf_size=leaf, fanout=fanout) == _straight_tree(payload, leaf, fanout), n


def test_threads_do_not_change_the_root():
    payload = np.random.default_rng(1).integers(0, 256, (2 << 20) + 77, dtype=np.uint8)
    one = tree_digest(payload, threads=1)
    assert tree_digest(payload, threads=4) == one == tree_digest(payload) == _straight_tree(payload.tobytes())
    assert tree_digest(payload, leaf_size=64, fanout=8, threads=3) == _straight_tree(payload.tobytes(), 64, 8)


def test_payload_kinds_are_hashed_as_their_bytes():
    t = torch.arange(1000, dtype=torch.float32)
    raw = t.numpy().tobytes()
    assert sha256(t) == hashlib.sha256(raw).digest() == sha256(bytearray(raw)) == sha256(memoryview(raw))
    assert tree_digest(t, leaf_size=64, fanout=4) == _straight_tree(raw, 64, 4)
    assert tree_digest(t.to(torch.bfloat16)) == _straight_tree(t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    with pytest.raises(LayoutError, match="contiguous"):
        tree_digest(t.view(10, 100).t())
    with pytest.raises(LayoutError, match="contiguous"):
        sha256(np.arange(10, dtype=np.uint8)[::2])
    with pytest.raises(LayoutError, match="bytes-like"):
        sha256("text")


def test_a_different_shape_gives_a_different_root():
    """The root commits to length and parameters: no two shapes of the same bytes collide."""
    payload = _pattern(10_000)
    roots = {tree_digest(payload, leaf_size=leaf, fanout=fanout) for leaf in (64, 128, 4096) for fanout in (2, 64)}
    assert len(roots) == 6
    assert tree_digest(payload + b"\x00") != tree_digest(payload)


@pytest.mark.parametrize("kwargs,match", [
    (dict(leaf_size=100), "leaf_size"), (dict(leaf_size=0), "leaf_size"), (dict(leaf_size=2 ** 31), "leaf_size"),
    (dict(leaf_size=4096.0), "leaf_size"), (dict(fanout=1), "fanout"), (dict(fanout=2 ** 25), "fanout"),
    (dict(fanout=True), "fanout"),
])
def test_invalid_parameters_are_refused(kwargs, match):
    with pytest.raises(IntegrityError, match=match):
        tree_digest(b"abc", **kwargs)


def test_object_digests_record_round_trip_and_refusals():
    payload = _pattern(50_000)
    d = object_digests(payload)
    assert d.sha256 == hashlib.sha256(payload).digest()
    assert d.tree_root == _straight_tree(payload)
    assert d.tree_format == TREE_FORMAT
    assert ObjectDigests.from_record(d.as_record()) == d
    record = d.as_record()
    with pytest.raises(IntegrityError, match="unknown tree digest format 'kmesh-tree-sha256/v2'"):
        ObjectDigests.from_record({**record, "tree_format": "kmesh-tree-sha256/v2"})
    with pytest.raises(IntegrityError, match="fanout"):
        ObjectDigests.from_record({**record, "tree_fanout": 1})
    with pytest.raises(IntegrityError, match="missing field 'tree_root'"):
        ObjectDigests.from_record({k: v for k, v in record.items() if k != "tree_root"})
    with pytest.raises(IntegrityError, match="sha256: expected 32 bytes"):
        ObjectDigests(sha256=b"short", tree_root=d.tree_root)
    check_tree_format(TREE_FORMAT)
    with pytest.raises(IntegrityError):
        check_tree_format("sha256")


def test_verification_names_the_object():
    payload = bytearray(_pattern(20_000))
    d = object_digests(bytes(payload), leaf_size=256, fanout=4)
    verify_object(payload, d, name="seg-7")
    verify_sha256(payload, d.sha256)
    verify_tree_digest(payload, d.tree_root, leaf_size=256, fanout=4)
    payload[12_345] ^= 0x10
    with pytest.raises(IntegrityError, match="kmesh-tree-sha256/v1 mismatch for 'seg-7'"):
        verify_object(payload, d, name="seg-7")
    with pytest.raises(IntegrityError, match="sha256 mismatch for 'seg-7'"):
        verify_object(payload, d, name="seg-7", tree_check=False)
    with pytest.raises(IntegrityError, match="mismatch for 'object'"):
        verify_tree_digest(bytes(payload[:-1]), d.tree_root, leaf_size=256, fanout=4)


@pytest.mark.parametrize("threads", [1, 3])
def test_hashlib_fallback_gives_the_same_root(monkeypatch, threads):
    """Without libcrypto/Numba the hashlib path serves; both paths give the published roots."""
    from kmesh_host import integrity

    payload = _pattern(3 << 20)
    want = "da0d3cb026178532c98bbac5d151c301effaecb63ae89497bda3a99686a2918a"
    assert tree_digest(payload, threads=threads).hex() == want
    monkeypatch.setattr(integrity, "_native_piece_hasher", lambda: None)
    assert tree_digest(payload, threads=threads).hex() == want
    assert tree_digest(payload, leaf_size=64, fanout=3, threads=threads) == _straight_tree(payload, 64, 3)
