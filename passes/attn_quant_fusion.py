"""Attention + static per-tensor fp8 quant of its output -> attention with ``output_scale``.

Unfused (post-grad)::

    out = auto_functionalized_v2(unified_attention_with_output, ..., _all_bases=[empty(...)])[1]
    q8 = static_scaled_fp8_quant(out, scale, fp8)      # or (out / scale).clamp(-m, m).to(fp8)

Fused::

    token = unified_kv_cache_update(k, v, layer, output_scale=scale)   # or the layer's fused writer
    q8 = auto_functionalized_v2(unified_attention_with_output, ..., kv_cache_dependency=token,
                                output_scale=scale, _all_bases=[empty(..., dtype=fp8)])[1]

The layer's cache update (the op whose token the attention takes: ``unified_kv_cache_update``
or a fused RoPE / QK-norm writer) gets the scale too and checks it before it writes: the
attention, which runs after the write, would otherwise be the first to refuse a bad scale,
with the step's keys already in the cache. A layer whose token comes from anything else, or
whose scale is computed from that update's results, is not fused.

The plain form is ``forms.make_fp8_quant_plain`` traced per model dtype and fp8 dtype; the
division must happen in fp32 (a tensor scale of one element, as the kernel divides in fp32).
The attention's output must be a fresh ``empty`` buffer used only by the quant (through views).
"""

from __future__ import annotations

import operator

import torch

from . import forms, fx_utils
from .base import FusionPass

aten = torch.ops.aten
rocm = torch.ops.rocm_attn
_ATTN = rocm.unified_attention_with_output.default
_QUANT_DEPTH = 6  # nodes from the attention output to the fp8 cast (div, casts, clamps)
#: the layer ops that write a layer's cache and return the token its attention takes, with the
#: index of that token among the node's results (None: the node is the token)
_CACHE_WRITERS = {
    rocm.unified_kv_cache_update.default: None,
    rocm.unified_rope_and_kv_cache_update.default: 0,  # functionalized: (token, query, key)
    rocm.unified_rope_cos_sin_and_kv_cache_update.default: 0,
    rocm.unified_qk_norm_rope_cos_sin_and_kv_cache_update.default: 0,
    rocm.unified_qk_norm_rope_and_kv_cache_update.default: 2,  # (query, key, token)
}


def _attentions(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if fx_utils.auto_functionalized_op(n) is _ATTN]


def _output_chain(out: torch.fx.Node):
    """Follow single-user views from the attention output to the first non-view user."""
    node = out
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "call_function" and user.target in fx_utils.VIEW_OPS:
            node = user
            continue
        return node, user
    return node, None


def _cache_writer(token: torch.fx.Node, layer: str) -> tuple[torch.fx.Node | None, str]:
    """``(node, "")``: the call of ``layer``'s cache-update op that produced ``token``, the
    attention's ``kv_cache_dependency``; else ``(None, why)``."""
    node, index = token, None
    if fx_utils.is_getitem(token):
        node, index = token.args
    op = fx_utils.called_op(node)
    if op not in _CACHE_WRITERS or _CACHE_WRITERS[op] != index:
        return None, ("the attention's kv_cache_dependency does not come from a rocm_attn cache-update op, "
                      "which would check the fused quant's scale before writing the cache")
    if fx_utils.op_arguments(node).get("layer_name") != layer:
        return None, "the attention's kv_cache_dependency comes from the cache update of another layer"
    return node, ""


def _computed_from(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``node`` is computed from ``source``'s results (only nodes after it can be)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in seen or not n > source:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _match_quant(x: torch.fx.Node, user: torch.fx.Node):
    """``(scale, fp8 dtype, root, "")`` when ``user`` is a static fp8 quant of ``x``."""
    if user.target is rocm.static_scaled_fp8_quant.default:
        if user.args[0] is not x:
            return None, None, None, "static_scaled_fp8_quant does not quantize the attention output"
        return user.args[1], user.args[2], user, ""
    xv = fx_utils.val(x)
    if xv is None or xv.dtype not in forms.MODEL_DTYPES:
        return None, None, None, "attention output dtype is not a model dtype"
    # the plain form's root is the final cast, a few single-user steps on
    node = user
    for _ in range(_QUANT_DEPTH):
        nv = fx_utils.val(node)
        if nv is not None and nv.dtype in forms.FP8_DTYPES:
            kw, w = forms.match(forms.fp8_quant_pattern(xv.dtype, nv.dtype, xv.dim()), node)
            if kw is None:
                return None, None, None, f"fp8 cast of the output is not (x / scale).clamp(min, max).to(fp8): {w}"
            if kw["x"] is not x:
                return None, None, None, "the quantized tensor is not the attention output"
            div = user
            if div.target is not aten.div.Tensor or fx_utils.val(div).dtype != torch.float32:
                return None, None, None, "the division by scale is not in fp32"
            return kw["scale"], nv.dtype, node, ""
        if len(node.users) != 1:
            break
        (node,) = node.users
    return None, None, None, "the attention output is not quantized to fp8"


class AttnQuantFusionPass(FusionPass):
    name = "attn_quant_fusion"
    depends_on = (forms, fx_utils)
    # It rewrites the attention itself: inside a piece that attention is only a stand-in
    # (the real one runs eagerly between the pieces), so the fusion must not fire there.
    applies_in_pieces = False

    def apply(self, graph: torch.fx.Graph) -> None:
        changed = False
        for attn in _attentions(graph):
            kw = attn.kwargs
            layer = kw["layer_name"]
            out = fx_utils.getitem_user(attn, 1 + kw.get("_output_base_index", 0))
            if out is None or kw.get("output_scale") is not None:
                continue
            if any(k.startswith("_output_") and k != "_output_base_index" for k in kw):
                continue  # the output is a view of a larger buffer: not a candidate
            x, user = _output_chain(out)
            if user is None:
                if len(x.users) > 1:
                    self._maybe_miss(layer, x, "the attention output has several users")
                continue
            scale, fp8, root, why = _match_quant(x, user)
            if root is None:
                if self._is_candidate(user):
                    self.not_fused(layer, why)
                continue
            base = kw["_all_bases"][kw.get("_output_base_index", 0)]
            sv = fx_utils.val(scale)
            if not (base.op == "call_function" and base.target is aten.empty.memory_format and len(base.users) == 1):
                self.not_fused(layer, "the attention output buffer is not a fresh empty tensor")
                continue
            # The kernels take an fp32 scale of shape () or (1,). A [1, 1] scale would make the fused
            # op raise; a bf16/fp16 scale widened in the graph lets Inductor skip its rounding.
            if sv is None or sv.numel() != 1 or sv.dim() > 1 or sv.dtype != torch.float32:
                self.not_fused(layer, "the quant scale is not an fp32 tensor of shape () or (1,)")
                continue
            # A CPU scalar divides a GPU output in the unfused graph; the fused attention needs the
            # scale on the output's device and would refuse every call.
            xv = fx_utils.val(x)
            if xv is None or sv.device != xv.device:
                self.not_fused(layer, "the quant scale is not on the attention output's device")
                continue
            rv = fx_utils.val(root)
            # reshape_like rebuilds the quant's shape from its static trailing dims (a symbolic one
            # would be specialized, breaking the dynamic token count).
            if rv is None or rv.dim() < 1 or not all(isinstance(d, int) for d in rv.shape[1:]):
                self.not_fused(layer, "the quantized view's trailing dims are not static")
                continue
            # None: the layer writes no cache before its attention (an encoder layer), nothing to check earlier
            writer = None
            if kw.get("kv_cache_dependency") is not None:
                writer, why = _cache_writer(kw["kv_cache_dependency"], layer)
                if writer is None:
                    self.not_fused(layer, why)
                    continue
                if fx_utils.op_arguments(writer).get("output_scale") not in (None, scale):
                    self.not_fused(layer, "the layer's cache update already checks another output_scale")
                    continue
                if _computed_from(scale, writer):  # the update cannot take it: a cycle
                    self.not_fused(layer, "the quant scale is computed from the results of the layer's cache update")
                    continue
            with graph.inserting_before(attn):
                new_base = fx_utils.call(graph, base.target, base.args, {**base.kwargs, "dtype": fp8})
                bases = list(kw["_all_bases"])
                bases[kw.get("_output_base_index", 0)] = new_base
                new_attn = fx_utils.call(graph, attn.target, attn.args,
                                         {**kw, "output_scale": scale, "_all_bases": bases})
                new_out = fx_utils.call(graph, operator.getitem, (new_attn, out.args[1]))
            with graph.inserting_after(new_out):
                q8 = fx_utils.reshape_like(graph, new_out, root)
            root.replace_all_uses_with(q8)
            if writer is not None:  # checked before the write; the sort below puts its input first
                fx_utils.set_op_argument(writer, "output_scale", scale)
            for n in (root, *reversed(self._path(out, root)), out, attn, base):
                if not n.users:
                    graph.erase_node(n)
            changed = True
            self.fused(layer, f"attention + static fp8 quant ({fp8}) -> unified_attention_with_output(output_scale)")
        if changed:
            fx_utils.finish(graph)

    @staticmethod
    def _path(out, root):
        nodes, node = [], root
        while node is not out:
            node = node.args[0]
            if node is not out:
                nodes.append(node)
        return nodes[::-1]

    @staticmethod
    def _is_candidate(user: torch.fx.Node) -> bool:
        """A quant-looking consumer: our quant op, a division, or anything producing fp8 soon."""
        node = user
        for _ in range(_QUANT_DEPTH):
            v = fx_utils.val(node)
            if node.target is rocm.static_scaled_fp8_quant.default or (v is not None and v.dtype in forms.FP8_DTYPES):
                return True
            if len(node.users) != 1:
                return False
            (node,) = node.users
        return False

    def _maybe_miss(self, layer, x, why):
        if any(self._is_candidate(u) for u in x.users):
            self.not_fused(layer, why)
