#!/usr/bin/env bash
# One call on the GPU machine: environment, NVRTC compile check, `pytest -m gpu`, the quick perf set,
# and the demo on CUDA. Everything lands in $OUT/gpu-check.tar.gz (the device tool returns few files).
#   bash tools/gpu-check.sh [all|tests|perf|demo] [extra pytest args...]
set -u
what=${1:-all}; shift || true
cd "$(dirname "$0")/.."
[ -f .devwheels/offline-env.sh ] && source .devwheels/offline-env.sh
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/kmesh-gpu-check}; logs=$(mktemp -d)
mkdir -p "$logs/perf"
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, cupy; print(sys.version.split()[0], 'torch', torch.__version__, 'cupy', cupy.__version__)"
  python3 -c "import warp; print('warp', warp.__version__)" 2>&1 | tail -1
  python3 -c "import kvikio; print('kvikio', kvikio.__version__)" 2>&1 | tail -1
  git log --oneline -1 2>/dev/null; git status --short 2>/dev/null | head -20
} > "$logs/env.txt" 2>&1
cat "$logs/env.txt"
rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rfEs "$@" 2>&1 | tee "$logs/pytest-gpu.log"
  rc=${PIPESTATUS[0]}
  tail -3 "$logs/pytest-gpu.log"
fi
if [ "$what" = all ] || [ "$what" = perf ]; then
  # the interpreter's speed per CPU before and after: virtual CPUs of the lent machine run at full or
  # about half speed for seconds at a time, which moves every host-bound figure below
  python3 tools/cpu_speed_map.py --rounds 3 > "$logs/perf/cpu_speed_map_before.txt" 2>&1
  for script in perf/bench_place.py perf/run_sha256.py perf/run_ssd_routes.py perf/bench_service.py; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .py)
    echo "== $script"
    timeout 420 python3 "$script" --device cuda --out "$logs/perf" > "$logs/perf/$name.txt" 2>&1
    echo "exit $?" >> "$logs/perf/$name.txt"
    tail -40 "$logs/perf/$name.txt"
  done
  python3 tools/cpu_speed_map.py --rounds 3 > "$logs/perf/cpu_speed_map_after.txt" 2>&1
fi
if [ "$what" = all ] || [ "$what" = demo ]; then
  timeout 300 python3 -m kmesh_vllm.cli demo --device cuda --preset qwen2.5-0.5b-shape --json "$logs/demo-cuda.json" \
    2>&1 | tee "$logs/demo-cuda.txt"
fi
mkdir -p "$out" && tar -C "$logs" -czf "$out/gpu-check.tar.gz" . && echo "logs: $out/gpu-check.tar.gz"
exit $rc
