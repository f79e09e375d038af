"""Inlining of the per-layer compile regions (``layer_regions``) of a Dynamo graph.

Dynamo traces a region once and calls it again for every identical layer
(``invoke_subgraph(subgraph, identifier, *operands)``, results read with ``getitem``).
:func:`inline_regions` copies each call's subgraph into the graph in its place, so the
graph that is split, deduped and compiled holds the same ops in the same order as a trace
without regions.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["inline_regions"]


def _invoke_subgraph():
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def inline_regions(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Inline every region call of ``gm`` in place (nested ones too); returns (calls,
    distinct subgraphs), (0, 0) for a graph without regions."""
    hop = _invoke_subgraph()
    calls = [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]
    if not calls:
        return 0, 0
    inlined: set[int] = set()
    targets: set[str] = set()
    for node in calls:
        attr = node.args[0]
        sub = getattr(gm, attr.target)
        targets.add(attr.target)
        if id(sub) not in inlined:  # a subgraph's own region calls first
            inline_regions(sub)
            inlined.add(id(sub))
        _inline_call(gm, node, sub)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in targets and not node.users:
            gm.graph.erase_node(node)
    for name in targets:
        if hasattr(gm, name):
            delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    return len(calls), len(targets)


def _inline_call(gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule) -> None:
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    operands = node.args[2:]
    if len(placeholders) != len(operands):
        raise RuntimeError(f"compile_piecewise: region call {node.name} passes {len(operands)} operands to a "
                           f"subgraph of {len(placeholders)} inputs")
    env: dict[torch.fx.Node, object] = dict(zip(placeholders, operands))
    outputs = None
    copied: list[torch.fx.Node] = []
    with gm.graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                outputs = sn.args[0]
                break
            if sn.op not in ("call_function", "call_method"):
                raise RuntimeError(f"compile_piecewise: cannot inline a region holding a {sn.op} node "
                                   f"({sn.format_node()})")
            env[sn] = gm.graph.node_copy(sn, lambda a: env[a])
            copied.append(env[sn])
    results = torch.fx.node.map_arg(outputs, lambda a: env[a])
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise RuntimeError(f"compile_piecewise: a region's result is used by {user.format_node()}, "
                               "not read by index")
        result = results[user.args[1]]
        if not isinstance(result, torch.fx.Node):
            raise RuntimeError(f"compile_piecewise: a region returns the constant {result!r}; return tensors")
        user.replace_all_uses_with(result)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    # A region reads the sizes it uses from its inputs (``size`` nodes); Dynamo drops the
    # unused ones of a flat trace, so drop them here too. Only those: an unused in-place op
    # (``add_``, ``masked_fill_``, ``setitem``) is what the region computes.
    for n in reversed(copied):
        if not n.users and _reads_a_size(n):
            gm.graph.erase_node(n)


def _reads_a_size(node: torch.fx.Node) -> bool:
    """A ``size`` call, or an index into one."""
    if node.op == "call_method" and node.target == "size":
        return True
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "call_method"
            and node.args[0].target == "size")
