"""Deprecated import path, kept for one release: use ``inductor_rocm_attn.compilation``
(``compile_piecewise``, ``PiecewiseRunner``, ``CompileStats``, ``CudaGraphBackend``,
``RerunGraphBackend``) or its modules ``split``, ``dedup``, ``graph_backends``, ``piecewise``."""

from .compilation.graph_backends import CudaGraphBackend, RerunGraphBackend
from .compilation.piecewise import CompileStats, PiecewiseRunner, compile_piecewise, plugin_context
from .compilation.split import SPLITTING_OPS, split_at_attention

__all__ = ["compile_piecewise", "PiecewiseRunner", "CompileStats", "SPLITTING_OPS",
           "split_at_attention", "plugin_context", "CudaGraphBackend", "RerunGraphBackend"]
