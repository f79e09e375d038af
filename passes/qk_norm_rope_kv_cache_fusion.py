"""QK-norm (per-head RMSNorm of q and k) + RoPE + cache update -> one fused op.

Unfused (post-grad)::

    q, k, v = split(qkv, [Hq*D, Hkv*D, Hkv*D], -1)
    q = rms_norm(q.view(T, Hq, D), q_weight, eps); k = rms_norm(k.view(T, Hkv, D), k_weight, eps)
    q_rot, k_rot = rope(positions, q, k, cos_sin_cache)
    token = unified_kv_cache_update(k_rot, v.view(T, Hkv, D), layer)
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)

Fused::

    q_rot, k_rot, token = unified_qk_norm_rope_and_kv_cache_update(
        qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox, Hq, Hkv, D, layer)
    unified_attention_with_output(q_rot, k_rot, v, out, layer, token)   # v: the split's slice

With separate q/k/v projections and the model's per-token cos/sin (transformers' Qwen3: the
norm on the ``[B, T, H, D]`` view, before the transpose to ``[B, H, T, D]``)::

    q = rms_norm(x_q, q_weight, eps); k = rms_norm(x_k, k_weight, eps)   # x_q [B, T, Hq, D]
    q_rot, k_rot = rope(q, k, cos, sin)                                    # per-token cos/sin
    token = unified_kv_cache_update(k_rot.reshape(B*T, Hkv, D), v, layer)

fuses into an op that normalizes and rotates q/k in place (emitted functionalized, as the
RoPE fusion's op)::

    token, q_new, k_new = auto_functionalized_v2(unified_qk_norm_rope_cos_sin_and_kv_cache_update,
        value=v, q_weight=q_weight, k_weight=k_weight, eps=eps, cos=cos.reshape(-1, D), ...,
        _all_bases=[x_q.reshape(-1, Hq, D), x_k.reshape(-1, Hkv, D)])

Its norm is transformers' ``Qwen3RMSNorm`` exactly (the normalized value rounded to the model
dtype before the weight), so only ``forms.RMS_FORMS`` match there, not ``rocm_attn.rms_norm``
(which rounds once). Gemma's ``Gemma3RMSNorm`` (``1 + weight`` in fp32, rounded once after
it; Gemma3 normalizes the heads-first ``[B, H, T, D]`` q/k) is the op's ``gemma_norm`` form.
Gemma4's ``Gemma4RMSNorm`` (``pow(mean + eps, -0.5)``, ``weight`` in fp32, rounded once; on
tokens-first ``[B, T, H, D]`` q/k) is the op's ``gemma4_norm`` form; where the cached value is
computed from q or k (Gemma4's ``attention_k_eq_v``: V is the V-norm of the key projection the
K-norm reads), the op normalizes a copy of that tensor, so the value reads it as it was.
Hunyuan's order, RoPE first and then the per-head norm of the rotated heads-first q/k (the
weight does not commute with the rotation), is the op's ``norm_after_rope`` form: matched
from the attention's q/k back through the norms to the RoPE under them.

RMSNorm is recognized as ``rocm_attn.rms_norm`` or one of ``forms.RMS_FORMS`` (HF casts),
RoPE by ``matchers.match_rope`` as in ``rope_kv_cache_fusion``. The norm must be over the head dim of a
``[T, heads, head_size]`` view of the q/k slice of the same ``qkv`` split whose v slice is
cached, with one eps for q and k. The fused writer emits interleaved V (AITER's layout), so
a layer fused here is switched to interleaved V at compile time
(``interleaved_v.switch_to_interleaved_v``); the impl also switches at run time if a cache
was bound after compilation.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from . import forms, fx_utils, interleaved_v, matchers
from .base import FusionPass
from .interleaved_v import switch_to_interleaved_v
from .matchers import (cache_updates, emit_in_place, layer_site, match_rope, per_token_cos_sin, per_token_rows,
                       replace_outputs, value_computed_from_rotated)

aten = torch.ops.aten
rocm = torch.ops.rocm_attn
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
_QKV_OP = rocm.unified_qk_norm_rope_and_kv_cache_update.default
_SEPARATE_OP = rocm.unified_qk_norm_rope_cos_sin_and_kv_cache_update.default
_CONVERT = torch.ops.prims.convert_element_type.default


def _match_norm(root: torch.fx.Node, which: str, rank: int = 3, op_form: bool = True):
    """``(x, weight, eps, form, "")`` when ``root`` is an RMSNorm of ``x`` over its last dim
    (``op_form``: ``rocm_attn.rms_norm`` counts too; ``form``: its ``forms.RMS_FORMS`` name,
    "op" for ``rocm_attn.rms_norm``); else ``(None, None, None, None, why)``."""
    v = fx_utils.val(root)
    if v is None or v.dim() != rank:
        shape = "[T, heads, head_size]" if rank == 3 else "[B, T, heads, head_size]"
        return None, None, None, None, (f"{which}-norm output is not a {shape} tensor (the rotated {which} comes "
                                        f"from {matchers.producer(root)})")
    if root.op == "call_function" and root.target is rocm.rms_norm.default:
        if not op_form:
            return None, None, None, None, (f"the {which}-norm is rocm_attn.rms_norm, which rounds once; the "
                                            "per-token writer implements transformers' RMSNorm")
        x, w, eps = root.args[:3]
        return x, w, eps, "op", ""
    if v.dtype not in forms.MODEL_DTYPES:
        return None, None, None, None, f"{which}: dtype {v.dtype} is not a model dtype"
    # every RMS form ends in `weight *`, or (Gemma's, in a 16-bit dtype) in the cast back
    if not (root.op == "call_function" and root.target in (aten.mul.Tensor, _CONVERT)):
        return None, None, None, None, (f"the rotated {which} is not a per-head RMSNorm output (it comes from "
                                        f"{matchers.producer(root)})")
    # The pattern is traced on [T, heads, head_size]; heads-first [B, H, T, D] has the token
    # count at -2, symbolic in a dynamic trace, and int() of it would guard the token dim to
    # the trace's size (the RMS pattern has no reshape: any head count traces the same).
    heads = v.shape[-2] if isinstance(v.shape[-2], int) else next(
        (s for s in v.shape[:-2] if isinstance(s, int) and s not in (1, forms._MAGIC_T)), 2)
    why = []
    for form in forms.RMS_FORMS:
        kw, w = forms.match(forms.rms_pattern(form, v.dtype, heads, int(v.shape[-1])), root)
        if kw is not None:
            return kw["x"], kw["weight"], kw["eps"], form, ""
        why.append(f"{form}: {w}")
    return None, None, None, None, (f"the rotated {which} ({matchers.producer(root)}) is not a per-head RMSNorm "
                                    "output (" + "; ".join(why) + ")")


@dataclasses.dataclass
class SeparateMatch:
    """A per-token site: q/k normalized per head and rotated with the model's cos/sin."""

    rope: matchers.RopeMatch
    x_q: torch.fx.Node  # what the fused op normalizes and rotates in place
    x_k: torch.fx.Node
    w_q: torch.fx.Node
    w_k: torch.fx.Node
    eps: float
    norm_kind: str | None  # None: transformers' RMSNorm; "gemma" (1 + weight); "gemma4" (weight in fp32)
    norm_after_rope: bool
    copy_q: bool = False  # the cached value is computed from q / k: the writer takes a copy
    copy_k: bool = False


_NORM_NAMES = {None: "QK-norm", "gemma": "Gemma QK-norm (1 + weight)", "gemma4": "Gemma4 QK-norm (weight in fp32)"}


def _norm_kind(form: str) -> str | None:
    """The fused op's norm flag for an RMS form: None (transformers'), "gemma" or "gemma4"."""
    if form in forms.GEMMA_RMS_FORMS:
        return "gemma"
    return "gemma4" if form in forms.GEMMA4_RMS_FORMS else None


def _norm_output(node: torch.fx.Node) -> tuple[torch.fx.Node, list | None]:
    """What the attention's query / key carries the values of, through views and copies, and
    the permutation in between (None: none): transformers' attention transposes heads-first
    ``[B, H, T, D]`` heads back to ``[B, T, H, D]``; a permutation that keeps the head dim last
    commutes with a per-head norm."""
    node = matchers.strip_copies(node)
    if node.op == "call_function" and node.target is aten.permute.default:
        perm = list(node.args[1])
        if perm[-1] in (-1, len(perm) - 1):
            return matchers.strip_copies(node.args[0]), perm
    return node, None


def _split_slot(x: torch.fx.Node):
    """``(split node, index)`` when ``x`` views a slice of a last-dim split, else (None, None)."""
    s = fx_utils.strip_views(x)
    if fx_utils.is_getitem(s) and isinstance(s.args[0], torch.fx.Node) and s.args[0].target in _SPLITS:
        split = s.args[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim in (-1, 1):
            return split, s.args[1]
    return None, None


class QKNormRopeKVCacheFusionPass(FusionPass):
    name = "qk_norm_rope_kv_cache_fusion"
    depends_on = (forms, fx_utils, matchers, interleaved_v)

    def match(self, site):
        rope, why = match_rope(site)
        if rope is None:
            after, why_after = self.match_norm_after_rope(site)
            return (after, "") if after is not None else (None, why_after or why)
        if rope.per_token:
            return self.match_separate(site, rope)
        parts = {}
        for which, pre, post in (("q", rope.q_in, rope.q_out), ("k", rope.k_in, rope.k_out)):
            root = fx_utils.strip_views(pre)
            x, w, eps, form, why = _match_norm(root, which)
            if x is None:
                return None, why
            if form in forms.GEMMA_RMS_FORMS | forms.GEMMA4_RMS_FORMS:
                return None, (f"the {which}-norm is Gemma's or Gemma4's RMSNorm; the qkv writer implements "
                              "transformers' RMSNorm only")
            xv, rv = fx_utils.val(x), fx_utils.val(root)
            if xv is None or xv.dim() != 3 or int(xv.shape[-1]) != int(rv.shape[-1]):
                return None, f"{which}-norm is not over the head dim of a [T, heads, head_size] view"
            if rv.dtype != xv.dtype or fx_utils.val(post).dtype != xv.dtype:
                return None, f"{which}-norm changes dtype ({xv.dtype} -> {rv.dtype}); the fused op keeps it"
            wv = fx_utils.val(w)
            if wv is None or tuple(wv.shape) != (int(xv.shape[-1]),):
                return None, f"{which}-norm weight is not [head_size]"
            split, idx = _split_slot(x)
            if split is None:
                return None, f"the normalized {which} is not a slice of a qkv split"
            parts[which] = (x, w, eps, split, idx)
        (xq, wq, eps_q, split, iq), (xk, wk, eps_k, split_k, ik) = parts["q"], parts["k"]
        if eps_q != eps_k or not isinstance(eps_q, float):
            return None, f"q-norm eps {eps_q} and k-norm eps {eps_k} differ or are not constants"
        split_v, iv = _split_slot(site.value)
        if not (split is split_k is split_v) or (iq, ik, iv) != (0, 1, 2):
            return None, "q, k and the cached v are not the three slices of one qkv split"
        qkv = split.args[0]
        hq, d = (int(s) for s in fx_utils.val(xq).shape[1:])
        hkv = int(fx_utils.val(xk).shape[1])
        qkv_val = fx_utils.val(qkv)
        sizes = [hq * d, hkv * d, hkv * d]
        out_sizes = [int(fx_utils.val(fx_utils.strip_views(g)).shape[-1]) for g in (xq, xk, site.value)]
        if qkv_val.dim() != 2 or out_sizes != sizes or int(qkv_val.shape[-1]) != sum(sizes):
            return None, f"qkv split sizes {out_sizes} are not [Hq*D, Hkv*D, Hkv*D] = {sizes}"
        if qkv_val.dtype not in forms.MODEL_DTYPES:
            return None, f"qkv dtype {qkv_val.dtype} is not a model dtype"
        if rope.head_size != d:
            return None, f"RoPE splits heads of {rope.head_size} channels, the norms heads of {d}"
        return (rope, qkv, wq, wk, float(eps_q), hq, hkv, d), ""

    def match_separate(self, site, rope):
        """q and k each normalized per head before a per-token RoPE (q/k/v need not share a
        tensor): ``(SeparateMatch, "")`` or ``(None, why)``."""
        rank = fx_utils.val(rope.k_in).dim()
        parts = {}
        for which, root in (("q", rope.q_in), ("k", rope.k_in)):
            # No looking through views: a norm over the whole projection, viewed as heads
            # afterwards, normalizes over another axis.
            x, w, eps, form, why = _match_norm(root, which, rank, op_form=False)
            if x is None:
                return None, why
            xv, rv, wv = fx_utils.val(x), fx_utils.val(root), fx_utils.val(w)
            if (xv is None or xv.dim() != rv.dim() or xv.dtype != rv.dtype
                    or not all(matchers.same_size(a, b) for a, b in zip(xv.shape, rv.shape))):
                return None, f"{which}-norm is not over the head dim of the {tuple(rv.shape)} heads RoPE rotates"
            if wv is None or tuple(wv.shape) != (rope.head_size,) or wv.dtype != xv.dtype:
                return None, (f"{which}-norm weight {tuple(wv.shape) if wv is not None else None} is not "
                              f"[head_size] = [{rope.head_size}] in the model dtype {xv.dtype}")
            parts[which] = (x, w, eps, _norm_kind(form))
        (xq, wq, eps_q, kind_q), (xk, wk, eps_k, kind_k) = parts["q"], parts["k"]
        if eps_q != eps_k or not isinstance(eps_q, float):
            return None, f"q-norm eps {eps_q} and k-norm eps {eps_k} differ or are not constants"
        if kind_q != kind_k:
            return None, f"q and k are normalized by different RMSNorm forms ({kind_q or 'HF'}, {kind_k or 'HF'})"
        # A value computed from q or k (Gemma4's attention_k_eq_v: V is the V-norm of the key
        # projection the K-norm reads) must read them as they were: the writer gets a copy.
        graph = site.cache.graph
        copy_q, copy_k = (value_computed_from_rotated(graph, site.value, x, x) for x in (xq, xk))
        return SeparateMatch(rope, xq, xk, wq, wk, float(eps_q), kind_q, False, copy_q, copy_k), ""

    def match_norm_after_rope(self, site):
        """q and k each rotated by a per-token RoPE, then normalized per head (Hunyuan): the
        op's ``norm_after_rope`` form. ``(m, "")`` as ``match_separate``; ``(None, "")`` when
        the attention's q / k are not RMSNorm outputs at all (the caller's reason stands)."""
        parts = {}
        for which, node in (("q", site.query), ("k", site.key)):
            root, perm = _norm_output(node)
            v = fx_utils.val(root)
            if v is None or v.dim() not in (3, 4):
                return None, ""
            x, w, eps, form, why = _match_norm(root, which, v.dim(), op_form=False)
            if x is None:
                return None, ""
            xv, wv = fx_utils.val(x), fx_utils.val(w)
            if (xv is None or xv.dim() != v.dim() or xv.dtype != v.dtype
                    or not all(matchers.same_size(a, b) for a, b in zip(xv.shape, v.shape))):
                return None, f"{which}-norm after RoPE is not over the head dim of the {tuple(v.shape)} heads"
            if wv is None or tuple(wv.shape) != (int(v.shape[-1]),) or wv.dtype != xv.dtype:
                return None, (f"{which}-norm after RoPE: weight {tuple(wv.shape) if wv is not None else None} is "
                              f"not [head_size] = [{int(v.shape[-1])}] in the model dtype {xv.dtype}")
            parts[which] = (x, w, eps, _norm_kind(form), perm)
        (xq, wq, eps_q, kind_q, perm_q), (xk, wk, eps_k, kind_k, perm_k) = parts["q"], parts["k"]
        if perm_q != perm_k:
            return None, "the normalized q and k reach the attention through different permutations"
        rope, why = self._rope_under_norm(site, xk, xq, perm_k)
        if rope is None:
            return None, f"q and k are normalized after an op that is not a recognized RoPE: {why}"
        if not rope.per_token:
            return None, "the norm follows a RoPE with a cos/sin cache; the norm-after-RoPE writer takes per-token rows"
        if eps_q != eps_k or not isinstance(eps_q, float):
            return None, f"q-norm eps {eps_q} and k-norm eps {eps_k} differ or are not constants"
        if kind_q != kind_k:
            return None, f"q and k are normalized by different RMSNorm forms ({kind_q or 'HF'}, {kind_k or 'HF'})"
        if fx_utils.val(rope.q_in).dtype != fx_utils.val(xq).dtype:
            return None, "the RoPE changes dtype before the norm; the fused op keeps it"
        if value_computed_from_rotated(site.cache.graph, site.value, rope.q_in, rope.k_in):
            return None, "the cached value is computed from the query/key the fused op rotates in place"
        return SeparateMatch(rope, rope.q_in, rope.k_in, wq, wk, float(eps_q), kind_q, True), ""

    @staticmethod
    def _rope_under_norm(site, xk, xq, perm):
        """``match_rope`` on the norms' inputs, seen through the attention's permutation (the
        RoPE forms end in it): stand-in permutes are inserted for the match and removed
        again (the fused op replaces what the attention reads, not them)."""
        if perm is None:
            return match_rope(site, roots=(xk, xq))
        graph = site.cache.graph
        stand_ins = []
        for x in (xk, xq):
            with graph.inserting_after(x):
                stand_ins.append(fx_utils.call(graph, aten.permute.default, (x, perm)))
        try:
            return match_rope(site, roots=tuple(stand_ins))
        finally:
            for n in stand_ins:
                if not n.users:  # a merge of duplicate views may have made one the kept view
                    graph.erase_node(n)

    def _emit_separate(self, graph, site, m: SeparateMatch, layer: str) -> torch.fx.Node:
        rope = m.rope
        q_in, k_in = (per_token_rows(graph, rope, x) for x in (m.x_q, m.x_k))
        if m.copy_q:
            q_in = fx_utils.call(graph, aten.clone.default, (q_in,))
        if m.copy_k:
            k_in = fx_utils.call(graph, aten.clone.default, (k_in,))
        cos, sin = per_token_cos_sin(graph, rope)
        kwargs = dict(value=site.value, q_weight=m.w_q, k_weight=m.w_k, eps=m.eps, cos=cos, sin=sin,
                      is_neox=rope.is_neox, layer_name=layer)
        if m.norm_kind:
            kwargs[f"{m.norm_kind}_norm"] = True
        if m.norm_after_rope:
            kwargs["norm_after_rope"] = True
        return emit_in_place(graph, _SEPARATE_OP, kwargs, site, q_in, k_in, rope.q_out, rope.k_out)

    def apply(self, graph: torch.fx.Graph) -> None:
        changed = False
        for cache in cache_updates(graph):
            layer = cache.args[2]
            site, why = layer_site(cache)
            m = None
            if site is not None:
                m, why = self.match(site)
            if m is None:
                self.not_fused(layer, why)
                continue
            rope = m.rope if isinstance(m, SeparateMatch) else m[0]
            norm = "QK-norm"
            after = False
            copied = ""
            if rope.per_token:
                eps, op = m.eps, _SEPARATE_OP
                norm = _NORM_NAMES[m.norm_kind]
                after = m.norm_after_rope
                if m.copy_q or m.copy_k:
                    read = " and ".join(n for n, c in (("query", m.copy_q), ("key", m.copy_k)) if c)
                    copied = f" (the value reads the {read}: the writer takes a copy)"
                with graph.inserting_before(cache):
                    token = self._emit_separate(graph, site, m, layer)
            else:
                _, qkv, wq, wk, eps, hq, hkv, d = m
                op = _QKV_OP
                with graph.inserting_before(cache):
                    fused = fx_utils.call(graph, _QKV_OP, (
                        qkv, wq, wk, eps, rope.positions, rope.cos_sin_cache, rope.is_neox, hq, hkv, d, layer))
                    outs = [fx_utils.call(graph, operator.getitem, (fused, i)) for i in range(3)]
                replace_outputs(graph, [(rope.q_out, outs[0]), (rope.k_out, outs[1])])
                token = outs[2]
            cache.replace_all_uses_with(token)
            graph.erase_node(cache)
            changed = True
            switched = switch_to_interleaved_v(layer)
            style = "NeoX" if rope.is_neox else "GPT-J"
            steps = (f"RoPE ({rope.form}, {style}) + {norm} (eps={eps:g}) after it" if after
                     else f"{norm} (eps={eps:g}) + RoPE ({rope.form}, {style})")
            self.fused(layer, f"{steps} + KV-cache update -> {op._opname} (interleaved V){copied}", switched,
                       interleaved_v=True)
        if changed:
            fx_utils.finish(graph)
            if matchers.copy_shared_view_bases(graph):
                fx_utils.finish(graph)

