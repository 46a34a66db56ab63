"""A serving run's roofline: how long its arrival schedule takes on a server that wastes nothing.

server_steps.floor_bound_duration charges each token the batch-1 weight floor and nothing else.
That leaves out two costs no server avoids: every decode step also reads the KV cache of every
running request (at 1k contexts and 50 rows, a third of an 8B model's weight bytes in bf16),
and every prompt token costs its GEMM FLOPs. roofline_duration adds both to a schedule that
is otherwise ideal:

  - every running request decodes one token in every step, a prompt's prefill rides the first
    step after its arrival (its first output token comes from that step), nothing waits;
  - a step costs max(bytes / bandwidth, FLOPs / peak): the weights once, plus each running
    request's context in KV bytes; 2 x (linear parameters) FLOPs per token, prompt and decode
    rows alike (attention FLOPs and the LM head of prompt tokens left out: a lower bound).

So the measured duration over roofline_duration says how far a server is from the hardware on
this workload, and roofline_duration over floor_bound_duration how much of a floor-bound bar
the hardware itself spends. Pure Python, no torch; bench/roofline_bound.py applies it to
`radixserve bench serving` results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class StepCost:
    """What a step costs on one card, in seconds."""
    weights_s: float            # reading the streamed weights once (the batch-1 weight floor)
    kv_s_per_token: float       # reading one cached token's K and V in every layer
    flop_s_per_token: float     # one token's GEMM FLOPs at the card's peak

    def step_s(self, kv_tokens: int, rows: int) -> float:
        return max(self.weights_s + kv_tokens * self.kv_s_per_token, rows * self.flop_s_per_token)


def roofline_duration(arrivals: Sequence[float], input_lens: Sequence[int],
                      output_lens: Sequence[int], cost: StepCost,
                      prefill_apart: bool = False) -> Tuple[float, int]:
    """(seconds from the first arrival's time origin until the last token, steps) of the ideal
    schedule in the module docstring. arrivals: each request's send time (s, same origin as the
    result's); a request with 0 or 1 output tokens ends with its prefill step.
    prefill_apart: the arrivals waiting at a step boundary are prefilled in a step of their own
    (weights and their FLOPs, no KV read), then the running requests decode in the next, as the
    server's --step-order alternate runs them; default: they ride the running requests' step."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    running: Dict[int, List[int]] = {}         # request -> [context tokens, tokens still to come]
    t, end, steps, nxt = 0.0, 0.0, 0, 0
    while nxt < len(order) or running:
        if not running and arrivals[order[nxt]] > t:
            t = arrivals[order[nxt]]              # idle until the next arrival
        new = []
        while nxt < len(order) and arrivals[order[nxt]] <= t:
            new.append(order[nxt])
            nxt += 1
        prompt_tokens = sum(input_lens[i] for i in new)
        if prefill_apart and new and running:
            t += cost.step_s(0, prompt_tokens)    # the prefill step; the decodes wait
            steps += 1
            end = _admit(new, running, input_lens, output_lens, t, end)
            new, prompt_tokens = [], 0            # they decode in the step below
        kv = sum(ctx for ctx, _ in running.values())
        t += cost.step_s(kv, len(running) + prompt_tokens)
        steps += 1
        for i in list(running):
            running[i][0] += 1
            running[i][1] -= 1
            if running[i][1] == 0:
                del running[i]
                end = t
        end = _admit(new, running, input_lens, output_lens, t, end)
    return end, steps


def _admit(new: List[int], running: Dict[int, List[int]], input_lens: Sequence[int],
           output_lens: Sequence[int], t: float, end: float) -> float:
    """Requests `new`, prefilled by the step that ended at t, join `running` (their first token
    came from that step); those with at most one token end there. Returns the latest end."""
    for i in new:
        if output_lens[i] <= 1:
            end = max(end, t)
        else:
            running[i] = [input_lens[i] + 1, output_lens[i] - 1]
    return end


@dataclass(frozen=True)
class ModelBytes:
    """A decoder's per-step byte and FLOP counts (Llama / Qwen layouts)."""
    streamed_weight_bytes: int   # linear layers and the LM head, as a decode step reads them
    kv_bytes_per_token: int      # K and V of one token in every layer
    linear_params: int           # parameters of the linear layers and LM head (FLOPs / 2)


def llama_bytes(config: Dict, weight_bytes: float = 2, head_bytes: float = 2,
                kv_bytes: float = 2) -> ModelBytes:
    """ModelBytes of a Llama-shaped HF config.json dict: weight_bytes per linear-layer weight (2
    bf16, 1 FP8), head_bytes per LM-head weight (bf16 also in FP8 checkpoints), kv_bytes per
    cached K/V element (2 bf16, 1 FP8)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv_heads = config.get("num_key_value_heads", heads)
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    per_layer = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * inter
    linear = layers * per_layer
    head = vocab * h
    return ModelBytes(
        streamed_weight_bytes=int(linear * weight_bytes + head * head_bytes),
        kv_bytes_per_token=int(layers * 2 * kv_heads * head_dim * kv_bytes),
        linear_params=linear + head)
