"""Site matchers the fusion passes share: a layer's cache update with the attention that
reads it (``LayerSite``), the RoPE that produced its key and query (``RopeMatch``), and the
rewiring of the rotated q/k to a fused op's outputs.

A layer site in a post-grad graph::

    q_rot, k_rot = rope(positions, q, k, cos_sin_cache)     # our op or an HF form
    token = unified_kv_cache_update(k_rot, v, layer)
    auto_functionalized_v2(unified_attention_with_output, query=q_rot, key=k_rot, value=v,
                           layer_name=layer, kv_cache_dependency=token, ...)

RoPE is recognized as ``rocm_attn.rotary_embedding`` (under ``auto_functionalized_v2``), as
one of ``forms.ROPE_FORMS`` (HF NeoX ``rotate_half``, HF GPT-J ``rotate_every_two``, cos/sin
gathered by position) or as one of ``forms.COS_SIN_ROPE_FORMS`` (the model's own per-token
cos/sin, e.g. transformers' attention: q/k viewed ``[B, T, H, D]``, rotated as ``[B, H, T,
D]``, viewed back to ``[B*T, H, D]`` for the attention), for fp16/bf16/fp32.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from . import forms, fx_utils

aten = torch.ops.aten
rocm = torch.ops.rocm_attn


@dataclasses.dataclass
class RopeMatch:
    """A recognized RoPE of a layer's query and key. Gathered forms carry ``positions`` and
    ``cos_sin_cache``; per-token forms (``per_token``) the model's ``cos``/``sin``."""

    form: str  # "op", a forms.ROPE_FORMS or forms.PER_TOKEN_ROPE_FORMS key
    is_neox: bool
    q_in: torch.fx.Node  # pre-rotation query / key (what the fused op takes)
    k_in: torch.fx.Node
    q_out: torch.fx.Node  # rotated query / key nodes (what the fused outputs replace)
    k_out: torch.fx.Node
    head_size: int  # the head size the rotation splits q/k into
    positions: torch.fx.Node | None = None
    cos_sin_cache: torch.fx.Node | None = None
    cos: torch.fx.Node | None = None  # [B, T, D] (q/k [B, T, H, D]) or [T, D] (q/k [T, H, D])
    sin: torch.fx.Node | None = None
    cos_batch: int | torch.SymInt | None = None  # cos/sin [1, T, D] broadcast over this many batch rows

    @property
    def per_token(self) -> bool:
        return self.cos is not None


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
    owner = _key_owner(cache)
    if owner is not None:
        return None, (f"the cached key is the key of layer {owner!r} (KV sharing: this layer computes no key of its own; "
                      "its cache update stays a plain copy)")
    return LayerSite(layer_name, cache, attn, key, value, attn.kwargs["query"]), ""


def _key_owner(cache: torch.fx.Node) -> str | None:
    """The other layer whose key ``cache`` writes (a KV-sharing layer caching its target's
    key), else None: the key is, through views and copies, an output of another layer's fused
    writer, or the key an earlier cache update of another layer writes."""
    layer_name = cache.args[2]
    root = _strip_copies(cache.args[0])
    base = root
    while isinstance(base, torch.fx.Node) and base.op == "call_function" and (
            fx_utils.is_getitem(base) or base.target is aten.slice.Tensor):
        base = base.args[0]
        args = fx_utils.op_arguments(base) if fx_utils.called_op(base) is not None else {}
        if args.get("layer_name") not in (None, layer_name):
            return args["layer_name"]
    for other in cache_updates(cache.graph):
        if other is cache:
            return None
        if other.args[2] != layer_name and _strip_copies(other.args[0]) is root:
            return other.args[2]
    return None


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
    return RopeMatch("op", bool(kw["is_neox"]), bases[qi], bases[ki], q_root, k_root, int(head_size),
                     positions=kw["positions"], cos_sin_cache=kw["cos_sin_cache"]), ""


def _match_rope_hf(k_root: torch.fx.Node, q_root: torch.fx.Node) -> tuple[RopeMatch | None, str]:
    kval, qval = fx_utils.val(k_root), fx_utils.val(q_root)
    if kval is None or kval.dim() not in (3, 4):
        return None, f"the cached key is not a RoPE output (it comes from {producer(k_root)})"
    if qval is None or qval.dim() != kval.dim():
        return None, f"the attention's query is not a RoPE output (it comes from {producer(q_root)})"
    if kval.dtype not in forms.MODEL_DTYPES or qval.dtype != kval.dtype:
        return None, f"dtype {kval.dtype}/{qval.dtype} is not a supported model dtype"
    why = []
    m, w = _match_rope_cos_sin(k_root, q_root, kval, qval, why)
    if m is not None or w:
        return m, w
    if kval.dim() != 3:
        return None, f"the cached key is not a RoPE output ({'; '.join(why)})"
    if not all(isinstance(s, int) for s in (*kval.shape[1:], *qval.shape[1:])):
        # heads first ([H, T, D]: the token count symbolic in a dynamic trace); int() of it
        # would guard the token dim to the trace's size
        return None, f"the cached key is not a RoPE output of [T, heads, head_size] ({'; '.join(why)})"
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
        xq, xk = fx_utils.val(qk["x"]), fx_utils.val(kk["x"])
        if xq is None or xk is None or xq.dtype != qval.dtype or xk.dtype != kval.dtype:
            # e.g. a bf16 q/k times an fp32 cos_sin_cache: the fused op rotates in q/k's dtype
            return None, (f"{form} RoPE changes dtype (q/k {getattr(xq, 'dtype', None)}/{getattr(xk, 'dtype', None)}"
                          f" rotated to {qval.dtype}); the fused op rotates in place in q/k's dtype")
        return RopeMatch(form, is_neox, qk["x"], kk["x"], q_root, k_root, int(kval.shape[2]),
                         positions=kk["positions"], cos_sin_cache=kk["cos_sin_cache"]), ""
    return None, "the cached key is not a RoPE output (" + "; ".join(why) + ")"


def same_size(a, b) -> bool:
    """Whether two sizes (ints or symbolic) are the same, without adding a shape guard."""
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or str(a) == str(b)


def _match_rope_cos_sin(k_root, q_root, kval, qval, why: list) -> tuple[RopeMatch | None, str]:
    """``forms.COS_SIN_ROPE_FORMS`` at the cached key and the query: ``(match, "")``, ``(None,
    why)`` for a RoPE of this kind that cannot fuse, ``(None, "")`` when the key is not one
    (the reasons appended to ``why``)."""
    rank, d = kval.dim(), int(kval.shape[-1])
    rot = _partial_rot_dim(k_root, d)
    candidates = [(form, form_rank, None) for form, (_, form_rank) in
                  (forms.COS_SIN_ROPE_FORMS | forms.HALF_COS_SIN_ROPE_FORMS | forms.GPTJ_COS_SIN_ROPE_FORMS).items()]
    if rot is not None:
        candidates += [(form, form_rank, rot) for form, (_, form_rank) in forms.PARTIAL_COS_SIN_ROPE_FORMS.items()]
    for form, form_rank, rot_dim in candidates:
        if form_rank != rank:
            continue
        fp32_rotation = form in forms.FP32_ROTATION_FORMS
        if fp32_rotation and kval.dtype == torch.float32:
            continue  # its conversions vanish in fp32: the model-dtype form is the same graph
        # rows in the model dtype, or (a form rotating in fp32) fp32 rows as well
        kk = kwhy = None
        for cos_dtype in (kval.dtype, torch.float32) if fp32_rotation else (kval.dtype,):
            pattern = forms.rope_cos_sin_pattern(form, kval.dtype, d, rot_dim, cos_dtype)
            if pattern is None:
                kwhy = "a size of the form equals a traced wildcard size"
                continue
            kk, kwhy = forms.match(pattern, k_root)
            if kk is not None:
                break
        if kk is None:
            why.append(f"{form}: {kwhy}")
            continue
        q_pattern = forms.rope_cos_sin_pattern(form, qval.dtype, int(qval.shape[-1]), rot_dim, cos_dtype)
        qk, qwhy = forms.match(q_pattern, q_root) if q_pattern is not None else (None, "no pattern")
        if qk is None:
            return None, f"key is {form} RoPE but the attention's query is not ({qwhy})"
        if qk["cos"] is not kk["cos"] or qk["sin"] is not kk["sin"]:
            return None, (f"query and key are rotated with different cos/sin ({form}: query {qk['cos'].name}/"
                          f"{qk['sin'].name}, key {kk['cos'].name}/{kk['sin'].name})")
        cos, sin = fx_utils.val(kk["cos"]), fx_utils.val(kk["sin"])
        xk, xq = fx_utils.val(kk["x"]), fx_utils.val(qk["x"])
        dtypes = {t.dtype for t in (cos, sin, xk, xq, kval, qval)}
        if fp32_rotation and cos.dtype == sin.dtype == torch.float32:
            # q/k widened to fp32 before the products: fp32 rows are what the writer computes with
            dtypes = {t.dtype for t in (xk, xq, kval, qval)}
        if len(dtypes) != 1:
            return None, (f"{form} RoPE mixes dtypes (q/k {xq.dtype}/{xk.dtype}, cos/sin {cos.dtype}/{sin.dtype}, "
                          f"rotated {qval.dtype}); the fused writer rotates in the model dtype's precision")
        heads_first = form in forms.HEADS_FIRST_FORMS
        lead = (xk.shape[0], xk.shape[2]) if heads_first else tuple(xk.shape[:rank - 2])  # (B, T) or (T,)
        width = forms.cos_sin_width(form, d, rot_dim)  # of the model's rows (repeat_pairs keeps it, even)
        if (cos.dim() != rank - 1 or sin.dim() != rank - 1 or not same_size(cos.shape[-1], width)
                or not all(same_size(a, b) for a, b in zip(cos.shape, sin.shape))):
            return None, f"{form} cos/sin {tuple(cos.shape)} are not per-token rows of {width} channels"
        q_lead = (xq.shape[0], xq.shape[2]) if heads_first else tuple(xq.shape[:rank - 2])
        if not all(same_size(a, b) for a, b in zip(q_lead, lead)):
            return None, f"{form}: query and key have different token shapes"
        batch = None
        if not all(same_size(a, b) for a, b in zip(cos.shape[:-1], lead)):
            c0 = cos.shape[0]
            if not (rank == 4 and isinstance(c0, int) and c0 == 1 and same_size(cos.shape[1], lead[1])):
                return None, f"{form} cos/sin {tuple(cos.shape)} do not give one row per token of {tuple(lead)}"
            batch = lead[0]  # position_ids [1, T] for a batch of B rows (symbolic under dynamic=True)
        return RopeMatch(form, form not in forms.GPTJ_FORMS, qk["x"], kk["x"], q_root, k_root, d,
                         cos=kk["cos"], sin=kk["sin"], cos_batch=batch), ""
    return None, ""


def _strip_copies(node: torch.fx.Node) -> torch.fx.Node:
    """Views and clones back to the tensor whose values they carry: transformers' attention
    reshapes ``[B, T, H, D]`` to ``[B*T, H, D]``, which copies (a post-grad ``clone``) when
    the RoPE's output is not laid out token-major (a partial rotary's ``cat``); and two
    permutes that undo each other (Gemma4 transposes its tokens-first q/k to ``[B, H, T, D]``,
    the attention transposes them back; the graph keeps both where the transposed key has
    another reader, a KV-sharing layer)."""
    while True:
        node = fx_utils.strip_views(node)
        inner = _undone_permute(node)
        if inner is not None:
            node = inner
            continue
        if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
                and node.target is aten.clone.default):
            return node
        node = node.args[0]


def _undone_permute(node) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``permute(permute(x, p1), p2)`` and ``p2`` undoes ``p1``, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.permute.default):
        return None
    inner = node.args[0]
    if not (isinstance(inner, torch.fx.Node) and inner.op == "call_function"
            and inner.target is aten.permute.default):
        return None
    n = len(node.args[1])
    p1, p2 = ([d % n for d in p] for p in (inner.args[1], node.args[1]))
    return inner.args[0] if all(p1[p2[i]] == i for i in range(n)) else None


def _partial_rot_dim(k_root: torch.fx.Node, d: int) -> int | None:
    """The rotated width of a partial-rotary key: the first input of the last-dim ``cat`` that
    is the key (under the transpose back, for ``[B, H, T, D]`` forms), if even and < d."""
    node = k_root
    if node.op == "call_function" and node.target is aten.permute.default:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.cat.default
            and len(node.args[0]) == 2):
        return None
    out, first = fx_utils.val(node), fx_utils.val(node.args[0][0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if out is None or first is None or dim not in (-1, out.dim() - 1):
        return None
    r = first.shape[-1]
    return int(r) if isinstance(r, int) and 0 < r < d and r % 2 == 0 else None


def producer(node: torch.fx.Node) -> str:
    """What computes ``node``, for a miss reason (``mm``, ``output 1 of split``...)."""
    if node.op != "call_function":
        return f"{node.op} {node.name}"
    if fx_utils.is_getitem(node):
        return f"output {node.args[1]} of {producer(node.args[0])}"
    return str(getattr(node.target, "__name__", node.target))


# Ops that only view their input, each a function of its arguments alone: two such nodes
# with the same target and arguments are the same tensor.
_PURE_VIEWS = frozenset({*fx_utils.VIEW_OPS, aten.slice.Tensor, aten.permute.default, aten.transpose.int,
                         aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.select.int})
_MERGE_DEPTH = 16  # how far above a rotated q/k duplicate views are looked for (a RoPE is ~10 ops)


def merge_duplicate_views(roots: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node, list]]:
    """Merge the duplicate views among the nodes up to ``_MERGE_DEPTH`` above ``roots``: a view
    node with the same target and arguments (after merging) as an earlier one has its uses
    moved to that one. Functionalization leaves such duplicates where a model mutates its
    projection in place before viewing it (OLMo's ``clamp_``: every use of the viewed q/k
    re-derives its views from the mutated base), and a form whose input is used twice binds
    it only when both uses are one node. Values are unchanged (the same view of the same
    tensor). Returns ``(duplicate, kept, moved users)`` for ``unmerge_views``."""
    cone, frontier = set(), list(roots)
    for _ in range(_MERGE_DEPTH):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in cone]
        cone.update(frontier)
    graph = roots[0].graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    written = _written_storages(graph)
    kept: dict = {}
    merged = []
    for n in sorted(cone, key=order.__getitem__):
        # a view of storage the graph writes in place may be read before or after the write
        # (and a reshape may copy): those are left alone
        if not (n.op == "call_function" and n.target in _PURE_VIEWS) or _storage_root(n) in written:
            continue
        try:
            key = (n.target, _freeze(n.args), _freeze(n.kwargs))
            hash(key)
        except TypeError:
            continue
        first = kept.setdefault(key, n)
        if first is not n:
            merged.append((n, first, n.replace_all_uses_with(first)))
    return merged


def _written_storages(graph: torch.fx.Graph) -> set:
    """The storage roots of every tensor an op of the graph writes in place."""
    out = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                a = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                for x in torch.fx.node.map_aggregate(a, lambda x: x) if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(x, torch.fx.Node):
                        out.add(_storage_root(x))
    return out


def _freeze(a):
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *(_freeze(x) for x in a))
    if isinstance(a, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in a.items()))
    return a if isinstance(a, torch.fx.Node) else (type(a).__name__, a)


def unmerge_views(merged) -> None:
    """Undo ``merge_duplicate_views``: each moved user reads its own view again."""
    for dup, first, users in reversed(merged):
        for user in users:
            user.replace_input_with(first, dup)


def _graph_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder ``node`` only views or copies, else None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
            node.target in _PURE_VIEWS or node.target in (aten.clone.default, aten.contiguous.default)):
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None


def strip_copies(node: torch.fx.Node) -> torch.fx.Node:
    """What the attention's query / key carries values of (``_strip_copies``)."""
    return _strip_copies(node)


def match_rope(site: LayerSite, roots: tuple[torch.fx.Node, torch.fx.Node] | None = None
               ) -> tuple[RopeMatch | None, str]:
    """Recognize the RoPE that produced the site's cached key and attention query (``roots``:
    ``(key, query)`` the rotation produced instead, when an op between it and the attention
    is fused with it: Hunyuan's norm after RoPE). Where a form's repeated input is bound to
    different nodes, the duplicate views above q/k are merged (``merge_duplicate_views``) and
    the match tried again; they stay merged only on a match."""
    k_root, q_root = roots if roots is not None else (_strip_copies(site.key), _strip_copies(site.query))
    m, why = _match_rope_op(k_root, q_root)
    if m is None and not why:
        m, why = _match_rope_hf(k_root, q_root)
        if m is None and "repeated pattern differs" in why:
            merged = merge_duplicate_views([k_root, q_root])
            if merged:
                m, why2 = _match_rope_hf(k_root, q_root)
                if m is None:
                    unmerge_views(merged)
                else:
                    why = why2
    if m is None:
        graph_input = _graph_input(k_root)
        if graph_input is not None and not why.startswith("the attention's query"):
            # A split piece's input: the key was computed before this graph (by a piece before
            # the split, or by the layer whose KV this one shares), so no RoPE is here to fuse.
            why = (f"the cached key is an input of this graph ({graph_input.name}), computed outside it "
                   f"(in an earlier piece, or by the layer whose KV this layer shares): no RoPE here to fuse")
        return None, why
    vv = fx_utils.val(site.value)
    if vv is None or int(vv.shape[-1]) != m.head_size:
        return None, f"RoPE splits heads of {m.head_size} channels, the cached value has heads of {vv.shape[-1]}"
    if m.per_token:
        # The fused outputs replace what the attention reads: [num_tokens, heads, head_size].
        for which, node in (("key", site.key), ("query", site.query)):
            v = fx_utils.val(node)
            if v is None or v.dim() != 3:
                return None, f"the attention's {which} is not a [num_tokens, heads, head_size] view"
        m.q_out, m.k_out = site.query, site.key
        return m, ""
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


def _sliced_columns(s: torch.fx.Node) -> ColumnSlice | None:
    """``s = x[..., start:end]`` (``aten.slice`` of the last dim, step 1) where ``x`` views a
    2-D tensor with the same last dim (``qkv[..., :q_size]`` on a ``[B, T, W]`` view of the
    projection's ``[B*T, W]``, as Phi-3 slices its fused qkv)."""
    args = list(s.args) + [None] * (5 - len(s.args))
    x, dim, start, end, step = args[:5]
    source = fx_utils.strip_views(x)
    xv, sv = fx_utils.val(x), fx_utils.val(source)
    if xv is None or sv is None or sv.dim() != 2 or dim not in (-1, xv.dim() - 1) or step not in (None, 1):
        return None
    width = sv.shape[1]
    if not isinstance(width, int) or not same_size(xv.shape[-1], width) or not isinstance(start, int):
        return None
    end = width if end is None else min(end, width)
    if not isinstance(end, int) or not 0 <= start < end:
        return None
    return ColumnSlice(source, start, end)


def column_slice(node: torch.fx.Node) -> ColumnSlice | None:
    """Where ``node`` (through reshapes) is one output of a last-dim split of a 2-D tensor, or
    a last-dim slice of a view of one (e.g. q, k or v of a fused qkv projection): its columns
    in that tensor; else None."""
    s = fx_utils.strip_views(node)
    if isinstance(s, torch.fx.Node) and s.op == "call_function" and s.target is aten.slice.Tensor:
        return _sliced_columns(s)
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


def per_token_rows(graph: torch.fx.Graph, rope: RopeMatch, x: torch.fx.Node) -> torch.fx.Node:
    """``x`` of a per-token RoPE as ``[num_tokens, ...]`` rows: q/k ``[B, T, H, D]`` (or
    heads-first ``[B, H, T, D]``) -> ``[B*T, H, D]``, cos/sin ``[B, T, D]`` -> ``[B*T, D]``
    (expanded first when they broadcast over the batch); token-major tensors as they are.
    Inserted at the insert point."""
    v = fx_utils.val(x)
    per_token = forms.PER_TOKEN_ROPE_FORMS
    if rope.form not in per_token or per_token[rope.form][1] == 3:
        return x
    if v.dim() == 3 and rope.cos_batch is not None:  # cos/sin [1, T, D]
        batch = rope.cos_batch
        if not isinstance(batch, int):  # a symbolic batch: read from the key, without a guard on it
            batch = fx_utils.call(graph, aten.sym_size.int, (rope.k_in, 0))
        x = fx_utils.call(graph, aten.expand.default, (x, [batch, -1, -1]))
    if v.dim() == 4 and rope.form in forms.HEADS_FIRST_FORMS:  # q/k [B, H, T, D] -> [B, T, H, D]
        x = fx_utils.call(graph, aten.permute.default, (x, [0, 2, 1, 3]))
        return fx_utils.call(graph, aten.reshape.default, (x, [-1, int(v.shape[1]), int(v.shape[3])]))
    return fx_utils.call(graph, aten.reshape.default, (x, [-1, *[int(s) for s in v.shape[2:]]]))


def per_token_cos_sin(graph: torch.fx.Graph, rope: RopeMatch) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The cos/sin rows the fused writers take (``per_token_rows``), one value per rotated
    channel: a half-width form's rows doubled (``cat((c, c))``: NeoX pairs channel i with
    i + D/2 at the same angle); a ``forms.PAIR_ROWS_FORMS`` form's first half of the rows,
    each value repeated for its pair (``forms.repeat_pairs``: ``[c0, c0, c1, c1, ...]``)."""
    rows = [per_token_rows(graph, rope, x) for x in (rope.cos, rope.sin)]
    if rope.form in forms.HALF_COS_SIN_ROPE_FORMS:
        rows = [fx_utils.call(graph, aten.cat.default, ([r, r], -1)) for r in rows]
    if rope.form in forms.PAIR_ROWS_FORMS:
        rows = [_repeat_pairs(graph, r) for r in rows]
    return rows[0], rows[1]


def _repeat_pairs(graph: torch.fx.Graph, rows: torch.fx.Node) -> torch.fx.Node:
    """``rows [N, W]`` (W even) -> ``[N, W]``: ``rows[:, :W/2]``, each column twice in a row."""
    w = int(fx_utils.val(rows).shape[-1])
    half = fx_utils.call(graph, aten.slice.Tensor, (rows, 1, 0, w // 2))
    col = fx_utils.call(graph, aten.unsqueeze.default, (half, 2))
    pairs = fx_utils.call(graph, aten.cat.default, ([col, col], 2))
    return fx_utils.call(graph, aten.reshape.default, (pairs, [-1, w]))


# Ops whose output aliases their first input (a view): Inductor tracks those aliases itself.
_ALIASING = frozenset({*fx_utils.VIEW_OPS, *_SPLITS, aten.slice.Tensor, operator.getitem, aten.permute.default,
                       aten.transpose.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                       aten.select.int})


def _storage_root(node: torch.fx.Node) -> torch.fx.Node:
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _ALIASING:
        node = node.args[0]
    return node


def value_computed_from_rotated(graph: torch.fx.Graph, value: torch.fx.Node, q_in: torch.fx.Node,
                                k_in: torch.fx.Node) -> bool:
    """Whether ``value`` is *computed* (by an op that is not a view) from the storage of ``q_in``/
    ``k_in``, which a fused writer rotates in place. Inductor may recompute such a value after the
    writer (it did: ``v = k * 2`` read the rotated k) while its reinplacing checks only the FX
    order, so these sites must not fuse. A view of that storage is safe (Inductor sees the alias
    and copies), as is a computation from columns of it that the writer does not touch (the v
    slice of a fused qkv)."""
    mutated: dict[torch.fx.Node, list] = {}  # storage root -> rotated column ranges (None: all of it)
    for x in (q_in, k_in):
        cols = column_slice(x)
        root = _storage_root(cols.source if cols is not None else x)
        if cols is None or mutated.get(root, []) is None:
            mutated[root] = None
        else:
            mutated.setdefault(root, []).append(cols)

    def untouched(n):
        cols = column_slice(n)
        if cols is None:
            return False
        rotated = mutated.get(_storage_root(cols.source), [])
        return rotated is not None and all(_disjoint(cols, c) for c in rotated)

    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[r] for r in mutated)
    seen, stack = set(), [(value, False)]
    while stack:
        n, computed = stack.pop()
        if not isinstance(n, torch.fx.Node) or order[n] < first or (n, computed) in seen:
            continue
        seen.add((n, computed))
        if n in mutated:
            if computed:
                return True
            continue
        if computed and untouched(n):
            continue
        view = n.op == "call_function" and n.target in _ALIASING
        stack.extend((a, computed or not view) for a in n.all_input_nodes)
    return False


_AUTO_FUNCTIONALIZED_V2 = torch.ops.higher_order.auto_functionalized_v2


def emit_in_place(graph: torch.fx.Graph, op, kwargs: dict, site: LayerSite, q_in: torch.fx.Node,
                  k_in: torch.fx.Node, q_out: torch.fx.Node, k_out: torch.fx.Node) -> torch.fx.Node:
    """Insert ``op`` (a layer-level writer that mutates ``query`` and ``key`` in place and
    returns a dependency token) functionalized at the insert point, on ``q_in``/``k_in``;
    point ``q_out``/``k_out`` (and the attention's v, see below) at its results; return
    its token. ``kwargs``: the op's other arguments (``value`` among them).

    When q and k are column slices of one tensor computed in the graph (``qkv = x @ W``,
    then split), that tensor is the one base, q and k its slices, and the attention reads
    q, k and v as slices of the op's result: Inductor reinplaces one base per storage, so
    this leaves no copy. Otherwise q and k are two bases (each reinplaced when nothing reads
    it afterwards; a graph input is never mutated in place, so it is copied); a base that views
    storage something else reads is copied once the graph is tidied (``copy_shared_view_bases``).
    """
    kwargs = dict(kwargs)
    _share_fused_key(site)
    q_cols, k_cols = column_slice(q_in), column_slice(k_in)
    v_cols = column_slice(site.value)
    one_base = (q_cols is not None and k_cols is not None and q_cols.source is k_cols.source
                and q_cols.source.op != "placeholder" and _disjoint(q_cols, k_cols)
                # v read from the op's result must not be columns the op rotates (v = k)
                and not (v_cols is not None and v_cols.source is q_cols.source
                         and not (_disjoint(v_cols, q_cols) and _disjoint(v_cols, k_cols))))
    if one_base:
        for arg, cols in (("query", q_cols), ("key", k_cols)):
            kwargs.update({f"_{arg}_base_index": 0, f"_{arg}_slice_dim": 1,
                           f"_{arg}_slice_start": cols.start, f"_{arg}_slice_end": cols.end})
        kwargs["_all_bases"] = [q_cols.source]
    else:
        kwargs.update(_query_base_index=0, _key_base_index=1, _all_bases=[q_in, k_in])
    fused = fx_utils.call(graph, _AUTO_FUNCTIONALIZED_V2, (op,), kwargs)
    token = fx_utils.call(graph, operator.getitem, (fused, 0))
    if not one_base:
        q_new, k_new = (fx_utils.call(graph, operator.getitem, (fused, i)) for i in (1, 2))
        replace_outputs(graph, [(q_out, q_new), (k_out, k_new)])
        return token
    base = fx_utils.call(graph, operator.getitem, (fused, 1))
    q_new, k_new = (fx_utils.call(graph, aten.slice.Tensor, (base, 1, c.start, c.end)) for c in (q_cols, k_cols))
    if v_cols is not None and v_cols.source is q_cols.source:
        # The attention's v is a slice of the same tensor: read it from the op's result, so no
        # use of the tensor from before the op is left after it (one would stop the reinplacing).
        v_new = fx_utils.reshape_like(graph, fx_utils.call(
            graph, aten.slice.Tensor, (base, 1, v_cols.start, v_cols.end)), site.value)
        site.value.replace_all_uses_with(v_new, delete_user_cb=lambda user: user is not fused)
    replace_outputs(graph, [(q_out, q_new), (k_out, k_new)])
    return token


_IN_PLACE_WRITERS = (rocm.unified_rope_and_kv_cache_update.default, rocm.unified_rope_cos_sin_and_kv_cache_update.default,
                     rocm.unified_qk_norm_rope_cos_sin_and_kv_cache_update.default)


def copy_shared_view_bases(graph: torch.fx.Graph) -> bool:
    """Give a fused in-place writer emitted with q and k as two bases (``emit_in_place``) a
    copy of each base that views storage anything else reads (the other base, the value, another
    view, a second writer); returns whether it changed the graph. Run after dead-code
    elimination, when the unfused RoPE no longer reads q/k. auto_functionalized_v2 takes one
    base per storage (Dynamo passes a mutated view as its base plus view arguments), and
    Inductor miscompiled a view base whose storage is read elsewhere (q a view of a ``cat`` or of
    a pointwise result whose other columns are the value: NaN attention output); a copy is a
    storage of its own."""
    changed = False
    for node in list(graph.find_nodes(op="call_function", target=_AUTO_FUNCTIONALIZED_V2)):
        if node.args[0] not in _IN_PLACE_WRITERS or "_query_slice_dim" in node.kwargs:
            continue
        bases = list(node.kwargs["_all_bases"])
        shared = [_storage_read_elsewhere(b, node) for b in bases]
        if not any(shared):
            continue
        with graph.inserting_before(node):
            bases = [fx_utils.call(graph, aten.clone.default, (b,)) if s else b for b, s in zip(bases, shared)]
        node.update_kwarg("_all_bases", bases)
        changed = True
    return changed


def _storage_read_elsewhere(base: torch.fx.Node, writer: torch.fx.Node) -> bool:
    """Whether ``base`` views (through ``_ALIASING`` ops) storage, not a graph input's, that a
    node other than ``writer`` reading ``base`` itself reads: any use of any view of its storage
    root that reads data."""
    root = _storage_root(base)
    if root is base or root.op == "placeholder":  # a graph input is copied, never written in place
        return False
    stack, seen = [root], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "call_function" and user.target in _ALIASING:
                stack.append(user)
            elif not (user is writer and n is base) and user.target not in _METADATA_READS:
                return True
    return False


# Ops that read only a tensor's sizes or strides, never its data
_METADATA_READS = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                             aten.sym_storage_offset.default})


def _share_fused_key(site: LayerSite) -> None:
    """Point the later layers that cache this layer's rotated key (KV sharing) at the key the
    attention reads, so that they read the fused writer's key too: left on their own view
    they would keep the unfused RoPE alive, computed from a key the writer changes in place."""
    root = _strip_copies(site.key)
    shape = fx_utils.val(site.key).shape
    for other in cache_updates(site.cache.graph):
        if other is site.cache or other.args[2] == site.layer_name or _strip_copies(other.args[0]) is not root:
            continue
        keys = {other.args[0], *(u.kwargs["key"] for u in other.users
                                 if fx_utils.auto_functionalized_op(u) is rocm.unified_attention_with_output.default)}
        for key in keys:
            v = fx_utils.val(key)
            # only a key that carries the same values: that layer's attention may read a key
            # of its own, which must keep its values (and every other use of it)
            if (key is not site.key and _strip_copies(key) is root and v is not None and len(v.shape) == len(shape)
                    and all(same_size(a, b) for a, b in zip(v.shape, shape))):
                key.replace_all_uses_with(site.key)


def _disjoint(a: ColumnSlice, b: ColumnSlice) -> bool:
    return a.end <= b.start or b.end <= a.start


def replace_outputs(graph: torch.fx.Graph, pairs) -> None:
    """Point every use of each old node at its new node (reshaped to the old shape)."""
    for old, new in pairs:
        with graph.inserting_after(new):
            new = fx_utils.reshape_like(graph, new, old)
        old.replace_all_uses_with(new)
