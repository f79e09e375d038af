"""Compilation around the attention op: the Inductor plugin and piecewise graph capture.

- ``plugin``: ``enable()`` / ``disable()`` / ``plugin()`` / ``fusion_report()``, the
  ``ROCM_ATTN_PLUGIN`` switch: our pass manager as Inductor's post-grad custom pass.
- ``piecewise``: ``compile_piecewise`` / ``PiecewiseRunner``: split the model at attention
  (``split``), compile each distinct piece once (``dedup``) and, on a GPU, capture per size
  CUDA/HIP graphs (``graph_backends``) of whole steps, attention inside (``decode_graphs``,
  ``mixed_graphs``: the default), or of each piece with attention eagerly between them
  (``piecewise_graphs``). A model
  whose layers live elsewhere passes ``forward=`` and ``layers=`` (transformers models:
  ``integrations.transformers_runner.compile_transformers``).

>>> from inductor_rocm_attn.compilation import compile_piecewise
>>> runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8], max_num_seqs=8)

The piecewise names load on first use: they import Inductor (over a second), which a plain
``import inductor_rocm_attn`` (it imports ``plugin``) must not pay.
"""

from __future__ import annotations

import importlib

from .plugin import disable, enable, fusion_report, is_enabled, plugin, set_pass_flag

_LAZY = {
    "compile_piecewise": "piecewise",
    "PiecewiseRunner": "piecewise",
    "CompileStats": "piecewise",
    "CudaGraphBackend": "graph_backends",
    "RerunGraphBackend": "graph_backends",
}

__all__ = ["compile_piecewise", "PiecewiseRunner", "CompileStats", "CudaGraphBackend", "RerunGraphBackend",
           "enable", "disable", "plugin", "fusion_report", "is_enabled", "set_pass_flag"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
