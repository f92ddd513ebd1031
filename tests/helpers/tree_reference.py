"""kmesh-tree-sha256/v1 written from its definition (docs/tree-sha256.md) with hashlib: the reference
the device digests are checked against in tests/kmesh_gpu (kmesh_host.tree_digest is checked against
the same definition in tests/kmesh_host). Pinned to the published vectors (``DOC_VECTORS``)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np

__all__ = ["DOC_VECTORS", "doc_payload", "tree_digest"]

_DOMAIN = b"kmesh-tree-sha256/v1\x00"


def tree_digest(payload, *, leaf_size: int = 4096, fanout: int = 64) -> bytes:
    """The 32-byte root of ``payload`` (any contiguous bytes-like object: bytes, a numpy array)."""
    view = memoryview(payload).cast("B")
    n = max(1, -(-view.nbytes // leaf_size))
    level = [hashlib.sha256(view[i * leaf_size:(i + 1) * leaf_size]).digest() for i in range(n)]
    while len(level) > 1:
        level = [hashlib.sha256(b"".join(level[i:i + fanout])).digest() for i in range(0, len(level), fanout)]
    header = _DOMAIN + struct.pack("<QII", view.nbytes, leaf_size, fanout)
    return hashlib.sha256(header + level[0]).digest()


def doc_payload(n) -> np.ndarray:
    """The published vectors' payload: ``i % 251`` for ``i < n`` (or the bytes ``b"abc"``)."""
    if n == "abc":
        return np.frombuffer(b"abc", np.uint8).copy()
    return (np.arange(n) % 251).astype(np.uint8)


# docs/tree-sha256.md test vectors: (payload length or "abc", leaf_size, fanout, root)
DOC_VECTORS = [
    (0, 4096, 64, "f827070984949eaa357cb8a7e4c45ce7259243db2560daf8d3e7e0253d2bedaf"),
    ("abc", 4096, 64, "398a25fb50c8654504e0d6d09fe5bfbcef547aae922bf26ab8b8bd5a13da343e"),
    ("abc", 64, 2, "7f7a07bd14c3579ae81f636c02c74e51011da0690a77dad47d86c9098328e4bc"),
    (4096, 4096, 64, "af7629c03b698e8de4c66180f7d33b1821f2c4a61c27c2779adca0f04b782cdb"),
    (4097, 4096, 64, "6e3d7b9f2060d615cbece6ba01bf910d2bc5e6d137e435e41a9c5dc5817a7045"),
    (262144, 4096, 64, "14560865f57b863cdd70874415db8797aadf3118752d52284832cdbd86cb4cde"),
    (262145, 4096, 64, "800b9993b578bc6dbebf18a50347c1ab8d7cd4efc4b16bd74b8dc212729f2039"),
    (3145728, 4096, 64, "da0d3cb026178532c98bbac5d151c301effaecb63ae89497bda3a99686a2918a"),
    (200, 64, 2, "4af2d850cec5c2e4c6e43d26b02e1ab1d44cf4c4eaecdd235f4fd81726820765"),
]
