"""Cheap post-grad graphs for pass tests, and a normalized text form for snapshots.

``capture`` runs ``torch.compile`` only as far as Inductor's post-grad passes: our pass
manager runs as the custom post pass, the graph text is taken before and after it, and
compilation is then aborted (no code generation, no C++ build: ~2 s instead of ~25 s).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch._inductor.config as inductor_config

from inductor_rocm_attn.passes.pass_manager import PassManager


class _Abort(Exception):
    pass


@dataclasses.dataclass
class Captured:
    before: str
    after: str
    manager: PassManager

    def count(self, name: str) -> int:
        return self.manager.get_pass(name).matched_count

    def reasons(self, name: str) -> list[str]:
        return [r.detail for r in self.manager.get_pass(name).records if not r.fused]


def capture(fn, *args, dynamic=(0,), pieces=False, user_pass=None, **flags) -> Captured:
    """Post-grad graph of ``fn(*args)`` before/after our passes; dim ``dynamic`` of each tensor arg
    whose dim 0 is the token count is marked dynamic. ``pieces``: the manager in piece mode
    (``PassManager.for_pieces()``); ``user_pass``: the user's post pass the manager wraps."""
    manager = PassManager(user_pass=user_pass, flags=flags)
    if pieces:
        manager = manager.for_pieces()
    out = {}

    def post(graph):
        out["before"] = normalize(graph)
        manager(graph)
        out["after"] = normalize(graph)
        raise _Abort

    torch._dynamo.reset()
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() and dynamic:
            torch._dynamo.mark_dynamic(a, 0)
    with inductor_config.patch(post_grad_custom_post_pass=post, fx_graph_cache=False), torch.no_grad():
        try:
            torch.compile(fn, backend="inductor")(*args)
        except Exception as e:  # the abort arrives wrapped by Dynamo/Inductor
            if "_Abort" not in repr(e) and not isinstance(e.__cause__, _Abort):
                raise
    torch._dynamo.reset()
    return Captured(out["before"], out["after"], manager)


def _short_target(t) -> str:
    if isinstance(t, torch._ops.OpOverload):
        return str(t).replace("aten::", "aten.").replace("rocm_attn::", "rocm_attn.")
    return getattr(t, "__name__", str(t))


def normalize(graph: torch.fx.Graph) -> str:
    """One line per node, names renumbered in order (``mul``, ``mul_1``...), sizes as ``T``."""
    names, counts, lines = {}, {}, []

    def fresh(base: str) -> str:
        n = counts.get(base, 0)
        counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def fmt(a) -> str:
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, torch._ops.OpOverload):
            return _short_target(a)
        if isinstance(a, str):
            return repr(a)
        return str(a)

    def meta(n) -> str:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape = ", ".join(re.sub(r"\bs\d+\b", "T", str(s)) for s in v.shape)
            return f"{str(v.dtype).replace('torch.', '')}[{shape}]"
        if isinstance(v, torch.SymInt):
            return "T"
        return ""

    for n in graph.nodes:
        if n.op == "placeholder":
            names[n] = fresh("in")
            lines.append(f"{names[n]}: {meta(n)}")
        elif n.op == "call_function":
            base = _short_target(n.target).split(".")[-2 if isinstance(n.target, torch._ops.OpOverload) else -1]
            names[n] = fresh(base)
            args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()]
            lines.append(f"{names[n]} = {_short_target(n.target)}({', '.join(args)})  {meta(n)}".rstrip())
        elif n.op == "output":
            lines.append(f"return {fmt(n.args[0])}")
    return "\n".join(lines)
