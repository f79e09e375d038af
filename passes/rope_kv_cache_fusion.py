"""RoPE + ``unified_kv_cache_update`` -> ``unified_rope_and_kv_cache_update``.

Unfused (post-grad)::

    q_rot, k_rot = rope(positions, q, k, cos_sin_cache)     # our op or the HF form
    token = unified_kv_cache_update(k_rot, v, layer)
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)

Fused::

    q_rot, k_rot, token = unified_rope_and_kv_cache_update(positions, q, k, v, cos_sin_cache,
                                                           is_neox, layer)
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)

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
from .matchers import cache_updates, layer_site, match_rope, replace_outputs

rocm = torch.ops.rocm_attn


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
                fused = fx_utils.call(graph, rocm.unified_rope_and_kv_cache_update.default, (
                    rope.positions, rope.q_in, rope.k_in, site.value, rope.cos_sin_cache, rope.is_neox, layer))
                outs = [fx_utils.call(graph, operator.getitem, (fused, i)) for i in range(3)]
            replace_outputs(graph, [(rope.q_out, outs[0]), (rope.k_out, outs[1])])
            cache.replace_all_uses_with(outs[2])
            graph.erase_node(cache)
            changed = True
            style = "NeoX" if rope.is_neox else "GPT-J"
            self.fused(layer, f"RoPE ({rope.form}, {style}) + KV-cache update -> unified_rope_and_kv_cache_update")
        if changed:
            fx_utils.finish(graph)
