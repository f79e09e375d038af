"""Order each KV-sharing layer's cache read after its target's cache write (whole graphs).

A layer built with ``kv_sharing_target_layer_name`` writes nothing and reads its target's
cache, so its attention takes no dependency token. When its input does not depend on the
target's output, nothing in the graph orders the target's write before that read, and
Inductor's scheduler (its peak-memory reordering) may run the read first: the read then sees
the cache without the step's keys. This pass gives the sharing layer's attention the token of
the target's latest write before it in the graph (the token the target's own attention takes,
from a fused writer or not), a data edge Inductor keeps::

    token = unified_kv_cache_update(k, v, "t")                     # or a fused writer's token
    unified_attention_with_output(q, k, v, out, "t", token)
    unified_attention_with_output(q2, k2, v2, out2, "s", token)    # was kv_cache_dependency=None

The node's ``eager_input_vals`` (the values Inductor's ``auto_functionalized_v2``
decomposition traces with) get the token too, else the decomposition drops it again.

A sharing layer whose target writes only after it in the graph (the forward calls the sharing
layer first) is refused at compile time. A target with no write in the graph (it ran in an
earlier graph) needs no edge, nor does a layer the compile cannot find (compiled before it
exists). Runs after the fusion passes, which match a token with exactly one consumer, and the
user's pass. Not in pieces: there every attention runs between the pieces, in program order.
"""

from __future__ import annotations

import torch

from . import fx_utils
from .base import GraphPass

_ATTN = torch.ops.rocm_attn.unified_attention_with_output.default
_DEP = "kv_cache_dependency"


def _sharing_target(layer_name: str) -> str | None:
    """The layer whose cache ``layer_name`` reads, or None (it owns one, or is not found)."""
    from inductor_rocm_attn.forward_context import get_layer

    try:
        layer = get_layer(layer_name)
    except KeyError:
        return None
    return layer.impl.kv_sharing_target_layer_name


class KVSharingOrderPass(GraphPass):
    """Give each sharing layer's attention the token of its target's latest earlier write."""

    name = "kv_sharing_order"
    applies_in_pieces = False
    depends_on = (fx_utils,)

    def __init__(self, report=None):
        super().__init__(report)
        self.ordered_count = 0

    def uuid(self) -> str:
        # The edges this pass adds depend on which registered layers share a cache, which the
        # graph's text does not show: Inductor's cache key must change with them.
        from inductor_rocm_attn.forward_context import registered_layers

        pairs = sorted((name, layer.impl.kv_sharing_target_layer_name)
                       for name, layer in registered_layers().items()
                       if layer.impl.kv_sharing_target_layer_name is not None)
        return f"{self.source_hash()}:{pairs!r}"

    def __call__(self, graph: torch.fx.Graph) -> int:
        tokens: dict[str, torch.fx.Node] = {}  # writing layer -> token of its latest write so far
        waiting: list[tuple[str, str]] = []  # (sharing layer, target) read before any write of the target
        ordered = 0
        for node in graph.nodes:
            if fx_utils.called_op(node) is not _ATTN:
                continue
            kw = fx_utils.op_arguments(node)
            name, dep = kw["layer_name"], kw.get(_DEP)
            if dep is not None:
                tokens[name] = dep
                continue
            target = _sharing_target(name)
            if target is None:
                continue
            if target in tokens:
                fx_utils.set_op_argument(node, _DEP, tokens[target])
                ordered += 1
            else:
                waiting.append((name, target))
        for name, target in waiting:
            if target in tokens:
                raise RuntimeError(
                    f"rocm_attn: layer {name!r} reads the KV cache of layer {target!r} "
                    f"(kv_sharing_target_layer_name), but the target writes it only later in this graph; call "
                    f"{target!r} before {name!r} in the forward, so the read sees the step's keys")
        self.ordered_count = ordered
        return ordered
