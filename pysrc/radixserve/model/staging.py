"""Packed host-to-device transfer of a step's small inputs: one copy per dtype, not one per field.

    pack = Packer(torch.int64)
    pack.add("rows", [3, 1, 2]); pack.add("slots", slots_tensor)
    views = pack.upload(device, copy_stream)      # {"rows": [3] device tensor, "slots": ...}

On CUDA the packed buffer is pinned host memory and travels on the copy stream (so step N+1's
inputs cross while step N computes); upload() makes the current (compute) stream wait for it
with an event, so kernels that read the views are ordered after the copy while the host never
blocks. The packed host buffer is kept alive by the
returned Upload until the step that used it has finished (its owner drops it after the step's
event), so the caching host allocator cannot hand it out while the copy may still be reading it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch

Values = Union[Sequence[int], Sequence[float], torch.Tensor]


class Upload:
    def __init__(self, views: Dict[str, torch.Tensor], host: Optional[torch.Tensor]):
        self.views = views
        self.host = host         # the packed host buffer (kept alive until the step is done)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]


class Packer:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.names: List[str] = []
        self.parts: List[torch.Tensor] = []

    def add(self, name: str, values: Values) -> None:
        if isinstance(values, torch.Tensor):
            t = values.reshape(-1).to(self.dtype)
        else:
            t = torch.tensor(values, dtype=self.dtype)
        self.names.append(name)
        self.parts.append(t)

    def upload(self, device: torch.device, copy_stream=None) -> Upload:
        sizes = [int(p.numel()) for p in self.parts]
        host = torch.cat(self.parts) if self.parts else torch.empty(0, dtype=self.dtype)
        if device.type == "cuda":
            host = host.pin_memory()
            compute = torch.cuda.current_stream(device)
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    dev = host.to(device, non_blocking=True)
                compute.wait_stream(copy_stream)
                dev.record_stream(compute)
            else:
                dev = host.to(device, non_blocking=True)
        else:
            dev, host = host, None
        views, offset = {}, 0
        for name, n in zip(self.names, sizes):
            views[name] = dev[offset:offset + n]
            offset += n
        return Upload(views, host)
