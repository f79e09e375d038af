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

With the model's own per-token cos/sin (transformers computes them once per forward from
``position_ids``; its attention rotates q/k viewed ``[B, T, H, D]`` and transposed to
``[B, H, T, D]``)::

    q_rot = (x_q.transpose(1, 2) * cos4 + rotate_half(x_q.transpose(1, 2)) * sin4).transpose(1, 2)
    k_rot = ...                                     # cos4 = cos.unsqueeze(1), cos [B, T, D]
    token = unified_kv_cache_update(k_rot.reshape(B*T, Hkv, D), v, layer)

the fused op takes cos/sin as ``[B*T, D]`` rows (views) and rotates with exactly that formula::

    token, q_new, k_new = auto_functionalized_v2(unified_rope_cos_sin_and_kv_cache_update,
        value=v, cos=cos.reshape(-1, D), sin=sin.reshape(-1, D), is_neox=True, layer_name=layer,
        _query_base_index=0, _key_base_index=1, _all_bases=[x_q.reshape(-1, Hq, D), x_k...])

RoPE is recognized by ``matchers.match_rope``: ``rocm_attn.rotary_embedding`` (under
``auto_functionalized_v2``), one of ``forms.ROPE_FORMS`` (HF NeoX ``rotate_half`` chunked or
sliced, HF GPT-J ``rotate_every_two``, cos/sin gathered by position) or one of
``forms.PER_TOKEN_ROPE_FORMS`` (per-token cos/sin, NeoX: the whole head, its first
channels, or GPT-OSS's halves with half-width cos/sin), for fp16/bf16/fp32. It fuses only
when the key the cache writes *is* the rotated key, the attention reads that key and value,
and the query is rotated by the same RoPE (same form, cos/sin or cache and positions).
"""

from __future__ import annotations

import torch

from . import forms, fx_utils, matchers
from .base import FusionPass
from .matchers import (cache_updates, emit_in_place, layer_site, match_rope, per_token_cos_sin, per_token_rows,
                       value_computed_from_rotated)

rocm = torch.ops.rocm_attn
_FUSED_OP = rocm.unified_rope_and_kv_cache_update.default
_COS_SIN_OP = rocm.unified_rope_cos_sin_and_kv_cache_update.default


def _emit_fused(graph: torch.fx.Graph, site, rope, layer: str) -> torch.fx.Node:
    """Insert the functionalized fused op at the insert point, point the rotated q/k at its
    results and return its dependency token."""
    if rope.per_token:
        q_in, k_in = (per_token_rows(graph, rope, x) for x in (rope.q_in, rope.k_in))
        cos, sin = per_token_cos_sin(graph, rope)
        kwargs = dict(value=site.value, cos=cos, sin=sin, is_neox=rope.is_neox, layer_name=layer)
        return emit_in_place(graph, _COS_SIN_OP, kwargs, site, q_in, k_in, rope.q_out, rope.k_out)
    kwargs = dict(positions=rope.positions, value=site.value, cos_sin_cache=rope.cos_sin_cache,
                  is_neox=rope.is_neox, layer_name=layer)
    return emit_in_place(graph, _FUSED_OP, kwargs, site, rope.q_in, rope.k_in, rope.q_out, rope.k_out)


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
            if rope is not None and value_computed_from_rotated(graph, site.value, rope.q_in, rope.k_in):
                rope, why = None, "the cached value is computed from the query/key the fused op rotates in place"
            if rope is None:
                self.not_fused(layer, why)
                continue
            with graph.inserting_before(cache):
                token = _emit_fused(graph, site, rope, layer)
            cache.replace_all_uses_with(token)
            graph.erase_node(cache)
            changed = True
            style = "NeoX" if rope.is_neox else "GPT-J"
            op = _COS_SIN_OP if rope.per_token else _FUSED_OP
            self.fused(layer, f"RoPE ({rope.form}, {style}) + KV-cache update -> {op._opname}")
        if changed:
            fx_utils.finish(graph)
            if matchers.copy_shared_view_bases(graph):
                fx_utils.finish(graph)
