"""Batched SHA-256 and kmesh-tree-sha256/v1 on the device, through the public functions: every
backend equals hashlib and kmesh_host.tree_digest, for boundary lengths, all alignments and
multi-level trees; canaries outside the messages; an ``out`` given is written and returned;
verification names the bad object; bad arguments are refused with named errors. Which internal
path ran (the fused tree, the per-level one, the repeated-call short path, the CUDA source run on
the host) is in test_sha256_paths.py."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kmesh_gpu import BackendError, IntegrityError, LayoutError, sha256_batched, tree_digests, verify_tree_roots
from kmesh_gpu import _backend
from tests.helpers.tree_reference import DOC_VECTORS, doc_payload, tree_digest

CASES = [
    pytest.param("cpu", "host", id="cpu-host"),
    pytest.param("cpu", "warp", id="cpu-warp"),
    pytest.param("cuda", "host", id="cuda-host", marks=pytest.mark.gpu),
    pytest.param("cuda", "warp", id="cuda-warp", marks=pytest.mark.gpu),
    pytest.param("cuda", "cupy", id="cuda-cupy", marks=pytest.mark.gpu),
]
BOUNDARY_LENGTHS = [0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 121, 127, 128, 129, 1000]


def _need(device: str, backend: str) -> None:
    if backend == "cupy" and not _backend.has_cupy():
        pytest.skip("needs cupy with a CUDA device (not installed here)")
    if backend == "warp" and not _backend.has_warp():
        pytest.skip("needs the warp-lang package (not installed here)")


def _bytes(seed: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _hashlib(data: torch.Tensor, offs, lens) -> list[bytes]:
    raw = data.cpu().numpy().tobytes()
    return [hashlib.sha256(raw[o:o + n]).digest() for o, n in zip(offs, lens)]


def _rows(digests: torch.Tensor) -> list[bytes]:
    assert digests.dtype == torch.uint8 and digests.dim() == 2 and digests.shape[1] == 32
    return [bytes(r) for r in digests.cpu().numpy()]


def test_the_reference_tree_digest_matches_the_published_vectors():
    for n, leaf, fanout, root in DOC_VECTORS:
        assert tree_digest(doc_payload(n), leaf_size=leaf, fanout=fanout).hex() == root, (n, leaf, fanout)


@pytest.mark.parametrize("device,backend", CASES)
def test_tree_digests_equal_the_published_vectors(device, backend):
    _need(device, backend)
    for n, leaf, fanout, root in DOC_VECTORS:
        data = torch.from_numpy(doc_payload(n)).to(device)
        got = tree_digests(data, [0], [data.numel()], leaf_size=leaf, fanout=fanout, backend=backend)
        assert _rows(got) == [bytes.fromhex(root)], (n, leaf, fanout)


@pytest.mark.parametrize("device,backend", CASES)
def test_known_vectors(device, backend):
    _need(device, backend)
    data = torch.tensor(list(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"), dtype=torch.uint8)
    got = sha256_batched(data.to(device), [0, 0, 0], [3, 0, 56], backend=backend)
    assert got.device.type == device
    assert [r.hex() for r in _rows(got)] == [
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ]


@pytest.mark.parametrize("device,backend", CASES)
def test_batched_boundary_lengths_every_alignment(device, backend):
    """Lengths around the padding boundaries, starting at every offset mod 16 (the three load paths)."""
    _need(device, backend)
    data = _bytes(1, 4096).to(device)
    offs, lens = [], []
    for n in BOUNDARY_LENGTHS:
        for shift in (0, 1, 2, 3, 4, 8, 13):
            offs.append(64 * len(offs) % 2048 + shift)
            lens.append(n)
    got = sha256_batched(data, np.array(offs, np.int64), torch.tensor(lens), backend=backend)
    assert _rows(got) == _hashlib(data, offs, lens)


@pytest.mark.parametrize("device,backend", CASES)
def test_batched_random_overlapping_messages(device, backend):
    _need(device, backend)
    rng = np.random.default_rng(2)
    data = _bytes(3, 50_000).to(device)
    lens = rng.integers(0, 5000, 120)
    offs = np.array([rng.integers(0, 50_000 - n + 1) for n in lens], dtype=np.int64)
    got = sha256_batched(data, torch.from_numpy(offs).to(device), lens.astype(np.int64), backend=backend)
    assert _rows(got) == _hashlib(data, offs.tolist(), lens.tolist())


@pytest.mark.parametrize("device,backend", CASES)
def test_canaries_outside_messages_do_not_matter(device, backend):
    """Bytes right before and after each message are never read; a flipped byte inside is seen."""
    _need(device, backend)
    data = _bytes(4, 3000)
    offs, lens = [16, 300, 1029, 2000], [200, 64, 55, 999]
    ref = sha256_batched(data, offs, lens, backend="host")
    poisoned = data.clone()
    for o, n in zip(offs, lens):
        poisoned[o - 1] ^= 0xFF
        poisoned[o + n] ^= 0xFF
    assert torch.equal(sha256_batched(poisoned.to(device), offs, lens, backend=backend).cpu(), ref)
    flipped = data.clone()
    flipped[1029 + 54] ^= 0x01
    got = sha256_batched(flipped.to(device), offs, lens, backend=backend).cpu()
    assert [torch.equal(got[i], ref[i]) for i in range(4)] == [True, True, False, True]


TREE_SHAPES = [
    pytest.param(64, 2, id="leaf64-fan2"),
    pytest.param(128, 3, id="leaf128-fan3"),
    pytest.param(256, 64, id="leaf256-fan64"),
]


def _tree_lengths(leaf: int, fanout: int) -> list[int]:
    span = leaf * fanout
    return sorted({0, 1, 55, 56, 63, 64, 119, 120, leaf - 1, leaf, leaf + 1, span - 1, span, span + 1,
                   span * fanout - 1, span * fanout + 1, 3 * span * fanout + 7})


@pytest.mark.parametrize("leaf,fanout", TREE_SHAPES)
@pytest.mark.parametrize("device,backend", CASES)
def test_tree_digests_equal_host_tree_digest(device, backend, leaf, fanout):
    """All objects of one call (different heights) in one launch per level, any offset alignment."""
    _need(device, backend)
    lens = _tree_lengths(leaf, fanout)
    offs, at = [], 0
    for i, n in enumerate(lens):
        offs.append(at + i % 5)
        at += n + 16
    data = _bytes(5, at + 16)
    raw = data.numpy().tobytes()
    want = [tree_digest(raw[o:o + n], leaf_size=leaf, fanout=fanout) for o, n in zip(offs, lens)]
    got = tree_digests(data.to(device), offs, lens, leaf_size=leaf, fanout=fanout, backend=backend)
    assert got.device.type == device
    assert _rows(got) == want


@pytest.mark.parametrize("device,backend", CASES)
def test_tree_digests_default_parameters(device, backend):
    _need(device, backend)
    leaf, span = 4096, 4096 * 64
    lens = [0, 5, leaf - 1, leaf, leaf + 1, span - 1, span, span + 1]
    offs = np.cumsum([0] + lens[:-1]).astype(np.int64)
    data = _bytes(6, int(sum(lens)))
    raw = data.numpy().tobytes()
    want = [tree_digest(raw[o:o + n]) for o, n in zip(offs.tolist(), lens)]
    assert _rows(tree_digests(data.to(device), offs, lens, backend=backend)) == want


@pytest.mark.parametrize("device,backend", CASES)
def test_verify_tree_roots_names_the_bad_object(device, backend):
    _need(device, backend)
    data = _bytes(7, 4 * 1000)
    offs, lens = [0, 1000, 2000, 3000], [1000, 1000, 1000, 999]
    names = ["seg-a", "seg-b", "seg-c", "seg-d"]
    roots = tree_digests(data, offs, lens, leaf_size=64, fanout=4, backend="host")
    on_device = data.to(device)
    verify_tree_roots(on_device, offs, lens, roots, names=names, leaf_size=64, fanout=4, backend=backend)
    verify_tree_roots(on_device, offs, lens, _rows(roots), leaf_size=64, fanout=4, backend=backend)
    on_device[2500] ^= 0x80
    on_device[3998] ^= 0x01
    with pytest.raises(IntegrityError, match=r"'seg-c' \(and 1 more of 4\)"):
        verify_tree_roots(on_device, offs, lens, roots.numpy(), names=names, leaf_size=64, fanout=4,
                          backend=backend)
    with pytest.raises(IntegrityError, match="object 2"):
        verify_tree_roots(on_device, offs, lens, roots, leaf_size=64, fanout=4, backend=backend)
    # Stored under other parameters: the roots differ, so verification refuses rather than passes.
    with pytest.raises(IntegrityError, match="object 0"):
        verify_tree_roots(data.to(device), offs, lens, roots, leaf_size=128, fanout=4, backend=backend)


def test_inputs_numpy_bytes_and_empty():
    payload = bytes(range(200))
    want = [hashlib.sha256(payload[10:150]).digest()]
    assert _rows(sha256_batched(payload, [10], [140])) == want
    assert _rows(sha256_batched(np.frombuffer(payload, np.uint8), np.array([10]), np.array([140]))) == want
    assert sha256_batched(payload, [], []).shape == (0, 32)
    assert tree_digests(payload, np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0, 32)
    empty = torch.zeros(0, dtype=torch.uint8)
    for backend in ("host", "warp"):
        assert _rows(tree_digests(empty, [0, 0], [0, 0], backend=backend)) == [tree_digest(b"")] * 2
        assert _rows(sha256_batched(empty, [0], [0], backend=backend)) == [hashlib.sha256(b"").digest()]


@pytest.mark.parametrize("call,match", [
    (lambda: sha256_batched(torch.zeros(8, dtype=torch.int32), [0], [1]), r"data: expected uint8\[M\]"),
    (lambda: sha256_batched(torch.zeros(2, 4, dtype=torch.uint8), [0], [1]), r"data: expected uint8\[M\]"),
    (lambda: sha256_batched(torch.zeros(8, dtype=torch.uint8)[::2], [0], [1]), "contiguous"),
    (lambda: sha256_batched(b"abcd", np.array([0], np.int32), [1]), r"offsets: expected int64\[N\]"),
    (lambda: sha256_batched(b"abcd", [0], torch.ones(1, 1, dtype=torch.int64)), r"lengths: expected int64\[N\]"),
    (lambda: sha256_batched(b"abcd", [0, 1], [1]), "same shape"),
    (lambda: sha256_batched(b"abcd", [-1], [1]), r"offsets\[0\] = -1"),
    (lambda: sha256_batched(b"abcd", [0, 0], [1, -2]), r"lengths\[1\] = -2"),
    (lambda: sha256_batched(b"abcd", [0, 2], [4, 3]), r"message 1 = data\[2:5\] runs past the end"),
    (lambda: sha256_batched(b"abcd", [0], [1], backend="fast"), "backend"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=100), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=0), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=True), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], leaf_size=2 ** 31), "leaf_size"),
    (lambda: tree_digests(b"abcd", [0], [4], fanout=1), "fanout"),
    (lambda: tree_digests(b"abcd", [0], [4], fanout=2 ** 25), "fanout"),
    (lambda: tree_digests(b"abcd", [0], [4], fanout=4.0), "fanout"),
    (lambda: verify_tree_roots(b"abcd", [0], [4], [b"x" * 31]), "expected_roots"),
    (lambda: verify_tree_roots(b"abcd", [0], [4], torch.zeros(2, 32, dtype=torch.uint8)), "expected_roots"),
    (lambda: verify_tree_roots(b"abcd", [0], [4], [b"x" * 32], names=["a", "b"]), "names"),
    (lambda: tree_digests(b"abcd", [0], [4], stream=1234), "stream: given for data that is not a CUDA tensor"),
    (lambda: tree_digests(torch.zeros(4, dtype=torch.uint8), [0], [4], stream=0), "stream: given for data"),
    (lambda: tree_digests(b"abcd", [0], [4], stream="1234"), "stream: expected a raw CUDA stream handle"),
    (lambda: tree_digests(b"abcd", [0], [4], stream=-1), "stream: expected a raw CUDA stream handle"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_named(call, match):
    with pytest.raises((LayoutError, IntegrityError, BackendError), match=match):
        call()


def test_cupy_refuses_cpu_data():
    with pytest.raises(BackendError, match="cupy"):
        sha256_batched(b"abcd", [0], [4], backend="cupy")
    with pytest.raises(BackendError, match="cupy"):
        tree_digests(b"abcd", [0], [4], backend="cupy")


@pytest.mark.parametrize("device,backend", CASES)
def test_tree_digests_into_a_given_out(device, backend):
    """``out``: the roots are written there and it is returned; a wrong one is refused by name,
    and the call has written nothing into it."""
    _need(device, backend)
    data = _bytes(15, 20_000).to(device)
    offs, lens = [0, 5000, 9999], [5000, 4999, 10_001]
    want = tree_digests(data, offs, lens, backend="host")
    out = torch.full((3, 32), 0xA5, dtype=torch.uint8, device=device)
    assert tree_digests(data, offs, lens, backend=backend, out=out) is out
    assert torch.equal(out.cpu(), want.cpu())
    assert tree_digests(data, offs, lens, backend=backend, out=out) is out  # again (a repeated call)
    assert torch.equal(out.cpu(), want.cpu())
    for bad in (torch.zeros((2, 32), dtype=torch.uint8, device=device),
                torch.zeros((3, 32), dtype=torch.int32, device=device),
                torch.zeros((3, 16), dtype=torch.uint8, device=device),
                torch.zeros((3, 32), dtype=torch.uint8, device="meta")):
        before = bad.clone() if bad.device.type != "meta" else None
        with pytest.raises(LayoutError, match="out"):
            tree_digests(data, offs, lens, backend=backend, out=bad)
        if before is not None:
            assert torch.equal(bad, before)
    empty = torch.zeros((0, 32), dtype=torch.uint8, device=device)
    assert tree_digests(data, [], [], backend=backend, out=empty) is empty


# -- GPU: all backends agree, on the data's stream, with poisoned allocator memory ---------------

def _poison_cuda_allocator(nbytes: int) -> None:
    """Leave 0xA5 bytes in the caching allocator's free blocks, so unwritten outputs would show."""
    junk = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    del junk


@pytest.mark.gpu
def test_gpu_backends_agree_on_large_batch():
    if not _backend.has_cupy():
        pytest.skip("needs cupy with a CUDA device (not installed here)")
    rng = np.random.default_rng(10)
    host = _bytes(11, 4 * (3 << 20) + 64)
    lens = [3 << 20] * 4 + rng.integers(0, 70_000, 200).tolist()
    offs = [i * (3 << 20) for i in range(4)] + rng.integers(0, (3 << 20) * 3, 200).tolist()
    data = host.cuda()
    raw = host.numpy().tobytes()
    _poison_cuda_allocator(64 << 20)
    ref_sha = _hashlib(host, offs, lens)
    backends = ["cupy"] + (["warp"] if _backend.has_warp() else [])   # warp's part needs warp-lang
    for backend in backends:
        assert _rows(sha256_batched(data, offs, lens, backend=backend)) == ref_sha, backend
    ref_tree = [tree_digest(raw[o:o + n]) for o, n in zip(offs, lens)]
    for backend in backends:
        _poison_cuda_allocator(64 << 20)
        assert _rows(tree_digests(data, offs, lens, backend=backend)) == ref_tree, backend
        _poison_cuda_allocator(64 << 20)                        # again: the repeated-call fast path
        assert _rows(tree_digests(data, offs, lens, backend=backend)) == ref_tree, backend
    # the seed's one-thread-per-object design, the baseline perf/run_sha256.py measures against
    from perf.sha256_baseline import sha256_one_thread_per_object

    assert _rows(sha256_one_thread_per_object(data, offs[4:40], lens[4:40])) == ref_sha[4:40]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "warp"])
def test_gpu_runs_on_the_current_stream(backend):
    """Data produced on a side stream is hashed after that copy, without an explicit sync."""
    _need("cuda", backend)
    host = _bytes(12, 8 << 20).pin_memory()
    want = tree_digest(host.numpy())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        data = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
        data.copy_(host, non_blocking=True)
        got = tree_digests(data, [0], [host.numel()], backend=backend)
        got_host = got.to("cpu", non_blocking=False)
    side.synchronize()
    assert bytes(got_host[0].numpy()) == want


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "warp", "host"])
def test_gpu_tree_digests_on_a_given_stream_into_out(backend):
    """``stream``: the digests are queued on that raw stream (ordered after the copy made there),
    into ``out``; repeated, the same; a wrong ``out`` is refused by name whatever the stream."""
    _need("cuda", backend)
    host = _bytes(16, 3 << 20).pin_memory()
    offs, lens = (0, 1 << 20, (1 << 20) + 4096), (1 << 20, 4096, (2 << 20) - 4096)
    want = [tree_digest(host.numpy().tobytes()[o:o + n]) for o, n in zip(offs, lens)]
    side = torch.cuda.Stream()
    data = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    out = torch.empty((3, 32), dtype=torch.uint8, device="cuda")
    for _ in range(3):  # the first call checks and plans; the next ones on that stream repeat it
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(5e6))  # the copy lands late: digests taken before it would differ
            data.copy_(host, non_blocking=True)
        assert tree_digests(data, offs, lens, backend=backend, out=out, stream=side.cuda_stream) is out
        side.synchronize()
        assert _rows(out) == want
        data.zero_()
    torch.cuda.synchronize()
    for bad in (torch.empty((3, 32), dtype=torch.int32, device="cuda"),
                torch.empty((3, 64), dtype=torch.uint8, device="cuda")[:, ::2],
                torch.empty((3, 4), dtype=torch.uint8, device="cuda")):
        data.copy_(host)
        if bad.dtype == torch.uint8 and bad.shape == (3, 32):  # strided: written row by row, or refused
            try:
                tree_digests(data, offs, lens, backend=backend, out=bad, stream=side.cuda_stream)
            except LayoutError:
                continue
            side.synchronize()
            assert _rows(bad.contiguous()) == want
            continue
        with pytest.raises(LayoutError, match="out"):
            tree_digests(data, offs, lens, backend=backend, out=bad, stream=side.cuda_stream)
