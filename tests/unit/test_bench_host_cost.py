"""bench/host_cost.py's reading of the server's counters."""
import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "host_cost.py")


def _load():
    """The script as a module, without leaving bench/ on sys.path (its kernels.py would shadow
    the `kernels` package that transformers imports) or its sibling modules in sys.modules."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("host_cost", _PATH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if getattr(sys.modules[name], "__file__", "") and \
                    os.path.dirname(os.path.abspath(sys.modules[name].__file__)) == \
                    os.path.dirname(os.path.abspath(_PATH)):
                del sys.modules[name]


host_cost = _load()

PAGE = """# HELP radixserve:generation_tokens_total Tokens generated
# TYPE radixserve:generation_tokens_total counter
radixserve:generation_tokens_total{model_name="m"} 24576.0
radixserve:loop_thread_cpu_seconds_total{model_name="m"} 2.125
radixserve:loop_thread_cpu_seconds_created{model_name="m"} 1.7e9
"""


def test_counter_reads_the_total_whatever_the_prefix_and_labels():
    assert host_cost.counter(PAGE, "generation_tokens") == 24576.0
    assert host_cost.counter(PAGE, "loop_thread_cpu_seconds") == 2.125
    assert host_cost.counter(PAGE.replace("radixserve:", ""), "generation_tokens") == 24576.0
    with pytest.raises(RuntimeError, match="forward_thread_cpu_seconds"):
        host_cost.counter(PAGE, "forward_thread_cpu_seconds")


def test_the_tiny_shape_keeps_heads_consistent():
    t = host_cost.TINY
    assert t["num_attention_heads"] * t["head_dim"] == t["hidden_size"]
    assert t["num_attention_heads"] % t["num_key_value_heads"] == 0
