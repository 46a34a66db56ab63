"""PNG plots of `radixserve bench serving` results (matplotlib, Agg backend: no display needed).

Every function takes the result dict that serving writes as JSON (or a part of it):
  result["sweep"][config] = [point, ...]    one point per --sweep-concurrency level: the metrics
                                           of metrics.summarize plus "max_concurrency"
  result["runs"][config]  = metrics        --compare without a sweep
  result["metrics"]       = metrics        one server
and metrics["per_request"] holds the per-request "ttft_ms" list and "itl_ms" lists. Results
written before the SGLang key names (output_token_throughput for output_throughput) plot too.

    radixserve bench plots RESULT.json      # (re)draw the plots of a saved result
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

LABELS = {"overlap": "overlap on", "no-overlap": "overlap off (--disable-overlap-schedule)",
          "default": "radixserve"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def output_throughput(metrics: Dict) -> float:
    """Output tokens/s of a run (SGLang's key; the older output_token_throughput too)."""
    if "output_throughput" in metrics:
        return metrics["output_throughput"]
    return metrics["output_token_throughput"]


def _label(config: str) -> str:
    return LABELS.get(config, config)


def _title(result: Dict) -> str:
    args = result.get("args") or {}
    server = result.get("server") or {}
    model = args.get("preset") or server.get("model") or server.get("served_model_name") or ""
    return " ".join(x for x in (model, args.get("dataset", "")) if x)


def plot_throughput_vs_concurrency(result: Dict, path: str) -> str:
    """Output tokens/s against max concurrency (log2 axis), one line per server configuration
    of result["sweep"]. Writes path; returns it. KeyError when result has no sweep."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, points in result["sweep"].items():
        xs = [p["max_concurrency"] for p in points]
        ys = [output_throughput(p) for p in points]
        ax.plot(xs, ys, marker="o", label=_label(config))
    ax.set_xscale("log", base=2)
    ticks = sorted({p["max_concurrency"] for pts in result["sweep"].values() for p in pts})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title(("output throughput vs concurrency  " + _title(result)).strip())
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def latency_series(result: Dict, concurrency: Optional[int] = None) -> Tuple[Dict[str, Dict], str]:
    """{config: metrics} to compare as CDFs, and a caption. From a sweep: the points at
    `concurrency` (default: the highest level every configuration ran); else the runs, else the
    one run."""
    if result.get("sweep"):
        levels = [set(p["max_concurrency"] for p in pts) for pts in result["sweep"].values()]
        common = set.intersection(*levels)
        c = concurrency if concurrency is not None else max(common)
        series = {config: next(p for p in pts if p["max_concurrency"] == c)
                  for config, pts in result["sweep"].items()}
        return series, f"max concurrency {c}"
    if result.get("runs"):
        return dict(result["runs"]), ""
    return {"default": result["metrics"]}, ""


def _cdf(ax, values: List[float], label: str) -> None:
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_latency_cdfs(result: Dict, path: str, concurrency: Optional[int] = None) -> str:
    """Two panels: the CDF of TTFT over requests and the CDF of ITL over all streamed gaps, one
    line per configuration (latency_series). Writes path; returns it. ValueError when no
    configuration has per-request data."""
    series, caption = latency_series(result, concurrency)
    series = {k: m for k, m in series.items() if m.get("per_request", {}).get("ttft_ms")}
    if not series:
        raise ValueError("the result has no per-request TTFT/ITL lists (metrics['per_request'])")
    plt = _pyplot()
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4.5))
    lowest = {ax_ttft: float("inf"), ax_itl: float("inf")}
    for config, m in series.items():
        per = m["per_request"]
        _cdf(ax_ttft, per["ttft_ms"], _label(config))
        lowest[ax_ttft] = min(lowest[ax_ttft], *per["ttft_ms"])
        itl = [x for gaps in per["itl_ms"] for x in gaps]
        if itl:
            _cdf(ax_itl, itl, _label(config))
            lowest[ax_itl] = min(lowest[ax_itl], *itl)
    for ax, what in ((ax_ttft, "time to first token (ms)"), (ax_itl, "inter-token latency (ms)")):
        ax.set_xlabel(what)
        ax.set_ylabel("fraction")
        # chunks that arrive in one read have a gap of 0 ms: linear below 0.1 ms, then log
        if lowest[ax] > 0:
            ax.set_xscale("log")
        else:
            ax.set_xscale("symlog", linthresh=0.1)
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
    ax_ttft.set_title("TTFT CDF")
    ax_itl.set_title("ITL CDF")
    fig.suptitle(" ".join(x for x in (_title(result), caption) if x))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(result: Dict, output_file: str) -> List[str]:
    """The plots that result supports, next to output_file (X.json or X.jsonl -> X-throughput.png when it
    has a sweep, X-latency-cdf.png when it has per-request data); returns their paths."""
    stem = os.path.splitext(output_file)[0]
    paths = []
    if result.get("sweep"):
        paths.append(plot_throughput_vs_concurrency(result, stem + "-throughput.png"))
    try:
        paths.append(plot_latency_cdfs(result, stem + "-latency-cdf.png"))
    except (ValueError, KeyError):
        pass
    return paths


def main(argv=None) -> List[str]:
    """`radixserve bench plots RESULT.json ...`: redraw the plots of saved JSON results."""
    p = argparse.ArgumentParser(prog="radixserve bench plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    paths: List[str] = []
    for name in p.parse_args(argv).results:
        with open(name) as f:
            for path in write_plots(json.load(f), name):
                print("wrote", path)
                paths.append(path)
    return paths
