#!/usr/bin/env bash
# Run a command with every CUDA process it starts as a client of a private MPS control daemon, then
# stop the daemon. Only processes that inherit the pipe directory below join it; nothing about the
# GPU itself is changed (compute mode, clocks and the like stay as they are), and the daemon is
# quit on the way out even when the command fails.
#   bash tools/with_mps.sh python3 perf/bench_service.py --device cuda
set -u
command -v nvidia-cuda-mps-control > /dev/null || { echo "with_mps: nvidia-cuda-mps-control not found" >&2; exit 3; }
dir=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "with_mps: the control daemon did not start" >&2; exit 3; }
stop() { echo quit | nvidia-cuda-mps-control; sleep 1; tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" >&2 2>/dev/null; }
trap stop EXIT
"$@"
