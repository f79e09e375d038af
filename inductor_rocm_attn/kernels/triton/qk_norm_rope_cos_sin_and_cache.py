"""Triton ``qk_norm_rope_cos_sin_and_cache``: per-head RMSNorm, RoPE with per-token cos/sin
and the cache write on separate query/key/value tensors, in place (the ``NORM`` form of the
kernel in ``rope_cos_sin_and_cache``)."""

from __future__ import annotations

import torch

from .configs import WriterConfig
from .rope_cos_sin_and_cache import launch

__all__ = ["qk_norm_rope_cos_sin_and_cache"]


def qk_norm_rope_cos_sin_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    gemma_norm: bool = False,
    norm_after_rope: bool = False,
    gemma4_norm: bool = False,
    *,
    cfg: WriterConfig | None = None,
) -> None:
    """Normalize each head of ``query``/``key`` (transformers' RMSNorm: the normalized value
    rounded to the model dtype, then times ``q_weight``/``k_weight`` ``[head_size]``; with
    ``gemma_norm`` Gemma's: the normalized value times ``1 + weight`` in fp32, then rounded;
    with ``gemma4_norm`` Gemma4's: times ``weight`` in fp32, then rounded),
    rotate with ``cos``/``sin`` ``[num_tokens, rot_dim]``, both in place, and cache the key and
    ``value``; ``norm_after_rope``: rotate first (rounded to the model dtype), then normalize
    the rotated heads, the result rounded (Hunyuan). Shapes and the other arguments as
    ``rope_cos_sin_and_cache``."""
    launch(query, key, value, cos, sin, is_neox, kv_cache, slot_mapping, k_scale, v_scale,
           interleaved_v, q_weight=q_weight, k_weight=k_weight, eps=eps, gemma_norm=gemma_norm,
           norm_after_rope=norm_after_rope, gemma4_norm=gemma4_norm, cfg=cfg)
