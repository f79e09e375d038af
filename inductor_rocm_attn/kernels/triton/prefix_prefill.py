"""The prefix-prefill kernel: sequences with query_len > 1 over the paged cache.

A prefill sequence has ``ctx = seq_len - query_len`` tokens in the paged cache and
``query_len`` new tokens in ``key``/``value``. Each program takes one query head and
``BLOCK_M`` of the sequence's new tokens, walks the cached context page by page
(``_paged_inner``), then the new tokens (``_dense_inner``, causal), with one online softmax
in fp32 over both. One launch covers the whole (mixed) batch: programs of decode sequences
return at once (the decode kernel in ``paged_decode.py`` owns them). The inner loops are
shared with the decode and encoder kernels (``attention_common.py``); the launcher is
``paged_attention.py``, the tuned configs ``configs.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import (
    _LOG2E, _dense_inner, _paged_inner, _plan, _row_block, _store_rows, _tiles,
)


@triton.jit
def _prefix_prefill_kernel(
    # pointers
    out_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr,
    # scalars
    sm_scale, softcap, window, num_seqs,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_bt,
    # constexpr
    GQA: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, X: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
    HAS_NEW_KV: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    FP8_KV: tl.constexpr, INTERLEAVED_V: tl.constexpr, USE_OUT_SCALE: tl.constexpr,
    OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, RESCALE_MARGIN: tl.constexpr,
    DENSE_MARGIN: tl.constexpr, LONGEST_FIRST: tl.constexpr, DENSE_TMA: tl.constexpr,
    K_ROWS: tl.constexpr,
    SHORT_QUERY_MAX: tl.constexpr = 1,
):
    """Grid ``(num_tokens // BLOCK_M + num_seqs, num_heads)``; sequences with query_len <= 1
    are skipped, and those up to ``SHORT_QUERY_MAX`` (the verify kernel runs them) too.
    Row blocks vary fastest: neighbours share one head's K/V in L2 (measured:
    heads-fastest with reversed row blocks ran 353 TFLOP/s against 399 for this order).
    With ``LONGEST_FIRST`` (causal) each sequence's row blocks run last-first: a later block
    sees more keys, so the long ones start early and the short ones fill the tail. Programs
    with no rows of a prefill sequence return first (``_row_block``).

    q/out ``[num_tokens, num_heads, HEAD_SIZE]``, k/v ``[num_tokens, num_kv_heads, HEAD_SIZE]``,
    caches as ``layout.k_view`` / ``layout.v_view``, block_table ``[num_seqs, max_blocks]``.
    Lazy-rescale margins: ``RESCALE_MARGIN`` over the cached context, ``DENSE_MARGIN`` over
    the new tokens. With ``DENSE_TMA`` k_ptr/v_ptr are tensor descriptors of k/v viewed as
    ``[num_tokens, num_kv_heads * HEAD_SIZE]`` (``_dense_inner``).
    """
    tl.static_assert(BLOCK_D >= HEAD_SIZE and (BLOCK_D & (BLOCK_D - 1)) == 0,
                     "BLOCK_D is the head size rounded up to a power of two")
    tl.static_assert((BLOCK_M & (BLOCK_M - 1)) == 0 and (BLOCK_N & (BLOCK_N - 1)) == 0,
                     "row and key tiles are powers of two")
    pid = tl.program_id(0)
    head = tl.program_id(1)
    # A program without rows of a prefill sequence (padding past the batch, an empty or
    # decode sequence, a spare row block) returns before any load or store.
    seq, q_start, q_len, q_tile, ok = _row_block(query_start_loc_ptr, num_seqs, pid,
                                                 BLOCK_M=BLOCK_M, LAST_FIRST=LONGEST_FIRST)
    if q_len <= 1 or not ok:
        return
    if SHORT_QUERY_MAX > 1:
        if q_len <= SHORT_QUERY_MAX:  # a verify-sized sequence: paged_verify.py owns it
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    kv_head = head // GQA

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_SIZE
    row = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    q_pos = ctx_len + offs_m
    p0 = ctx_len + q_tile * BLOCK_M
    p1 = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_M)

    sm = sm_scale
    v_scale = 1.0
    if FP8_KV:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + head).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if USE_SINKS:  # the sink is a key of logit `sink` (unscaled) and value 0
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)

    # 1) cached context (the whole sequence when the new tokens are in the cache too).
    if HAS_NEW_KV:
        cache_hi = ctx_len
    else:
        cache_hi = seq_len
    zero = seq_len * 0
    lo, hi, f_lo, f_hi = _plan(zero, cache_hi, p0, p1, window, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW)
    t0, t1, t2, t3 = _tiles(lo, hi, f_lo, f_hi, zero, TILE=BLOCK_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if FP8_KV:
        sm = sm_scale * k_scale
    acc, m_i, l_i = _paged_inner(
        acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
        kv_head, t0, t1, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
        COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
        TILE_N=BLOCK_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION,
        RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=False, K_ROWS=K_ROWS)
    acc, m_i, l_i = _paged_inner(
        acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
        kv_head, t1, t2, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
        COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
        TILE_N=BLOCK_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=False, DOT_PRECISION=DOT_PRECISION,
        RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=False, K_ROWS=K_ROWS)
    acc, m_i, l_i = _paged_inner(
        acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
        kv_head, t2, t3, lo, hi, stride_kcb, stride_kch, stride_vcb, stride_vch,
        COMPUTE=COMPUTE, BLOCK_SIZE=BLOCK_SIZE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, X=X,
        TILE_N=BLOCK_N, SUB=SUB, INTERLEAVED_V=INTERLEAVED_V, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True, DOT_PRECISION=DOT_PRECISION,
        RESCALE_MARGIN=RESCALE_MARGIN, V_PACKETS=False, K_ROWS=K_ROWS)
    if FP8_KV:
        # The cache part was accumulated from V / v_scale units: bring it to model units.
        acc = acc * v_scale

    # 2) the new tokens, from key/value (unquantised).
    if HAS_NEW_KV:
        lo, hi, f_lo, f_hi = _plan(ctx_len, seq_len, p0, p1, window, CAUSAL=CAUSAL,
                                   USE_WINDOW=USE_WINDOW)
        t0, t1, t2, t3 = _tiles(lo, hi, f_lo, f_hi, ctx_len, TILE=BLOCK_N)
        if DENSE_TMA:  # descriptors: _dense_inner addresses rows and columns itself
            k_base = k_ptr
            v_base = v_ptr
        else:
            k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
            v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        q_row0 = q_start.to(tl.int32)  # TMA coordinates are 32-bit (index tensors may be int64)
        col0 = kv_head * HEAD_SIZE
        acc, m_i, l_i = _dense_inner(
            acc, m_i, l_i, q, q_pos, slope, sm_scale, softcap, window, k_base, v_base,
            stride_kt, stride_vt, ctx_len, t0, t1, lo, hi, q_row0, col0,
            COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=DENSE_MARGIN, TMA=DENSE_TMA)
        acc, m_i, l_i = _dense_inner(
            acc, m_i, l_i, q, q_pos, slope, sm_scale, softcap, window, k_base, v_base,
            stride_kt, stride_vt, ctx_len, t1, t2, lo, hi, q_row0, col0,
            COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=False,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=DENSE_MARGIN, TMA=DENSE_TMA)
        acc, m_i, l_i = _dense_inner(
            acc, m_i, l_i, q, q_pos, slope, sm_scale, softcap, window, k_base, v_base,
            stride_kt, stride_vt, ctx_len, t2, t3, lo, hi, q_row0, col0,
            COMPUTE=COMPUTE, HEAD_SIZE=HEAD_SIZE, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
            USE_WINDOW=USE_WINDOW, USE_ALIBI=USE_ALIBI, USE_SOFTCAP=USE_SOFTCAP, MASK=True,
            DOT_PRECISION=DOT_PRECISION, RESCALE_MARGIN=DENSE_MARGIN, TMA=DENSE_TMA)

    out_scale = 1.0
    if USE_OUT_SCALE:
        out_scale = tl.load(out_scale_ptr)
    out_ptrs = out_ptr + row[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    _store_rows(out_ptrs, acc, l_i, 1.0, out_scale, m_ok[:, None] & d_ok[None, :],
                USE_OUT_SCALE=USE_OUT_SCALE, OUT_MAX=OUT_MAX)
