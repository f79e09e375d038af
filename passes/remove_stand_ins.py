"""Remove the stand-in attentions of a piecewise piece: the pass the manager runs last when
it compiles a piece (``PassManager.for_pieces()``), after the user's post pass.

Why stand-ins: the fusion passes match a layer site, a cache update whose token is consumed
by exactly one attention that reads the query/key/value the piece computes. A model split at
its attention ops (``inductor_rocm_attn.compilation.split``) leaves the cache update in the
piece before the attention, and the attention itself outside, running eagerly. So the
splitter gives each such piece a stand-in: a call of the real attention op on exactly the
values the eager attention reads, consuming the token, while the piece returns a
placeholder in the token's slot::

    token = unified_kv_cache_update(k_rot, v, layer)
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)      # stand-in
    return ..., token_placeholder(k_rot, layer), ...

After the fusion passes (which may have replaced the cache update by a fused writer), this
pass deletes each stand-in and puts the (possibly fused) token where its placeholder was::

    token = unified_rope_and_kv_cache_update(...)[2]
    return ..., token, ...

so the compiled piece writes the cache, returns the token and attends to nothing. A stand-in
is recognized by its layer name: the name a placeholder of the graph carries.
"""

from __future__ import annotations

import torch

from . import fx_utils
from .base import GraphPass

_lib = torch.library.Library("rocm_attn_capture", "DEF")
_lib.define("token_placeholder(Tensor like, str layer_name) -> Tensor")


def _token_placeholder(like, layer_name):
    return like.new_empty(0)


_lib.impl("token_placeholder", _token_placeholder, "CompositeExplicitAutograd")
torch.library.register_fake("rocm_attn_capture::token_placeholder", _token_placeholder, lib=_lib)

#: ``token_placeholder(like, layer_name) -> Tensor [0]``: where a piece returns the token of
#: ``layer_name``'s cache update until ``RemoveStandInsPass`` puts the token there.
TOKEN_PLACEHOLDER = torch.ops.rocm_attn_capture.token_placeholder.default


class RemoveStandInsPass(GraphPass):
    """Drop each stand-in attention of a piece and put its token where the placeholder was."""

    name = "remove_stand_ins"
    applies_in_whole_graphs = False  # whole graphs hold real attentions and no placeholders
    depends_on = (fx_utils,)

    def __init__(self, report=None):
        super().__init__(report)
        self.removed_count = 0

    def __call__(self, graph: torch.fx.Graph) -> int:
        placeholders = list(graph.find_nodes(op="call_function", target=TOKEN_PLACEHOLDER))
        stand_in_layers = {node.args[1] for node in placeholders}
        attn_op = torch.ops.rocm_attn.unified_attention_with_output.default
        tokens = {}
        removed = 0
        for node in list(graph.nodes):
            if fx_utils.auto_functionalized_op(node) is not attn_op:
                continue
            kw = node.kwargs
            name = kw["layer_name"]
            if name not in stand_in_layers:
                continue  # a real attention: leave it
            tokens[name] = kw["kv_cache_dependency"]
            if "_all_bases" in kw:  # v2: getitem(af, 1 + i) is the updated base i
                bases = kw["_all_bases"]
                for u in list(node.users):
                    u.replace_all_uses_with(bases[u.args[1] - 1])
                    graph.erase_node(u)
            else:  # v1: getitem(af, 1) is the updated ``output``
                for u in list(node.users):
                    u.replace_all_uses_with(kw["output"])
                    graph.erase_node(u)
            graph.erase_node(node)
            removed += 1
        for node in placeholders:
            layer_name = node.args[1]
            if layer_name not in tokens:
                raise RuntimeError(f"rocm_attn: the piece returns a token placeholder of layer {layer_name!r} "
                                   "but holds no stand-in attention of that layer (a pass rewrote it?)")
            node.replace_all_uses_with(tokens[layer_name])
            graph.erase_node(node)
        self.removed_count = removed
        return removed
