"""Generic FX helpers the passes share: read a node's fake value, look through views, find
``getitem`` users, recognize ``auto_functionalized`` nodes, insert nodes with their
``meta["val"]`` and tidy a graph after hand rewrites.
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
