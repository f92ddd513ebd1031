"""Warp kernels of batched SHA-256 and the kmesh-tree-sha256/v1 levels (CPU and CUDA).

The same logic as ``csrc/sha256.cu``: one thread hashes one whole message, a launch hashes many.
Imported only when the warp backend is used (``kmesh_gpu.sha256`` imports it lazily), so importing
``kmesh_gpu`` never imports Warp. Messages are read byte by byte: this backend is the portable check of
the kernel logic (CI runs it on CPU), the CuPy kernel is the fast path on CUDA.
"""

from __future__ import annotations


import numpy as np

from . import _backend
from ._once import once_per_key

wp = _backend.warp()

ROUND_CONSTANTS = np.array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
], dtype=np.uint32)

INITIAL_STATE = np.array([
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
], dtype=np.uint32)

Words16 = wp.types.vector(length=16, dtype=wp.uint32)
State8 = wp.types.vector(length=8, dtype=wp.uint32)


@wp.func
def _rotr(x: wp.uint32, n: wp.uint32) -> wp.uint32:
    return (x >> n) | (x << (wp.uint32(32) - n))


@wp.func
def _compress(state: State8, block: Words16, k: wp.array(dtype=wp.uint32)) -> State8:
    w = Words16(block)
    a = state[0]
    b = state[1]
    c = state[2]
    d = state[3]
    e = state[4]
    f = state[5]
    g = state[6]
    h = state[7]
    for r in range(64):
        slot = r % 16
        wr = w[slot]
        if r >= 16:
            w15 = w[(r - 15) % 16]
            w2 = w[(r - 2) % 16]
            s0 = _rotr(w15, wp.uint32(7)) ^ _rotr(w15, wp.uint32(18)) ^ (w15 >> wp.uint32(3))
            s1 = _rotr(w2, wp.uint32(17)) ^ _rotr(w2, wp.uint32(19)) ^ (w2 >> wp.uint32(10))
            wr = wr + s0 + w[(r - 7) % 16] + s1
            w[slot] = wr
        big_s1 = _rotr(e, wp.uint32(6)) ^ _rotr(e, wp.uint32(11)) ^ _rotr(e, wp.uint32(25))
        choose = (e & f) ^ (~e & g)
        t1 = h + big_s1 + choose + k[r] + wr
        big_s0 = _rotr(a, wp.uint32(2)) ^ _rotr(a, wp.uint32(13)) ^ _rotr(a, wp.uint32(22))
        majority = (a & b) | (c & (a | b))
        t2 = big_s0 + majority
        h = g
        g = f
        f = e
        e = d + t1
        d = c
        c = b
        b = a
        a = t1 + t2
    return State8(state[0] + a, state[1] + b, state[2] + c, state[3] + d,
                  state[4] + e, state[5] + f, state[6] + g, state[7] + h)


@wp.func
def _message_byte(data: wp.array(dtype=wp.uint8), start: wp.int64, pos: wp.int64,
                  length: wp.int64) -> wp.uint32:
    """Byte ``pos`` of the padded message: data, then 0x80, zeros, and the big-endian bit length."""
    padded = ((length + wp.int64(8)) // wp.int64(64) + wp.int64(1)) * wp.int64(64)
    if pos < length:
        return wp.uint32(data[wp.int32(start + pos)])
    if pos == length:
        return wp.uint32(0x80)
    if pos >= padded - wp.int64(8):
        shift = wp.int64(8) * (padded - wp.int64(1) - pos)
        return wp.uint32((wp.uint64(length) * wp.uint64(8)) >> wp.uint64(shift)) & wp.uint32(0xFF)
    return wp.uint32(0)


@wp.func
def _hash_message(data: wp.array(dtype=wp.uint8), start: wp.int64, length: wp.int64,
                  init: State8, k: wp.array(dtype=wp.uint32),
                  out: wp.array(dtype=wp.uint8), out_at: wp.int64):
    state = State8(init)
    padded = ((length + wp.int64(8)) // wp.int64(64) + wp.int64(1)) * wp.int64(64)
    full = length // wp.int64(64)
    base = wp.int64(0)
    while base < padded:
        block = Words16()
        if base // wp.int64(64) < full:
            for q in range(16):
                at = wp.int32(start + base) + 4 * q
                block[q] = ((wp.uint32(data[at]) << wp.uint32(24)) | (wp.uint32(data[at + 1]) << wp.uint32(16))
                            | (wp.uint32(data[at + 2]) << wp.uint32(8)) | wp.uint32(data[at + 3]))
        else:
            for q in range(16):
                word = wp.uint32(0)
                for b in range(4):
                    pos = base + wp.int64(4 * q + b)
                    word = (word << wp.uint32(8)) | _message_byte(data, start, pos, length)
                block[q] = word
        state = _compress(state, block, k)
        base = base + wp.int64(64)
    at = wp.int32(out_at)
    for q in range(8):
        word = state[q]
        out[at + 4 * q] = wp.uint8(word >> wp.uint32(24))
        out[at + 4 * q + 1] = wp.uint8((word >> wp.uint32(16)) & wp.uint32(0xFF))
        out[at + 4 * q + 2] = wp.uint8((word >> wp.uint32(8)) & wp.uint32(0xFF))
        out[at + 4 * q + 3] = wp.uint8(word & wp.uint32(0xFF))


@wp.kernel(enable_backward=False)
def sha256_batched_kernel(data: wp.array(dtype=wp.uint8), offsets: wp.array(dtype=wp.int64),
                          lengths: wp.array(dtype=wp.int64), init: State8,
                          k: wp.array(dtype=wp.uint32), out: wp.array(dtype=wp.uint8)):
    i = wp.tid()
    _hash_message(data, offsets[i], lengths[i], init, k, out, wp.int64(32) * wp.int64(i))


@wp.kernel(enable_backward=False)
def sha256_tree_level_kernel(src: wp.array(dtype=wp.uint8), piece: wp.int64,
                             table: wp.array(dtype=wp.int64), table_at: wp.int32, n_obj: wp.int32,
                             init: State8, k: wp.array(dtype=wp.uint32), out: wp.array(dtype=wp.uint8)):
    """One tree level; ``table[table_at:]`` holds the four columns described in csrc/sha256.cu."""
    i = wp.int64(wp.tid())
    starts = table_at
    src_off = table_at + n_obj + 1
    src_bytes = src_off + n_obj
    out_off = src_bytes + n_obj
    lo = wp.int32(0)
    hi = n_obj - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table[starts + mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    j = i - table[starts + lo]
    begin = j * piece
    length = wp.min(piece, table[src_bytes + lo] - begin)
    _hash_message(src, table[src_off + lo] + begin, length, init, k, out,
                  table[out_off + lo] + wp.int64(32) * j)


@once_per_key(maxsize=None)
def round_constants(device: str):
    """The 64 round constants as a Warp array on ``device`` (one per device, built once)."""
    return wp.array(ROUND_CONSTANTS, dtype=wp.uint32, device=device)


def initial_state():
    return State8(*[int(x) for x in INITIAL_STATE])
