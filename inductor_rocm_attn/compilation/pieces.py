"""What the piecewise runner is built from: a compiled piece (shared compiled code bound to
its own layers, run eagerly or captured / replayed as a graph), the runner's mode, compile
statistics, and the plugin context of the piece compiles."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

from inductor_rocm_attn.passes.pass_manager import PassManager

from .dedup import bind_alias, slot_alias
from .plugin import plugin as _plugin_on

if TYPE_CHECKING:
    from .piecewise import PiecewiseRunner

__all__ = ["CompileStats", "CompiledPiece", "Mode", "piece_post_pass", "plugin_context"]


def plugin_context(enabled: bool | None):
    """Context that turns the plugin's passes on for compiles inside it (``enabled``: True
    or None; False: off). Returns ``(context manager yielding the pass manager or None,
    plugin_active: bool)``."""
    if enabled is False:
        return contextlib.nullcontext(), False
    return _plugin_on(), True


def piece_post_pass(manager: PassManager | None):
    """The post-grad custom pass of piece compiles: the plugin's ``manager`` in piece mode;
    without the plugin, the pass the user installed (ours left out: ``plugin=False``), also
    when an enabled plugin wraps it."""
    if manager is not None:
        return manager.for_pieces()
    installed = torch._inductor.config.post_grad_custom_post_pass
    return installed.user_pass if isinstance(installed, PassManager) else installed


@dataclasses.dataclass
class CompileStats:
    """Counts and times of one runner's compile and capture (``runner.stats``)."""

    num_attention_pieces: int = 0
    num_compiled_pieces: int = 0
    num_unique_compiles: int = 0
    num_captures: int = 0
    trace_s: float = 0.0
    trace_loaded: bool = False  # the traced graph came from the trace cache (no Dynamo)
    region_calls: int = 0  # layer-region calls in the trace (``layer_regions``), inlined
    region_subgraphs: int = 0  # of them traced (the others reused one)
    compile_s: float = 0.0
    capture_s: float = 0.0  # the precompile's time included
    precompile_s: float = 0.0  # Triton kernels compiled in parallel before capture
    precompiled_kernels: int = 0
    # (kernel, start s, seconds) per precompiled kernel, longest first
    precompile_times: list[tuple] = dataclasses.field(default_factory=list)
    plugin_active: bool = False
    num_stand_ins: int = 0
    piece_groups: list[list[str]] = dataclasses.field(default_factory=list)


class Mode:
    EAGER, CAPTURE, REPLAY = 0, 1, 2


class CompiledPiece:
    """A compiled piece: runs its (shared) compiled code, or captures / replays a graph."""

    __slots__ = ("name", "fn", "slots", "runner", "graphs", "bindings")

    def __init__(self, name: str, fn: Callable, slots: list, runner: "PiecewiseRunner"):
        self.name, self.fn, self.slots, self.runner = name, fn, slots, runner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.bindings = [(slot_alias(j), layer) for j, layer in enumerate(slots)]  # (alias, layer)

    def bind(self) -> None:
        """Point the slot aliases of this piece's code at its own layers (runner's table)."""
        table = self.runner.layer_table
        for alias, layer in self.bindings:
            bind_alias(table, alias, layer)

    def __call__(self, *args):
        r = self.runner
        mode = r._mode
        if mode == Mode.REPLAY:
            graph, out = self.graphs[r._size]
            graph.replay()
            return out
        self.bind()
        if mode == Mode.CAPTURE:
            graph, out = r._graph_backend.capture(self, args)
            self.graphs[r._size] = (graph, out)
            r.stats.num_captures += 1
            return out
        return self.fn(*args)
