"""Expansion of the per-layer compile regions (``layer_regions``) of a Dynamo graph, so the
graph that is split, deduped and compiled holds the same ops in the same order as a trace
without regions.

- Nested mode: Dynamo traces a region once and calls it again for every identical layer
  (``invoke_subgraph(subgraph, identifier, *operands)``, results read with ``getitem``);
  :func:`inline_regions` copies each call's subgraph into the graph in its place.
- Stamp mode: a group's representative is traced inline between identity markers
  (``region_input`` / ``region_output``) and every other member is one opaque
  ``region_copy`` call taking its arguments and its module's tensors; :func:`stamp_regions`
  copies the representative's marked segment in place of each copy call, its arguments and
  tensors substituted, and drops the markers.
"""

from __future__ import annotations

import operator

import torch

from inductor_rocm_attn import layer_regions

from .split import op_name

__all__ = ["inline_regions", "stamp_regions"]


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


# --- stamp mode ------------------------------------------------------------------------------


def _is_call(node: torch.fx.Node, fn) -> bool:
    return node.op == "call_function" and node.target is fn


def stamp_regions(gm: torch.fx.GraphModule, example_inputs) -> tuple[int, int]:
    """Stamp out every ``region_copy`` call of ``gm`` (in place) from its group's marked
    representative, then drop the markers; ``example_inputs``: the graph's inputs (real),
    which tell the representative's own tensors among the placeholders. Returns (region
    calls, representatives traced), (0, 0) for a graph without stamp markers. Raises when a
    representative's segment reads a value the stamp cannot substitute."""
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if _is_call(n, layer_regions.region_input)]
    outputs = [n for n in nodes if _is_call(n, layer_regions.region_output)]
    copies = [n for n in nodes if _is_call(n, layer_regions.region_copy)]
    if not (inputs or outputs or copies):
        return 0, 0
    plan = layer_regions.plan()
    if plan is None:
        raise RuntimeError("compile_piecewise: a graph with layer-region stamps traced outside a stamp plan")
    values = dict(zip((n for n in nodes if n.op == "placeholder"), example_inputs))
    position = {n: i for i, n in enumerate(nodes)}
    segments = {}
    for key in dict.fromkeys(tuple(n.args[1:3]) for n in inputs + outputs):
        segments[key] = _segment(key, nodes, position, values, plan,
                                 [n for n in inputs if tuple(n.args[1:3]) == key],
                                 [n for n in outputs if tuple(n.args[1:3]) == key])
    for call in copies:
        index, group, member, num_args = call.args[:4]
        if (index, group) not in segments:
            raise RuntimeError(f"compile_piecewise: layer region {index} of group {group} has copies but no "
                               "marked representative")
        _stamp(gm, call, segments[(index, group)], call.args[4:4 + num_args], call.args[4 + num_args:])
    for marker in inputs + outputs:
        marker.replace_all_uses_with(marker.args[0])
        gm.graph.erase_node(marker)
    gm.graph.lint()
    gm.recompile()
    return len(segments) + len(copies), len(segments)


def _segment(key, nodes, position, values, plan, inputs, outputs) -> dict:
    """The representative's region: the nodes between its last input marker and its first
    output marker, and how each outside value it reads is substituted for a copy."""
    index, group = key
    if not inputs or not outputs:
        raise RuntimeError(f"compile_piecewise: layer region {index} of group {group} lacks its input or "
                           "output markers")
    if len({n.args[3] for n in inputs}) != len(inputs) or len({n.args[3] for n in outputs}) != len(outputs):
        raise RuntimeError(f"compile_piecewise: layer region {index} of group {group}: its representative "
                           "module is called more than once; a module shared between calls cannot be stamped")
    start = max(position[n] for n in inputs)
    end = min(position[n] for n in outputs)
    body = nodes[start + 1:end]
    inside = set(body)
    by_marker = {n: ("arg", n.args[3]) for n in inputs}
    representative = plan.groups[group][0]
    own = {id(t): ("tensor", j) for j, t in enumerate(representative._region_tensors)}
    layer_tensors = {id(t) for t in list(representative.parameters()) + list(representative.buffers())}
    subst: dict[torch.fx.Node, tuple] = {}
    for node in body:
        if node.op not in ("call_function", "call_method") or node.target in (
                layer_regions.region_input, layer_regions.region_output, layer_regions.region_copy):
            raise RuntimeError(f"compile_piecewise: cannot stamp a layer region holding {node.format_node()}")
        if _names_a_layer(node):  # the copy would name the representative's layer
            raise RuntimeError(f"compile_piecewise: a layer region holds an op naming its layer "
                               f"({node.format_node()}); attention stays outside the regions")
        for a in node.all_input_nodes:
            if a in inside or a in subst:
                continue
            subst[a] = _substitute(a, by_marker, own, layer_tensors, values, node)
    for node in body:  # values leave the region only through its outputs
        for user in node.users:
            if user not in inside and not (_is_call(user, layer_regions.region_output) and user in outputs):
                raise RuntimeError(f"compile_piecewise: a layer region's value {node.name} is read outside it "
                                   f"({user.format_node()})")
    results = {}
    for n in outputs:
        a = n.args[0]
        if a not in inside and a not in subst:
            subst[a] = _substitute(a, by_marker, own, layer_tensors, values, n)
        results[n.args[3]] = a
    return dict(body=body, subst=subst, results=results, num_outputs=outputs[0].args[4])


def _names_a_layer(node: torch.fx.Node) -> bool:
    """One of our ops taking a string: the ops that name their layer (attention, cache writers)."""
    name = op_name(node)
    return (name is not None and name.startswith("rocm_attn.")
            and any(isinstance(a, str) for a in list(node.args) + list(node.kwargs.values())))


def _substitute(a: torch.fx.Node, by_marker, own, layer_tensors, values, reader) -> tuple:
    """How outside value ``a`` of a representative maps to a copy: its argument i, its own
    tensor j, or the same value (a size, or a tensor from outside the layer)."""
    if a in by_marker:
        return by_marker[a]
    if a.op == "placeholder" and isinstance(values.get(a), torch.Tensor):
        t = values[a]
        if id(t) in own:
            return own[id(t)]
        if id(t) in layer_tensors:
            raise RuntimeError(f"compile_piecewise: a layer region reads a tensor of its layer that the stamp "
                               f"does not substitute ({a.name}, read by {reader.format_node()})")
        return ("same",)
    value = a.meta.get("example_value")
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return ("same",)
    raise RuntimeError(f"compile_piecewise: a layer region reads {a.format_node()}, neither an argument, a "
                       "tensor of its layer nor a size")


def _stamp(gm: torch.fx.GraphModule, call: torch.fx.Node, seg: dict, args, tensors) -> None:
    env: dict[torch.fx.Node, object] = {}
    for a, how in seg["subst"].items():
        env[a] = args[how[1]] if how[0] == "arg" else tensors[how[1]] if how[0] == "tensor" else a
    copied = set()
    with gm.graph.inserting_before(call):
        for node in seg["body"]:
            env[node] = gm.graph.node_copy(node, lambda a: env[a])
            copied.add(env[node])
    results = {i: env[a] for i, a in seg["results"].items()}
    if seg["num_outputs"]:
        for user in list(call.users):
            if not (_is_call(user, operator.getitem) and user.args[0] is call):
                raise RuntimeError(f"compile_piecewise: a stamped region's result is used by {user.format_node()}, "
                                   "not read by index")
            _take_over(user, results[user.args[1]], copied)
    else:
        _take_over(call, results[0], copied)
        return
    gm.graph.erase_node(call)


def _take_over(node: torch.fx.Node, result: torch.fx.Node, copied: set) -> None:
    """``result`` replaces ``node``; a copied node takes ``node``'s fake value (the one the
    rest of the trace saw; the copy carries the representative's)."""
    if "example_value" in node.meta and result in copied:
        result.meta = dict(result.meta, example_value=node.meta["example_value"])
    node.replace_all_uses_with(result)
    node.graph.erase_node(node)
