"""Warp placement kernel (CPU and CUDA), the portable twin of ``csrc/place.cu``.

Same tables, same work unit and the same fp32 operation order as the CUDA source; compiled with
``fuse_fp=False`` so no multiply-add is contracted. Addresses are built from uint64 base pointers and
int64 element offsets inside the kernel (``wp.array(ptr=...)``), so one launch covers many items,
per-layer cache tensors and caches larger than 2**31 elements.
"""

# No `from __future__ import annotations`: Warp evaluates kernel annotations with closure types.

import functools

import torch

from . import _backend

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}


@functools.cache
def _kernel(dtype_name: str):
    wp = _backend.warp()
    T = getattr(wp, dtype_name)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}[dtype_name]
    is_fp8 = dtype_name == "uint8"
    is_f32 = dtype_name == "float32"

    @wp.func
    def at(base: wp.uint64, offset: wp.int64):
        return wp.array(ptr=base + wp.uint64(offset * wp.int64(itemsize)), shape=(1,), dtype=T)

    @wp.func
    def fp8_encode(x: wp.float32) -> wp.uint8:
        bits = wp.cast(x, wp.uint32)
        sign = (bits >> wp.uint32(24)) & wp.uint32(0x80)
        a = wp.abs(x)
        if wp.isnan(a):
            return wp.uint8(sign | wp.uint32(0x7F))
        if a >= 448.0:
            return wp.uint8(sign | wp.uint32(0x7E))
        if a < 0.015625:
            m = wp.rint(a * 512.0)
            return wp.uint8(sign | wp.uint32(m))
        ab = bits & wp.uint32(0x7FFFFFFF)
        e = (ab >> wp.uint32(23)) - wp.uint32(120)
        man = ab & wp.uint32(0x7FFFFF)
        keep = man >> wp.uint32(20)
        rem = man & wp.uint32(0xFFFFF)
        q = (e << wp.uint32(3)) | keep
        if rem > wp.uint32(0x80000) or (rem == wp.uint32(0x80000) and (keep & wp.uint32(1)) != wp.uint32(0)):
            q = q + wp.uint32(1)
        if q > wp.uint32(0x7E):
            q = wp.uint32(0x7E)
        return wp.uint8(sign | q)

    @wp.func
    def load(p: wp.array(dtype=T), table: wp.array(dtype=wp.float32), scale: wp.float32) -> wp.float32:
        if wp.static(is_fp8):
            return table[wp.int32(p[0])] * scale
        elif wp.static(is_f32):
            return p[0]
        else:
            return wp.float32(p[0])

    @wp.func
    def store(p: wp.array(dtype=T), x: wp.float32, scale: wp.float32):
        if wp.static(is_fp8):
            y = x / scale
            if not wp.isnan(y):  # wp.clamp turns NaN into -448; torch's clamp (the reference) keeps NaN
                y = wp.clamp(y, -448.0, 448.0)
            p[0] = fp8_encode(y)
        elif wp.static(is_f32):
            p[0] = x
        else:
            p[0] = T(x)

    @wp.kernel(enable_backward=False, module="unique", module_options={"fuse_fp": False})
    def place_kernel(
        kv_ptrs: wp.array(dtype=wp.uint64),
        item_tok_start: wp.array(dtype=wp.int64),
        tok_item: wp.array(dtype=wp.int64),
        slots: wp.array(dtype=wp.int64),
        old_pos: wp.array(dtype=wp.int64),
        new_pos: wp.array(dtype=wp.int64),
        layer_base: wp.array(dtype=wp.uint64),
        item_cache: wp.array(dtype=wp.int64),
        k_st: wp.array(dtype=wp.int64),  # (block, head, token, d, offset)
        v_st: wp.array(dtype=wp.int64),
        L: wp.int64,
        H: wp.int64,
        D: wp.int64,
        N: wp.int64,
        gather: wp.int32,
        rope: wp.int32,
        neox: wp.int32,
        rd: wp.int64,
        cos_sin: wp.array(dtype=wp.float32),
        fp8_table: wp.array(dtype=wp.float32),
        k_scale: wp.array(dtype=wp.float32),
    ):
        a, g32, b = wp.tid()  # a = kvsel*L + l ; g = token ; b = h * D/2 + j
        g = wp.int64(g32)
        half_d = D / wp.int64(2)
        kvsel = wp.int64(a) / L
        l = wp.int64(a) - kvsel * L
        h = wp.int64(b) / half_d
        j = wp.int64(b) - h * half_d
        slot = slots[g]
        if slot < wp.int64(0):
            return
        item = tok_item[g]
        t = g - item_tok_start[item]
        t_i = item_tok_start[item + wp.int64(1)] - item_tok_start[item]
        src = kv_ptrs[item]
        src_off = (((kvsel * L + l) * t_i + t) * H + h) * D
        st = k_st
        if kvsel == wp.int64(1):
            st = v_st
        dst = layer_base[item_cache[item] * L + l]
        dst_off = st[4] + (slot / N) * st[0] + h * st[1] + (slot - (slot / N) * N) * st[2]
        half_rd = rd / wp.int64(2)
        rotate = rope != 0 and gather == 0 and kvsel == wp.int64(0) and j < half_rd
        e0 = wp.int64(2) * j
        e1 = e0 + wp.int64(1)
        if rotate and neox != 0:
            e0 = j
            e1 = j + half_rd
        s0 = at(src, src_off + e0)
        s1 = at(src, src_off + e1)
        c0 = at(dst, dst_off + e0 * st[3])
        c1 = at(dst, dst_off + e1 * st[3])
        if gather != 0:
            s0[0] = c0[0]
            s1[0] = c1[0]
            return
        if not rotate:
            c0[0] = s0[0]
            c1[0] = s1[0]
            return
        scale = k_scale[wp.int32(l)]
        x0 = load(s0, fp8_table, scale)
        x1 = load(s1, fp8_table, scale)
        po = old_pos[g] * rd
        pn = new_pos[g] * rd
        cp = cos_sin[po + j]
        sp = cos_sin[po + half_rd + j]
        cq = cos_sin[pn + j]
        sq = cos_sin[pn + half_rd + j]
        u0 = x0 * cp + x1 * sp
        u1 = x1 * cp - x0 * sp
        z0 = u0 * cq - u1 * sq
        z1 = u1 * cq + u0 * sq
        store(c0, z0, scale)
        store(c1, z1, scale)

    return place_kernel


def launch(tables: dict, dtype: torch.dtype, device: torch.device, *, L: int, H: int, D: int, N: int,
           total_tokens: int, gather: bool, rope: bool, neox: bool, rd: int) -> None:
    """Launch the Warp kernel over (2*L, total_tokens, H*D/2) on ``device``."""
    wp = _backend.warp()
    kernel = _kernel(_DTYPES[dtype])
    wdev = _backend.warp_device(device)

    def arr(t: torch.Tensor, wdtype):
        return wp.array(ptr=t.data_ptr(), shape=(t.numel(),), dtype=wdtype, device=wdev)

    u64, i64, f32 = wp.uint64, wp.int64, wp.float32
    stream = None
    if device.type == "cuda":
        stream = wp.stream_from_torch(torch.cuda.current_stream(device))
    inputs = [
        arr(tables["kv_ptrs"], u64), arr(tables["item_tok_start"], i64), arr(tables["tok_item"], i64),
        arr(tables["slots"], i64), arr(tables["old_pos"], i64), arr(tables["new_pos"], i64),
        arr(tables["layer_base"], u64), arr(tables["item_cache"], i64),
        arr(tables["k_st"], i64), arr(tables["v_st"], i64),
        L, H, D, N, int(gather), int(rope), int(neox), rd,
        arr(tables["cos_sin"], f32), arr(tables["fp8_table"], f32), arr(tables["k_scale"], f32),
    ]
    wp.launch(kernel, dim=(2 * L, total_tokens, H * (D // 2)), inputs=inputs, device=wdev, stream=stream)
