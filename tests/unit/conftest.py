"""Engine test fixtures: one loaded default model shared by every scheduler, one offline Engine,
and memoised greedy references.

  smol_model            (ModelConfig, model) of the default model, loaded once
  make_scheduler(**kw)  a fresh Scheduler (own KV pool, given ServerArgs overrides) over that model
  greedy_alone(ids, n)  the greedy output of ids run alone (memoised), the reference for batching
  smol_engine           a radixserve.Engine on the default model (its AsyncEngine is used too)
  text_prompts          a few natural prompts tokenized with the model's tokenizer
"""
import pytest

SMALL_POOL = 4096


@pytest.fixture(scope="session")
def smol_model(default_model_path):
    import torch

    from radixserve.config import ModelConfig
    from radixserve.model.loader import load_model

    config = ModelConfig.from_path(default_model_path)
    model = load_model(default_model_path, config, "auto", torch.float32, torch.device("cpu"))
    return config, model


@pytest.fixture(scope="session")
def make_scheduler(default_model_path, smol_model):
    from radixserve.config import ServerArgs
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    config, model = smol_model

    def make(**overrides):
        kw = dict(model_path=default_model_path, device="cpu", max_total_tokens=SMALL_POOL,
                  max_running_requests=16, context_length=1024)
        kw.update(overrides)
        args = ServerArgs(**kw)
        runner = ModelRunner(args, config, default_model_path, context_len=args.context_length,
                             model=model)
        return Scheduler(args, runner)

    return make


def run_to_completion(sched, reqs, check=True, arrivals=None, max_steps=10_000):
    """Step sched until every req finished. arrivals: {step index: [reqs to add then]};
    reqs not in arrivals are added before the first step. check: integrity after every step."""
    arrivals = dict(arrivals or {})
    late = {id(r) for rs in arrivals.values() for r in rs}
    for r in reqs:
        if id(r) not in late:
            sched.add_request(r)
    step = 0
    while sched.has_work() or arrivals:
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        sched.step()
        if check:
            sched.check_integrity()
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    return step


@pytest.fixture(scope="session")
def greedy_alone(make_scheduler):
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    sched = make_scheduler(disable_radix_cache=True)
    memo = {}

    def run(ids, n):
        key = (tuple(ids), n)
        if key not in memo:
            sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            req = Req(f"alone-{len(memo)}", list(ids), sp, n)
            run_to_completion(sched, [req], check=False)
            memo[key] = list(req.output_ids)
        return memo[key]

    return run


@pytest.fixture(scope="session")
def text_prompts(default_tokenizer):
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a land far away, there lived",
             "List three colors:", "The quick brown fox", "In 1969, the first humans",
             "import numpy as np\n", "Water boils at"]
    return [default_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="session")
def smol_engine(default_model_path):
    from radixserve import Engine

    engine = Engine(default_model_path, device="cpu", max_total_tokens=SMALL_POOL,
                    max_running_requests=16, context_length=1024)
    yield engine
    engine.shutdown()
