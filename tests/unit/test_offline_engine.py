"""The offline API: radixserve.Engine. Acceptance: greedy parity with HF transformers on the
default model (8 prompts x 48 tokens, batched through the engine)."""
import asyncio

import pytest
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived", "List three colors:",
           "The quick brown fox", "In 1969, the first humans", "import numpy as np\n",
           "Water boils at"]
NEW_TOKENS = 48


@pytest.fixture(scope="session")
def hf_greedy_48(hf_gguf_model, hf_gguf_tokenizer):
    """HF greedy continuations (ids, cut after the first EOS) of PROMPTS, one by one."""
    eos = hf_gguf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = hf_gguf_tokenizer(p, return_tensors="pt").input_ids
            gen = hf_gguf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=NEW_TOKENS, do_sample=False)
            new = gen[0, ids.shape[1]:].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            outs.append(new[:cut])
    return outs


def test_engine_schedules_prefill_first(smol_engine):
    """The offline Engine's default step order (no stream waits on its next token)."""
    assert smol_engine.server_args.step_order == "prefill-first"
    assert smol_engine.async_engine.scheduler.alternate is False


def test_greedy_parity_with_hf(smol_engine, hf_greedy_48, hf_gguf_tokenizer):
    outs = smol_engine.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0})
    assert len(outs) == len(PROMPTS)
    for p, out, ref in zip(PROMPTS, outs, hf_greedy_48):
        assert out["output_ids"] == ref, p
        meta = out["meta_info"]
        assert meta["completion_tokens"] == len(ref)
        assert meta["prompt_tokens"] == len(hf_gguf_tokenizer(p).input_ids)
        want = "length" if len(ref) == NEW_TOKENS and ref[-1] not in \
            (hf_gguf_tokenizer.eos_token_id,) else "stop"
        assert meta["finish_reason"]["type"] == want
        assert out["text"] == hf_gguf_tokenizer.decode(ref, skip_special_tokens=True)


def test_single_prompt_input_ids_and_errors(smol_engine, default_tokenizer):
    ids = default_tokenizer.encode("Hello there")
    one = smol_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3,
                                                               "temperature": 0})
    assert isinstance(one, dict) and len(one["output_ids"]) == 3
    by_text = smol_engine.generate("Hello there", {"max_new_tokens": 3, "temperature": 0})
    assert by_text["output_ids"] == one["output_ids"]
    # the same prompt again is served from the radix cache
    assert by_text["meta_info"]["cached_tokens"] == len(ids) - 1
    with pytest.raises(ValueError, match="exactly one"):
        smol_engine.generate()
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        smol_engine.generate("x", {"max_tokens": 3})
    with pytest.raises(ValueError, match="empty"):
        smol_engine.generate(input_ids=[])


def test_async_generate_in_callers_loop(smol_engine):
    async def main():
        a = smol_engine.async_generate("Water boils at", {"max_new_tokens": 4, "temperature": 0})
        b = smol_engine.async_generate(["The quick brown fox", "List three colors:"],
                                       {"max_new_tokens": 4, "temperature": 0})
        return await asyncio.gather(a, b)

    single, pair = asyncio.run(main())
    ref = smol_engine.generate(["Water boils at", "The quick brown fox", "List three colors:"],
                               {"max_new_tokens": 4, "temperature": 0})
    assert single["output_ids"] == ref[0]["output_ids"]
    assert [o["output_ids"] for o in pair] == [r["output_ids"] for r in ref[1:]]


def test_a_batch_larger_than_one_handoff_keeps_order_and_is_refused_whole(smol_engine):
    """generate() hands its requests to the loop RUN_ALL_BATCH at a time (the first step can
    start meanwhile): outputs still come back in prompt order, and a bad prompt anywhere in
    the batch refuses the whole batch before any of it runs."""
    from radixserve.offline import RUN_ALL_BATCH

    n = 2 * RUN_ALL_BATCH + 5
    prompts = [[100 + i, 200 + 3 * i, 7] for i in range(n)]
    sp = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    forward = smol_engine.generate(input_ids=prompts, sampling_params=sp)
    backward = smol_engine.generate(input_ids=prompts[::-1], sampling_params=sp)
    assert [o["output_ids"] for o in forward] == [o["output_ids"] for o in backward[::-1]]
    sched = smol_engine.async_engine.scheduler
    steps = sched.counters["num_prefill_steps"]
    bad = prompts[:n - 3] + [[1, -5]] + prompts[n - 2:]
    with pytest.raises(ValueError, match="out of range"):
        smol_engine.generate(input_ids=bad, sampling_params=sp)
    assert sched.counters["num_prefill_steps"] == steps
    with pytest.raises(ValueError, match="out of range"):
        smol_engine.generate(input_ids=[[1, True, 2]], sampling_params=sp)   # bool is not an id


def test_expand_requests_is_prompts_times_n():
    """engine/io.expand_requests, the one n expansion of the HTTP routes and the Engine:
    sequence p * n + j of prompt p, each with n=1, seed + j, rid "<rid>-<index>"."""
    from radixserve.engine.io import expand_requests
    from radixserve.sampling.params import SamplingParams

    sp = SamplingParams(max_new_tokens=3, temperature=0.7, n=3, seed=40)
    greedy = SamplingParams(max_new_tokens=3, n=3)
    reqs = expand_requests("r", [[1, 2], [3]], 3, [sp, greedy])
    assert [r.input_ids for r in reqs] == [[1, 2]] * 3 + [[3]] * 3
    assert [r.rid for r in reqs] == [f"r-{i}" for i in range(6)]
    assert [r.sampling_params.n for r in reqs] == [1] * 6
    assert [r.sampling_params.seed for r in reqs] == [40, 41, 42, None, None, None]
    assert sp.n == 3 and sp.seed == 40          # the caller's params are not changed
    one = expand_requests("r", [[1, 2]], 1, [SamplingParams(seed=5)])
    assert [(r.rid, r.sampling_params.seed) for r in one] == [("r", 5)]
    named = expand_requests("r", [[1], [2]], 2, [greedy, greedy], rids=["a", "b"])
    assert [r.rid for r in named] == ["a-0", "a-1", "b-0", "b-1"]


def test_n_is_expanded_like_the_native_route(smol_engine):
    """Engine.generate(prompt, {"n": 4}) gives 4 completions, the ones /generate gives for
    the same body (sample j seeded seed + j), in the same shape: a list, prompt-major."""
    prompt = "Once upon a time"
    sp = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11, "n": 4, "ignore_eos": True}
    outs = smol_engine.generate(prompt, sp)
    assert isinstance(outs, list) and len(outs) == 4
    native = smol_engine.native("/generate", {"text": prompt, "sampling_params": sp})
    assert isinstance(native, list) and len(native) == 4

    def same(o):
        m = o["meta_info"]
        return (o["text"], o["output_ids"], m["prompt_tokens"], m["completion_tokens"],
                m["finish_reason"])

    assert [same(o) for o in outs] == [same(o) for o in native]
    assert all(len(o["output_ids"]) == 6 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1      # n samples, not one repeated
    ids = [o["meta_info"]["id"] for o in outs]
    assert len(set(ids)) == 4 and all(i.endswith(f"-{j}") for j, i in enumerate(ids))
    # sample j is the n=1 request seeded seed + j
    for j, o in enumerate(outs):
        alone = smol_engine.generate(prompt, {**sp, "n": 1, "seed": 11 + j})
        assert isinstance(alone, dict) and alone["output_ids"] == o["output_ids"]
    # a batch: prompt p's sample j at p * n + j, as /generate answers it
    prompts = [prompt, "Water boils at"]
    pair = smol_engine.generate(prompts, {**sp, "n": 2})
    native_pair = smol_engine.native("/generate", {"text": prompts,
                                                   "sampling_params": {**sp, "n": 2}})
    assert [same(o) for o in pair] == [same(o) for o in native_pair]
    assert [o["output_ids"] for o in pair[:2]] == [o["output_ids"] for o in outs[:2]]
    # the async twin expands the same way
    assert [same(o) for o in asyncio.run(smol_engine.async_generate(prompt, sp))] == \
        [same(o) for o in outs]
