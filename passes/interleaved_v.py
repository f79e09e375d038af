"""The one place a pass (or the piecewise compiler) switches a layer to interleaved V.

A fused writer that emits AITER's interleaved-V layout changes how its layer's V cache must
be read, so the layer is switched when the fusion is compiled: its cached data is converted
in place and every later read and write follows ``layer.interleaved_v``. Layers that share
one compiled piece follow the layer that piece was compiled for. When a graph is compiled
before its layer exists, or comes from Inductor's cache (no pass runs; the fusion report
switches the layer again when it takes the graph's records back, if it can find the layer
then), the impl's run-time guard switches the layer on its first fused write.
"""

from __future__ import annotations

from typing import Any


def switch_to_interleaved_v(layer: Any, enabled: bool = True) -> bool:
    """Switch ``layer`` to interleaved V (``enabled=False``: back to the standard layout).

    Args:
        layer: an ``Attention`` layer, or a layer name (or slot alias) registered in the
            forward context.
        enabled: the layout to switch to.

    Returns whether the layer now uses interleaved V; False when no layer of that name is
    registered yet (the impl's run-time guard switches it later).
    """
    if isinstance(layer, str):
        from inductor_rocm_attn.forward_context import get_layer

        try:
            layer = get_layer(layer)
        except KeyError:
            return False
    layer.set_interleaved_v_cache(enabled)
    return layer.interleaved_v
