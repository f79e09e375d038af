"""The ``aiter`` provider: AMD AITER's fused RoPE + KV-cache kernels behind our signatures.

AITER is the PyPI package ``amd-aiter`` (import name ``aiter``; the PyPI package named
``aiter`` is an unrelated library and is never used). It is imported lazily inside the
functions, never at module import. The ``aiter`` record of ``providers.REGISTRY`` says
which calls come here (and when it is preferred); the checks below raise for what its
capability table cannot express.

What runs (ROCm/aiter at commit e4048607a5, Triton kernels under ``aiter/ops/triton``):

- ``rope_and_cache`` -> ``fused_qk_rope_reshape_and_cache`` (one kernel). Its non-flash
  layout is ours exactly: K ``[num_blocks, H, D/x, block_size, x]`` and V either standard
  ``[num_blocks, H, D, block_size]`` (4-D) or its "shuffle" layout ``[num_blocks, H,
  block_size/x, D, x]`` (5-D), which writes element (t, d) at ``(t//x)*D*x + d*x + t%x`` of
  the page: DESIGN.md's interleaved V. We hand it ``layout.k_view`` / ``layout.v_view``, so
  LHBNC and LBHNC both work through strides. Limits (asserted by AITER or checked here):
  cache bf16 or fp8 e4m3 (no fp16, no e5m2), head_size and block_size powers of two, the
  whole head rotated (no partial rotary). fp8: it multiplies by ``1/scale`` (we divide) and
  relies on the fp8 conversion to saturate. Keys of padding tokens (slot < 0) are not
  rotated in place by AITER (their rows are never read); every other row matches the
  reference.
- ``qk_norm_rope_and_cache`` -> ``fused_qkv_split_qk_norm_rope_cache`` for split + RMSNorm +
  RoPE, then our Triton ``reshape_and_cache`` for the cache write: AITER's kernel writes
  only HND/NHD caches (a channel stride), which cannot express our x-packed K page, so we
  give it an empty cache and write K/V ourselves (two launches, not one). Its RMSNorm is
  Gemma-style ``x * (1 + w)``, so it gets ``w - 1``.

On CUDA (``AITER_TRITON_ONLY=1``) AITER picks the OCP/AMD fp8 type by GPU arch and assumes
the AMD ``fnuz`` e4m3 off gfx950; we point its module-level ``e4m3_dtype`` at the cache's
dtype before the call.
"""

from __future__ import annotations

import functools

import torch

from ..layout import is_fp8_dtype, k_view, v_view

__all__ = ["rope_and_cache", "qk_norm_rope_and_cache"]


@functools.cache
def _fused_kv_cache():
    from aiter.ops.triton.fusions import fused_kv_cache

    return fused_kv_cache


@functools.cache
def _fused_qk_norm():
    from aiter.ops.triton.rope import fused_qkv_split_qk_norm_rope_cache

    return fused_qkv_split_qk_norm_rope_cache


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_rope_and_cache(head_size: int, rot_dim: int, kv_cache: torch.Tensor) -> None:
    """What fused_qk_rope_reshape_and_cache asserts, as NotImplementedError with the reason."""
    op = "aiter.rope_and_cache"
    if not _pow2(head_size):
        raise NotImplementedError(f"{op}: head_size {head_size} is not a power of two")
    if not _pow2(kv_cache.shape[2]):
        raise NotImplementedError(f"{op}: block_size {kv_cache.shape[2]} is not a power of two")
    if rot_dim != head_size:
        raise NotImplementedError(
            f"{op}: partial rotary (rot_dim {rot_dim} < head_size {head_size}) is not supported"
        )
    if kv_cache.dtype != torch.bfloat16 and not (
        is_fp8_dtype(kv_cache.dtype) and "e4m3" in str(kv_cache.dtype)
    ):
        raise NotImplementedError(f"{op}: cache dtype {kv_cache.dtype}; AITER writes bf16 or fp8 e4m3")


def _use_cache_fp8_type(mod, kv_cache: torch.Tensor) -> None:
    if is_fp8_dtype(kv_cache.dtype) and mod.e4m3_dtype != kv_cache.dtype:
        mod.e4m3_dtype = kv_cache.dtype


def _cos_sin(cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[max_pos, rot]`` -> cos, sin views ``[max_pos, rot/2]`` (AITER's reuse-front-part form)."""
    half = cos_sin_cache.shape[-1] // 2
    return cos_sin_cache[:, :half], cos_sin_cache[:, half:]


def rope_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
) -> None:
    """Same contract as ``reference.rope_and_cache`` (see the module docstring for limits)."""
    num_tokens = query.shape[0]
    head_size = value.shape[-1]
    _check_rope_and_cache(head_size, cos_sin_cache.shape[-1], kv_cache)
    if num_tokens == 0:
        return
    mod = _fused_kv_cache()
    _use_cache_fp8_type(mod, kv_cache)
    num_kv_heads = kv_cache.shape[3] // head_size
    q = query.view(num_tokens, -1, head_size)
    k = key.view(num_tokens, num_kv_heads, head_size)
    v = value.view(num_tokens, num_kv_heads, head_size)
    n = slot_mapping.shape[0]
    if n < num_tokens:  # AITER writes every token it rotates: pad with "skip"
        slot_mapping = torch.cat((slot_mapping, slot_mapping.new_full((num_tokens - n,), -1)))
    cos, sin = _cos_sin(cos_sin_cache)
    mod.fused_qk_rope_reshape_and_cache(
        q, k, v,
        k_view(kv_cache, num_kv_heads), v_view(kv_cache, num_kv_heads, interleaved_v),
        slot_mapping, positions, cos, sin, k_scale, v_scale, bool(is_neox),
        flash_layout=False, apply_scale=is_fp8_dtype(kv_cache.dtype),
        q_out=q, k_out=k, output_zeros=False, upcast_operand=True,
    )


def qk_norm_rope_and_cache(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    interleaved_v: bool,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.qk_norm_rope_and_cache``: returns fresh q, k, v."""
    if not _pow2(head_size):
        raise NotImplementedError(f"aiter.qk_norm_rope_and_cache: head_size {head_size} is not a power of two")
    from .triton.reshape_and_cache import reshape_and_cache as triton_reshape_and_cache

    mod = _fused_qk_norm()
    num_tokens = qkv.shape[0]
    cos, sin = _cos_sin(cos_sin_cache)
    # An empty HND cache: AITER bounds-checks slots against num_blocks * block_size = 0 and
    # skips every write; slot_mapping only has to be num_tokens long (positions is).
    no_cache = qkv.new_empty(1, num_kv_heads, 16, head_size)[:0]
    q, k, v = mod.fused_qkv_split_qk_norm_rope_cache(
        qkv, q_weight.float() - 1.0, k_weight.float() - 1.0, cos, sin, positions,
        no_cache, no_cache, positions, num_heads, num_kv_heads, head_size,
        is_neox=bool(is_neox), reuse_freqs_front_part=True, eps=float(eps),
        kv_cache_layout="HND",
    )
    if num_tokens:
        triton_reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v)
    return q, k, v
