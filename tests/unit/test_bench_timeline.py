"""radixserve.bench.timeline: busy time, gaps and their attribution from device records."""
from radixserve.bench.timeline import Record, records_from_chrome_trace, short_name, summarize_records


def test_busy_span_and_gaps_of_one_stream():
    recs = [Record(7, 0.0, 10.0, "void ns::gemm<float>(Params)"),
            Record(7, 12.0, 20.0, "attn"),
            Record(7, 50.0, 55.0, "void ns::gemm<float>(Params)"),
            Record(7, 57.0, 60.0, "attn")]
    s = summarize_records(recs)
    st = s["streams"]["7"]
    assert st["records"] == 4
    assert st["busy_us"] == 26.0 and st["span_us"] == 60.0 and st["gap_us"] == 34.0
    assert st["gaps_over_10us_us"] == 30.0            # only the 20 -> 50 stretch
    top = st["top_gaps"][0]
    assert (top["after"], top["before"], top["us"], top["count"]) == ("attn", "ns::gemm", 30.0, 1)
    pair = next(g for g in st["top_gaps"] if g["after"] == "ns::gemm")
    assert pair["us"] == 4.0 and pair["count"] == 2   # 10 -> 12 and 55 -> 57
    assert st["top_records"] == [{"name": "ns::gemm", "us": 15.0, "count": 2},
                                 {"name": "attn", "us": 11.0, "count": 2}]


def test_overlapping_records_count_once_and_streams_union():
    recs = [Record(1, 0.0, 10.0, "a"), Record(1, 5.0, 8.0, "b"), Record(1, 9.0, 14.0, "c"),
            Record(2, 12.0, 30.0, "copy")]
    s = summarize_records(recs)
    assert s["streams"]["1"]["busy_us"] == 14.0 and s["streams"]["1"]["gap_us"] == 0.0
    assert s["device_busy_us"] == 30.0 and s["span_us"] == 30.0


def test_gap_is_charged_to_the_record_that_ended_last():
    # b starts inside a and ends before it: the gap before c follows a's end, not b's
    recs = [Record(0, 0.0, 10.0, "a"), Record(0, 2.0, 4.0, "b"), Record(0, 13.0, 14.0, "c")]
    st = summarize_records(recs)["streams"]["0"]
    assert st["top_gaps"] == [{"after": "a", "before": "c", "us": 3.0, "count": 1}]


def test_empty_and_chrome_trace_parsing():
    assert summarize_records([])["device_busy_us"] == 0.0
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 100.0, "dur": 5.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 90.0, "dur": 2.0, "tid": 9},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0}]}
    recs = records_from_chrome_trace(trace)
    assert sorted(recs) == [Record(7, 100.0, 105.0, "k1"), Record(9, 90.0, 92.0, "Memcpy HtoD")]


def test_short_name_drops_templates_and_arguments():
    assert short_name("void radixserve::attn::paged_decode_kernel<__nv_bfloat16, 128>(P)") == \
        "radixserve::attn::paged_decode_kernel"
    assert short_name("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == \
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"


def test_records_from_profile_reads_the_exported_trace():
    import json

    from radixserve.bench.timeline import records_from_profile, summarize_profile

    class FakeProfile:       # what torch.profiler.profile offers: export_chrome_trace(path)
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": [
                    {"ph": "X", "cat": "kernel", "name": "k", "ts": 5.0, "dur": 2.0,
                     "args": {"stream": 3}},
                    {"ph": "X", "cat": "kernel", "name": "k", "ts": 9.0, "dur": 1.0,
                     "args": {"stream": 3}}]}, f)

    assert records_from_profile(FakeProfile()) == [Record(3, 5.0, 7.0, "k"), Record(3, 9.0, 10.0, "k")]
    assert summarize_profile(FakeProfile())["streams"]["3"]["gap_us"] == 2.0
