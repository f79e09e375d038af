"""Attention without a cache (encoder / encoder-only layers), varlen over ``cu_seqlens``.

Same function as ``kernels.reference.encoder_attention``. The kernel is the prefix-prefill
kernel with no cached context: it reuses the dense inner loop (``_dense_inner``), range
planner and epilogue of ``attention_common.py``, and the prefill configs (``configs.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...layout import fp8_max
from .attention_common import TL_DTYPES, _LOG2E, _dense_inner, _plan, _row_block, _store_rows, _tiles
from .configs import PrefillConfig, interpreting, prefill_config

__all__ = ["encoder_attention"]


@triton.jit
def _encoder_attention_kernel(
    # pointers
    out_ptr, q_ptr, k_ptr, v_ptr, cu_seqlens_ptr, alibi_ptr, sinks_ptr, out_scale_ptr,
    # scalars
    sm_scale, softcap, window, num_seqs,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    # constexpr
    GQA: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_OUT_SCALE: tl.constexpr,
    OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, RESCALE_MARGIN: tl.constexpr,
):
    """Grid ``(num_tokens // BLOCK_M + num_seqs, num_heads)`` (as the prefill kernel).

    q/out ``[num_tokens, num_heads, HEAD_SIZE]``, k/v ``[num_tokens, num_kv_heads, HEAD_SIZE]``;
    sequence s is rows ``cu_seqlens[s] : cu_seqlens[s+1]``, positions from 0. The sliding
    window keeps ``abs(q - k) < window`` (``0 <= q - k < window`` when causal).
    """
    tl.static_assert(BLOCK_D >= HEAD_SIZE and (BLOCK_D & (BLOCK_D - 1)) == 0,
                     "BLOCK_D is the head size rounded up to a power of two")
    pid = tl.program_id(0)
    head = tl.program_id(1)
    # A program without rows (padding past cu_seqlens[-1], an empty sequence, a spare row
    # block) returns before any load or store.
    seq, start, seq_len, q_tile, ok = _row_block(cu_seqlens_ptr, num_seqs, pid, BLOCK_M=BLOCK_M,
                                                 LAST_FIRST=False)
    if not ok:
        return
    kv_head = head // GQA

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_SIZE
    row = (start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    p0 = q_tile * BLOCK_M
    p1 = tl.minimum(seq_len, p0 + BLOCK_M)

    slope = tl.zeros([BLOCK_M], tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + head).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if USE_SINKS:
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)

    zero = seq_len * 0
    # An encoder's window bounds keys on both sides of the query (a decoder's: before it).
    lo, hi, f_lo, f_hi = _plan(zero, seq_len, p0, p1, window, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
                               WINDOW_BOTH_SIDES=True)
    t0, t1, t2, t3 = _tiles(lo, hi, f_lo, f_hi, zero, TILE=BLOCK_N)
    k_base = k_ptr + start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + start.to(tl.int64) * stride_vt + kv_head * stride_vh
    acc, m_i, l_i = _dense_inner(
        acc, m_i, l_i, q, offs_m, slope, sm_scale, softcap, window, k_base, v_base,
        stride_kt, stride_vt, zero, t0, t1, lo, hi, start, 0,
        COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
        USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
        DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, TMA=False,
        WINDOW_BOTH_SIDES=True)
    acc, m_i, l_i = _dense_inner(
        acc, m_i, l_i, q, offs_m, slope, sm_scale, softcap, window, k_base, v_base,
        stride_kt, stride_vt, zero, t1, t2, lo, hi, start, 0,
        COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
        USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=False,
        DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, TMA=False,
        WINDOW_BOTH_SIDES=True)
    acc, m_i, l_i = _dense_inner(
        acc, m_i, l_i, q, offs_m, slope, sm_scale, softcap, window, k_base, v_base,
        stride_kt, stride_vt, zero, t2, t3, lo, hi, start, 0,
        COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
        USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
        DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=RESCALE_MARGIN, TMA=False,
        WINDOW_BOTH_SIDES=True)

    out_scale = 1.0
    if USE_OUT_SCALE:
        out_scale = tl.load(out_scale_ptr)
    out_ptrs = out_ptr + row[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    _store_rows(out_ptrs, acc, l_i, 1.0, out_scale, m_ok[:, None] & d_ok[None, :],
                USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)


def encoder_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float,
    output_scale: torch.Tensor | None,
    *,
    cfg: PrefillConfig | None = None,
) -> None:
    """Varlen attention without a cache, written into ``output``.

    output/query ``[num_tokens, num_heads, head_size]``, key/value
    ``[num_tokens, num_kv_heads, head_size]``, cu_seqlens ``[num_seqs + 1]`` int32/int64;
    alibi_slopes/sinks ``[num_heads]``; output_scale ``[1]`` fp32 (then output is fp8).
    ``cfg`` replaces the tuned ``configs.prefill_config`` (tiles, warps, stages; its
    ``dense_margin`` is the lazy-rescale margin, 0: rescale on every tile).
    """
    num_tokens, num_heads, head_size = query.shape
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0:
        return
    gqa = num_heads // key.shape[1]
    compute = query.dtype if query.dtype in TL_DTYPES else key.dtype
    cfg = cfg or prefill_config(head_size, gqa, 0, compute, interpreting())
    use_window = sliding_window is not None and sliding_window > 0
    use_out_scale = output_scale is not None
    _encoder_attention_kernel[(num_tokens // cfg.block_m + num_seqs, num_heads)](
        output, query, key, value, cu_seqlens,
        alibi_slopes if alibi_slopes is not None else query,
        sinks if sinks is not None else query,
        output_scale if use_out_scale else query,
        scale, float(logits_soft_cap) if logits_soft_cap > 0 else 1.0,
        int(sliding_window) if use_window else 0, num_seqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        GQA=gqa, HEAD_SIZE=head_size, BLOCK_D=triton.next_power_of_2(head_size),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, COMPUTE=TL_DTYPES[compute], CAUSAL=bool(causal),
        USE_WINDOW=use_window, USE_ALIBI=alibi_slopes is not None, USE_SINKS=sinks is not None,
        USE_SOFTCAP=logits_soft_cap > 0, USE_OUT_SCALE=use_out_scale,
        OUT_MAX=fp8_max(output.dtype) if use_out_scale else 0.0,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
        RESCALE_MARGIN=float(cfg.dense_margin), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
