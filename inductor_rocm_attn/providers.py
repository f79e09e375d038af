"""Per-call kernel choice: capability table -> provider -> kernel function.

Every provider exposes the same function signatures as ``kernels.reference``; the choice is
cached per call signature so the eager path pays one dict lookup.
"""

from __future__ import annotations

import functools

import torch

from . import capabilities
from .layout import cache_layout_of, is_fp8_dtype


def kv_cache_dtype_of(cache: torch.Tensor) -> str:
    """The kv_cache_dtype string that describes an allocated cache."""
    if is_fp8_dtype(cache.dtype):
        return "fp8_e5m2" if "e5m2" in str(cache.dtype) else "fp8_e4m3"
    return "auto"


def _load(provider: str, op: str):
    if provider == "reference":
        from .kernels import reference as mod
    elif provider == "triton":
        from .kernels import triton as mod
    elif provider == "aiter":
        from .kernels import aiter as mod
    elif provider == "native":
        from . import native as mod
    else:
        raise ValueError(f"unknown provider {provider!r}")
    return getattr(mod, op)


@functools.lru_cache(maxsize=4096)
def _select(op: str, device: str, head_size: int, dtype: torch.dtype, block_size, layout,
            kv_cache_dtype: str, interleaved_v: bool, features: tuple[str, ...], exclude: tuple[str, ...]):
    provider = capabilities.select_provider(
        op, exclude=exclude, device=device, head_size=head_size, dtype=dtype,
        block_size=block_size, layout=layout, kv_cache_dtype=kv_cache_dtype,
        interleaved_v=interleaved_v, features=features,
    )
    return provider, _load(provider, op)


def select(
    op: str,
    *,
    device: torch.device,
    head_size: int,
    dtype: torch.dtype,
    kv_cache: torch.Tensor | None = None,
    interleaved_v: bool = False,
    features: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
):
    """(provider name, kernel function) for one call; raises NotImplementedError with reasons."""
    block_size = layout = None
    kv_dtype = "auto"
    if kv_cache is not None:
        block_size = kv_cache.shape[2]
        layout = cache_layout_of(kv_cache)
        kv_dtype = kv_cache_dtype_of(kv_cache)
    return _select(op, device.type, head_size, dtype, block_size, layout, kv_dtype,
                   interleaved_v, features, exclude)


def attention_features(*, causal: bool, sliding_window: int, alibi_slopes, sinks,
                       logits_soft_cap: float, output_scale) -> tuple[str, ...]:
    feats = []
    if sliding_window > 0:
        feats.append("sliding_window")
    if alibi_slopes is not None:
        feats.append("alibi")
    if sinks is not None:
        feats.append("sinks")
    if logits_soft_cap > 0:
        feats.append("logits_soft_cap")
    if output_scale is not None:
        feats.append("output_scale")
    if not causal:
        feats.append("non_causal")
    return tuple(feats)


__all__ = ["select", "kv_cache_dtype_of", "attention_features"]
