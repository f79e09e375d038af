"""Ticket counters of the decode kernels that merge their KV splits in the last split program
(the Triton decode's ``split_merge="last_split"``, the native decode's ``split_merge=
"last_split"``): one int32 per (sequence, KV head, head chunk), per device.

Each launch leaves them 0 (its last split program resets them), so one zeroed buffer serves
every launch on the device in stream order. A grown buffer replaces the old one, which is
kept: a captured graph may still address it.
"""

from __future__ import annotations

import torch

_MERGE_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least ``n`` zeroed counters on ``device``; None when they must grow during a CUDA
    graph capture (an allocation there belongs to the graph's pool): merge in a second kernel
    then."""
    buf = _MERGE_COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED_COUNTERS.append(buf)
    buf = torch.zeros(max(1024, 1 << max(0, n - 1).bit_length()), dtype=torch.int32, device=device)
    _MERGE_COUNTERS[device] = buf
    return buf
