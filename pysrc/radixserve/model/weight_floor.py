"""The batch-1 decode floor of a model on its device: the bytes a decode step must stream (every
weight once) over the device's copy bandwidth, measured where the model runs.

A decode step of batch 1 reads every linear layer's weights once, so no kernel can take less
than streamed_weight_bytes / bandwidth. The server measures it once at start (ModelRunner), and
reports it (`weight_floor_seconds` on /metrics), so a benchmark can put any step time, ITL or
run duration over a floor measured in the same process (bench/decode_steps.py, bench serving's
server_steps).
"""
from __future__ import annotations

import torch


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (bytes read + bytes written), median of iters timed
    copies (CUDA events) after 3 untimed ones. nbytes: the size of the source buffer (the
    copy needs twice that free); keep it several times the L2."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times = sorted(times[3:])
    return 2 * src.numel() * 4 / times[len(times) // 2]


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Every parameter once (named_parameters yields a tied LM head once, as the embedding),
    except an untied embedding table: a decode step reads one row of it per request."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def weight_floor_seconds(model: torch.nn.Module, device: torch.device,
                         nbytes: int = 512 << 20) -> float:
    """streamed_weight_bytes(model) / copy_bandwidth(device): the batch-1 decode step's lower
    bound in seconds, on a CUDA device (the copy uses 2 x nbytes of free device memory, given
    back before it returns)."""
    floor = streamed_weight_bytes(model) / copy_bandwidth(device, nbytes, iters=10)
    torch.cuda.empty_cache()    # the copy's buffers go back to the device, not the cache, so
    return floor                # the KV pool sized after this sees them free
