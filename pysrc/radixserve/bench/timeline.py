"""Where the device's time goes between kernels: a summary of a torch profiler trace's device
records (kernels, memcpys, memsets), stream by stream.

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ...
    summary = summarize_profile(prof)    # or summarize_records(records) for records in hand

A record is (stream, start_us, end_us, name). For each stream: its busy time (the union of its
records' intervals), its span (first start to last end) and its gaps (the idle stretches
between consecutive records), the gaps summed by the pair of records around them, so the
largest entries say which boundaries the idle time sits at. Across streams: the device's busy
time (the union over all streams), the figure a device-busy fraction is made of.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from typing import Dict, Iterable, List, NamedTuple, Tuple


class Record(NamedTuple):
    stream: int
    start: float       # us
    end: float         # us
    name: str


def short_name(name: str, width: int = 60) -> str:
    """A kernel's name without its template and argument lists (CUTLASS / cuBLAS names stay)."""
    base = name.split("(")[0].split("<")[0].strip()
    if base.startswith("void "):
        base = base[5:]
    return base[-width:]


def _union_us(intervals: List[Tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize_records(records: Iterable[Record], top: int = 20) -> dict:
    """-> {"device_busy_us", "span_us", "streams": {stream: {...}}} where each stream has
    records, busy_us, span_us, gap_us (span - busy: idle stretches between its records, overlaps
    counted once), gaps_over_10us_us, top_records: [{"name", "us", "count"}], the records' own
    time summed by short name, largest first, and top_gaps: [{"after", "before", "us", "count"}], the
    largest sums of gap time by (the record that ended, the record that started)."""
    by_stream: Dict[int, List[Record]] = defaultdict(list)
    for r in records:
        by_stream[r.stream].append(r)
    all_iv = [(r.start, r.end) for rs in by_stream.values() for r in rs]
    if not all_iv:
        return {"device_busy_us": 0.0, "span_us": 0.0, "streams": {}}
    out = {"device_busy_us": _union_us(all_iv),
           "span_us": max(e for _, e in all_iv) - min(s for s, _ in all_iv), "streams": {}}
    for stream, rs in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        rs.sort(key=lambda r: r.start)
        pairs: Dict[Tuple[str, str], List[float]] = defaultdict(lambda: [0.0, 0])
        big, last_end, last_name = 0.0, None, None
        for r in rs:
            if last_end is not None and r.start > last_end:
                gap = r.start - last_end
                p = pairs[(last_name, short_name(r.name))]
                p[0] += gap
                p[1] += 1
                big += gap if gap > 10.0 else 0.0
            if last_end is None or r.end >= last_end:
                last_end, last_name = r.end, short_name(r.name)
        busy = _union_us([(r.start, r.end) for r in rs])
        span = max(r.end for r in rs) - rs[0].start
        by_name: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
        for r in rs:
            entry = by_name[short_name(r.name)]
            entry[0] += r.end - r.start
            entry[1] += 1
        out["streams"][str(stream)] = {
            "records": len(rs), "busy_us": busy, "span_us": span, "gap_us": span - busy,
            "gaps_over_10us_us": big,
            "top_records": [{"name": n, "us": v[0], "count": v[1]}
                            for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
            "top_gaps": [{"after": a, "before": b, "us": v[0], "count": v[1]}
                         for (a, b), v in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]]}
    return out


def records_from_chrome_trace(trace: dict) -> List[Record]:
    """The device records of a chrome trace as torch.profiler exports it: complete events
    ("ph": "X") of category kernel, gpu_memcpy or gpu_memset; the stream from args.stream (else
    the tid)."""
    cats = ("kernel", "gpu_memcpy", "gpu_memset")
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in cats:
            continue
        stream = ev.get("args", {}).get("stream", ev.get("tid", 0))
        start = float(ev["ts"])
        out.append(Record(int(stream), start, start + float(ev.get("dur", 0.0)), ev.get("name", "")))
    return out


def records_from_profile(prof) -> List[Record]:
    """A finished torch.profiler.profile's device records (through its chrome-trace export,
    which keeps each record's stream)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return records_from_chrome_trace(json.load(f))
    finally:
        os.unlink(path)


def summarize_profile(prof, top: int = 20) -> dict:
    """summarize_records of a finished torch.profiler.profile's device records."""
    return summarize_records(records_from_profile(prof), top)
