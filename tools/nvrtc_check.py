"""Compile kmesh_gpu/csrc/*.cu with NVRTC for sm_90 without a GPU (syntax and template check).

Needs the `cuda-bindings` and `nvidia-cuda-nvrtc` wheels; used on CPU-only machines before a GPU run.
Usage: python tools/nvrtc_check.py [file.cu ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from cuda.bindings import nvrtc

CSRC = Path(__file__).resolve().parent.parent / "kmesh_gpu" / "csrc"
# Template instantiations to force per source (kernels that are templates).
NAME_EXPRESSIONS = {
    "place.cu": [f"kmesh_place<{t}>" for t in ("float", "__half", "__nv_bfloat16", "unsigned char")]
    + [f"kmesh_place_vec<{t}, 2, 4>" for t in ("float", "__half", "__nv_bfloat16", "unsigned char")]
    + [f"kmesh_place_runs<{t}, 1, 2, 4, {f}>" for t in ("float", "__half", "__nv_bfloat16", "unsigned char") for f in (0, 1)],
}


def _cuda_include_dirs() -> list[Path]:
    """CUDA headers from the nvidia-cuda-runtime wheel (cuda_fp16.h and friends)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    dirs = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        dirs += [p.parent for p in Path(root).glob("*/include/cuda_fp16.h")]
    return dirs


def check(path: Path) -> bool:
    src = path.read_bytes()
    headers = sorted(CSRC.glob("*.cuh"))
    err, prog = nvrtc.nvrtcCreateProgram(src, path.name.encode(), len(headers),
                                         [h.read_bytes() for h in headers], [h.name.encode() for h in headers])
    for name in NAME_EXPRESSIONS.get(path.name, []):
        nvrtc.nvrtcAddNameExpression(prog, name.encode())
    opts = [b"--std=c++17", b"-fmad=false", b"--gpu-architecture=sm_90", b"-I" + str(CSRC).encode()]
    opts += [b"-I" + str(p).encode() for p in _cuda_include_dirs()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    ok = err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    print(f"{path.name}: {'ok' if ok else 'FAILED'}")
    if log.strip(b"\x00 \n"):
        print(log.decode(errors="replace"))
    return ok


if __name__ == "__main__":
    files = [Path(a) for a in sys.argv[1:]] or sorted(CSRC.glob("*.cu"))
    sys.exit(0 if all(check(f) for f in files) else 1)
