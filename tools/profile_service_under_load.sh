#!/bin/bash
# Where the cache service's CPU goes with 16 clients restoring concurrently: py-spy samples the
# service process only (found by its kmesh-reaper thread) while tools/probe_service_concurrency.py
# runs, from a few seconds after it started to its end, and the samples are summed per function
# (self and inclusive) and per thread, on the machine (the raw samples stay there): all of them,
# then those of restore requests alone (stacks through _serve_binary), which leaves out the
# registrations and anything else the window catches.
#
# Needs py-spy (a wheel: pip install --no-index py_spy-*.whl). Usage on the GPU machine:
#   [CLIENTS=16 ROUNDS=1500] bash tools/profile_service_under_load.sh [seconds=60] [rate=100] [extra py-spy flags, e.g. --native]
# (sampling stops at the given seconds or when the service exits, whichever is first)
# Writes $OUT/service_load_profile.txt (or perf/out/...).
set -u
SECONDS_TO_SAMPLE=${1:-60}
RATE=${2:-100}
shift 2 2>/dev/null || shift $#
OUTDIR=${OUT:-perf/out}
mkdir -p "$OUTDIR"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
python tools/probe_service_concurrency.py --clients ${CLIENTS:-16} --reply-spin auto --rounds ${ROUNDS:-1500} --repeats 1 \
  > "$OUTDIR/service_load_probe.txt" 2>&1 &
PROBE=$!
P=""
for _ in $(seq 1 600); do
  for p in $(pgrep -f "multiprocessing" 2>/dev/null); do
    if grep -qs kmesh-reaper /proc/$p/task/*/comm; then P=$p; break; fi
  done
  [ -n "$P" ] && break
  sleep 0.1
done
if [ -z "$P" ]; then echo "service process not found"; wait $PROBE; exit 1; fi
sleep 2  # past the service's start
RAW=$(mktemp)
py-spy record --pid "$P" --rate "$RATE" --duration "$SECONDS_TO_SAMPLE" --format raw --threads "$@" -o "$RAW" \
  > "$OUTDIR/service_load_pyspy_log.txt" 2>&1
wait $PROBE
python - "$RAW" "$OUTDIR/service_load_profile.txt" "$OUTDIR/service_load_probe.txt" <<'PY'
import collections, re, sys
raw, out, probe = sys.argv[1:4]

def tables(keep):
    self_t, incl, threads, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in open(raw):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit() or not keep(stack):
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[re.sub(r"\d+", "N", frames[0])] += n
        self_t[frames[-1]] += n
        for f in {re.sub(r":\d+\)$", ")", f) for f in frames[1:]}:  # per function, lines merged
            incl[f] += n
    lines = [f"samples: {total}", "", "by thread (numbers as N):"]
    total = max(total, 1)
    lines += [f"  {100 * v / total:6.2f}%  {k}" for k, v in threads.most_common(12)]
    lines += ["", "self (leaf frame, by line):"]
    lines += [f"  {100 * v / total:6.2f}%  {k}" for k, v in self_t.most_common(45)]
    lines += ["", "inclusive (by function):"]
    lines += [f"  {100 * v / total:6.2f}%  {k}" for k, v in incl.most_common(60)]
    return "\n".join(lines) + "\n"


with open(out, "w") as f:
    f.write(open(probe).read() + "\n")
    f.write("=== every sample of the service process (on CPU)\n" + tables(lambda s: True))
    f.write("\n=== samples of restore requests (stacks through _Service._serve_binary)\n"
            + tables(lambda s: "_serve_binary" in s))
print(open(out).read()[:8000])
PY
rm -f "$RAW"
