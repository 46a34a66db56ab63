"""The model on CUDA with our kernels against the CPU reference path (the default model).

1. --dtype float32: the offline Engine on CUDA (kernels) and on the CPU (torch references)
   greedy-decode 8 prompts x 48 tokens to identical token ids.
2. bfloat16 teacher forcing: the same token sequences (prompt + the CPU's greedy continuation)
   are fed through the CUDA bf16 model, once as one prefill (extend kernel) and once as prefill
   of the prompt then one decode step per token (decode kernel); each position's logits are
   compared with the CPU fp32 model's. The same bf16 model then runs through the torch
   references on the same GPU (control). Asserted:
     * top-1 agreement >= 99% of positions;
     * |logit diff| over all positions x vocabulary: mean <= BF16_MEAN_ATOL (0.11), 99.9th
       percentile <= BF16_P999_ATOL (0.6), max <= BF16_MAX_ATOL (1.5);
     * the kernel path's mean and 99.9th percentile at most KERNEL_ERR_RATIO (1.25) x the
       control's, and its agreement at most 0.5 points below the control's.
   Why these numbers: the bf16 model rounds its weights (the GGUF's dequantized fp32 values are
   not bf16 numbers) and every GEMM input and output to bf16; only the residual stream is fp32.
   Measured on the CPU (bf16 model on the torch references vs the fp32 model, same sequences,
   logits from an fp32-output LM head as on CUDA; `python tests/gpu/test_model_cuda.py`):
   mean 0.079, p99.9 0.43, max 0.81, agreement 99.50% (1385/1392). Rounding only the weights to
   bf16 (fp32 compute) already gives mean 0.033, max 0.28, 99.71%. The same model with a bf16
   residual stream measured mean 0.13, p99.9 0.94, max 1.37 (CPU) and 1.45 (H200): the mean and
   percentile bounds fail on it. The max of ~68M differences is one outlier that moves with
   rounding luck (0.8 to 1.2 in the runs here), so it only gets a loose bound against gross
   errors; the mean and p99.9 carry the precision claim.
   Agreement is the fragile part. The flips are near-ties of the fp32 model (top-1 minus top-2
   < 0.1 logit at about 4% of positions); the test prints each flip with that margin. Position
   8, inside the system prompt that every chat prompt shares, is such a tie (0.079) and counts
   16 times (1.15% of all positions). Emulating on the CPU the extend kernel's rounding of the
   softmax numerators to bf16 (the P of P V) reproduced the kernels' 98.64% on H200 with a bf16
   residual exactly; with the fp32 residual the same emulation gives mean 0.076, p99.9 0.41,
   max 1.18, but 98.20%, because that rounding flips position 8 (all 16 copies). With the
   extend kernels summing the rounded numerators into the denominator as well (exactly
   normalised weights, the kernels now) the emulation gives 99.57%; the margin error's spread
   (0.059 to 0.063 logit RMS) is the same for every variant tried, so which near-ties flip is
   rounding luck, and a resampling estimate puts the chance that any bf16 path (the torch
   references included) passes the 99% bar on these 8 prompts at roughly 0.7 to 0.85.
   H200, kernels: 1381/1392 = 99.21%, mean 0.078, p99.9 0.417, max 0.885; torch references
   on the same GPU: 99.21%, 0.088, 0.522, 0.867 (bench/results/logs/gpu-model-h200.txt).

The GGUF comes from RADIXSERVE_TEST_GGUF when set (the device machine has no package index),
else the default model's usual resolution.
"""
import os
from typing import List, NamedTuple, Sequence, Tuple

import pytest
import torch

from radixserve import ops
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.ops._ext import kernels_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available() or not kernels_available(),
                       reason="needs a CUDA device and radixserve._C"),
]

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a Python function that reverses a string.",
    "Quel temps fait-il à Paris en hiver?",
]
MAX_NEW = 48
# |logit diff| bounds of the bf16 model against the fp32 one (logits span roughly [-20, 30]);
# see the module docstring for the measurements behind them
BF16_MEAN_ATOL = 0.11
BF16_P999_ATOL = 0.6
BF16_MAX_ATOL = 1.5
KERNEL_ERR_RATIO = 1.25   # kernel path vs torch references, same model, same GPU


@pytest.fixture(scope="module")
def model_path():
    from radixserve.model.loader import resolve_model_path

    return resolve_model_path(os.environ.get("RADIXSERVE_TEST_GGUF") or None)


@pytest.fixture(scope="module")
def prompts_ids(model_path):
    from radixserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_path(model_path)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def _greedy(model_path, prompts_ids, device: str):
    """Greedy output ids of the offline Engine on device (float32), one list per prompt."""
    import radixserve

    eng = radixserve.Engine(model_path=model_path, device=device, dtype="float32")
    try:
        outs = eng.generate(input_ids=prompts_ids,
                            sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                             "ignore_eos": True})
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def cpu_greedy(model_path, prompts_ids):
    return _greedy(model_path, prompts_ids, "cpu")


def test_fp32_cuda_greedy_equals_cpu(model_path, prompts_ids, cpu_greedy):
    outs = _greedy(model_path, prompts_ids, "cuda")
    for i, (out, ref) in enumerate(zip(outs, cpu_greedy)):
        assert len(ref) == MAX_NEW
        assert out == ref, f"prompt {i} diverged"


class _Runner:
    """A KV pool + token-to-slot table on one device, driving the model one request at a time."""

    def __init__(self, model, config: ModelConfig, device: str, dtype: torch.dtype):
        self.model, self.device = model, device
        self.pool = KVPool(4096, config.num_hidden_layers, config.num_key_value_heads,
                           config.head_dim, dtype, device)
        self.rows = ReqToTokenPool(2, 1024)                                   # host rows
        self.table = torch.zeros((2, 1024), dtype=torch.int32, device=device)  # device copy

    def run(self, ids: Sequence[int], decode_from: int) -> torch.Tensor:
        """Logits [len(ids), vocab] f32 (row t predicts ids[t+1]): a prefill of
        ids[:decode_from], then one DECODE step per remaining token."""
        row = self.rows.alloc()
        slots = self.pool.alloc(len(ids))
        self.rows.write(row, 0, slots)
        self.table[row, :len(ids)] = slots.to(device=self.device, dtype=torch.int32)
        out: List[torch.Tensor] = []
        chunks = [(0, decode_from)] + [(t, t + 1) for t in range(decode_from, len(ids))]
        for start, end in chunks:
            n = end - start
            mode = ForwardMode.EXTEND if start == 0 else ForwardMode.DECODE
            dev = self.device
            seq_lens = torch.tensor([end], dtype=torch.int32, device=dev)
            kv_indptr = torch.zeros(2, dtype=torch.int32, device=dev)
            kv_indices = torch.zeros(end, dtype=torch.int32, device=dev)
            ops.build_kv_indices(self.table,
                                 torch.tensor([row], dtype=torch.int32, device=dev), seq_lens,
                                 kv_indptr, kv_indices)
            fb = ForwardBatch(
                mode=mode, batch_size=1,
                input_ids=torch.tensor(list(ids[start:end]), device=dev),
                positions=torch.arange(start, end, device=dev),
                out_cache_loc=slots[start:end].to(dev),
                qo_indptr=torch.tensor([0, n], dtype=torch.int32, device=dev),
                kv_indptr=kv_indptr, kv_indices=kv_indices, seq_lens=seq_lens,
                logits_indices=torch.arange(n, device=dev), kv_pool=self.pool)
            with torch.inference_mode():
                hidden = self.model(fb)
                out.append(self.model.compute_logits(hidden).float().cpu())
        self.pool.free(slots)
        self.rows.free(row)
        return torch.cat(out)


class TeacherForcing(NamedTuple):
    agree: int              # positions whose top-1 equals the fp32 model's
    total: int              # positions compared
    mean: float             # mean |logit diff| over positions x vocabulary
    p999: float             # its 99.9th percentile
    max: float              # its maximum
    flips: List[Tuple[int, int, float]]   # (sequence, position, fp32 top-1 minus top-2 logit)

    def summary(self) -> str:
        return (f"top-1 agreement {self.agree}/{self.total} = {self.agree / self.total:.4f}, "
                f"|logit diff| mean {self.mean:.4f} p99.9 {self.p999:.3f} max {self.max:.3f}")


def _teacher_forcing(ref_runner: "_Runner", runner: "_Runner", prompts_ids,
                     continuations) -> TeacherForcing:
    """runner's logits against ref_runner's over every sequence (prompt + continuation), fed to
    runner as one prefill and as prefill + one decode step per continuation token; ref_runner
    runs one prefill. Works on any devices (the runners' logits come back on the CPU)."""
    agree = total = 0
    diffs: List[torch.Tensor] = []
    flips: List[Tuple[int, int, float]] = []
    for i, (prompt, cont) in enumerate(zip(prompts_ids, continuations)):
        seq = prompt + cont
        ref = ref_runner.run(seq, len(seq))                # [len(seq), vocab] f32
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        for decode_from in (len(seq), len(prompt)):        # all-extend, then extend + decodes
            got = runner.run(seq, decode_from)
            assert got.shape == ref.shape and torch.isfinite(got).all()
            same = got.argmax(-1) == ref.argmax(-1)
            agree += int(same.sum())
            total += ref.shape[0]
            diffs.append((got - ref).abs().flatten())
            flips += [(i, t, round(float(margin[t]), 3)) for t in (~same).nonzero().flatten().tolist()]
    d = torch.cat(diffs)                                   # [positions * vocab]
    k = max(1, int(0.999 * d.numel()))
    return TeacherForcing(agree, total, float(d.mean()), float(d.kthvalue(k).values),
                          float(d.max()), flips)


def test_bf16_teacher_forcing_matches_cpu_fp32(model_path, prompts_ids, cpu_greedy, monkeypatch):
    from radixserve.model.loader import load_model

    config = ModelConfig.from_path(model_path)
    cpu = _Runner(load_model(model_path, config, "auto", torch.float32, "cpu"), config, "cpu",
                  torch.float32)
    gpu = _Runner(load_model(model_path, config, "auto", torch.bfloat16, "cuda"), config, "cuda",
                  torch.bfloat16)
    kern = _teacher_forcing(cpu, gpu, prompts_ids, cpu_greedy)
    # control: the same bf16 model on CUDA through the torch references instead of our kernels,
    # so the kernels' own share of the bf16 error is visible
    monkeypatch.setattr(ops, "_use_kernel", lambda t: False)
    ctrl = _teacher_forcing(cpu, gpu, prompts_ids, cpu_greedy)
    print(f"bf16 teacher forcing vs CPU fp32\n  kernels:          {kern.summary()}\n"
          f"    flips (seq, pos, fp32 margin): {kern.flips}\n"
          f"  torch references: {ctrl.summary()}\n    flips (seq, pos, fp32 margin): {ctrl.flips}")
    # the kernels' error is the bf16 model's, not more (a kernel bug shows up as far more)
    assert kern.mean <= KERNEL_ERR_RATIO * ctrl.mean
    assert kern.p999 <= KERNEL_ERR_RATIO * ctrl.p999
    assert kern.agree / kern.total >= ctrl.agree / ctrl.total - 0.005
    for run in (kern, ctrl):
        assert run.mean <= BF16_MEAN_ATOL
        assert run.p999 <= BF16_P999_ATOL
        assert run.max <= BF16_MAX_ATOL
    assert kern.agree / kern.total >= 0.99


def _cpu_measurement() -> None:
    """The CPU numbers of the module docstring: the bf16 model on the torch references against
    the fp32 model, both on the CPU, with the LM head's logits in fp32 from the bf16 weights (as
    the CUDA GEMM makes them; the CPU's bf16 F.linear would round them to bf16)."""
    import torch.nn.functional as F

    from radixserve.model import llama
    from radixserve.model.loader import load_model, resolve_model_path
    from radixserve.tokenizer.tokenizer import Tokenizer

    def lm_head_fp32(head, hidden):
        return F.linear(hidden.float(), head.weight.float())[:, :head.num_embeddings]

    llama.lm_head_logits = lm_head_fp32
    path = resolve_model_path(os.environ.get("RADIXSERVE_TEST_GGUF") or None)
    tok = Tokenizer.from_path(path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    greedy = _greedy(path, prompts, "cpu")
    config = ModelConfig.from_path(path)
    fp32 = _Runner(load_model(path, config, "auto", torch.float32, "cpu"), config, "cpu",
                   torch.float32)
    bf16 = _Runner(load_model(path, config, "auto", torch.bfloat16, "cpu"), config, "cpu",
                   torch.bfloat16)
    run = _teacher_forcing(fp32, bf16, prompts, greedy)
    print(f"CPU bf16 (torch references) vs CPU fp32: {run.summary()}\n"
          f"  flips (seq, pos, fp32 margin): {run.flips}")


if __name__ == "__main__":
    # PYTHONPATH=pysrc RADIXSERVE_DISABLE_KERNELS=1 python tests/gpu/test_model_cuda.py (~1 min)
    _cpu_measurement()
