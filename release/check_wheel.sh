#!/usr/bin/env bash
# `make check-wheel`: a built wheel works on its own. In a new, empty virtual environment (away
# from the source tree, so nothing imports from pysrc/): pip install the wheel (which pulls its
# pinned torch and every dependency), import radixserve._C from the installed package and check
# the ops it registers, print `radixserve env`, then serve the default model on the CPU, send one
# request, and run `radixserve bench serving` (the [bench] extra) against that server. Exit
# status 0 only if all of it worked.
#
#   bash release/check_wheel.sh [dist/radixserve-*.whl]    (default: the newest in dist/)
#   PY=python3.12 ...            the interpreter for the venv (must match the wheel's cp tag)
#   CHECK_GPU=1 ...              also require the kernels in use on this machine's GPU
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=$(realpath "${1:-$(ls -t dist/radixserve-*.whl | head -1)}")
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/radixserve-wheel-check.XXXXXX)
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

echo "== install $(basename "$WHEEL") into a new venv ($WORK/venv)"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/pip" install -q ${PIP_ARGS:-} "$WHEEL[bench]"
cd "$WORK"                                   # nothing of the checkout on sys.path from here on

echo "== import radixserve._C from the installed package"
"$V/python" - <<'PY'
import os, sys
import torch
import radixserve, radixserve._C as C
from radixserve.ops.kernel_status import EXTENSION_OPS, missing_extension_ops
assert radixserve.__file__.startswith(sys.prefix), radixserve.__file__
missing = missing_extension_ops()
assert not missing, f"ops missing: {missing}"
print(f"{C.__file__}: archs {C.CUDA_ARCHS}, torch {torch.__version__}, {len(EXTENSION_OPS)} ops")
if os.environ.get("CHECK_GPU") == "1":
    from radixserve.ops.kernel_status import kernel_status
    st = kernel_status("cuda")
    assert st.in_use, st.reason
    print("kernels in use:", st.reason)
PY
"$V/radixserve" env

echo "== serve the default model on the CPU (port $PORT), one request"
"$V/radixserve" serve --device cpu --port "$PORT" >"$WORK/server.log" 2>&1 &
SERVER=$!
"$V/python" - "$PORT" "$SERVER" "$WORK/server.log" <<'PY'
import json, os, sys, time, urllib.request
port, pid, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 600
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=5).read()
        break
    except OSError:
        if time.time() > deadline or not os.path.exists(f"/proc/{pid}"):
            sys.exit("server did not come up:\n" + open(log).read()[-4000:])
        time.sleep(1)
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                   "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
text = out["choices"][0]["text"]
assert out["usage"]["completion_tokens"] > 0 and text.strip(), out
print(f"served: {text!r} ({out['usage']['completion_tokens']} tokens)")
PY

echo "== radixserve bench serving from the installed wheel, against that server"
"$V/radixserve" bench serving --port "$PORT" --backend completions --dataset random \
    --num-prompts 4 --random-input-len 16 --random-output-len 4 --disable-tqdm \
    --output-file "$WORK/bench.jsonl" --no-plots | tail -5
"$V/python" -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); \
assert r['completed'] == 4 and r['median_ttft_ms'] > 0, r; print('bench keys ok:', len(r))" \
    "$WORK/bench.jsonl"
echo "wheel check passed: $(basename "$WHEEL")"
