"""Dedup of identical layers: the pieces of layers 1..L-1 become one graph, compiled once.

A piece's layer names are replaced by slot aliases (``__rocm_attn_slot0__``) bound to the
piece's own layers at run time (``bind_alias``, in the runner's layer table, which the
forward context resolves names through during its steps), its nodes are renamed canonically, and a
structure key (the graph up to node names, plus its inputs' metadata) says which pieces can
share one compiled artifact. Compile time then does not grow with depth, and the canonical
code gives the same key in Inductor's FX-graph cache across layers, depths and processes.
"""

from __future__ import annotations

import hashlib
from typing import Any, MutableMapping, Sequence

import torch

from inductor_rocm_attn.forward_context import SLOT_PREFIX  # noqa: F401  (re-exported: the one definition)
from inductor_rocm_attn.passes.interleaved_v import switch_to_interleaved_v


def slot_alias(j: int) -> str:
    """The name slot ``j`` of a shared piece calls its layer by."""
    return f"{SLOT_PREFIX}{j}__"


def bind_alias(table: MutableMapping[str, Any], alias: str, layer) -> None:
    """Point a slot alias at ``layer`` in ``table`` (a runner's layer table, the one its
    steps enter as the forward context's): rebound before a shared piece runs or is captured."""
    table[alias] = layer


def normalize_layer_names(gm: torch.fx.GraphModule, layer_names: set[str]) -> list[str]:
    """Replace layer-name constants in ``gm`` by slot aliases, in place; returns the names
    in slot order."""
    order: list[str] = []

    def sub(a):
        if isinstance(a, str) and a in layer_names:
            if a not in order:
                order.append(a)
            return slot_alias(order.index(a))
        return a

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = torch.fx.node.map_aggregate(node.args, sub)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, sub)
    gm.recompile()
    return order


def canonicalize_names(gm: torch.fx.GraphModule) -> None:
    """Rename every node of a piece ``n0, n1, ...`` (placeholders ``arg0, ...``), in place:
    the pieces of different layers then have the same code, and so the same key in
    Inductor's FX graph cache (warm compiles hit across layers, depths and processes)."""
    i = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            node.target = f"arg{i}"
            node._rename(f"arg{i}")
        else:
            node._rename(f"n{i}")
        i += 1
    gm.recompile()


def _meta_key(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({tuple(map(str, x.shape))},{tuple(map(str, x.stride()))},{x.dtype},{x.device},{x.requires_grad})"
    if isinstance(x, torch.SymInt):
        return f"S({x.node.expr})"
    return f"C({type(x).__name__}:{x!r})"


def structure_key(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> str | None:
    """Hash of a piece's graph up to node names, plus its inputs' metadata; None when the
    piece holds module state (get_attr) and so cannot be shared."""
    index: dict[torch.fx.Node, int] = {}
    parts = []

    def ref(a):
        return f"%{index[a]}" if isinstance(a, torch.fx.Node) else repr(a)

    for i, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr" or node.op == "call_module":
            return None
        index[node] = i
        target = node.target if isinstance(node.target, str) else torch.fx.node._get_qualified_name(node.target) \
            if callable(node.target) and not isinstance(node.target, torch._ops.OpOverload) else str(node.target)
        args = torch.fx.node.map_aggregate(node.args, ref)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
        parts.append(f"{node.op}|{target if node.op != 'placeholder' else ''}|{args}|{kwargs}")
    parts.append("inputs:" + ";".join(_meta_key(x) for x in inputs))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def follow_interleaved_v(representative: Sequence, layers: Sequence) -> None:
    """A pass may have switched the layers of the piece compiled first (``representative``)
    to interleaved V at compile time: the layers sharing its code follow, slot by slot."""
    for a, b in zip(representative, layers):
        if a.interleaved_v != b.interleaved_v:
            switch_to_interleaved_v(b, a.interleaved_v)
