"""A ``TinyDecoder`` and its eager twin (same weights), each with its own poisoned KV caches:
the model a runner compiles and the reference it is compared with."""

from __future__ import annotations

import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.models import TinyDecoder


def decoder_pair(cfg, num_blocks: int, dtype=torch.float32, device="cpu"):
    """(model, ref) built from ``cfg`` with seed 0, caches of ``num_blocks`` blocks filled
    with NaN so a read of an unwritten slot shows."""
    torch.manual_seed(0)
    model = TinyDecoder(cfg).to(device=device, dtype=dtype).eval()
    ref = TinyDecoder(cfg).to(device=device, dtype=dtype).eval()
    ref.load_state_dict(model.state_dict())
    ira.bind_kv_caches(model, num_blocks, dtype, device, poison=True)
    ira.bind_kv_caches(ref, num_blocks, dtype, device, poison=True)
    return model, ref
