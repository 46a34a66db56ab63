#!/usr/bin/env bash
# One device call: install the carried wheels, build radixserve._C for sm_90a, then run the
# stage(s) named in $@ with logs under $OUT. Used from the device tool as
#   bash bench/gpu_session.sh build tests kernels
# The GGUF of the default model travels in parts (.gguf/part.aa, .ab, ...: with the tracked tree
# it is over one call's 64 MiB); stage `gguf` copies whichever part is carried to /tmp and joins
# them once all $GGUF_PARTS are there.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/pysrc:${PYTHONPATH:-}
export RADIXSERVE_CACHE_DIR=/tmp/rscache
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
# issue 13's kernel peer: FlashInfer from the carried .whl-fi/ (bench/flashinfer_peer.py's
# docstring: the wheels and its prebuilt sm_90a decode and sampling modules), into this shell
flashinfer_env() {
  [ -d .whl-fi ] || return 0
  if [ ! -d /tmp/fisite/flashinfer ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fisite .whl-fi/*.whl \
      .whl/apache_tvm_ffi-*.whl 2>&1 | tail -2
    tar -xzf .whl-fi/flashinfer-*-aot-sm90a-cu130.tar.gz -C /tmp/fisite
  fi
  export PYTHONPATH=/tmp/fisite:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws \
    TVM_FFI_CACHE_DIR=/tmp/fiws/tvm-ffi FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 \
    CUDA_HOME=/usr/local/cuda
  export PATH=$(python3 -c 'import ninja; print(ninja.BIN_DIR)'):/usr/local/cuda/bin:$PATH
}
# sampling.cuh's carried baselines (.ssweep-base/: sampling.cuh = issue 13's baseline 7650ca1,
# sampling_head.cuh = the previous commit's) as the variants base and head under $1
carried_sampling_bases() {
  mkdir -p "$1/var_base/radixserve" "$1/var_head/radixserve"
  cp .ssweep-base/sampling.cuh "$1/var_base/radixserve/"
  cp .ssweep-base/sampling_head.cuh "$1/var_head/radixserve/sampling.cuh"
}
# csrc/harness/test_$2.cu built into $1 in the background (its log: $1/harness_$2.txt); then run
# after a `wait`, printing the last $3 lines (or the build log where it did not build)
build_harness() {
  nvcc -O2 -std=c++17 -arch=sm_90a -Icsrc/include -Icsrc/harness "csrc/harness/test_$2.cu" \
    -o "$1/test_$2" > "$1/harness_$2.txt" 2>&1 &
}
run_harness() { (timeout 200 "$1/test_$2" || cat "$1/harness_$2.txt") 2>&1 | tail -"$3"; }
# radixserve._C for sm_90a, in place; the last $1 lines of the build's output
build_ext() {
  RADIXSERVE_CUDA=1 RADIXSERVE_CUDA_ARCHS=90a MAX_JOBS=16 python3 setup.py build_ext --inplace \
    2>&1 | tail -"$1"
}
# the GPU tests (not the slow ones), the log in $1; the last $2 lines printed
gpu_tests() {
  # (GPU_TESTS_ARGS: more pytest arguments, e.g. --ignore of a file that stage oneshot runs)
  python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/gpu ${GPU_TESTS_ARGS:-} 2>&1 \
    | tee "$1" | tail -"$2"
}
for stage in "$@"; do
  echo "=== stage $stage" | tee -a "$OUT/log.txt"
  case $stage in
    build)
      # an extension built by an earlier call on this warm machine from the same csrc/ is reused
      # (/tmp/rs_C, keyed by a hash of csrc/ and setup.py)
      # (an extension left in pysrc/ by an earlier call from other sources is removed first: its
      # key is in pysrc/radixserve/.C_key; without that, a stale one went on under the new key)
      key=$(find csrc setup.py -type f | sort | xargs sha1sum | sha1sum | cut -c1-16)
      if [ "$(cat pysrc/radixserve/.C_key 2>/dev/null)" != "$key" ]; then
        rm -f pysrc/radixserve/_C*.so pysrc/radixserve/.C_key
      fi
      if ! ls pysrc/radixserve/_C*.so >/dev/null 2>&1 && ls /tmp/rs_C/$key/_C*.so >/dev/null 2>&1; then
        cp /tmp/rs_C/$key/_C*.so pysrc/radixserve/ && echo "ext reused ($key)" | tee -a "$OUT/log.txt"
      fi
      if ! ls pysrc/radixserve/_C*.so >/dev/null 2>&1; then
        build_ext 20 | tee -a "$OUT/log.txt"
      fi
      if ls pysrc/radixserve/_C*.so >/dev/null 2>&1; then
        echo "$key" > pysrc/radixserve/.C_key
        mkdir -p /tmp/rs_C/$key && cp pysrc/radixserve/_C*.so /tmp/rs_C/$key/
      fi
      python3 -c "import torch, radixserve._C; print('ext ok', torch.__version__)" 2>&1 | tee -a "$OUT/log.txt" ;;
    wheel)
      # issue 14: the release wheel for this image's Python and torch, built from the carried
      # sdist (dist/), then the GPU tests against the installed wheel, not the source tree
      sdist=$(ls dist/radixserve-*.tar.gz | head -1)
      rm -rf dist/*.whl build/wheel-raw
      PATH=/tmp/site/bin:$PATH SOURCE=$sdist MAX_JOBS=16 PYTHONS=python3 bash release/wheel.sh \
        2>&1 | tail -40 | tee -a "$OUT/log.txt"
      cp dist/radixserve-*.whl dist/radixserve-*.json "$OUT/" 2>/dev/null
      # installed as pip installs it (the image's torch lives outside any venv's reach, so the
      # wheel goes into its own site directory, ahead of the carried dependencies)
      rm -rf /tmp/wheelsite
      python3 -m pip install -q --no-deps --target /tmp/wheelsite dist/radixserve-*.whl 2>&1 | tail -3
      (cd /tmp && PYTHONPATH=/tmp/wheelsite:/tmp/site python3 -m radixserve env 2>&1 | tee -a "$OUT/log.txt")
      rm -rf /tmp/wheelroot && mkdir -p /tmp/wheelroot && cp -r tests pyproject.toml /tmp/wheelroot/
      (cd /tmp/wheelroot && RADIXSERVE_TEST_INSTALLED=1 PYTHONPATH=/tmp/wheelsite:/tmp/site \
        python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/gpu 2>&1 \
        | tee "$OUT/gpu_tests_wheel.txt" | tail -15) ;;
    gguf)
      # the parts carried by this and earlier calls on this warm machine; joined once all
      # ${GGUF_PARTS:-2} are there (the part count: the tracked tree leaves ~25 MiB a call)
      mkdir -p /tmp/gguf
      cp .gguf/part.* /tmp/gguf/ 2>/dev/null
      ls -la /tmp/gguf | tee -a "$OUT/log.txt"
      if [ "$(ls /tmp/gguf/part.* 2>/dev/null | wc -l)" -ge "${GGUF_PARTS:-2}" ]; then
        cat /tmp/gguf/part.* > "$GGUF"
        sha256sum "$GGUF" | tee -a "$OUT/log.txt"
      fi ;;
    tests)
      gpu_tests "$OUT/gpu_tests.txt" 15 ;;
    oneshot)
      # the one-shot all-reduce's tests on their own clock: a rank left waiting must not eat the
      # call
      timeout "${ONESHOT_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_oneshot_allreduce_cuda.py 2>&1 | tee "$OUT/oneshot-tests.txt" | tail -8
      echo "oneshot rc ${PIPESTATUS[0]}" ;;
    grammar)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_constrained_cuda.py \
        tests/gpu/test_overlap_cuda.py tests/gpu/test_sampling.py 2>&1 | tee "$OUT/gpu_grammar_tests.txt" | tail -15 ;;
    structured)
      python3 bench/structured.py --device cuda --preset llama-3.1-8b --batch-size 64 \
        --out "$OUT/structured-h200-8b.json" 2>&1 | grep -v "batch\." | tail -40 | tee "$OUT/structured.txt" ;;
    kernels)
      # with FlashInfer as the same-process peer when .whl-fi/ was carried ($FI_PARTS: which of
      # decode, extend, sampling, topk, tensor_cores; default decode,sampling)
      (flashinfer_env; python3 bench/kernels.py --flashinfer-parts "${FI_PARTS:-decode,sampling}" 2>&1 \
        | tee "$OUT/kernels.txt" | tail -60)
      cp bench/results/kernels-h200.json "$OUT/" 2>/dev/null ;;
    model)
      RADIXSERVE_TEST_GGUF=$GGUF python3 -m pytest -q -s -p no:cacheprovider -m slow tests/gpu \
        2>&1 | tee "$OUT/gpu_model.txt" | tail -15 ;;
    offline)
      python3 bench/offline.py --device cuda --num-prompts 64 --input-len 256 --output-len 256 \
        --model-path "$GGUF" --out "$OUT/offline-h200.json" 2>&1 | tail -8 | tee -a "$OUT/log.txt"
      python3 bench/offline.py --device cuda --num-prompts 64 --input-len 256 --output-len 256 \
        --model-path "$GGUF" --disable-cuda-graph --out "$OUT/offline-h200-no-graph.json" 2>&1 \
        | tail -8 | tee -a "$OUT/log.txt" ;;
    serve)
      python3 -m radixserve.launch_server --model-path "$GGUF" --port 30123 > "$OUT/serve.txt" 2>&1 &
      for i in $(seq 120); do curl -sf localhost:30123/health >/dev/null && break; sleep 1; done
      curl -s localhost:30123/v1/chat/completions -H 'content-type: application/json' -d \
        '{"messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0,"max_tokens":24}' \
        | tee "$OUT/serve_reply.json"; echo
      kill %1; sleep 1; tail -5 "$OUT/serve.txt" ;;
    decode)
      python3 bench/decode_steps.py --preset llama-3.1-8b --out "$OUT/decode-steps-h200.json" \
        2>&1 | tee "$OUT/decode.txt" | tail -30 ;;
    decodeqwen3)
      # Qwen3-8B's decode steps: its per-head q/k norms run as two extra norm kernels (and a
      # copy each) per layer, outside the fused batch-1 paths; ~2 min
      python3 bench/decode_steps.py --preset qwen3-8b --out "$OUT/decode-steps-qwen3-h200.json" \
        2>&1 | tee "$OUT/decode-qwen3.txt" | tail -30 ;;
    serving)
      python3 bench/serving.py --preset llama-3.1-8b --compare overlap --dataset random \
        --random-input-len 1024 --random-output-len 1024 --num-prompts 200 --request-rate 16 \
        --server-log-dir "$OUT/serving-logs" --output-file "$OUT/serving-h200.json" 2>&1 \
        | tee "$OUT/serving.txt" | tail -40 ;;
    servab)
      # the server's step orders on the serving workload above (--compare schedule: alternate,
      # --enable-mixed-chunk, --step-order prefill-first), with each run's server_steps; ~5 min
      python3 bench/serving.py --preset llama-3.1-8b --compare schedule --dataset random \
        --random-input-len 1024 --random-output-len 1024 --num-prompts 200 --request-rate 16 \
        --server-log-dir "$OUT/servab-logs" --output-file "$OUT/servab-h200.json" 2>&1 \
        | tee "$OUT/servab.txt" | grep -E "^---|Output token|TTFT|TPOT|Server" ;;
    offline8b)
      python3 bench/offline.py --device cuda --preset llama-3.1-8b --num-prompts 256 \
        --input-len 1024 --output-len 256 --hf-mode generate_batch \
        --out "$OUT/offline-h200-8b-vs-hf-generate-batch.json" 2>&1 | tee "$OUT/offline8b.txt" \
        | grep -v "it/s" | tail -12 ;;
    sweep)
      python3 bench/serving.py --preset llama-3.1-8b --compare overlap --dataset random \
        --random-input-len 1024 --random-output-len 256 --num-prompts 512 \
        --sweep-concurrency 1,2,4,8,16,32,64,128,256 --sweep-prompts-per-concurrency 2 \
        --server-log-dir "$OUT/sweep-logs" --output-file "$OUT/sweep-h200.json" 2>&1 \
        | tee "$OUT/sweep.txt" | tail -30 ;;
    arrivals)
      # issue 33's arrival-bound workload (200 prompts at 16 req/s, lengths up to 1024/1024 as
      # SGLang's client draws them by default) against self-launched servers, one per
      # $ARRIVAL_CONFIGS entry (name:flags), with py-spy sampling the first server's threads
      # (collapsed stacks, one line per stack, under $OUT) for where the loop's time goes
      P=/tmp/preset-8b
      python3 -m radixserve bench presets llama-3.1-8b --out $P > /dev/null
      first=1
      for cfg in ${ARRIVAL_CONFIGS:-alternate: mixed:--enable-mixed-chunk}; do
        name=${cfg%%:*}; extra=${cfg#*:}; extra=${extra//,/ }
        python3 -m radixserve.launch_server --model-path $P --load-format dummy --port 30124 \
          $extra > "$OUT/arrivals-$name-server.log" 2>&1 &
        pid=$!
        for i in $(seq 300); do curl -sf localhost:30124/health >/dev/null && break; sleep 1; done
        spy=
        if [ $first = 1 ] && [ -x /tmp/site/bin/py-spy ]; then
          /tmp/site/bin/py-spy record --pid $pid --threads --nonblocking -r 200 -f raw \
            -o "$OUT/arrivals-$name-pyspy.txt" -d 40 > /dev/null 2>&1 & spy=$!
        fi
        python3 bench/serving.py --port 30124 --dataset random --random-range-ratio 0 \
          --random-input-len 1024 --random-output-len 1024 --num-prompts 200 --request-rate 16 \
          --disable-tqdm --no-plots --output-file "$OUT/arrivals-$name.json" 2>&1 \
          | grep -E "^(Succ|Failed|Bench|Total|Output|Median|Mean|P99|Server|error)" \
          | sed "s/^/[$name] /"
        [ -n "$spy" ] && wait $spy
        kill $pid; wait $pid 2>/dev/null; first=0
      done ;;
    gemmfp8)
      # decode-batch GEMMs of the 8B shape: cuBLAS bf16 against the bf16 floor, our
      # fp8_skinny_linear (<= 16 rows) and torch._scaled_mm rowwise against the FP8 floor
      python3 bench/gemm_decode.py --preset llama-3.1-8b --fp8 --no-triton \
        --batch-sizes 1,2,4,8,16,32,64,128 --iters 40 --out "$OUT/gemm-decode-fp8.json" 2>&1 \
        | tee "$OUT/gemmfp8.txt" | tail -60 ;;
    fp8speed)
      # issue 35's decode and prefill points: bf16, FP8 weights, FP8 weights + FP8 KV, one
      # process, the Llama-3.1-8B shape; ~3 min
      python3 bench/fp8_speed.py --preset llama-3.1-8b --out "$OUT/fp8-speed.json" 2>&1 \
        | tee "$OUT/fp8speed.txt" | tail -45 ;;
    ablation)
      # issues 33/35: what the norms, rope+store and decode attention cost inside the real
      # batch-1 / batch-8 step, bf16 and FP8 weights (bench/decode_ablation.py); ~2 min
      python3 bench/decode_ablation.py --preset llama-3.1-8b --configs bf16,fp8 \
        --out "$OUT/decode-ablation.json" 2>&1 | tee "$OUT/ablation.txt" | tail -40 ;;
    dashoverhead)
      # issue 41's cost bar on a GPU server (the loop is the busy part there, unlike the 2-core
      # CPU where the client competes with it): the Llama-3.1-8B shape, dummy weights, 64
      # streaming clients, the emulated page open / closed in alternating phases; ~3 min
      python3 -c "import sys; sys.path.insert(0, 'bench'); from presets import build_preset; \
build_preset('llama-3.1-8b', '/tmp/preset-llama-3.1-8b')"
      python3 bench/dashboard_overhead.py --phases ${DASH_PHASES:-16} --phase-s 8 \
        --warmup-s 15 --concurrency 64 --max-tokens 256 --log "$OUT/dashoverhead-server.log" \
        --out "$OUT/dashboard-overhead-gpu.json" -- --model-path /tmp/preset-llama-3.1-8b \
        --load-format dummy 2>&1 | tee "$OUT/dashoverhead.txt" | tail -25 ;;
    fp8kvattn)
      # issue 35's FP8 KV point: decode attention at batch 256 x 1k over FP8 pages against copy
      # bandwidth in FP8 bytes (and the bf16 pool beside it)
      timeout 200 python3 bench/attention_bench.py --kv-cache-dtype fp8_e4m3 \
        --json "$OUT/attention-fp8kv.json" 2>&1 | tee "$OUT/fp8kvattn.txt" | tail -25 ;;
    servfp8)
      # issue 35's serving point: bf16 / FP8 / FP8 + FP8 KV servers, random 1k/1k at 16 req/s,
      # SGLang's default lengths (range ratio 0) then fixed 1024/1024 (range ratio 1)
      for r in ${SERVFP8_RATIOS:-0 1}; do
        python3 bench/serving.py --preset llama-3.1-8b --compare fp8 --dataset random \
          --random-input-len 1024 --random-output-len 1024 --random-range-ratio $r \
          --num-prompts 200 --request-rate 16 --no-plots --disable-tqdm \
          --server-log-dir "$OUT/servfp8-logs-$r" --output-file "$OUT/serving-fp8-r$r.json" 2>&1 \
          | tee "$OUT/servfp8-r$r.txt" | grep -E "^---|Output token|Succ|Failed|ratio|_over_"
      done ;;
    serve70b)
      # issue 35's scale point: the Llama-3.1-70B shape, FP8 weights and FP8 KV, on this one GPU;
      # the serving run at SGLang's published config must finish without a failed request
      python3 bench/serving.py --preset llama-3.1-70b-fp8 --launch \
        --server-args "--kv-cache-dtype fp8_e4m3" --dataset random --random-input-len 1024 \
        --random-output-len 1024 --num-prompts ${N70B:-200} --request-rate 16 --no-plots \
        --disable-tqdm --server-log-dir "$OUT/serve70b-logs" \
        --output-file "$OUT/serving-70b-fp8.json" 2>&1 | tee "$OUT/serve70b.txt" | tail -30
      grep -h "KV pool" "$OUT"/serve70b-logs/* | head -3 ;;
    tp)
      # issue 42, on a host of N >= 2 GPUs (TP_SIZES, default "2 4 8", those above the GPU count
      # skipped): the TP GPU tests; small all-reduces, NCCL against our one-shot kernel; decode
      # steps of the 8B shape at TP=1 and TP=N; the 70B shape in bf16 at TP=N on SGLang's
      # published serving config (and Qwen3-32B at the smallest N)
      gpus=$(nvidia-smi -L | wc -l)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_cuda.py \
        tests/gpu/test_oneshot_allreduce_cuda.py 2>&1 | tee "$OUT/tp-tests.txt" | tail -5
      python3 bench/allreduce_bench.py 2>&1 | tee "$OUT/allreduce.txt" | tail -30
      python3 bench/decode_steps.py --preset llama-3.1-8b --batch-sizes 1,64,256 \
        --modes overlap,eager --out "$OUT/decode-steps-tp1.json" 2>&1 | grep -E "ms/step"
      first=1
      for n in ${TP_SIZES:-2 4 8}; do
        [ "$n" -gt "$gpus" ] && continue
        python3 bench/decode_steps.py --preset llama-3.1-8b --batch-sizes 1,64,256 \
          --modes overlap --tp-size $n --out "$OUT/decode-steps-tp$n.json" 2>&1 | grep -E "ms/step"
        python3 bench/serving.py --preset llama-3.1-70b --launch --server-args "--tp-size $n" \
          --dataset random --random-input-len 1024 --random-output-len 1024 --num-prompts 200 \
          --request-rate 16 --no-plots --disable-tqdm --server-log-dir "$OUT/tp$n-70b-logs" \
          --output-file "$OUT/serving-70b-tp$n.json" 2>&1 | grep -E "^(Succ|Failed|Output|Median ITL|Duration)"
        if [ $first = 1 ]; then
          python3 bench/serving.py --preset qwen3-32b --launch --server-args "--tp-size $n" \
            --dataset random --random-input-len 1024 --random-output-len 1024 --num-prompts 200 \
            --request-rate 16 --no-plots --disable-tqdm --server-log-dir "$OUT/tp$n-32b-logs" \
            --output-file "$OUT/serving-qwen3-32b-tp$n.json" 2>&1 | grep -E "^(Succ|Failed|Output)"
          first=0
        fi
      done ;;
    accept33)
      # issue 33's acceptance runs: per server config of $ACCEPT_CONFIGS (name:flags; default
      # overlap on and off), our client at SGLang's published config (200 prompts at 16 req/s,
      # random 1024/1024 with SGLang's default range ratio 0.0) and at fixed 1024/1024 lengths
      # (range ratio 1), then on the first config SGLang's own client (.sgl/bench_serving.py,
      # git-ignored: see .sgl/README) on both workloads, --dataset-name random with the same
      # seed, so the same lengths and arrival gaps
      P=/tmp/preset-8b
      python3 -m radixserve bench presets llama-3.1-8b --out $P > /dev/null
      first=1
      for cfg in ${ACCEPT_CONFIGS:-overlap: no-overlap:--disable-overlap-schedule}; do
        name=${cfg%%:*}; extra=${cfg#*:}; extra=${extra//,/ }
        python3 -m radixserve.launch_server --model-path $P --load-format dummy --port 30124 \
          $extra > "$OUT/accept33-$name-server.log" 2>&1 &
        pid=$!
        for i in $(seq 300); do curl -sf localhost:30124/health >/dev/null && break; sleep 1; done
        for wl in published:0 fixed:1; do
          w=${wl%%:*}; r=${wl#*:}
          python3 bench/serving.py --port 30124 --dataset random --random-range-ratio $r \
            --random-input-len 1024 --random-output-len 1024 --num-prompts 200 --request-rate 16 \
            --disable-tqdm --no-plots --output-file "$OUT/serving-$name-$w.json" 2>&1 \
            | grep -E "^(Succ|Failed|Bench|Total|Output|Median|Mean|Server|Floor|Duration|error)" \
            | sed "s/^/[$name $w] /"
          if [ $first = 1 ] && [ -f .sgl/bench_serving.py ]; then
            HF_HUB_OFFLINE=1 python3 .sgl/bench_serving.py --backend sglang --host 127.0.0.1 --port 30124 \
              --dataset-name random --dataset-path .sgl/sharegpt_small.json --tokenize-prompt \
              --tokenizer $P --model $P --random-input-len 1024 --random-output-len 1024 \
              --random-range-ratio $r --num-prompts 200 --request-rate 16 --disable-tqdm \
              --output-file "$OUT/sglang-client-$name-$w.jsonl" 2>&1 \
              | tee "$OUT/sglang-client-$name-$w.txt" \
              | grep -E "^(Succ|Bench|Total|Output|Median|Mean)" | sed "s/^/[$name $w sglang-client] /"
          fi
        done
        kill $pid; wait $pid 2>/dev/null; first=0
      done ;;
    abbuild)
      # radixserve._C of the carried older tree .ab_base/ (`git archive REV | tar -x -C .ab_base`),
      # built in the background (log: $OUT/ab-build.txt); stage ab waits for it
      (cd .ab_base && RADIXSERVE_CUDA=1 RADIXSERVE_CUDA_ARCHS=90a MAX_JOBS=16 python3 setup.py \
        build_ext --inplace > "$OUT/ab-build.txt" 2>&1) &
      AB_BUILD=$! ;;
    ab)
      # same-run A/B of the working tree (head) against .ab_base/ (base), Llama-3.1-8B shape,
      # dummy weights: decode steps at batch 1 and 64 (overlap loop, CUDA graphs), then SGLang's
      # published serving config (200 prompts at 16 req/s, random 1024/1024, range ratio 0), each
      # tree with its own Python and _C, head and base alternating; ~6 min
      [ -n "${AB_BUILD:-}" ] && wait "$AB_BUILD"
      tail -2 "$OUT/ab-build.txt" 2>/dev/null
      ab_py() { if [ "$1" = base ]; then echo "/tmp/site:$PWD/.ab_base/pysrc"; else echo "$PYTHONPATH"; fi; }
      for t in ${AB_ORDER:-head base}; do
        PYTHONPATH=$(ab_py $t) timeout 200 python3 bench/decode_steps.py --preset llama-3.1-8b \
          --batch-sizes 1,64 --modes overlap --out "$OUT/ab-decode-$t.json" 2>&1 \
          | grep -E "ms/step|floor|Error|error" | sed "s/^/[$t decode] /"
      done
      for t in ${AB_ORDER:-head base}; do
        PYTHONPATH=$(ab_py $t) timeout 240 python3 bench/serving.py --preset llama-3.1-8b --launch \
          --dataset random --random-input-len 1024 --random-output-len 1024 --num-prompts 200 \
          --request-rate 16 --no-plots --disable-tqdm --server-log-dir "$OUT/ab-serving-logs-$t" \
          --output-file "$OUT/ab-serving-$t.json" 2>&1 \
          | grep -E "^(Succ|Failed|Output|Median ITL|Duration|Floor|error)" | sed "s/^/[$t serving] /"
      done ;;
    spec)
      # issue 39: the speculation GPU tests; the verify-step cost at the Llama-3.1-8B shape
      # (dummy weights, batch 1 and 4, k = 4); the copy workload on the default model's real
      # weights when the GGUF is there (stage gguf), concurrency 1 and 4, on vs off
      # (SPEC_COPY_ONLY=1: the copy workload alone)
      if [ -z "${SPEC_COPY_ONLY:-}" ]; then
        python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_cuda.py 2>&1 \
          | tee "$OUT/spec-tests.txt" | tail -5
        timeout 300 python3 bench/spec_decode.py --preset llama-3.1-8b --batch-sizes 1,4 \
          --out "$OUT/spec-cost-8b.json" 2>&1 | grep -E "^batch|Error|error" | tee "$OUT/spec.txt"
      fi
      if [ -f "$GGUF" ]; then
        for n in ${SPEC_DRAFT_TOKENS:-5 8}; do
          echo "--num-draft-tokens $n" | tee -a "$OUT/spec.txt"
          timeout 200 python3 bench/spec_decode.py --model-path "$GGUF" --device cuda \
            --num-draft-tokens $n --out "$OUT/spec-copy-n$n.json" 2>&1 \
            | grep -E "^spec|^concurrency|Error|error" | tee -a "$OUT/spec.txt"
        done
      fi
      # the gate on SGLang's published serving config (random 1k/1k at 16 req/s): on vs off
      [ -n "${SPEC_SERVING:-}" ] && python3 bench/serving.py --preset llama-3.1-8b --compare spec \
        --dataset random --random-input-len 1024 --random-output-len 1024 --num-prompts 200 \
        --request-rate 16 --no-plots --disable-tqdm --server-log-dir "$OUT/spec-serving-logs" \
        --output-file "$OUT/spec-serving.json" 2>&1 \
        | grep -E "^---|Output token|Succ|Failed|over_off" | tee -a "$OUT/spec.txt" ;;
    soak)
      # the CPU soak of issue 10 on the device's 16 cores (the model on the CPU, as CI would)
      python3 bench/soak.py --num-requests "${SOAK_REQUESTS:-10000}" \
        --concurrency "${SOAK_CONCURRENCY:-256}" --server-args "--model-path $GGUF --device cpu" \
        --server-log "$OUT/soak-server.log" --output-file "$OUT/soak.json" 2>&1 \
        | tee "$OUT/soak.txt" | tail -30 ;;
    ssweep)
      # bitmask_sample A/B (bench/variants/sample_sweep.cu): the header at git revision
      # $SSWEEP_BASE (default HEAD; or a carried .ssweep-base/sampling.cuh where the copy has no
      # git history, as on the device: bench/variants/README.md says how to prepare it) against
      # the working tree's, built side by side, same run
      V=/tmp/ssweep; rm -rf $V
      if [ -f .ssweep-base/sampling.cuh ]; then
        mkdir -p $V/var_base/radixserve && cp .ssweep-base/sampling.cuh $V/var_base/radixserve/
      else
        python3 bench/variants/make_variant.py $V base sampling.cuh --rev "${SSWEEP_BASE:-HEAD}"
      fi
      if [ -f .ssweep-tree/sampling.cuh ]; then
        # a branch's header carried as the tree (.ssweep-tree/sampling.cuh); the nohist and diag
        # variants below edit the working tree's header, so they are left out
        mkdir -p $V/var_tree/radixserve && cp .ssweep-tree/sampling.cuh $V/var_tree/radixserve/
        bash bench/variants/run.sh $V sample_sweep.cu 2>&1 | tee "$OUT/ssweep.txt"
        continue
      fi
      python3 bench/variants/make_variant.py $V tree sampling.cuh
      python3 bench/variants/make_variant.py $V nohist sampling.cuh --sub \
        "const bool hist_row = spec && use_p" "const bool hist_row = false && spec && use_p"
      # nohist: the tree without the bins (the refactor alone); diag: the tree with counters of
      # the two-pass top-p's outcomes per launch: rows that did not bin, no window, a window
      # that is empty or fuller than counted, cut outside the window, nothing kept in the tile,
      # L == 0, drawn
      D=/tmp/ssweep-diag; rm -rf $D
      python3 bench/variants/make_variant.py $D diag sampling.cuh \
        --sub "struct TopPRow {" "__device__ unsigned int g_diag[8];\nstruct TopPRow {" \
        --sub "  if (!find_window(sm, r)) return false;" "  if (!find_window(sm, r)) { if (threadIdx.x == 0) atomicAdd(&g_diag[1], 1u); return false; }" \
        --sub "  if (n == 0 || n > kTopKCap || sm.overflow) return false;" "  if (n == 0 || n > kTopKCap || sm.overflow) { if (threadIdx.x == 0) atomicAdd(&g_diag[2], 1u); return false; }" \
        --sub "  if (cut_above || cut_below) return false;" "  if (cut_above || cut_below) { if (threadIdx.x == 0) atomicAdd(&g_diag[3], 1u); return false; }" \
        --sub "    if (id < 0) return false;" "    if (id < 0) { if (threadIdx.x == 0) atomicAdd(&g_diag[4], 1u); return false; }\n    if (threadIdx.x == 0) atomicAdd(&g_diag[6], 1u);" \
        --sub "  if (L == 0) return false;" "  if (L == 0) { if (threadIdx.x == 0) atomicAdd(&g_diag[5], 1u); return false; }\n  if (threadIdx.x == 0) atomicAdd(&g_diag[6], 1u);" \
        --sub "  if (!st.hist_on) pass1<" "  if (hist_row && !st.hist_on && tid == 0) atomicAdd(&g_diag[0], 1u);\n  if (!st.hist_on) pass1<"
      bash bench/variants/run.sh $V sample_sweep.cu 2>&1 | tee "$OUT/ssweep.txt"
      bash bench/variants/run.sh $D sample_sweep.cu -DDIAG 2>&1 | tee -a "$OUT/ssweep.txt" ;;
    sdiag)
      # bitmask_sample's two-pass top-p (sample_sweep.cu, one run): the tree against the carried
      # .ssweep-base/ headers (sampling.cuh: the issue's baseline; sampling_head.cuh: the last
      # commit's), the tree with one step cut out each (outputs wrong on purpose: the flat
      # top_p rows then return the argmax), and other values of the speculative k and the bins'
      # depth under the anchor (logs/sample-diag-h200.txt ran it on an earlier tree: k 64 and a
      # compare-first pass-1 binning loop, since reverted)
      V=/tmp/sdiag; rm -rf $V; H=sampling.cuh; M="python3 bench/variants/make_variant.py $V"
      carried_sampling_bases $V
      $M tree $H
      P1=(--sub "  if (!find_window(sm, r)) return false;" "  return true;")
      $M d_p1 $H "${P1[@]}"
      $M d_p1_nobin $H "${P1[@]}" --sub "if (st.hist_on && hist_bin(bm, a, sc) < kHistBins - 1) {" "if (false) {"
      $M d_pass2 $H --sub "  const int n = sm.count;\n  if (n == 0" "  return true;\n  const int n = sm.count;\n  if (n == 0"
      SK="constexpr int kSpecK = 128;"; HB="constexpr int kHistBins = 1536;"; HH="constexpr int kHeadBins = 2 * kBinsPerNat;"
      $M spec64 $H --sub "$SK" "constexpr int kSpecK = 64;"
      $M spec256 $H --sub "$SK" "constexpr int kSpecK = 256;"
      $M tail6 $H --sub "$HB" "constexpr int kHistBins = 1024;"
      $M tail14 $H --sub "$HB" "constexpr int kHistBins = 2048;"
      # the previous commit's span and k with this tree's pass 2
      $M spec256_tail12h4 $H --sub "$SK" "constexpr int kSpecK = 256;" --sub "$HB" "constexpr int kHistBins = 2048;" \
        --sub "$HH" "constexpr int kHeadBins = 4 * kBinsPerNat;"
      build_harness $V sampling
      bash bench/variants/run.sh $V sample_sweep.cu 2>&1 | tee "$OUT/sdiag.txt"
      wait
      run_harness $V sampling 25 | tee -a "$OUT/sdiag.txt" ;;
    sfinal)
      # bitmask_sample A/B (sample_sweep.cu): the tree against the carried .ssweep-base/ headers
      # (sampling.cuh: the issue's baseline, sampling_head.cuh: the previous commit's) and the tree
      # with plain rows on the streaming draw (no thread-order draw); then the sampling and attention
      # harnesses
      V=/tmp/sfinal; rm -rf $V; H=sampling.cuh; M="python3 bench/variants/make_variant.py $V"
      carried_sampling_bases $V
      $M tree $H
      $M no_plain_draw $H --sub "    if (plain && !sm.z_recompute) {" "    if (false) {"
      build_harness $V sampling; build_harness $V attention
      bash bench/variants/run.sh $V sample_sweep.cu 2>&1 | tee "$OUT/sfinal.txt"
      wait
      for t in sampling attention; do run_harness $V $t 6 | tee -a "$OUT/sfinal.txt"; done ;;
    srepeat)
      # sfinal's base / head / tree sweep binaries built once and run in $SREPEAT rounds
      # (default 3), interleaved, for the run-to-run spread of each configuration
      # (logs/sample-sweep-plain-h200.txt also ran the plain draw inlined and cut out)
      V=/tmp/srepeat; rm -rf $V; H=sampling.cuh; M="python3 bench/variants/make_variant.py $V"
      carried_sampling_bases $V
      $M tree $H
      build_harness $V sampling
      BUILD_ONLY=1 bash bench/variants/run.sh $V sample_sweep.cu > /dev/null 2>&1
      wait
      for r in $(seq "${SREPEAT:-3}"); do
        for d in $V/var_*/; do echo "round $r"; timeout 120 "${d}sweep" || cat "${d}build.txt"; done
      done 2>&1 | tee "$OUT/srepeat.txt"
      run_harness $V sampling 8 | tee -a "$OUT/srepeat.txt" ;;
    eattn)
      timeout 200 python3 bench/attention_bench.py --json "$OUT/extend-attention-h200.json" 2>&1 \
        | tee "$OUT/eattn.txt" | tail -25 ;;
    ksampling)
      python3 bench/kernels.py --parts sampling --flashinfer-parts "" \
        --out "$OUT/kernels-h200-sampling.json" 2>&1 | tee "$OUT/ksampling.txt" | tail -20 ;;
    gsweep)
      # skinny GEMM variants (bench/variants/gemv_sweep.cu): the tree's stream plans against
      # others (loads in flight per lane, prefetch) and 4 warps per CTA; cuBLAS beside them when
      # its header and library are found
      V=/tmp/gsweep; rm -rf $V
      H=gemv.cuh; S="launch_skinny_planned<T, false, 16, false>"; LR="launch_skinny_planned<T, false, 8, false>"
      python3 bench/variants/make_variant.py $V tree $H
      python3 bench/variants/make_variant.py $V short_p8 $H --sub "$S" "launch_skinny_planned<T, false, 8, true>"
      python3 bench/variants/make_variant.py $V long_p8 $H --sub "$LR" "launch_skinny_planned<T, false, 8, true>"
      python3 bench/variants/make_variant.py $V long_16 $H --sub "$LR" "launch_skinny_planned<T, false, 16, false>"
      python3 bench/variants/make_variant.py $V w4 $H --sub "constexpr int kWarps = 8;" "constexpr int kWarps = 4;"
      CUB=(); NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
      inc=$(find /usr/local/cuda/include $NV -name cublas_v2.h 2>/dev/null | head -1)
      lib=$(find /usr/local/cuda/lib64 $NV -name "libcublas.so*" 2>/dev/null | head -1)
      if [ -n "$inc" ] && [ -n "$lib" ]; then
        CUB=(-DWITH_CUBLAS -I"$(dirname "$inc")" -L"$(dirname "$lib")" -l:"$(basename "$lib")"
             -Xlinker -rpath -Xlinker "$(dirname "$lib")")
        lt=$(find "$(dirname "$lib")" -name "libcublasLt.so*" | head -1); [ -n "$lt" ] && CUB+=(-l:"$(basename "$lt")")
      fi
      echo "cublas: ${CUB[*]:-not found}" | tee "$OUT/gsweep.txt"
      bash bench/variants/run.sh $V gemv_sweep.cu "${CUB[@]}" 2>&1 | tee -a "$OUT/gsweep.txt" ;;
    fp8cc)
      # issue 35's batch-1 bar: the CUDA-core FP8 skinny GEMM (fp8_gemv_cc.cuh, rows fp8cc /
      # fp8ccg) beside the tree's tensor-core kernel and the bf16 one, same weights, same
      # graphs; ~1 min
      # Variants of the CUDA-core kernel (the tree's: 4 chunks a lane per plain trip, the next
      # trip's loads first): np8 = 8 chunks a trip, no prefetch; pf8 = 8 with prefetch; w4 = 4
      # warps (columns) per CTA
      V=/tmp/fp8cc; rm -rf $V; H=fp8_gemv_cc.cuh
      # (FP8CC_TREE_ONLY=1: the tree's alone)
      python3 bench/variants/make_variant.py $V tree $H
      if [ "${FP8CC_TREE_ONLY:-0}" != 1 ]; then
        python3 bench/variants/make_variant.py $V np8 $H --sub "kPrefetch = true" "kPrefetch = false" \
          --sub "kPlainU = 4, kGatedU = 2" "kPlainU = 8, kGatedU = 4"
        python3 bench/variants/make_variant.py $V pf8 $H --sub "kPlainU = 4, kGatedU = 2" "kPlainU = 8, kGatedU = 4"
        python3 bench/variants/make_variant.py $V w4 $H --sub "kWarps = 8;" "kWarps = 4;"
      fi
      bash bench/variants/run.sh $V fp8_gemv_sweep.cu 2>&1 | tee "$OUT/fp8cc.txt" ;;
    fp8ccspeed)
      # the same two kernels inside the real decode step (bench/fp8_speed.py, one process):
      # bf16, FP8 as served (the default dispatch), FP8 with the tensor-core kernel forced
      python3 bench/fp8_speed.py --preset llama-3.1-8b --configs ${CC_CONFIGS:-bf16,fp8,fp8-mma} \
        --batch-sizes ${CC_BS:-1,2,4,8} --prefill-reps 1 --out "$OUT/fp8-speed-cc.json" 2>&1 \
        | tee "$OUT/fp8ccspeed.txt" | tail -30 ;;
    fp8kvsweep)
      # issue 35's FP8 KV bar (decode attention at batch 256 x 1k >= 0.85 of copy bandwidth in
      # FP8 bytes; 0.485 at 7f37cc4, in about the bf16 pool's time): variants of the FP8
      # tensor-core kernel (bench/variants/decode_fp8_sweep.cu): pipeline stages 2 / 4 / 5 / 6
      # against the tree's 3, the tree's with head pairs, the kernel before 2026-12-07, four
      # CTAs an SM (lb4), and two
      # diagnostics whose outputs are wrong on purpose: no half-precision multiply in the e4m3
      # conversion (cheapconv) and slots computed instead of read from kv_indices (noidx)
      V=/tmp/fp8kvsweep; rm -rf $V; H=decode_attention_mma_fp8.cuh
      S="constexpr int kDecodeMmaFp8Stages = 3;"
      python3 bench/variants/make_variant.py $V tree $H
      for n in 2 4 5 6; do
        python3 bench/variants/make_variant.py $V st$n $H --sub "$S" "constexpr int kDecodeMmaFp8Stages = $n;"
      done
      # the tree's kernel with two KV heads per CTA (pairs; measured slower on an H100,
      # bench/results/h100-2026-12-07.md), and the kernel before 2026-12-07 (prev: lane tiles,
      # lane t's K bytes one contiguous D/4 run, every 32-byte sector split over two load
      # instructions, so read from L2 twice)
      P="constexpr bool kDecodeMmaFp8PairHeads = false;"; Q="constexpr bool kDecodeMmaFp8PairHeads = true;"
      python3 bench/variants/make_variant.py $V pairs $H --sub "$P" "$Q"
      python3 bench/variants/make_variant.py $V prev $H \
        --sub "constexpr bool kDecodeMmaFp8RowTiles = true;" "constexpr bool kDecodeMmaFp8RowTiles = false;" \
        --sub "(int64_t)(qh0 + g) * p.q_stride_h + t * 16;" "(int64_t)(qh0 + g) * p.q_stride_h + t * (D / 4);" \
        --sub "qrow + (kk / 4) * 64 + (kk % 4) * 4)" "qrow + kk * 4)" \
        --sub "(int64_t)kvh * p.kv_stride_h + t * 16;" "(int64_t)kvh * p.kv_stride_h + t * (D / 4);" \
        --sub "kbase + off + i * 64, ok);" "kbase + off + i * 16, ok);"
      # at most 128 registers a thread (149 at 7f37cc4: three CTAs an SM), four CTAs an SM
      python3 bench/variants/make_variant.py $V lb4 $H \
        --sub "__launch_bounds__(kDecodeMmaThreads)\n    paged_decode_mma_fp8_kernel" \
              "__launch_bounds__(kDecodeMmaThreads, 4)\n    paged_decode_mma_fp8_kernel"
      python3 bench/variants/make_variant.py $V noidx $H \
        --sub "tok < kv_len ? __ldg(idx + tok) : 0;" "tok < kv_len ? kv_start + tok + 1 : 0;"
      python3 bench/variants/make_variant.py $V cheapconv fp8_kv.cuh \
        --sub "__half2 a = __hmul2(*reinterpret_cast<const __half2*>(&l), k256);" \
              "__half2 a = *reinterpret_cast<const __half2*>(&l);" \
        --sub "__half2 b = __hmul2(*reinterpret_cast<const __half2*>(&h), k256);" \
              "__half2 b = *reinterpret_cast<const __half2*>(&h);"
      BUILD_ONLY=1 bash bench/variants/run.sh $V decode_fp8_sweep.cu 2>&1 | tee "$OUT/fp8kvsweep.txt"
      for d in "$V"/var_*/; do  # the bf16 pool beside the tree's kernel only
        n=${d%/}; n=${n##*/var_}
        if [ "$n" = tree ]; then timeout 120 "${d}sweep"; else SWEEP_NO_BF16=1 timeout 60 "${d}sweep"; fi \
          || cat "${d}build.txt"
      done 2>&1 | tee -a "$OUT/fp8kvsweep.txt"
      # one head per CTA over a head-major pool (a head's slots adjacent): bytes or touched rows?
      for n in tree prev; do
        SWEEP_LAYOUT=hmajor SWEEP_NO_BF16=1 timeout 60 $V/var_$n/sweep 2>&1 | tee -a "$OUT/fp8kvsweep.txt"
      done ;;
    fp8kvrows)
      # the FP8 KV kernel's row tiles (kDecodeMmaFp8RowTiles: K and V rows copied whole into
      # shared memory, swizzled) against its lane tiles (each lane copies the bytes it reads),
      # and the row tiles with 2 / 4 stages, head pairs and four CTAs an SM
      # (bench/variants/decode_fp8_sweep.cu, batch 256 x 1k down to 8 x 8k)
      V=/tmp/fp8kvrows; rm -rf $V; H=decode_attention_mma_fp8.cuh
      S="constexpr int kDecodeMmaFp8Stages = 3;"
      python3 bench/variants/make_variant.py $V rows $H
      python3 bench/variants/make_variant.py $V lanes $H \
        --sub "constexpr bool kDecodeMmaFp8RowTiles = true;" "constexpr bool kDecodeMmaFp8RowTiles = false;"
      for n in 2 4; do
        python3 bench/variants/make_variant.py $V rows_st$n $H --sub "$S" "constexpr int kDecodeMmaFp8Stages = $n;"
      done
      python3 bench/variants/make_variant.py $V rows_pairs $H \
        --sub "constexpr bool kDecodeMmaFp8PairHeads = false;" "constexpr bool kDecodeMmaFp8PairHeads = true;"
      python3 bench/variants/make_variant.py $V rows_lb4 $H \
        --sub "__launch_bounds__(kDecodeMmaThreads)\n    paged_decode_mma_fp8_kernel" \
              "__launch_bounds__(kDecodeMmaThreads, 4)\n    paged_decode_mma_fp8_kernel"
      BUILD_ONLY=1 bash bench/variants/run.sh $V decode_fp8_sweep.cu 2>&1 | tee "$OUT/fp8kvrows.txt"
      for n in rows lanes rows_st2 rows_st4 rows_pairs rows_lb4 lanes rows; do
        if [ $n = rows ]; then timeout 90 $V/var_$n/sweep; else SWEEP_NO_BF16=1 timeout 60 $V/var_$n/sweep; fi \
          || cat $V/var_$n/build.txt
      done 2>&1 | tee -a "$OUT/fp8kvrows.txt" ;;
    ncufp8kv)
      # Nsight Compute's per-instruction tables (SASS, csv) of the FP8 KV decode kernel and of the
      # bf16 tensor-core decode kernel, each its first launch in bench/attention_bench.py's FP8
      # run (batch 256 x 1k, slots in order); the reports stay on the device
      for k in paged_decode_mma_fp8 paged_decode_mma_kernel; do
        timeout 240 ncu --clock-control none --kernel-name regex:$k --launch-count 1 --set full \
          --import-source no -f -o /tmp/ncu-$k python3 bench/attention_bench.py \
          --kv-cache-dtype fp8_e4m3 > "$OUT/ncu-$k-run.txt" 2>&1
        tail -3 "$OUT/ncu-$k-run.txt"
        ncu -i /tmp/ncu-$k.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-$k-sass.csv" 2>&1
        ncu -i /tmp/ncu-$k.ncu-rep --page details > "$OUT/ncu-$k-details.txt" 2>&1
        wc -l "$OUT/ncu-$k-sass.csv" "$OUT/ncu-$k-details.txt"
      done ;;
    fp8sweep)
      # FP8 skinny GEMM variants (bench/variants/fp8_gemv_sweep.cu): warps per CTA (the in-CTA k
      # split) and k blocks in flight per warp of the plain and the gated forms against the
      # tree's (fp8_gemv.cuh: kPlainWarps / kPlainUnroll, kGatedWarps / kGatedUnroll); the bf16
      # skinny GEMM at 1 row beside each shape
      V=/tmp/fp8sweep; rm -rf $V; H=fp8_gemv.cuh
      P="constexpr int kPlainWarps = 16, kPlainUnroll = 2;"; G="constexpr int kGatedWarps = 8, kGatedUnroll = 2;"
      python3 bench/variants/make_variant.py $V tree $H
      for wu in 8:4 16:4 8:2 32:1; do
        python3 bench/variants/make_variant.py $V plain_w${wu%:*}u${wu#*:} $H \
          --sub "$P" "constexpr int kPlainWarps = ${wu%:*}, kPlainUnroll = ${wu#*:};"
      done
      for wu in 8:4 4:2 16:1; do
        python3 bench/variants/make_variant.py $V gated_w${wu%:*}u${wu#*:} $H \
          --sub "$G" "constexpr int kGatedWarps = ${wu%:*}, kGatedUnroll = ${wu#*:};"
      done
      bash bench/variants/run.sh $V fp8_gemv_sweep.cu 2>&1 | tee "$OUT/fp8sweep.txt" ;;
    esweep)
      # extend attention A/B (bench/variants/extend_sweep.cu: 4k causal, 32 heads, d128): the
      # sm_90a kernel and its launcher at git revision $ESWEEP_BASE (default HEAD) against the
      # working tree's, and the tree's with one design choice flipped each; then the harness
      # (csrc/harness/test_attention.cu) against the tree
      V=/tmp/esweep; rm -rf $V; H=extend_attention_sm90.cuh
      M="python3 bench/variants/make_variant.py $V"
      $M base $H --rev "${ESWEEP_BASE:-HEAD}"; $M base attention_launch.cuh --rev "${ESWEEP_BASE:-HEAD}"
      $M tree $H
      # flip NAME KEY A B: the tree with KEY's value A set to B (or B to A, whichever it holds)
      flip() {
        local name=$1 key=$2 a=$3 b=$4
        if grep -q "$key = $a;" csrc/include/radixserve/$H; then $M "$name" $H --sub "$key = $a;" "$key = $b;"
        else $M "$name" $H --sub "$key = $b;" "$key = $a;"; fi
      }
      flip no_pingpong "constexpr bool kPingPong" true false
      flip q_regs "constexpr bool kQInRegs" false true
      flip one_item_per_cta "constexpr bool kPersistent" true false
      flip stages3 "constexpr int kStages" 2 3
      flip no_pack "constexpr bool kPackGqa" true false
      build_harness $V attention
      bash bench/variants/run.sh $V extend_sweep.cu 2>&1 | tee "$OUT/esweep.txt"
      wait
      run_harness $V attention 30 | tee -a "$OUT/esweep.txt" ;;
    dsweep)
      # decode attention split plans (bench/variants/decode_sweep.cu): the CTAs-per-SM target and
      # the floor of tokens per split, variants of the working tree's headers, one build each
      V=/tmp/dsweep; rm -rf $V
      H=csrc/include/radixserve/decode_attention.cuh
      M="constexpr int kDecodeMinSplitTokens = "; C="constexpr int kDecodeCtasPerSm = "
      m0=$(grep -o "${M}[0-9]*" $H | grep -o "[0-9]*$"); c0=$(grep -o "${C}[0-9]*" $H | grep -o "[0-9]*$")
      for cm in ${DSWEEP:-1:64 2:64 4:64 1:32 2:32 2:128}; do
        c=${cm%:*}; m=${cm#*:}
        python3 bench/variants/make_variant.py $V c${c}m$m decode_attention.cuh \
          --sub "${M}${m0};" "${M}${m};" --sub "${C}${c0};" "${C}${c};"
        python3 bench/variants/make_variant.py $V c${c}m$m attention_launch.cuh
      done
      bash bench/variants/run.sh $V decode_sweep.cu 2>&1 | tee "$OUT/dsweep.txt" ;;
    servhost)
      # issue 35's serving gap is on the host (bench/results/h100-2026-12-07-late.md): bf16 and
      # FP8 + FP8 KV servers at fixed 1024/1024 then SGLang's default lengths (SERVHOST_RATIOS),
      # then a py-spy profile of the FP8 server's threads mid-run (the py-spy wheel carried in
      # .whl-spy/, git-excluded: `pip download py-spy --no-deps -d .whl-spy`)
      # SERVHOST_CONFIGS: names fp8-kv, bf16, each with -ep for --engine-process
      F="--quantization fp8 --kv-cache-dtype fp8_e4m3"
      for r in ${SERVHOST_RATIOS:-1 0}; do
        for n in ${SERVHOST_CONFIGS:-fp8-kv bf16}; do
          a=""; case $n in fp8-kv*) a="$F";; esac
          case $n in *-ep) a="$a --engine-process";; *) a="$a --no-engine-process";; esac
          timeout 150 python3 bench/serving.py --preset llama-3.1-8b --launch --server-args "$a" \
            --dataset random --random-input-len 1024 --random-output-len 1024 \
            --random-range-ratio $r --num-prompts 200 --request-rate 16 --no-plots --disable-tqdm \
            --server-log-dir "$OUT/servhost-$n-r$r" --output-file "$OUT/serving-$n-r$r.json" 2>&1 \
            | grep -E "^(Output token|Failed|Server mean|Server loop|Server process|Server tokens|Median ITL|Duration /)" \
            | sed "s/^/[$n r$r] /"
        done
      done
      if [ -z "${SERVHOST_NO_SPY:-}" ] && ls .whl-spy/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-deps --target /tmp/spy .whl-spy/*.whl 2>&1 | tail -1
        P=/tmp/preset-8b; python3 -m radixserve bench presets llama-3.1-8b --out $P > /dev/null
        # SERVHOST_SPY_EP=1: the server runs --engine-process and py-spy records the engine
        # process (its forward worker and loop), not the HTTP one
        ep="--no-engine-process"; [ -n "${SERVHOST_SPY_EP:-}" ] && ep="--engine-process"
        python3 -m radixserve.launch_server --model-path $P --load-format dummy --port 30124 $F \
          $ep > "$OUT/servhost-spy-server.log" 2>&1 &
        pid=$!
        for i in $(seq 200); do curl -sf localhost:30124/health >/dev/null && break; sleep 1; done
        target=$pid
        if [ "$ep" = --engine-process ]; then
          target=$(pgrep -P $pid -f spawn_main | head -1); echo "[spy] engine process $target"
        fi
        (sleep 10; timeout 40 /tmp/spy/bin/py-spy record -p $target -d 12 -r 200 --threads \
          --native --format raw -o "$OUT/spy-fp8kv${SERVHOST_SPY_EP:+-ep}.txt" > "$OUT/spy.log" 2>&1) &
        sp=$!
        timeout 100 python3 bench/serving.py --port 30124 --dataset random --random-range-ratio 1 \
          --random-input-len 1024 --random-output-len 1024 --num-prompts 200 --request-rate 16 \
          --disable-tqdm --no-plots 2>&1 | grep -E "^(Output token|Server loop)" | sed "s/^/[spy] /"
        wait $sp; tail -1 "$OUT/spy.log"; kill $pid; wait $pid 2>/dev/null
      fi ;;
    scaledmm)
      # issue 35's W8A8 GEMMs at serving batches (~0.57 of copy bandwidth at batch 128 in
      # h100-2026-12-07-late.md): torch._scaled_mm called four ways over the 8B step's GEMMs
      # (bench/scaled_mm_variants.py), the variants' GPU test, then the decode step at 16-128 rows
      # under each (bench/fp8_speed.py, knob RADIXSERVE_FP8_SCALED_MM)
      python3 bench/scaled_mm_variants.py --rows ${SMM_ROWS:-16,32,48,64,128,256} \
        --out "$OUT/scaled-mm-variants.json" 2>&1 | tee "$OUT/scaled-mm-variants.txt" | tail -30
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_linear_cuda.py 2>&1 | tail -3
      python3 bench/fp8_speed.py --preset llama-3.1-8b \
        --configs ${SMM_CONFIGS:-fp8,fp8-mm-fast,fp8-mm-swap,fp8-mm-swap-fast} \
        --batch-sizes ${SMM_BS:-16,32,64,128} --prefill-reps 1 --out "$OUT/fp8-speed-scaledmm.json" \
        2>&1 | tail -30 ;;
    servprof)
      # issue 35's serving gap: where a decode step at a serving-like batch and context goes
      # (bench/decode_profile.py under CUDA graphs, batch 128 x 1,536 tokens, as the fixed-length
      # 1k/1k run's steps were), bf16 against FP8 weights and FP8 weights + FP8 KV
      for c in ${SERVPROF_CONFIGS:-fp8-kv bf16 fp8}; do
        timeout 150 python3 bench/decode_profile.py --batch-size ${SERVPROF_BS:-128} \
          --prompt-len ${SERVPROF_LEN:-1536} --cuda-graph --no-linear-bandwidth \
          --server-config $c --steps 10 --out "$OUT/decode-profile-servprof-$c.json" \
          > "$OUT/servprof-$c.txt" 2>&1
        python3 -c "import json; d = json.load(open('$OUT/decode-profile-servprof-$c.json'))
print('$c', {k: d[k] for k in ('kernel_us_per_step', 'floor_us', 'groups_us_per_step')})
for t in d['top_kernels'][:10]: print(round(t['us_per_step'], 1), t['calls_per_step'], t['name'][:110])" \
          2>&1 | tee -a "$OUT/servprof.txt"
      done ;;
    profile)
      for len in ${PROFILE_LENS:-128 1024}; do
        python3 bench/decode_profile.py --batch-size 1 --prompt-len $len \
          --out "$OUT/decode-profile-h200-bs1-ctx$len.json" 2>&1 | tail -40 | tee "$OUT/profile-$len.txt"
      done ;;
    profile8b)
      # offline8b's two phases, kernel by kernel: a prefill of 32 x 1024 and decode at 256 x 1024
      python3 bench/decode_profile.py --phase prefill --batch-size 32 --prompt-len 1024 \
        --out "$OUT/prefill-profile-h200-bs32-len1024.json" 2>&1 | tail -60 | tee "$OUT/profile-prefill.txt"
      python3 bench/decode_profile.py --batch-size 256 --prompt-len 1024 --steps 5 --warmup 2 \
        --no-linear-bandwidth --out "$OUT/decode-profile-h200-bs256-ctx1024.json" 2>&1 | tail -60 \
        | tee "$OUT/profile-bs256.txt" ;;
    offline8b_ab)
      # offline8b's engine alone under each setting of $OFFLINE_AB (';'-separated, each a
      # space-separated list of NAME=VALUE engine args; the defaults first), then the full
      # same-process comparison with HF under the fastest of them
      common=(--device cuda --preset llama-3.1-8b --num-prompts 256 --input-len 1024 --output-len 256)
      IFS=';' read -ra settings <<< ";${OFFLINE_AB:-}"
      i=0
      for setting in "${settings[@]}"; do
        eargs=(); for a in $setting; do eargs+=(--engine-arg "$a"); done
        python3 bench/offline.py "${common[@]}" --hf-mode none "${eargs[@]}" \
          --out "$OUT/offline-ab-$i.json" 2>&1 | grep -v "it/s" | tail -3 | tee -a "$OUT/offline_ab.txt"
        echo "setting $i: '${setting}'" | tee -a "$OUT/offline_ab.txt"; i=$((i + 1))
      done
      best=$(python3 -c "
import json, sys
runs = []
for i in range($i):
    try:
        runs.append((json.load(open('$OUT/offline-ab-%d.json' % i))['radixserve_tok_per_s'], i))
    except (OSError, KeyError, ValueError):
        pass
print(max(runs)[1] if runs else 0)")
      setting=${settings[$best]}; eargs=(); for a in $setting; do eargs+=(--engine-arg "$a"); done
      echo "fastest: setting $best '${setting}'; with HF:" | tee -a "$OUT/offline_ab.txt"
      python3 bench/offline.py "${common[@]}" --hf-mode generate_batch "${eargs[@]}" \
        --out "$OUT/offline-h200-8b-vs-hf-generate-batch.json" 2>&1 | grep -v "it/s" | tail -12 \
        | tee -a "$OUT/offline_ab.txt" ;;
    offline9)
      # issue 9's offline point, one call: the engine alone under its defaults (prefill-first,
      # prefills scheduled over the prefill in flight, the raised GC threshold), under
      # step_order=alternate (the server's order), and under CPython's GC threshold
      # (RADIXSERVE_GC_GEN0=700); then the same-process comparison with HF at the defaults
      common=(--device cuda --preset llama-3.1-8b --num-prompts 256 --input-len 1024 --output-len 256)
      for run in default "alternate --engine-arg step_order=alternate" gc700; do
        name=${run%% *}; extra=(); [ "$name" != "$run" ] && extra=(${run#* })
        env_gc=(); [ "$name" = gc700 ] && env_gc=(RADIXSERVE_GC_GEN0=700)
        echo "run $name: ${extra[*]} ${env_gc[*]}" | tee -a "$OUT/offline9.txt"
        env "${env_gc[@]}" python3 bench/offline.py "${common[@]}" --hf-mode none "${extra[@]}" \
          --out "$OUT/offline9-$name.json" 2>&1 | grep -v "it/s" | tail -2 | tee -a "$OUT/offline9.txt"
      done
      python3 bench/offline.py "${common[@]}" --hf-mode generate_batch \
        --out "$OUT/offline-h200-8b-vs-hf-generate-batch.json" 2>&1 | grep -v "it/s" | tail -12 \
        | tee -a "$OUT/offline9.txt" ;;
    gaps)
      # where the offline run's device time goes between kernels: the engine alone, the same
      # run under --profile-device (the kernel timeline's busy time, gaps and kernels, by
      # phase), then $GAPS_DECODE_STEPS decode steps at 256 x 1024 as CUDA graph replays under
      # the profiler; the GPU's SM clock, power and throttle reasons sampled every 200 ms
      # throughout ($OUT/gaps-smi.csv; the runs' start times in gaps.txt)
      common=(--device cuda --preset llama-3.1-8b --num-prompts 256 --input-len 1024 --output-len 256 --hf-mode none)
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 200 > "$OUT/gaps-smi.csv" 2>&1 &
      smi=$!
      if [ "${GAPS_PLAIN:-1}" = 1 ]; then
        date +"plain run from %T.%N" | tee -a "$OUT/gaps.txt"
        python3 bench/offline.py "${common[@]}" --out "$OUT/gaps-plain.json" 2>&1 | grep -v "it/s" \
          | tail -2 | tee -a "$OUT/gaps.txt"
      fi
      date +"profiled run from %T.%N" | tee -a "$OUT/gaps.txt"
      python3 bench/offline.py "${common[@]}" --profile-device "$OUT/gaps-offline-timeline.json" \
        --out "$OUT/gaps-profiled.json" 2>&1 | grep -v "it/s" | tail -2 | tee -a "$OUT/gaps.txt"
      date +"decode profile from %T.%N" | tee -a "$OUT/gaps.txt"
      python3 bench/decode_profile.py --batch-size 256 --prompt-len 1024 --steps "${GAPS_DECODE_STEPS:-5}" \
        --warmup 2 --no-linear-bandwidth --cuda-graph --out "$OUT/gaps-decode-bs256-graph.json" 2>&1 \
        | grep -v "^ \|^{\|^}" | tail -5 | tee -a "$OUT/gaps.txt"
      kill $smi ;;
    tcdecode)
      # the tensor-core decode kernel: the attention harness (both decode kernels against the
      # CPU reference), the GPU attention tests, the attention bench (bs256 tc vs simt), then
      # the offline run's engine alone with it (default) and with RADIXSERVE_DECODE_KERNEL=simt
      build_harness "$OUT" attention
      wait
      run_harness "$OUT" attention 12 | tee "$OUT/harness-attention.txt"
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention.py 2>&1 \
        | tee "$OUT/gpu_tests_attention.txt" | tail -6
      timeout 200 python3 bench/attention_bench.py --json "$OUT/attention-h200.json" 2>&1 \
        | tee "$OUT/attention.txt" | grep "decode" | head -30
      common=(--device cuda --preset llama-3.1-8b --num-prompts 256 --input-len 1024 --output-len 256 --hf-mode none)
      for kernel in tc simt; do
        env_k=(); [ $kernel = simt ] && env_k=(RADIXSERVE_DECODE_KERNEL=simt)
        echo "decode kernel $kernel:" | tee -a "$OUT/tcdecode.txt"
        env "${env_k[@]}" python3 bench/offline.py "${common[@]}" --out "$OUT/tcdecode-offline-$kernel.json" \
          2>&1 | grep -v "it/s" | tail -2 | tee -a "$OUT/tcdecode.txt"
      done ;;
    offline8b_engine)
      # radixserve's half of offline8b alone (no HF), with the engine's step log
      python3 bench/offline.py --device cuda --preset llama-3.1-8b \
        --num-prompts 256 --input-len 1024 --output-len 256 --hf-mode none 2>&1 \
        | tee "$OUT/offline8b_engine.txt" | grep -v "it/s" | tail -12 ;;
    offline8b_diag)
      # where offline8b's engine time goes: the engine alone under the defaults and under
      # $OFFLINE_DIAG_ARGS (NAME=VALUE ...), then the latter again with the event-loop thread
      # under cProfile ($OUT/offline-host-profile.txt; that run's throughput is not a result)
      common=(--device cuda --preset llama-3.1-8b --num-prompts 256 --input-len 1024
              --output-len 256 --hf-mode none)
      eargs=(); for a in ${OFFLINE_DIAG_ARGS:-max_prefill_tokens=32768 chunked_prefill_size=16384}; do
        eargs+=(--engine-arg "$a"); done
      python3 bench/offline.py "${common[@]}" --out "$OUT/offline-diag-default.json" 2>&1 \
        | grep -v "it/s" | tail -2 | tee -a "$OUT/offline_diag.txt"
      python3 bench/offline.py "${common[@]}" "${eargs[@]}" --out "$OUT/offline-diag-args.json" \
        2>&1 | grep -v "it/s" | tail -2 | tee -a "$OUT/offline_diag.txt"
      python3 bench/offline.py "${common[@]}" "${eargs[@]}" --profile-host "$OUT/offline-host-profile.txt" \
        --out "$OUT/offline-diag-profiled.json" 2>&1 | grep -v "it/s" | tail -2 | tee -a "$OUT/offline_diag.txt" ;;
    flashinfer)
      # FlashInfer alone (bench/flashinfer_peer.py); parts that JIT-compile bounded by FI_TIMEOUT
      (flashinfer_env
       timeout "${FI_TIMEOUT:-240}" python3 bench/flashinfer_peer.py --parts "${FI_PARTS:-decode,sampling}" \
         --json "$OUT/flashinfer-h200.json" 2>&1 | grep -v "^ \|^{\|^}" | tail -30 | tee "$OUT/flashinfer.txt") ;;
    *) echo "unknown stage $stage" ;;
  esac
done
