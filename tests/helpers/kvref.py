"""Independent references for placement tests.

Logical views are built with plain torch slicing/permutes from the physical tensor (not with
KVLayout's strides), and the shift is written pair by pair, so the product's stride math and
vectorised shift are checked against something that shares no code with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kmesh_gpu import KVLayout

NAMED = {
    "LBHNC": "LBHNC", "LBNHC": "LBNHC", "LHBNC": "LHBNC", "BLHNC": "BLHNC", "BLNHC": "BLNHC", "BHLNC": "BHLNC",
}


@dataclass(frozen=True)
class Case:
    """A cache arrangement: how to build its KVLayout and how to see its logical K/V planes."""

    kind: str      # "named", "planes", "legacy", "padded"
    name: str      # vLLM layout name, or legacy "first/NHD" etc.

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.name.replace('/', '-')}"


def build(case: Case, *, L, B, H, N, D, dtype):
    """Return (layout, cache_tensor, views) where views(cache) -> (K, V) logical [L, B, H, N, D] views."""
    if case.kind == "named":
        layout = KVLayout.from_vllm(case.name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H,
                                    head_size=D, dtype=dtype, kv_packing="content")
        axes = [a for a in case.name]  # memory order, C last

        def views(t):
            lg = t.permute([axes.index(a) for a in "LBHNC"])
            return lg[..., :D], lg[..., D:]
    elif case.kind == "planes":
        layout = KVLayout.from_vllm(case.name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H,
                                    head_size=D, dtype=dtype, kv_packing="planes")
        axes = [a for a in case.name[:-1]]
        axes.insert(axes.index("N"), "2")
        axes.append("D")
        k_axes = [{"N": "D", "D": "N"}.get(a, a) for a in axes]  # vLLM's CPU backend stores K as [D, N]
        sizes = {"L": L, "B": B, "H": H, "N": N, "D": D, "2": 2}

        def views(t):
            lg = t.permute([axes.index(a) for a in "2LBHND"])
            kg = t.reshape([sizes[a] for a in k_axes]).permute([k_axes.index(a) for a in "2LBHND"])
            return kg[0], lg[1]
    elif case.kind == "legacy":
        kv_axis, order = case.name.split("/")
        layout = KVLayout.from_vllm_legacy(kv_axis, order, num_layers=L, num_blocks=B, block_size=N,
                                           num_kv_heads=H, head_size=D, dtype=dtype)
        inner = ["N", "H", "D"] if order == "NHD" else ["H", "N", "D"]
        axes = ["L"] + (["2", "B"] if kv_axis == "first" else ["B", "2"]) + inner

        def views(t):
            lg = t.permute([axes.index(a) for a in "2LBHND"])
            return lg[0], lg[1]
    elif case.kind == "padded":
        # A custom allocation: (B, L, 2, H, N, D + 6) with 6 pad elements after each head row and a
        # 32-element header: described through from_strides with strides read back from torch views.
        phys_shape = (B, L, 2, H, N, D + 6)
        numel = 32 + torch.Size(phys_shape).numel()
        flat = torch.empty(numel, dtype=dtype)
        phys = flat[32:].view(phys_shape)
        k = phys[:, :, 0, :, :, :D].permute(1, 0, 2, 3, 4)
        v = phys[:, :, 1, :, :, :D].permute(1, 0, 2, 3, 4)
        layout = KVLayout.from_strides((L, B, H, N, D), k.stride(), v.stride(), k.storage_offset(),
                                       v.storage_offset(), dtype=dtype, physical_shape=(numel,), name="padded")

        def views(t):
            p = t[32:].view(phys_shape)
            return p[:, :, 0, :, :, :D].permute(1, 0, 2, 3, 4), p[:, :, 1, :, :, :D].permute(1, 0, 2, 3, 4)
    else:
        raise ValueError(case.kind)
    return layout, views


ALL_CASES = ([Case("named", n) for n in NAMED] + [Case("planes", "LBHNC"), Case("planes", "BLNHC")]
             + [Case("legacy", f"{a}/{o}") for a in ("first", "second") for o in ("NHD", "HND")]
             + [Case("padded", "custom")])


def fp8_decode(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).float()


def shift_pairwise(k: torch.Tensor, old: torch.Tensor, new: torch.Tensor, cos_sin: torch.Tensor, rd: int,
                   neox: bool) -> torch.Tensor:
    """fp32 keys [L, T, H, D]: per pair, undo at old and apply at new (the documented op order)."""
    out = k.clone()
    half = rd // 2
    for i in range(half):
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        cp = cos_sin[old, i].view(1, -1, 1)
        sp = cos_sin[old, half + i].view(1, -1, 1)
        cq = cos_sin[new, i].view(1, -1, 1)
        sq = cos_sin[new, half + i].view(1, -1, 1)
        x0, x1 = k[..., a], k[..., b]
        u0 = x0 * cp + x1 * sp
        u1 = x1 * cp - x0 * sp
        out[..., a] = u0 * cq - u1 * sq
        out[..., b] = u1 * cq + u0 * sq
    return out


def reference_place(cache, views, kv, slots, *, N, rope=None, old=None, new=None, k_scale=1.0):
    """Place token by token through the logical views (a copy of cache is modified and returned)."""
    out = cache.clone()
    K, V = views(out.view(torch.uint8) if kv.dtype == torch.uint8 else out)
    kk, vv = kv[0], kv[1]
    if rope is not None:
        table = rope.cos_sin_cache().float()
        if kv.dtype == torch.uint8:
            x = fp8_decode(kk) * k_scale
            y = shift_pairwise(x, old, new, table, rope.rotary_dim, rope.is_neox_style)
            kk = (y / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            kk = shift_pairwise(kk.float(), old, new, table, rope.rotary_dim, rope.is_neox_style).to(kv.dtype)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        K[:, s // N, :, s % N, :] = kk[:, t]
        V[:, s // N, :, s % N, :] = vv[:, t]
    return out
