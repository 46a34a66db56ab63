"""bench/host_cost.py (its counters come from radixserve.bench.server_steps, which
test_bench_serving tests)."""
import importlib.util
import os
import sys

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

def test_the_tiny_shape_keeps_heads_consistent():
    t = host_cost.TINY
    assert t["num_attention_heads"] * t["head_dim"] == t["hidden_size"]
    assert t["num_attention_heads"] % t["num_key_value_heads"] == 0
