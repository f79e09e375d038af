"""Generic FX helpers the passes share: read a node's fake value, look through views, find
``getitem`` users, recognize ``auto_functionalized`` nodes, read and set an op call's
arguments by name, insert nodes with their ``meta["val"]`` and tidy a graph after hand
rewrites.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._inductor import pattern_matcher as pm

aten = torch.ops.aten

#: the ops post-grad graphs express views with
VIEW_OPS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def val(node: Any) -> torch.Tensor | None:
    """The fake tensor a node computes (None for non-tensor values)."""
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def strip_views(node: torch.fx.Node) -> torch.fx.Node:
    """Follow reshape/view nodes back to the tensor they view."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return node


def is_getitem(node: Any, index: int | None = None) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and (index is None or node.args[1] == index))


def auto_functionalized_op(node: Any):
    """The op an ``auto_functionalized(_v2)`` node wraps, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    hops = [getattr(torch.ops.higher_order, n, None) for n in ("auto_functionalized_v2", "auto_functionalized")]
    if node.target in [h for h in hops if h is not None]:
        return node.args[0]
    return None


def called_op(node: Any):
    """The op a node calls, plainly or under ``auto_functionalized(_v2)``, else None."""
    op = auto_functionalized_op(node)
    if op is None and isinstance(node, torch.fx.Node) and node.op == "call_function":
        op = node.target
    return op if isinstance(op, torch._ops.OpOverload) else None


def op_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments of ``called_op(node)`` by schema name, as the node passes them (a
    functionalized call passes them all by keyword)."""
    if auto_functionalized_op(node) is not None:
        return dict(node.kwargs)
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def set_op_argument(node: torch.fx.Node, name: str, value: torch.fx.Node | None) -> None:
    """Set argument ``name`` of the op call ``node`` (plain or functionalized), in its
    arguments and in the ``eager_input_vals`` Inductor's ``auto_functionalized_v2``
    decomposition traces with (else that decomposition drops it again)."""
    op = called_op(node)
    i = [a.name for a in op._schema.arguments].index(name)
    positional = auto_functionalized_op(node) is None and len(node.args) > i
    if positional:
        node.update_arg(i, value)
    else:
        node.update_kwarg(name, value)
    eager = node.meta.get("eager_input_vals")
    if eager is not None:
        args, kwargs = eager
        v = value.meta["val"] if isinstance(value, torch.fx.Node) else value
        if positional:
            args = (*args[:i], v, *args[i + 1:])
        else:
            kwargs = {**kwargs, name: v}
        node.meta["eager_input_vals"] = (args, kwargs)


def getitem_user(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    for u in node.users:
        if is_getitem(u, index):
            return u
    return None


def _fake_mode(values):
    mode = torch._guards.detect_fake_mode(values)
    if mode is None:
        from torch._inductor.virtualized import V

        mode = V.fake_mode
    return mode


def call(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insert point, with ``meta["val"]``."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    vargs, vkwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    if target is operator.getitem:
        node.meta["val"] = vargs[0][vargs[1]]
    else:
        leaves = [v for v in torch.utils._pytree.tree_leaves((vargs, vkwargs)) if isinstance(v, torch.Tensor)]
        with _fake_mode(leaves):
            node.meta["val"] = target(*vargs, **vkwargs)
    return node


def reshape_like(graph: torch.fx.Graph, node: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """``node`` reshaped to ``like``'s shape (leading token dim inferred), or ``node`` itself."""
    src, dst = val(node).shape, val(like).shape
    if len(src) == len(dst) and all(a is b or a == b for a, b in zip(src[1:], dst[1:])):
        return node
    return call(graph, aten.reshape.default, (node, [-1, *[int(s) for s in dst[1:]]]))


def finish(graph: torch.fx.Graph) -> None:
    """Drop dead nodes and restore a topological order after hand rewrites."""
    pm.stable_topological_sort(graph)
    graph.eliminate_dead_code()
