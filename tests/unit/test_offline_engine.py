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
    from radixserve.engine.engine import RUN_ALL_BATCH

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
