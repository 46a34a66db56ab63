"""The W8A8 decode GEMMs of a whole model step, four ways of calling torch._scaled_mm (issue 35:
at serving batches of 16-256 rows the FP8 GEMMs streamed their weights at ~0.57 of copy
bandwidth, bench/results/h100-2026-12-07-late.md, while the step is weight-streaming bound).

Each GEMM is ops.scaled_mm_rowwise, the call ops.fp8_scaled_mm makes under the knob
RADIXSERVE_FP8_SCALED_MM. For each row count M of --rows, one CUDA graph runs the four
projections of every layer of the Llama-3.1-8B shape (--layers x [q|k|v 6144 x 4096, o 4096 x 4096, gate|up 28672 x 4096, down
4096 x 14336], each layer its own e4m3 weights, so nothing is reused from L2), as:
  plain       _scaled_mm(x [M, K], w.t() [K, N]), rowwise scales: what ops.fp8_scaled_mm does
  fast        the same with use_fast_accum=True (the tensor cores' own accumulation over K, as
              vLLM's CUTLASS FP8 kernels for Hopper run)
  swap        out.t() = _scaled_mm(w [N, K], x.t() [K, M]): the weight as the first operand, so
              the library tiles the long N side (needs M % 16 == 0); the [N, M] output is
              transposed back with a copy (counted)
  swap-fast   both
Reported: ms a step (median of --reps graph replays), the weight floor (FP8 weight bytes over a
device-to-device copy's bandwidth measured here) and the ratio; and whether each variant's
output equals plain's (max |diff| over the outputs' magnitude), so a fast variant that loses
accuracy shows it.

    python bench/scaled_mm_variants.py --rows 16,32,64,128,256 --out bench/results/scaled-mm-variants-h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve import ops  # noqa: E402
from radixserve.model.weight_floor import copy_bandwidth  # noqa: E402

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
VARIANTS = ("plain", "fast", "swap", "swap-fast")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128,256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = []
    for _ in range(args.layers):
        layer = []
        for name, n, k in SHAPES:
            w = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
            ws = torch.rand(n, device=dev) * 0.01 + 0.001
            layer.append((name, w, ws))
        layers.append(layer)
    weight_bytes = sum(w.numel() for layer in layers for _, w, _ in layer)
    bw = copy_bandwidth(dev)
    floor_ms = weight_bytes / bw * 1e3
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"{weight_bytes / 1e9:.2f} GB of FP8 weights, floor {floor_ms:.3f} ms a step")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_bytes_per_s": bw, "weight_bytes": weight_bytes,
              "floor_ms": floor_ms, "layers": args.layers, "rows": {}}
    for m in rows:
        xs_in = {k: torch.randn(m, k, device=dev) for k in {k for _, _, k in SHAPES}}
        acts = {}
        for k, x in xs_in.items():
            scale = x.abs().amax(dim=1, keepdim=True) / 448.0
            acts[k] = ((x / scale).to(torch.float8_e4m3fn), scale.float().contiguous())
        row = {}
        ref_out = None
        for variant in VARIANTS:
            if variant.startswith("swap") and m % 16:
                row[variant] = {"error": "M % 16 != 0"}
                continue

            def step():
                outs = []
                for layer in layers:
                    for name, w, ws in layer:
                        x8, xsc = acts[w.shape[1]]
                        outs.append(ops.scaled_mm_rowwise(x8, xsc, w, ws, variant))
                return outs[:4]               # layer 0's outputs, for the comparison
            try:
                first = step()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graph.replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(args.reps):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                del graph
            except RuntimeError as e:                      # a variant the library refuses
                row[variant] = {"error": str(e).splitlines()[0][:200]}
                print(f"M {m:4d} {variant:9s} refused: {row[variant]['error']}")
                continue
            ms = statistics.median(times)
            entry = {"ms": ms, "over_floor": ms / floor_ms}
            if ref_out is None:
                ref_out = [o.float() for o in first]
            else:
                entry["max_rel_diff_vs_plain"] = max(
                    ((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                    for o, r in zip(first, ref_out))
            row[variant] = entry
            extra = (f", max rel diff vs plain {entry['max_rel_diff_vs_plain']:.2e}"
                     if "max_rel_diff_vs_plain" in entry else "")
            print(f"M {m:4d} {variant:9s} {ms:7.3f} ms a step ({ms / floor_ms:.2f}x floor){extra}")
        result["rows"][str(m)] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
