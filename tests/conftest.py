"""Session fixtures shared by unit and e2e tests.

Everything here is lazy: a test that does not name a fixture never pays for it. The default
model is downloaded/converted once per machine (cached under radixserve's cache dir) and loaded
once per session.
  default_model_path  HF-style directory of SmolLM2-135M-Instruct (our conversion)
  hf_gguf_model       HF transformers' model of the GGUF, fp32, eval mode: the correctness
                      oracle. Loaded with HF's own loader from the directory that HF's GGUF
                      import wrote (gguf_convert.py), since dequantizing the GGUF again costs
                      ~20 s of CPU per session; test_loader.py checks that directory's tensors
                      against the GGUF's, dequantized independently with the gguf package.
  hf_gguf_tokenizer   HF tokenizer of the GGUF (chat template included), loaded the same way
  default_tokenizer   our Tokenizer for the default model
After each test module its garbage is collected and the C heap's free pages go back to the
system (release_module_memory): make test runs two xdist workers, each for many modules in
turn, and without that their freed model and KV buffers stayed in glibc's per-thread arenas
(a worker reached 12 GB of RSS holding ~1 GB of live tensors, and the kernel OOM-killed it).
"""
import ctypes
import ctypes.util
import gc
import os
import sys

import pytest

# The source tree's package first, unless RADIXSERVE_TEST_INSTALLED=1: then the tests run against
# the installed radixserve (a wheel's: bench/gpu_session.sh stage wheel) and say where it is.
_PYSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pysrc")
if os.environ.get("RADIXSERVE_TEST_INSTALLED") != "1" and _PYSRC not in sys.path:
    sys.path.insert(0, _PYSRC)


def _malloc_trim():
    """glibc's malloc_trim(0), or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


@pytest.fixture(scope="module", autouse=True)
def release_module_memory():
    """After a module: free its garbage and return the heap's free pages to the system."""
    yield
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


def pytest_report_header(config):
    import radixserve
    return f"radixserve {radixserve.__version__} from {os.path.dirname(radixserve.__file__)}"


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from radixserve.model.default_model import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from radixserve.model.default_model import default_gguf_path as find

    return find()


@pytest.fixture(scope="session")
def hf_gguf_model(default_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from radixserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(default_model_path)
