"""The one helper every op family uses: an Inductor fallback with exact FX strides."""

from __future__ import annotations

import torch


def register_fallbacks(ops) -> None:
    from torch._inductor import lowering as L

    for op in ops:
        L.make_fallback(op, layout_constraint=L.constrain_to_fx_strides, warn=False)


def ops_of(*names: str):
    return [getattr(torch.ops.rocm_attn, n).default for n in names]
