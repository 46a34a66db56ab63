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
"""
import os
import sys

import pytest

# The source tree's package first, unless RADIXSERVE_TEST_INSTALLED=1: then the tests run against
# the installed radixserve (a wheel's: bench/gpu_session.sh stage wheel) and say where it is.
_PYSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pysrc")
if os.environ.get("RADIXSERVE_TEST_INSTALLED") != "1" and _PYSRC not in sys.path:
    sys.path.insert(0, _PYSRC)


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
