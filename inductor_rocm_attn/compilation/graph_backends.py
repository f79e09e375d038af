"""What captures and replays the graphs of a piecewise runner.

``CudaGraphBackend`` captures with ``torch.cuda.CUDAGraph`` (HIP graphs on ROCm);
``RerunGraphBackend`` stands in for graphs on machines without a GPU (tests). Both offer
``warmup()``, ``capture(piece, args)``, ``capture_step(fn, args)`` and ``synchronize()``;
``capture*`` return ``(graph, outputs)`` where ``graph.replay()`` refreshes ``outputs``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from inductor_rocm_attn import forward_context
from inductor_rocm_attn.forward_context import set_forward_context

__all__ = ["CudaGraphBackend", "RerunGraphBackend"]


class CudaGraphBackend:
    """Captures with ``torch.cuda.CUDAGraph`` (HIP graphs on ROCm), all graphs from one pool,
    on one side stream."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.step_pool = None
        self.stream = torch.cuda.Stream()

    @contextlib.contextmanager
    def warmup(self):
        # Warm up on the capture stream (cuBLAS workspaces, Triton autotuning), then sync.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.synchronize()

    def capture(self, piece, args) -> tuple[Any, Any]:
        """One compiled piece (``piece.fn``) in one graph, from the shared pool."""
        return self.capture_call(piece.fn, args, self.pool)

    def capture_step(self, fn: Callable, args) -> tuple[Any, Any]:
        """A whole step (pieces and attention) in one graph, from its own pool: the piecewise
        graphs' outputs stay untouched by it."""
        if self.step_pool is None:
            self.step_pool = torch.cuda.graph_pool_handle()
        return self.capture_call(fn, args, self.step_pool)

    def capture_call(self, fn: Callable, args, pool) -> tuple[Any, Any]:
        # capture_begin/end rather than torch.cuda.graph(): that one synchronizes and
        # empties the allocator cache on every entry (hundreds of captures here).
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class RerunGraphBackend:
    """A stand-in for graphs on machines without a GPU (tests): "capture" runs the piece and
    keeps its inputs, outputs, slot-alias binding and forward context (metadata and layer
    table); "replay" runs it again on exactly those input tensors, under that context with
    the piece's aliases rebound, and copies the results into the kept outputs. Like a real graph, a replay sees new data only through the same tensors
    (persistent buffers, earlier pieces' outputs), so it checks the runner's buffer
    discipline on CPU."""

    class _Graph:
        __slots__ = ("fn", "bind", "args", "out", "ctx")

        def replay(self):
            ctx = self.ctx
            with set_forward_context(ctx.attn_metadata, profiling=ctx.profiling, layers=ctx.layers, **ctx.extra):
                if self.bind is not None:
                    self.bind()
                new = self.fn(*self.args)
            for o, n in zip(_flat(self.out), _flat(new)):
                o.copy_(n)

    @contextlib.contextmanager
    def warmup(self):
        yield

    def capture(self, piece, args):
        return self._capture(piece.fn, piece.bind, args)

    def capture_step(self, fn, args):
        return self._capture(fn, None, args)

    def _capture(self, fn, bind, args):
        g = self._Graph()
        g.fn, g.bind, g.args = fn, bind, args
        g.ctx = forward_context.get_forward_context()
        md = g.ctx.attn_metadata
        if md is not None and md.plan is not None and md.plan.buffers is not None:
            # replays run under this metadata after later steps refilled its buffers
            md.plan.buffers.keep_for_replay(md)
        g.out = fn(*args)
        return g, g.out

    def synchronize(self) -> None:
        pass


def _flat(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]
