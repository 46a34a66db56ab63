"""FlashInfer as a same-run kernel peer: decode attention (paged KV, page_size 1), causal
extend/prefill attention (paged, page_size 1; ragged too), and top-k/top-p sampling, all bf16
(sampling fp32 logits) on the current CUDA device. `run(results, time_us)` adds flashinfer_* keys;
bench/kernels.py's time_us (median CUDA-event microseconds, fn(i)) is the timer.

Version: flashinfer-python 0.6.18.post1 (py3-none-any JIT wheel: csrc, CUTLASS, CCCL 3.3.2 and
spdlog headers are in the wheel; kernels compile with nvcc at first use and talk to torch through
apache-tvm-ffi, so no torch C++ ABI is involved). Of its Requires-Dist only apache-tvm-ffi
(<0.2, !=0.1.8: radixserve's .whl/ 0.1.15.post2 fits) and nvidia-ml-py (`import pynvml` in
flashinfer.utils) are needed for these APIs; filelock, numpy, packaging, requests, tqdm come with
torch's image. cuda-python, nvidia-cutlass-dsl (CuTe-DSL kernels, Blackwell), cudnn-frontend,
cuda-tile, nccl4py, click, einops, tabulate are optional for import and unused here.

.whl-fi/ is not committed (git ignores it through .git/info/exclude); remake it on a machine
with PyPI and nvcc 13.0 (no GPU needed):

  python -m pip download --no-deps -d .whl-fi flashinfer-python==0.6.18.post1 nvidia-ml-py==13.615.71
  # the flashinfer wheel installed with --target (plus apache-tvm-ffi, ninja and any torch: torch
  # only supplies dtypes and the C++11 ABI flag; the modules talk through tvm-ffi alone)
  FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_JIT_DEBUG=0 MAX_JOBS=2 CUDA_HOME=/usr/local/cuda \
  PYTHONPATH=<that site> python bench/flashinfer_peer.py \
      --aot-build .whl-fi/flashinfer-0.6.18.post1-aot-sm90a-cu130.tar.gz
  # builds decode, FA3 and FA2 batch prefill, sampling and top-k for sm_90a (~19 min on 2
  # cores: FA3 612 s, top-k 249 s, FA2 133 s, sampling 103 s, decode 42 s). Where the toolkit
  # lacks curand.h, point FLASHINFER_EXTRA_CUDAFLAGS="-isystem DIR" at torch's
  # nvidia/cu13/include; where it lacks lib64/stubs/libcuda.so, an empty libcuda.so in a
  # directory named by FLASHINFER_EXTRA_LDFLAGS=-LDIR satisfies -lcuda (no driver symbol is
  # used). FLASHINFER_JIT_VERBOSE=1 without FLASHINFER_JIT_DEBUG=0 builds -O0 -G modules.

Install offline on the GPU machine (the files travel in .whl-fi/ and .whl/):

  python -m pip install --no-index --no-deps --target /tmp/fisite \
      .whl-fi/flashinfer_python-0.6.18.post1-py3-none-any.whl \
      .whl-fi/nvidia_ml_py-13.615.71-py3-none-any.whl \
      .whl/apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
  # optional: prebuilt sm_90a / CUDA 13.0 modules (compiled off-GPU with nvcc 13.0.88 by
  # --aot-build below); flashinfer loads flashinfer/data/aot/<module>/<module>.so instead of
  # compiling it, and JIT-builds any module the tarball lacks (a .so that fails to load: warning + JIT)
  tar -xzf .whl-fi/flashinfer-0.6.18.post1-aot-sm90a-cu130.tar.gz -C /tmp/fisite
  export PYTHONPATH=/tmp/fisite:$PYTHONPATH \
         FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/fiws/tvm-ffi \
         FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 CUDA_HOME=/usr/local/cuda
  export PATH=$(python -c 'import ninja; print(ninja.BIN_DIR)'):$CUDA_HOME/bin:$PATH
  # only if a module has to JIT and the toolkit lacks curand.h (torch's nvidia/cu13 wheel has it):
  # export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $(python -c 'import nvidia; print(list(nvidia.__path__)[0])')/cu13/include"
  python -c "import flashinfer; print(flashinfer.__version__)"

JIT cost without the tarball: the same 5 modules, built one after another on first use (the
times above, over 2 cores; on the GPU machine's 16 cores the FA3 module's many sources go in
parallel, the others have ~3 sources each): expect ~5-10 min in all. Compiled modules are cached
under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer, so a second run on the same (warm) machine
starts at once.

  PYTHONPATH=/tmp/fisite:pysrc python bench/flashinfer_peer.py [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

HQ, HKV, D = 32, 8, 128  # q heads, kv heads, head_dim (Llama-3-8B shapes)
BF16, I32 = torch.bfloat16, torch.int32


def _graph_us(time_us, fn, calls: int):
    """Device time of one fn(i) with no host work between calls: `calls` calls (i = 0..calls-1,
    so fn can rotate inputs) captured in one CUDA graph, replayed under time_us, divided by calls
    (how the decode step runs under graphs). Returns (us, mode, eager_us); falls back to the
    eager time_us(fn) if capture fails or a replay leaves the last call's zeroed output
    untouched (kernels not captured)."""
    eager = time_us(fn, sets=calls)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(2):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                out = fn(i)
        probe = out[0] if isinstance(out, (tuple, list)) else out
        probe.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = bool(probe.float().abs().sum() > 0)
        us = time_us(lambda _: graph.replay(), reps=20, warmup=3) / calls
    except Exception as e:  # noqa: BLE001 -- capture unsupported: time it eagerly
        print(f"  (graph capture failed, eager timing: {type(e).__name__}: {e})", file=sys.stderr)
        torch.cuda.synchronize()
        return eager, "eager", eager
    if not replayed:
        return eager, "eager (graph replay looked empty)", eager
    return us, "graph", eager


def _first_call(what: str, setup):
    """setup() -> fn; runs fn(0) once so the JIT build / module load (in plan() or the first
    call) stays out of the timed region. Prints how long that took."""
    t0 = time.time()
    fn = setup()
    fn(0)
    torch.cuda.synchronize()
    print(f"flashinfer {what}: setup + first call (JIT build or cache load) {time.time() - t0:.1f} s")
    return fn


def _decode_setup(fi, ws, batch, ctx, sets=1, tensor_cores=False, shuffle=False):
    """Decode, one q token per request, page_size 1 (one token per page), NHD layout:
    q [batch, 32, 128]; K, V caches [batch*ctx pages, 1, 8, 128] as a (k, v) tuple;
    indptr [batch+1] = 0, ctx, 2ctx, ...; indices [batch*ctx]; last_page_len [batch] = 1."""
    n = batch * ctx
    caches = [(torch.randn(n, 1, HKV, D, dtype=BF16, device="cuda"),
               torch.randn(n, 1, HKV, D, dtype=BF16, device="cuda")) for _ in range(sets)]
    q = torch.randn(batch, HQ, D, dtype=BF16, device="cuda")
    indptr = torch.arange(0, n + 1, ctx, dtype=I32, device="cuda")
    indices = (torch.randperm(n, device="cuda") if shuffle else torch.arange(n, device="cuda")).to(I32)
    last_page_len = torch.ones(batch, dtype=I32, device="cuda")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last_page_len, HQ, HKV, D, 1, q_data_type=BF16, kv_data_type=BF16)
    fn = lambda i: w.run(q, caches[i % sets])  # noqa: E731
    fn.check = lambda: _decode_err(fn(0), q, caches[0], indices, batch, ctx)
    return fn


def _decode_err(out, q, cache, indices, batch, ctx):
    """max |out - fp32 reference| for request 0 (GQA: q head h reads kv head h // 4)."""
    k = cache[0][indices[:ctx].long(), 0].float().repeat_interleave(HQ // HKV, 1)  # [ctx, 32, 128]
    v = cache[1][indices[:ctx].long(), 0].float().repeat_interleave(HQ // HKV, 1)
    p = torch.softmax(torch.einsum("hd,khd->hk", q[0].float(), k) / math.sqrt(D), -1)
    return (out[0].float() - torch.einsum("hk,khd->hd", p, v)).abs().max().item()


def _extend_setup(fi, ws, new, prefix=0, ragged=False):
    """One request: `new` q tokens after `prefix` cached tokens, causal (FlashInfer aligns the
    causal mask bottom-right: new token j sees kv 0 .. prefix + j, so the prefix is seen in full).
    q [new, 32, 128]; paged: K, V [prefix+new pages, 1, 8, 128], page_size 1, indices 0..kv-1;
    ragged: K, V [prefix+new, 8, 128]; qo_indptr [0, new], kv_indptr [0, prefix+new]."""
    kv = prefix + new
    q = torch.randn(new, HQ, D, dtype=BF16, device="cuda")
    qo_indptr = torch.tensor([0, new], dtype=I32, device="cuda")
    kv_indptr = torch.tensor([0, kv], dtype=I32, device="cuda")
    if ragged:
        k = torch.randn(kv, HKV, D, dtype=BF16, device="cuda")
        v = torch.randn(kv, HKV, D, dtype=BF16, device="cuda")
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True, q_data_type=BF16, kv_data_type=BF16)
        fn = lambda i: w.run(q, k, v)  # noqa: E731
    else:
        k = torch.randn(kv, 1, HKV, D, dtype=BF16, device="cuda")
        v = torch.randn(kv, 1, HKV, D, dtype=BF16, device="cuda")
        indices = torch.arange(kv, dtype=I32, device="cuda")
        last_page_len = torch.ones(1, dtype=I32, device="cuda")
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo_indptr, kv_indptr, indices, last_page_len, HQ, HKV, D, 1, causal=True,
               q_data_type=BF16, kv_data_type=BF16)
        fn = lambda i: w.run(q, (k, v))  # noqa: E731
    fn.backend = getattr(w, "_backend", "?")
    fn.check = lambda: _extend_err(fn(0), q, k.view(kv, HKV, D), v.view(kv, HKV, D), prefix)
    return fn


def _extend_err(out, q, k, v, prefix):
    """max |out - torch SDPA (fp32 math)| with the same bottom-right causal mask."""
    new, kv = q.shape[0], k.shape[0]
    mask = torch.arange(kv, device="cuda")[None, :] <= prefix + torch.arange(new, device="cuda")[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(HQ // HKV, 0),
        v.float().transpose(0, 1).repeat_interleave(HQ // HKV, 0), attn_mask=mask)
    return (out.float() - ref.transpose(0, 1)).abs().max().item()


def _causal_flops(new, prefix=0):
    # causal FLOPs = 4 * heads * head_dim * (q, k) pairs: QK^T and PV each 2 FLOPs per multiply-add
    # over head_dim; pairs = new * prefix (prefix seen in full) + new * (new + 1) / 2 (diagonal
    # included), i.e. 4 * H * D * n * (n + 1) / 2 without a prefix.
    return 4 * HQ * D * (new * prefix + new * (new + 1) / 2)


def _measure(results, what, body):
    try:
        body()
    except Exception as e:  # noqa: BLE001 -- one failure keeps the other measurements
        msg = f"{type(e).__name__}: {e}"
        results[f"flashinfer_{what}_error"] = msg[-2000:]
        print(f"flashinfer {what}: FAILED {msg[-2000:]}", file=sys.stderr)
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


PARTS = ("decode", "extend", "sampling", "topk", "tensor_cores")


def run(results: dict, time_us, parts=PARTS, ours=None) -> None:
    """Adds the flashinfer_* keys to results; time_us(fn, reps=50, warmup=5, sets=1) -> median us.
    parts: which of PARTS to measure (a module the prebuilt tarball lacks JIT-compiles: minutes
    of nvcc on first use). ours: {"sampling_topp_only" / "sampling_topk50_topp": fn(logits)},
    radixserve's sampler for the same call, timed on the same rows
    (bitmask_sample_on_flashinfer_rows_<what>_us)."""
    try:
        import flashinfer as fi
        import flashinfer.sampling  # noqa: F401
    except Exception as e:  # noqa: BLE001
        results["flashinfer_error"] = f"{type(e).__name__}: {e}"
        print(f"flashinfer: import failed: {results['flashinfer_error']}", file=sys.stderr)
        return
    results["flashinfer_version"] = fi.__version__
    print(f"flashinfer {fi.__version__} from {os.path.dirname(fi.__file__)}")
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # float workspace (split-kv), shared

    # 1. decode, page_size 1: batch 32 x 4096 context and batch 1 x 1024 (one layer's call).
    #    Device time under a CUDA graph (as bench/attention_bench.py times radixserve's decode);
    #    eager time too. bs1: 16 K/V sets (64 MiB > 50 MiB L2) rotated so each call reads from HBM.
    for what, batch, ctx, sets in (("decode_attention", 32, 4096, 1),
                                   ("decode_attention_bs1_1k", 1, 1024, 16)) if "decode" in parts else ():
        def body(what=what, batch=batch, ctx=ctx, sets=sets):
            fn = _first_call(what, lambda: _decode_setup(fi, ws, batch, ctx, sets))
            results[f"flashinfer_{what}_max_abs_err"] = err = fn.check()
            us, mode, eager = _graph_us(time_us, fn, calls=sets * (1 if batch > 1 else 4))
            results[f"flashinfer_{what}_us"] = us
            results[f"flashinfer_{what}_timing"] = mode
            results[f"flashinfer_{what}_eager_us"] = eager
            print(f"flashinfer {what}: {us:.1f} us ({mode}), eager {eager:.1f} us, "
                  f"max abs err {err:.3g}")
        _measure(results, what, body)

    def decode_shuffled():  # same bytes, the 131,072 pages in random order
        fn = _first_call("decode_attention_shuffled", lambda: _decode_setup(fi, ws, 32, 4096, shuffle=True))
        us, mode, _ = _graph_us(time_us, fn, calls=10)
        results["flashinfer_decode_attention_shuffled_us"] = us
        print(f"flashinfer decode_attention_shuffled: {us:.1f} us ({mode})")
    if "decode" in parts:
        _measure(results, "decode_attention_shuffled", decode_shuffled)

    # 2. extend/prefill, causal, one request: q_len = kv_len = n (paged, page_size 1; ragged too),
    #    then 1,024 new tokens over a 3,072-token cached prefix (paged).
    for n in (1024, 2048, 4096, 8192) if "extend" in parts else ():
        for layout in ("paged", "ragged"):
            what = f"extend_attention_{n}" + ("_ragged" if layout == "ragged" else "")

            def body(what=what, n=n, layout=layout):
                fn = _first_call(what, lambda: _extend_setup(fi, ws, n, ragged=layout == "ragged"))
                if n == 1024:
                    results[f"flashinfer_{what}_max_abs_err"] = fn.check()
                us, mode, _ = _graph_us(time_us, fn, calls=10)
                results[f"flashinfer_{what}_us"] = us
                results[f"flashinfer_{what}_tflops"] = tf = _causal_flops(n) / (us * 1e-6) / 1e12
                results["flashinfer_extend_backend"] = fn.backend
                print(f"flashinfer {what}: {us:.1f} us, {tf:.1f} TFLOP/s ({mode}, {fn.backend})")
            _measure(results, what, body)

    def extend_prefix():
        what = "extend_attention_prefix3k_new1k"
        fn = _first_call(what, lambda: _extend_setup(fi, ws, 1024, prefix=3072))
        results[f"flashinfer_{what}_max_abs_err"] = fn.check()
        us, mode, _ = _graph_us(time_us, fn, calls=10)
        results[f"flashinfer_{what}_us"] = us
        results[f"flashinfer_{what}_tflops"] = tf = _causal_flops(1024, 3072) / (us * 1e-6) / 1e12
        print(f"flashinfer {what}: {us:.1f} us, {tf:.1f} TFLOP/s ({mode}, {fn.backend})")
    if "extend" in parts:
        _measure(results, "extend_attention_prefix3k_new1k", extend_prefix)

    # 3. sampling from fp32 logits [256, 128256], random-normal rows of std 3 (bench/kernels.py's
    #    flat rows: top_p 0.9 keeps ~5,000 tokens). Eager time_us, as bench/kernels.py times
    #    radixserve's sampler (timed here too, on the same rows, when `ours` is given). top_p
    #    alone has no from-logits API, so its time includes flashinfer's softmax.
    S = fi.sampling
    softmax = getattr(S, "softmax", None)
    results["flashinfer_sampling_api"] = (
        ("flashinfer.sampling.softmax" if softmax else "torch.softmax")
        + "(logits) + top_p_sampling_from_probs(probs, 0.9); "
        "top_k_top_p_sampling_from_logits(logits, 50, 0.9) (top_k_first: radix top-k, softmax over "
        "the 50, top-p)")
    softmax = softmax or (lambda x: torch.softmax(x, -1))
    logits = torch.randn(256, 128256, device="cuda", dtype=torch.float32) * 3
    top50 = logits.topk(50, -1).indices

    def sample(what, fn):
        def body():
            tok = _first_call(what, lambda: fn)(0)
            if what.startswith("sampling_topk50"):
                results[f"flashinfer_{what}_in_top50"] = (
                    (top50 == tok.long()[:, None]).any(-1).float().mean().item())
            us = time_us(fn)
            results[f"flashinfer_{what}_us"] = us
            print(f"flashinfer {what}: {us:.1f} us (eager)")
            if ours and what in ours:
                mine = time_us(lambda i: ours[what](logits))
                results[f"bitmask_sample_on_flashinfer_rows_{what}_us"] = mine
                print(f"radixserve {what} on the same rows: {mine:.1f} us (eager)")
        _measure(results, what, body)

    if "sampling" in parts:
        sample("sampling_topp_only", lambda i: S.top_p_sampling_from_probs(softmax(logits), 0.9))
    if "topk" in parts:   # the radix top-k module
        sample("sampling_topk50_topp", lambda i: S.top_k_top_p_sampling_from_logits(logits, 50, 0.9))

    # 4. decode on tensor cores (the prefill kernel; SGLang's choice for GQA group >= 4): extra
    #    keys, last because it JIT-builds one more module.
    for what, batch, ctx, sets in (("decode_attention_tensor_cores", 32, 4096, 1),
                                   ("decode_attention_bs1_1k_tensor_cores", 1, 1024, 16)) \
            if "tensor_cores" in parts else ():
        def body(what=what, batch=batch, ctx=ctx, sets=sets):
            fn = _first_call(what, lambda: _decode_setup(fi, ws, batch, ctx, sets, tensor_cores=True))
            us, mode, _ = _graph_us(time_us, fn, calls=sets * (1 if batch > 1 else 4))
            results[f"flashinfer_{what}_us"] = us
            print(f"flashinfer {what}: {us:.1f} us ({mode})")
        _measure(results, what, body)


def aot_build(out_tar: str) -> None:
    """Compile the modules run() uses (bf16, head_dim 128, int32 indices, no RoPE / window /
    soft-cap) for $FLASHINFER_CUDA_ARCH_LIST without a GPU and pack them as
    flashinfer/data/aot/<name>/<name>.so, which flashinfer loads instead of JIT-building."""
    import tarfile

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.sampling import gen_sampling_module
    from flashinfer.jit.topk import gen_topk_module

    specs = [gen_batch_decode_module(BF16, BF16, BF16, I32, D, D, 0, False, False),
             gen_batch_prefill_module("fa3", BF16, BF16, BF16, I32, D, D, 0, False, False, False),
             gen_batch_prefill_module("fa2", BF16, BF16, BF16, I32, D, D, 0, False, False, False),
             gen_sampling_module(), gen_topk_module()]
    with tarfile.open(out_tar, "w:gz") as tar:
        for spec in specs:   # one failure leaves the others in the tarball
            t0 = time.time()
            try:
                spec.build()
            except Exception as e:  # noqa: BLE001
                print(f"FAILED {spec.name}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            print(f"built {spec.name} in {time.time() - t0:.0f} s")
            tar.add(spec.jit_library_path, f"flashinfer/data/aot/{spec.name}/{spec.name}.so")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--aot-build", metavar="OUT_TAR_GZ", help="only compile the modules, no GPU")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    args = p.parse_args()
    if args.aot_build:
        aot_build(args.aot_build)
        sys.exit(0)
    res: dict = {"device": torch.cuda.get_device_name()}
    from kernels import time_us   # bench/kernels.py's timer (this file's folder is on sys.path)
    run(res, time_us, tuple(args.parts.split(",")))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
