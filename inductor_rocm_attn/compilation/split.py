"""The split of a traced model at its attention ops, and the stand-in attentions inserted
into the pieces so the fusion passes still see whole layer sites.

``split_at_attention`` cuts the graph with ``torch.fx.passes.split_module`` at every
``rocm_attn.unified_attention_with_output``: ``L`` attention layers give ``L + 1`` compiled
pieces and ``L`` attention pieces (run eagerly). The cache update
(``unified_kv_cache_update``) stays inside the piece before its attention.
``add_stand_ins`` then gives each piece that produces an attention's inputs a stand-in of
that attention (see ``inductor_rocm_attn.passes.remove_stand_ins``, the pass that removes
them after the fusions).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx.passes.split_module

from inductor_rocm_attn.passes.remove_stand_ins import TOKEN_PLACEHOLDER

#: The op the graph is split at (attention runs eagerly between compiled pieces).
SPLITTING_OPS = ("rocm_attn.unified_attention_with_output",)

_ATTN_ARGS = ("query", "key", "value", "output", "layer_name", "kv_cache_dependency", "output_scale")


def op_name(node: torch.fx.Node) -> str | None:
    """``"namespace.op"`` of a node calling an op (overload or packet), else None."""
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"{t._qualified_op_name.replace('::', '.')}"
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}"
    return None


def is_split_node(node: torch.fx.Node) -> bool:
    return op_name(node) in SPLITTING_OPS


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """Split ``gm`` at every attention op. Returns (split module, compiled piece names,
    attention piece names), each list in execution order."""
    part = 0
    ids: dict[torch.fx.Node, int] = {}
    attn_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node):
            part += 1
            ids[node] = part
            attn_parts.add(part)
            part += 1
        else:
            ids[node] = part
    split = torch.fx.passes.split_module.split_module(
        gm, None, lambda n: ids[n], keep_original_order=True
    )
    compiled, attn = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            idx = int(node.target.rsplit("_", 1)[-1])
            (attn if idx in attn_parts else compiled).append(node.target)
    return split, compiled, attn


def submodule_inputs(split: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     names: Sequence[str] | None = None,
                     memo_key: Callable[[str, list], str | None] | None = None) -> dict[str, list[Any]]:
    """Fake inputs of the submodules ``names`` (default: all), each in its placeholder order.

    ``split_module`` copies each input's node meta onto the submodule's placeholder, and a
    graph from Dynamo carries its fake values there (``meta["example_value"]``; ``"val"``
    after AOT tracing): read them. Only when a placeholder has none (a graph built without
    fake values) is the split graph run on fakes of ``example_inputs`` (the graph's inputs,
    real or fake) under their fake mode to learn them; ``memo_key(name, inputs)`` (e.g. a
    structure key: equal keys, equal outputs) lets a submodule reuse the outputs of an
    earlier one of the same key instead of running (identical layers run once)."""
    names = list(names) if names is not None else [
        n.target for n in split.graph.nodes if n.op == "call_module"]
    seen: dict[str, list[Any]] = {}
    for name in names:
        values = [_fake_value(ph) for ph in split._modules[name].graph.nodes if ph.op == "placeholder"]
        if any(v is None for v in values):
            return _interpret_inputs(split, example_inputs, names, memo_key)
        seen[name] = values
    return seen


_MISSING = object()


def _fake_value(placeholder: torch.fx.Node) -> Any:
    meta = placeholder.meta
    value = meta.get("val", meta.get("example_value", _MISSING))
    if value is _MISSING or (value is None and placeholder.type is not type(None)):
        return None
    return value


class _Recorder(torch.fx.Interpreter):
    """Runs a submodule and records each node's value as Dynamo does (``example_value``):
    AOTAutograd's cache needs it to tell tensors from other values."""

    def run_node(self, n):
        out = super().run_node(n)
        n.meta.setdefault("example_value", out)
        return out


def _interpret_inputs(split: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      names: Sequence[str], memo_key) -> dict[str, list[Any]]:
    """The fallback: the split graph run under the fake mode, each submodule's node values
    recorded in its meta (a submodule reusing another's outputs records none)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    fake_args = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
                 else x for x in example_inputs]
    seen: dict[str, list[Any]] = {}
    outputs: dict[str, Any] = {}

    class _Interp(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            assert not kwargs
            seen[target] = list(args)
            key = memo_key(target, list(args)) if memo_key is not None else None
            if key is not None and key in outputs:
                return outputs[key]
            out = _Recorder(split._modules[target]).run(*args)
            if key is not None:
                outputs[key] = out
            return out

    # The Python dispatcher, as Dynamo's fake runs use: without it, torch 2.11's C++ matmul
    # reads concrete sizes and specializes the token dimension (every piece then static).
    with fake_mode, enable_python_dispatcher():
        _Interp(split).run(*fake_args)
    _check_not_specialized(fake_mode, [x for x in example_inputs if isinstance(x, (FakeTensor, torch.SymInt))])
    return {name: seen[name] for name in names}


def _check_not_specialized(fake_mode, token_inputs: Sequence[Any]) -> None:
    """A symbolic size of the graph's token inputs (the ones that came in fake; parameters
    made fake here get symbols that rightly become constants) that the fake run turned into
    a constant would compile every piece for that one size: refuse it here rather than fail
    at the first other size."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return
    for x in token_inputs:
        sizes = x.shape if isinstance(x, torch.Tensor) else [x]
        for size in sizes:
            if not isinstance(size, torch.SymInt):
                continue
            if size.node.expr.is_number:  # the symbol was replaced by a constant
                symbol = next((k for k, v in shape_env.replacements.items() if v == size.node.expr), "size")
                raise RuntimeError(
                    f"compile_piecewise: the fake run of the split graph specialized the token "
                    f"dimension ({symbol} = {size.node.expr}) on torch {torch.__version__}; the "
                    f"pieces would only run at that size")


def _attn_call_args(node: torch.fx.Node) -> dict[str, Any]:
    args = dict(zip(_ATTN_ARGS, node.args))
    args.update(node.kwargs)
    return args


def add_stand_ins(split: torch.fx.GraphModule, compiled_names: list[str]) -> int:
    """Give each piece that produces an attention's inputs a stand-in of that attention;
    returns how many were added."""
    pieces = set(compiled_names)
    calls = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
    added = 0
    for attn_call in calls.values():
        sub = split._modules[attn_call.target]
        attn = next((n for n in sub.graph.nodes if is_split_node(n)), None)
        if attn is None:
            continue
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        outer = dict(zip(phs, attn_call.args))  # attention piece placeholder -> split-graph value

        def source(a):  # the (piece, output index) a split-graph value comes from
            v = outer.get(a) if isinstance(a, torch.fx.Node) else None
            if (isinstance(v, torch.fx.Node) and v.target is operator.getitem
                    and v.args[0].op == "call_module" and v.args[0].target in pieces):
                return v.args[0].target, v.args[1]
            return None

        a = _attn_call_args(attn)
        srcs = {k: source(a.get(k)) for k in ("query", "key", "value", "output", "kv_cache_dependency")}
        if any(v is None for v in srcs.values()) or a.get("output_scale") is not None:
            continue
        names = {v[0] for v in srcs.values()}
        if len(names) != 1:
            continue
        piece = split._modules[names.pop()]
        out_node = next(n for n in piece.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        if not isinstance(outs, (tuple, list)):
            continue
        val = {k: outs[i] for k, (_, i) in srcs.items()}
        token = val["kv_cache_dependency"]
        if not isinstance(token, torch.fx.Node) or len(token.users) != 1:
            continue
        with piece.graph.inserting_before(out_node):
            # It "writes" the real output buffer, which the piece returns: so functionalization
            # keeps it (a stand-in writing a dead scratch buffer is dropped with the cache update).
            piece.graph.call_function(torch.ops.rocm_attn.unified_attention_with_output.default, (
                val["query"], val["key"], val["value"], val["output"], a["layer_name"], token))
            ph = piece.graph.call_function(TOKEN_PLACEHOLDER, (val["key"], a["layer_name"]))
        tok_idx = srcs["kv_cache_dependency"][1]
        out_node.args = (tuple(ph if i == tok_idx else o for i, o in enumerate(outs)),)
        piece.recompile()
        added += 1
    return added
