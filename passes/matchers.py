"""Site matchers the fusion passes share: a layer's cache update with the attention that
reads it (``LayerSite``), the RoPE that produced its key and query (``RopeMatch``), and the
rewiring of the rotated q/k to a fused op's outputs.

A layer site in a post-grad graph::

    q_rot, k_rot = rope(positions, q, k, cos_sin_cache)     # our op or an HF form
    token = unified_kv_cache_update(k_rot, v, layer)
    auto_functionalized_v2(unified_attention_with_output, query=q_rot, key=k_rot, value=v,
                           layer_name=layer, kv_cache_dependency=token, ...)

RoPE is recognized as ``rocm_attn.rotary_embedding`` (under ``auto_functionalized_v2``) or
as one of ``forms.ROPE_FORMS`` (HF NeoX ``rotate_half``, HF GPT-J ``rotate_every_two``, cos/
sin gathered by position) for fp16/bf16/fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from . import forms, fx_utils

rocm = torch.ops.rocm_attn


@dataclasses.dataclass
class RopeMatch:
    form: str  # "op" or a forms.ROPE_FORMS key
    is_neox: bool
    positions: torch.fx.Node
    cos_sin_cache: torch.fx.Node
    q_in: torch.fx.Node  # pre-rotation query / key (what the fused op takes)
    k_in: torch.fx.Node
    q_out: torch.fx.Node  # rotated query / key nodes (what the fused outputs replace)
    k_out: torch.fx.Node
    head_size: int  # the head size the rotation splits q/k into


@dataclasses.dataclass
class LayerSite:
    """A layer's cache update and the attention that reads it."""

    layer_name: str
    cache: torch.fx.Node  # unified_kv_cache_update
    attention: torch.fx.Node  # auto_functionalized_v2(unified_attention_with_output)
    key: torch.fx.Node
    value: torch.fx.Node
    query: torch.fx.Node


def cache_updates(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Every ``unified_kv_cache_update`` of the graph, in order."""
    return list(graph.find_nodes(op="call_function", target=rocm.unified_kv_cache_update.default))


def layer_site(cache: torch.fx.Node) -> tuple[LayerSite | None, str]:
    """The site of a cache update: ``(site, "")``, or ``(None, why)`` when its token is not
    read by exactly one attention of the same layer over the key and value it writes."""
    key, value, layer_name = cache.args[:3]
    attns = [u for u in cache.users
             if fx_utils.auto_functionalized_op(u) is rocm.unified_attention_with_output.default]
    if len(attns) != 1 or len(cache.users) != 1:
        return None, "the cache update's token is not consumed by exactly one attention"
    attn = attns[0]
    if attn.kwargs.get("kv_cache_dependency") is not cache or attn.kwargs.get("layer_name") != layer_name:
        return None, "the attention reading the token belongs to another layer"
    if fx_utils.strip_views(attn.kwargs["key"]) is not fx_utils.strip_views(key):
        return None, "the attention's key is not the key the cache update writes"
    if fx_utils.strip_views(attn.kwargs["value"]) is not fx_utils.strip_views(value):
        return None, "the attention's value is not the value the cache update writes"
    return LayerSite(layer_name, cache, attn, key, value, attn.kwargs["query"]), ""


def _match_rope_op(k_root: torch.fx.Node, q_root: torch.fx.Node) -> tuple[RopeMatch | None, str]:
    if not fx_utils.is_getitem(k_root):
        return None, ""
    af = k_root.args[0]
    if fx_utils.auto_functionalized_op(af) is not rocm.rotary_embedding.default:
        return None, ""
    kw = af.kwargs
    if any(k.startswith(("_query_", "_key_")) and not k.endswith("_base_index") for k in kw):
        return None, "rotary_embedding rotates views of larger tensors (not supported)"
    qi, ki = kw.get("_query_base_index"), kw.get("_key_base_index")
    if ki is None or qi is None or k_root.args[1] != 1 + ki:
        return None, "the cached key is not the key rotary_embedding rotated"
    if not (fx_utils.is_getitem(q_root, 1 + qi) and q_root.args[0] is af):
        return None, "the attention's query is not the query rotary_embedding rotated with this key"
    bases = kw["_all_bases"]
    head_size = kw["head_size"]
    kv = fx_utils.val(bases[ki])
    if kv is None or kv.shape[-1] % head_size and kv.shape[-1] != head_size:
        return None, "rotary_embedding key shape does not fit head_size"
    return RopeMatch("op", bool(kw["is_neox"]), kw["positions"], kw["cos_sin_cache"], bases[qi], bases[ki],
                     q_root, k_root, int(head_size)), ""


def _match_rope_hf(k_root: torch.fx.Node, q_root: torch.fx.Node) -> tuple[RopeMatch | None, str]:
    kval, qval = fx_utils.val(k_root), fx_utils.val(q_root)
    if kval is None or kval.dim() != 3:
        return None, f"the cached key is not a RoPE output (it comes from {_producer(k_root)})"
    if qval is None or qval.dim() != 3:
        return None, f"the attention's query is not a RoPE output (it comes from {_producer(q_root)})"
    if kval.dtype not in forms.MODEL_DTYPES or qval.dtype != kval.dtype:
        return None, f"dtype {kval.dtype}/{qval.dtype} is not a supported model dtype"
    why = []
    for form, (_, is_neox) in forms.ROPE_FORMS.items():
        kk, kwhy = forms.match(forms.rope_pattern(form, kval.dtype, int(kval.shape[1]), int(kval.shape[2])), k_root)
        if kk is None:
            why.append(f"{form}: {kwhy}")
            continue
        qk, qwhy = forms.match(forms.rope_pattern(form, qval.dtype, int(qval.shape[1]), int(qval.shape[2])), q_root)
        if qk is None:
            return None, f"key is {form} RoPE but the attention's query is not ({qwhy})"
        if qk["positions"] is not kk["positions"] or qk["cos_sin_cache"] is not kk["cos_sin_cache"]:
            return None, f"query and key are rotated with different positions or cos/sin caches ({form})"
        return RopeMatch(form, is_neox, kk["positions"], kk["cos_sin_cache"], qk["x"], kk["x"], q_root, k_root,
                         int(kval.shape[2])), ""
    return None, "the cached key is not a RoPE output (" + "; ".join(why) + ")"


def _producer(node: torch.fx.Node) -> str:
    if node.op != "call_function":
        return f"{node.op} {node.name}"
    if fx_utils.is_getitem(node):
        return f"output {node.args[1]} of {_producer(node.args[0])}"
    return str(getattr(node.target, "__name__", node.target))


def match_rope(site: LayerSite) -> tuple[RopeMatch | None, str]:
    """Recognize the RoPE that produced the site's cached key and attention query."""
    k_root, q_root = fx_utils.strip_views(site.key), fx_utils.strip_views(site.query)
    m, why = _match_rope_op(k_root, q_root)
    if m is None and not why:
        m, why = _match_rope_hf(k_root, q_root)
    if m is None:
        return None, why
    vv = fx_utils.val(site.value)
    if vv is None or int(vv.shape[-1]) != m.head_size:
        return None, f"RoPE splits heads of {m.head_size} channels, the cached value has heads of {vv.shape[-1]}"
    if m.positions.meta.get("val") is None or m.positions.meta["val"].dtype not in (torch.int64, torch.int32):
        return None, "positions are not an integer tensor"
    return m, ""


@dataclasses.dataclass
class ColumnSlice:
    """``node`` views columns ``[start, end)`` of the 2-D tensor ``source`` (a last-dim split)."""

    source: torch.fx.Node
    start: int
    end: int


_SPLITS = (torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor)


def column_slice(node: torch.fx.Node) -> ColumnSlice | None:
    """Where ``node`` (through reshapes) is one output of a last-dim split of a 2-D tensor
    (e.g. q, k or v of a fused qkv projection): its columns in that tensor; else None."""
    s = fx_utils.strip_views(node)
    if not (fx_utils.is_getitem(s) and isinstance(s.args[0], torch.fx.Node) and s.args[0].target in _SPLITS):
        return None
    split = s.args[0]
    source = split.args[0]
    sv = fx_utils.val(source)
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if sv is None or sv.dim() != 2 or dim not in (-1, 1) or not isinstance(sv.shape[1], int):
        return None
    width = int(sv.shape[1])
    sizes = split.args[1]
    if isinstance(sizes, int):  # split.Tensor: equal chunks of `sizes` columns
        sizes = [min(sizes, width - i) for i in range(0, width, sizes)]
    if not all(isinstance(x, int) for x in sizes) or sum(sizes) != width:
        return None
    i = s.args[1]
    start = sum(sizes[:i])
    return ColumnSlice(source, start, start + sizes[i])


def replace_outputs(graph: torch.fx.Graph, pairs) -> None:
    """Point every use of each old node at its new node (reshaped to the old shape)."""
    for old, new in pairs:
        with graph.inserting_after(new):
            new = fx_utils.reshape_like(graph, new, old)
        old.replace_all_uses_with(new)
