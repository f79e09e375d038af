"""How our ops become code inside Inductor: explicit fallbacks with pinned layouts.

Every ``rocm_attn`` op runs as an Inductor fallback kernel (an opaque call in the output
code). We register those fallbacks ourselves, one file per op family, so their layout
constraint does not depend on ``config.custom_op_default_layout_constraint``: our kernels
view their tensors as ``[T, H, D]`` and write the attention output in place, so Inductor
must hand them the strides the FX graph has (``constrain_to_fx_strides``). With exact
strides the reinplaced ``unified_attention_with_output`` writes straight into its ``empty``
output buffer, and no copy of that buffer appears; the KV cache is never a graph value
(layer-level ops reach it through the forward context), so it cannot be copied at all.
``tests/test_lowering.py`` reads the generated code to check both.
"""

from __future__ import annotations

import functools

from . import attention, kv_cache, norm_quant


@functools.cache
def register() -> None:
    """Register the fallbacks (idempotent; called by ``inductor_rocm_attn.enable()``)."""
    for family in (attention, kv_cache, norm_quant):
        family.register()
