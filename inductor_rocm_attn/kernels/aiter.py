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
  the page: docs/design.md's interleaved V. We hand it ``layout.k_view`` / ``layout.v_view``, so
  LHBNC and LBHNC both work through strides. Limits (asserted by AITER or checked here):
  cache bf16 or fp8 e4m3 (no fp16, no e5m2), head_size and block_size powers of two, the
  whole head rotated (no partial rotary). fp8: it multiplies by ``1/scale`` (we divide) and
  relies on the fp8 conversion to saturate. Keys of padding tokens (slot < 0) are not
  rotated in place by AITER (their rows are never read); every other row matches the
  reference.
- ``qk_norm_rope_and_cache`` is not taken. AITER's Triton split + QK-norm + RoPE kernel
  (``fused_qkv_split_qk_norm_rope_cache``) writes only HND/NHD caches (a channel stride per
  token), which cannot express our x-packed K page; using it with an empty cache and dummy
  slots, then writing K/V with our own kernel, is two launches for one op. Its HIP kernel
  ``fused_qk_norm_rope_cache_quant_shuffle`` writes a "shuffle" cache, but whether its K page
  is ours has not been checked on a GPU. So the ``aiter`` record declares no such op and the
  Triton kernel serves it.

On CUDA (``AITER_TRITON_ONLY=1``) AITER picks the OCP/AMD fp8 type by GPU arch and assumes
the AMD ``fnuz`` e4m3 off gfx950; we point its module-level ``e4m3_dtype`` at the cache's
dtype before the call.
"""

from __future__ import annotations

import functools

import torch

from ..layout import is_fp8_dtype, k_view, v_view

__all__ = ["rope_and_cache"]


@functools.cache
def _fused_kv_cache():
    from aiter.ops.triton.fusions import fused_kv_cache

    return fused_kv_cache


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
