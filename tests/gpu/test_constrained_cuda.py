"""Constrained decoding on the GPU: the grammar slot (forward launched, mask filled on the host
while it runs, pinned mask copied up, bitmask_sample's kernel applying it), decode as CUDA
graphs, overlap on. The model is the smollm2-135m preset (real shape and vocabulary, generated
tokenizer) with rescaled random weights: unmasked, its output would be noise, so every output
validating shows the mask is applied on the device. Free rows in the same batches equal their
serial-loop run; integrity holds after every turn."""
from __future__ import annotations

import json
import re

import pytest

from _gpu import requires_kernels, rescale_dummy_weights
from radixserve.config import ModelConfig, ServerArgs

pytestmark = requires_kernels

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["alpha", "beta", "gamma"]},
    "ok": {"type": "boolean"},
    "name": {"type": "string", "maxLength": 6}}, "required": ["id", "tag", "ok", "name"]}
PHONE = r"\d{3}-\d{4}"


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    from radixserve.bench.presets import build_preset

    return build_preset("smollm2-135m", str(tmp_path_factory.mktemp("smollm2_preset")))


@pytest.fixture(scope="module")
def tokenizer(preset_dir):
    from radixserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(preset_dir)


def _scheduler(preset_dir, tokenizer, model=None, **kw):
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner
    from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

    args = ServerArgs(model_path=preset_dir, load_format="dummy", device="cuda", dtype="bfloat16",
                      max_total_tokens=8000, max_running_requests=24, context_length=1024, **kw)
    runner = ModelRunner(args, ModelConfig.from_path(preset_dir), preset_dir, context_len=1024,
                         model=model)
    if model is None:
        rescale_dummy_weights(runner.model)
    return Scheduler(args, runner, tokenizer=tokenizer,
                     detokenizer_factory=lambda r: IncrementalDetokenizer(tokenizer))


def _requests(backend, tokenizer, vocab):
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    reqs = []
    for i in range(18):
        prompt = [17 + (i * 37 + j * 11) % (vocab - 100) for j in range(5 + i)]
        if i % 3 == 0:
            sp = SamplingParams(max_new_tokens=120, temperature=0.0, json_schema=json.dumps(SCHEMA))
        elif i % 3 == 1:
            sp = SamplingParams(max_new_tokens=20, temperature=0.8, seed=i, regex=PHONE)
        else:
            sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        req = Req(f"r{i}", prompt, sp, sp.max_new_tokens)
        if sp.grammar_key is not None:
            req.grammar = backend.matcher(backend.compile_sync(sp.grammar_key))
        reqs.append(req)
    return reqs


def _run(sched, reqs):
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        sched.step()
        sched.check_integrity()
        steps += 1
        assert steps < 5000
    return sched


def _check_outputs(reqs, tokenizer):
    import jsonschema

    for r in reqs:
        text = tokenizer.decode(r.output_ids)
        if r.sampling_params.json_schema:
            assert r.finish_reason["type"] == "stop", (r.rid, r.finish_reason, text)
            jsonschema.validate(json.loads(text), SCHEMA)
        elif r.sampling_params.regex:
            assert re.fullmatch(PHONE, text), (r.rid, text)


def test_grammar_masks_apply_on_the_gpu_and_free_rows_match_serial(preset_dir, tokenizer):
    from radixserve.constrained import GrammarBackend

    jumping = _scheduler(preset_dir, tokenizer)
    vocab = jumping.vocab_size
    backend = GrammarBackend(tokenizer, vocab, jumping.eos_ids)
    reqs = _requests(backend, tokenizer, vocab)
    _run(jumping, reqs)
    assert jumping.runner.graph_runner is not None
    assert jumping.pipeline.num_overlapped > 0 and jumping.counters["num_jumps"] > 0
    _check_outputs(reqs, tokenizer)
    # without jumps the batches are the same in both loops, so bf16 rows compare exactly
    runs = []
    for serial in (False, True):
        sched = _scheduler(preset_dir, tokenizer, model=jumping.runner.model,
                           disable_overlap_schedule=serial, disable_jump_forward=True)
        again = _requests(backend, tokenizer, vocab)
        _run(sched, again)
        _check_outputs(again, tokenizer)
        assert sched.num_used_tokens() == 0
        runs.append(again)
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids, a.rid
    assert jumping.num_used_tokens() == 0
