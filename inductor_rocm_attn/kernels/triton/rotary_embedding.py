"""Triton ``rotary_embedding``: NeoX / GPT-J RoPE on query and key, in place.

One program rotates ``BLOCK_T`` tokens x one head (query heads first, then key heads). The
rotated channels are handled as two halves ``x1``, ``x2`` of ``rot_dim / 2`` channels each,
which both styles rotate the same way with ``cos``/``sin`` of the same column:

    o1 = x1 * cos - x2 * sin        o2 = x2 * cos + x1 * sin

NeoX: x1 = channels ``[0, h)``, x2 = ``[h, 2h)`` (two contiguous, vectorised loads).
GPT-J: x1 = even channels, x2 = odd channels (``h = rot_dim / 2``). Channels past
``rot_dim`` (partial rotary) are not touched in place; the fused writers load them as a
third "pass" piece for the cache. ``h`` need not be a power of two (head 80): the half tiles
are ``BLOCK_R = next_pow2(h)`` wide and masked.

The jit helpers ``_half_cols`` / ``_load_cos_sin`` / ``_rotate`` are shared with the fused
writers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import WriterConfig, writer_block_t, writer_num_warps

__all__ = ["rotary_embedding"]


@triton.jit
def _half_cols(ROT_HALF: tl.constexpr, BLOCK_R: tl.constexpr, IS_NEOX: tl.constexpr):
    """Channel offsets of the two halves (``d1``, ``d2`` ``[BLOCK_R]``) and their mask."""
    offs_r = tl.arange(0, BLOCK_R)
    if IS_NEOX:
        d1 = offs_r
        d2 = offs_r + ROT_HALF
    else:  # GPT-J: pairs (2i, 2i + 1)
        d1 = 2 * offs_r
        d2 = 2 * offs_r + 1
    return offs_r, d1, d2, offs_r < ROT_HALF


@triton.jit
def _load_cos_sin(cos_sin_ptr, pos, stride_cs, offs_r, mask_r, mask_t, ROT_HALF: tl.constexpr):
    """cos, sin ``[BLOCK_T, BLOCK_R]`` fp32 at the tokens' positions (contiguous rows of the table)."""
    cs_ptrs = cos_sin_ptr + pos[:, None] * stride_cs + offs_r[None, :]
    m = mask_t[:, None] & mask_r[None, :]
    cos = tl.load(cs_ptrs, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptrs + ROT_HALF, mask=m, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotary_embedding_kernel(
    # pointers
    positions_ptr, query_ptr, key_ptr, cos_sin_ptr,
    # sizes
    num_tokens, num_q_heads,
    # strides (elements)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_cs,
    # meta
    ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """grid = (cdiv(num_tokens, BLOCK_T), num_q_heads + num_k_heads)."""
    tl.static_assert(BLOCK_R >= ROT_HALF, "BLOCK_R covers half the rotated channels")
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_r, d1, d2, mask_r = _half_cols(ROT_HALF=ROT_HALF, BLOCK_R=BLOCK_R, IS_NEOX=IS_NEOX)
    pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, offs_r, mask_r, mask_t, ROT_HALF=ROT_HALF)

    tok = offs_t.to(tl.int64)
    if pid_h < num_q_heads:
        base = query_ptr + tok[:, None] * stride_qt + pid_h * stride_qh
        stride_d = stride_qd
    else:
        base = key_ptr + tok[:, None] * stride_kt + (pid_h - num_q_heads) * stride_kh
        stride_d = stride_kd
    mask = mask_t[:, None] & mask_r[None, :]
    x1_ptrs = base + d1[None, :] * stride_d
    x2_ptrs = base + d2[None, :] * stride_d
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, cos, sin)
    tl.store(x1_ptrs, o1.to(query_ptr.dtype.element_ty), mask=mask)
    tl.store(x2_ptrs, o2.to(query_ptr.dtype.element_ty), mask=mask)


def head_strides(t: torch.Tensor, head_size: int) -> tuple[int, int, int]:
    """(token, head, channel) strides of ``[T, H * D]`` or ``[T, H, D]`` without a copy."""
    if t.dim() == 3:
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), head_size * t.stride(1), t.stride(1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    cfg: WriterConfig | None = None,
) -> None:
    """Rotate ``query`` and ``key`` in place (same semantics as the reference).

    positions: ``[num_tokens]`` int32/int64.
    query: ``[num_tokens, num_heads * head_size]`` or ``[num_tokens, num_heads, head_size]``,
    any token stride (e.g. a slice of qkv); key likewise with num_kv_heads, or None.
    cos_sin_cache: ``[max_position, rot_dim]`` (cos half, then sin half), ``rot_dim <= head_size``.
    ``cfg`` replaces the tile rules of ``configs`` (``writer_block_t``, ``writer_num_warps``).
    """
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    num_q_heads = query.numel() // (num_tokens * head_size)
    num_k_heads = 0 if key is None else key.numel() // (num_tokens * head_size)
    k = query if key is None else key  # a valid pointer when there is no key
    rot_half = cos_sin_cache.shape[-1] // 2
    block_r = triton.next_power_of_2(rot_half)
    block_t = cfg.block_t if cfg else writer_block_t(num_tokens)
    warps = (cfg and cfg.num_warps) or writer_num_warps(block_t, block_r)
    grid = (triton.cdiv(num_tokens, block_t), num_q_heads + num_k_heads)
    _rotary_embedding_kernel[grid](
        positions, query, k, cos_sin_cache,
        num_tokens, num_q_heads,
        *head_strides(query, head_size),
        *head_strides(k, head_size),
        cos_sin_cache.stride(0),
        ROT_HALF=rot_half, IS_NEOX=bool(is_neox), BLOCK_T=block_t, BLOCK_R=block_r,
        num_warps=warps,
    )
