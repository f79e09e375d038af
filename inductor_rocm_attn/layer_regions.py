"""Per-layer compile regions: the code of a decoder layer around its attention, traced by
Dynamo once and reused for every identical layer while ``compile_piecewise`` traces.

A model marks the parts of its layer that hold no attention op with :func:`region`
(``models.DecoderLayer``: the qkv projection with norms and RoPE; the output projection and
the MLP), and each module that takes the region path carries ``compile_regions = True``. The attention op stays outside the regions: it names its layer
(``layer_name``, a per-layer constant), so a region around it could not be reused. Only
inside :func:`tracing` (``compile_piecewise``'s trace) does a model take the region path;
``compile_piecewise`` then inlines the regions (``compilation.regions``), so the split, the
dedup and the fusion passes see the same flat graph as without regions, traced in a
fraction of the time. Eager runs and a plain ``torch.compile`` of the model (whose fusion
passes must see a layer's RoPE next to its cache update) never take it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["active", "available", "marked", "region", "tracing"]

_TRACING = False
# torch.compiler.nested_compile_region (torch >= 2.8); without it the regions are plain calls.
_NESTED = getattr(torch.compiler, "nested_compile_region", None)


def available() -> bool:
    """Whether this torch has nested compile regions (else :func:`tracing` leaves them off)."""
    return _NESTED is not None


def marked(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a module that takes a region path (``compile_regions = True``)."""
    return any(getattr(m, "compile_regions", False) is True for m in model.modules())


def active() -> bool:
    """Whether a model should take its region path (inside :func:`tracing`): one global read."""
    return _TRACING


def region(fn: Callable) -> Callable:
    """Mark ``fn`` (a function of tensors and modules, holding no attention op) as a region."""
    return _NESTED(fn) if _NESTED is not None else fn


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Models take their region path inside (``compile_piecewise``'s Dynamo trace)."""
    global _TRACING
    before, _TRACING = _TRACING, _NESTED is not None
    try:
        yield
    finally:
        _TRACING = before
