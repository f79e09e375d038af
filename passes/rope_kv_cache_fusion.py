"""RoPE + ``unified_kv_cache_update`` -> ``unified_rope_and_kv_cache_update``.

Unfused (post-grad)::

    q_rot, k_rot = rope(positions, q, k, cos_sin_cache)     # our op or the HF form
    token = unified_kv_cache_update(k_rot, v, layer)
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)

Fused. The op rotates q and k in place, so it is emitted functionalized, as Dynamo emits
every mutating op; Inductor's reinplacing then runs it on q and k themselves, without
copies, wherever nothing reads the unrotated q/k afterwards::

    token, q_rot, k_rot = auto_functionalized_v2(unified_rope_and_kv_cache_update,
        positions=positions, value=v, cos_sin_cache=cos_sin_cache, is_neox=is_neox,
        layer_name=layer, _query_base_index=0, _key_base_index=1, _all_bases=[q, k])
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)

When q and k are column slices of one tensor computed in the graph (``qkv = x @ W``, then
split), that tensor is the one base, q and k its slices, and the attention reads q, k and
v as slices of the op's result: Inductor reinplaces one base per storage, so this form
leaves no copy either::

    token, qkv_new = auto_functionalized_v2(unified_rope_and_kv_cache_update, ...,
        _query_base_index=0, _query_slice_dim=1, _query_slice_start=0, _query_slice_end=Hq*D,
        _key_base_index=0, ..., _all_bases=[qkv])

RoPE is recognized by ``matchers.match_rope``: ``rocm_attn.rotary_embedding`` (under
``auto_functionalized_v2``) or one of ``forms.ROPE_FORMS`` (HF NeoX ``rotate_half``, HF GPT-J
``rotate_every_two``, cos/sin gathered by position) for fp16/bf16/fp32. It fuses only when
the key the cache writes *is* the rotated key, the attention reads that key and value, and
the query is rotated by the same RoPE (same form, cache and positions).
"""

from __future__ import annotations

import operator

import torch

from . import forms, fx_utils, matchers
from .base import FusionPass
from .matchers import cache_updates, column_slice, layer_site, match_rope, replace_outputs

aten = torch.ops.aten
rocm = torch.ops.rocm_attn
# Outputs: the op's own (the dependency token), then the new value of each base (q, k).
_AUTO_FUNCTIONALIZED_V2 = torch.ops.higher_order.auto_functionalized_v2
_FUSED_OP = rocm.unified_rope_and_kv_cache_update.default


def _emit_fused(graph: torch.fx.Graph, site, rope, layer: str) -> torch.fx.Node:
    """Insert the functionalized fused op at the insert point, point the rotated q/k (and the
    attention's v, see below) at its results, and return its dependency token."""
    kwargs = dict(positions=rope.positions, value=site.value, cos_sin_cache=rope.cos_sin_cache,
                  is_neox=rope.is_neox, layer_name=layer)
    q_cols, k_cols = column_slice(rope.q_in), column_slice(rope.k_in)
    one_base = (q_cols is not None and k_cols is not None and q_cols.source is k_cols.source
                and q_cols.source.op != "placeholder"
                and (q_cols.end <= k_cols.start or k_cols.end <= q_cols.start))
    if one_base:
        # q and k are column slices of one tensor computed in this graph (a fused qkv
        # projection): that tensor is the op's one base. Inductor reinplaces one base per
        # storage, so two bases (q and k) on one storage would leave one of them copied. (A
        # graph input is never mutated in place: there q and k stay two bases, copied.)
        for arg, cols in (("query", q_cols), ("key", k_cols)):
            kwargs.update({f"_{arg}_base_index": 0, f"_{arg}_slice_dim": 1,
                           f"_{arg}_slice_start": cols.start, f"_{arg}_slice_end": cols.end})
        kwargs["_all_bases"] = [q_cols.source]
    else:
        kwargs.update(_query_base_index=0, _key_base_index=1, _all_bases=[rope.q_in, rope.k_in])
    fused = fx_utils.call(graph, _AUTO_FUNCTIONALIZED_V2, (_FUSED_OP,), kwargs)
    token = fx_utils.call(graph, operator.getitem, (fused, 0))
    if not one_base:
        q_rot, k_rot = (fx_utils.call(graph, operator.getitem, (fused, i)) for i in (1, 2))
        replace_outputs(graph, [(rope.q_out, q_rot), (rope.k_out, k_rot)])
        return token
    base = fx_utils.call(graph, operator.getitem, (fused, 1))
    q_rot, k_rot = (fx_utils.call(graph, aten.slice.Tensor, (base, 1, c.start, c.end)) for c in (q_cols, k_cols))
    v_cols = column_slice(site.value)
    if v_cols is not None and v_cols.source is q_cols.source:
        # The attention's v is a slice of the same tensor: read it from the op's result, so no
        # use of the tensor from before the op is left after it (one would stop the reinplacing).
        v_new = fx_utils.reshape_like(graph, fx_utils.call(
            graph, aten.slice.Tensor, (base, 1, v_cols.start, v_cols.end)), site.value)
        site.value.replace_all_uses_with(v_new, delete_user_cb=lambda user: user is not fused)
    replace_outputs(graph, [(rope.q_out, q_rot), (rope.k_out, k_rot)])
    return token


class RopeKVCacheFusionPass(FusionPass):
    name = "rope_kv_cache_fusion"
    depends_on = (forms, fx_utils, matchers)

    def apply(self, graph: torch.fx.Graph) -> None:
        changed = False
        for cache in cache_updates(graph):
            site, why = layer_site(cache)
            layer = cache.args[2]
            if site is None:
                self.not_fused(layer, why)
                continue
            rope, why = match_rope(site)
            if rope is None:
                self.not_fused(layer, why)
                continue
            with graph.inserting_before(cache):
                token = _emit_fused(graph, site, rope, layer)
            cache.replace_all_uses_with(token)
            graph.erase_node(cache)
            changed = True
            style = "NeoX" if rope.is_neox else "GPT-J"
            self.fused(layer, f"RoPE ({rope.form}, {style}) + KV-cache update -> unified_rope_and_kv_cache_update")
        if changed:
            fx_utils.finish(graph)
