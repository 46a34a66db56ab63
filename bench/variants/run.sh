#!/usr/bin/env bash
# Builds SWEEP (sample_sweep.cu or extend_sweep.cu) against every OUT/var_*/ in parallel, then
# runs each in turn (one process per variant, same GPU, back to back). See README.md.
#   bash bench/variants/run.sh OUT SWEEP [extra nvcc flags]
set -u
OUT=$1; SWEEP=$2; shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
for d in "$OUT"/var_*/; do
  d=${d%/}; name=${d##*/var_}
  ( nvcc -O3 -std=c++17 -arch=sm_90a "$@" -DVARIANT="\"$name\"" -I"$d" -I"$HERE/../../csrc/include" \
      -o "$d/sweep" "$HERE/$SWEEP" > "$d/build.txt" 2>&1 || echo "build of $name failed" ) &
done
wait
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0      # BUILD_ONLY=1: build the variants, run none
for d in "$OUT"/var_*/; do timeout 120 "${d}sweep" || cat "${d}build.txt"; done
