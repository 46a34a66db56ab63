"""Decode-batch GEMMs against the weight-streaming floor: how far cuBLAS (torch's F.linear, what
the model runs for decode batches above ops.SKINNY_MAX_ROWS) is from the bytes it must move, at
the linear-layer shapes of a preset, for the batch sizes a serving run decodes at (issue 33:
the decode step at batch 32-128 was 1.3x its bandwidth ideal in the arrival-bound run).

For each shape (N, K) and batch M: the median time of y = x @ w.T over --iters launches
(CUDA events; the weight rotates among enough copies that every launch reads it from HBM, not
L2), the bytes it must move (w + x + y), and that over the device-to-device copy bandwidth
measured in the same process (the floor). A Triton probe (a plain tiled kernel, swept over a
few tile shapes, computing y^T = w @ x^T so the weight rows fill the tensor cores' M side)
says how much of the gap any kernel can close at each point; its outputs are checked against
cuBLAS's. Prints one table; --out writes the numbers as JSON with the command.

    python bench/gemm_decode.py --preset llama-3.1-8b --out bench/results/gemm-decode-h100.json

--fp8 adds, per point, the FP8-weight GEMMs of issue 35 against the FP8 floor (one byte per
weight): our fp8_skinny_linear (e4m3 weights, bf16 math; batches of up to 16 rows) when
radixserve._C is built, and torch._scaled_mm with rowwise scales (W8A8: x quantized per token,
outside the timing) at every batch size.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve.model.weight_floor import copy_bandwidth  # noqa: E402

L2_BYTES = 64 << 20     # a little over an H100/H200's L2: copies rotate past it


def preset_shapes(name: str):
    """[(label, N, K)] of one decoder layer's linear layers (q|k|v, o, gate|up, down) and the
    LM head, from the preset's published config."""
    from radixserve.bench.presets import PRESETS
    c = PRESETS[name].config
    h, inter = c["hidden_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // heads
    return [("qkv", (heads + 2 * kv) * hd, h), ("o", h, heads * hd),
            ("gate_up", 2 * inter, h), ("down", h, inter), ("lm_head", c["vocab_size"], h)]


def time_fn(fn, copies, iters: int) -> float:
    """Median seconds of fn(copy) over iters launches, cycling through copies."""
    for c in copies[:3]:
        fn(c)
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c = copies[i % len(copies)]
        a.record()
        fn(c)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def triton_probe():
    """A Triton kernel y[M, N] = x[M, K] @ w[N, K]^T computed as w-tile @ x-tile^T, or None
    when Triton is missing. Returns run(x, w, bn, bk, stages, warps) -> y."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)                  # weight rows (output columns)
        rm = tl.arange(0, BM)                             # activation rows
        rk = tl.arange(0, BK)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :],
                        mask=(rn[:, None] < N) & ((k0 + rk)[None, :] < K), other=0.0)
            x = tl.load(x_ptr + rm[None, :] * K + (k0 + rk)[:, None],
                        mask=(rm[None, :] < M) & ((k0 + rk)[:, None] < K), other=0.0)
            acc = tl.dot(w, x, acc)                        # [BN, BK] @ [BK, BM]
        tl.store(y_ptr + rm[None, :] * N + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[None, :] < M) & (rn[:, None] < N))

    def run(x, w, bn, bk, stages, warps):
        m, k = x.shape
        n = w.shape[0]
        bm = max(16, triton.next_power_of_2(m))
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, BM=bm, BN=bn, BK=bk,
                                      num_stages=stages, num_warps=warps)
        return y
    return run


def fp8_times(x, copies, iters: int):
    """{"fp8_skinny_us", "scaled_mm_us"} for x [m, k] against e4m3 copies of the weights (each
    checked against the dequantized product first)."""
    from radixserve.ops._ext import kernels_available
    qs = []
    for w in copies:
        scale = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
        qs.append(((w.float() / scale).to(torch.float8_e4m3fn), scale.reshape(-1).contiguous()))
    ref = x.float() @ (qs[0][0].float() * qs[0][1][:, None]).t()
    out = {}
    if kernels_available() and x.shape[0] <= 16:
        y = torch.ops.radixserve.fp8_skinny_linear(x, qs[0][0], qs[0][1], None).float()
        assert torch.allclose(y, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
        out["fp8_skinny_us"] = 1e6 * time_fn(
            lambda q: torch.ops.radixserve.fp8_skinny_linear(x, q[0], q[1], None), qs, iters)
    xs = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    xq = (x.float() / xs).to(torch.float8_e4m3fn)
    try:
        def smm(q):
            return torch._scaled_mm(xq, q[0].t(), scale_a=xs, scale_b=q[1][None, :],
                                    out_dtype=torch.bfloat16)
        y = smm(qs[0]).float()
        assert torch.allclose(y, ref, rtol=8e-2, atol=8e-2 * ref.abs().max().item())
        out["scaled_mm_us"] = 1e6 * time_fn(smm, qs, iters)
    except RuntimeError as e:        # a torch without rowwise scaling on this card
        out["scaled_mm_error"] = str(e).splitlines()[0][:200]
    return out


TRITON_CONFIGS = [(bn, bk, st, wp) for bn in (64, 128) for bk in (128, 256)
                  for st in (3, 5) for wp in (4, 8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--batch-sizes", default="1,8,16,32,48,64,96,128,192,256")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-triton", action="store_true")
    p.add_argument("--fp8", action="store_true", help="time the FP8-weight GEMMs too (doc)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    probe = None if args.no_triton else triton_probe()
    rows = []
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'shape':>8} {'N':>6} {'K':>6} {'M':>4} {'floor us':>9} {'cublas us':>10} "
          f"{'x floor':>8} {'triton us':>10} {'x floor':>8}  best triton (BN,BK,stages,warps)")
    for label, n, k in preset_shapes(args.preset):
        wbytes = n * k * 2
        copies = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                  for _ in range(max(2, -(-2 * L2_BYTES // wbytes)))]
        for m in [int(v) for v in args.batch_sizes.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            floor = (wbytes + 2 * m * (n + k)) / bw
            t_cublas = time_fn(lambda w: F.linear(x, w), copies, args.iters)
            best = None
            if probe is not None and m <= 256:
                ref = F.linear(x, copies[0]).float()
                for cfg in TRITON_CONFIGS:
                    try:
                        y = probe(x, copies[0], *cfg).float()
                    except Exception:      # noqa: BLE001 - a config that does not compile
                        continue
                    if not torch.allclose(y, ref, rtol=2e-2, atol=2e-2):
                        raise AssertionError(f"triton probe {cfg} disagrees at {label} M={m}")
                    t = time_fn(lambda w: probe(x, w, *cfg), copies, max(10, args.iters // 3))
                    if best is None or t < best[0]:
                        best = (t, cfg)
            row = {"shape": label, "N": n, "K": k, "M": m, "floor_us": floor * 1e6,
                   "cublas_us": t_cublas * 1e6, "cublas_over_floor": t_cublas / floor}
            if best is not None:
                row.update(triton_us=best[0] * 1e6, triton_over_floor=best[0] / floor,
                           triton_config=list(best[1]))
            if args.fp8:
                row.update(fp8_times(x, copies, args.iters))
                row["fp8_floor_us"] = (wbytes / 2 + 2 * m * (n + k)) / bw * 1e6
            rows.append(row)
            if args.fp8:
                print("         fp8 floor {:.1f} us: ".format(row["fp8_floor_us"]) + ", ".join(
                    f"{key} {row[key]:.1f} us ({row[key] / row['fp8_floor_us']:.2f}x)"
                    for key in ("fp8_skinny_us", "scaled_mm_us") if key in row))
            print(f"{label:>8} {n:>6} {k:>6} {m:>4} {floor * 1e6:>9.1f} {t_cublas * 1e6:>10.1f} "
                  f"{t_cublas / floor:>8.2f} "
                  + (f"{best[0] * 1e6:>10.1f} {best[0] / floor:>8.2f}  {best[1]}" if best else ""))
        del copies
    # per batch size: one layer set (q|k|v, o, gate|up, down) x layers + lm_head, both ways
    from radixserve.bench.presets import PRESETS
    layers = PRESETS[args.preset].config["num_hidden_layers"]
    summary = {}
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m]
        mult = {r["shape"]: (1 if r["shape"] == "lm_head" else layers) for r in sel}
        tot = {key: sum(r[key] * mult[r["shape"]] for r in sel if key in r)
               for key in ("floor_us", "cublas_us", "triton_us")}
        summary[m] = tot
        print(f"M={m:>4}: step GEMMs floor {tot['floor_us'] / 1e3:.2f} ms, cuBLAS "
              f"{tot['cublas_us'] / 1e3:.2f} ms ({tot['cublas_us'] / tot['floor_us']:.2f}x)"
              + (f", best triton {tot['triton_us'] / 1e3:.2f} ms "
                 f"({tot['triton_us'] / tot['floor_us']:.2f}x)" if tot.get("triton_us") else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python bench/gemm_decode.py " + " ".join(sys.argv[1:]),
                       "device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9,
                       "rows": rows, "per_step": summary}, f, indent=1)


if __name__ == "__main__":
    main()
