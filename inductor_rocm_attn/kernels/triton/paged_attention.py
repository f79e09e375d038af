"""Paged attention over the ROCM_ATTN cache: paged decode + prefix prefill, one call.

``paged_attention`` has the signature of ``kernels.reference.paged_attention``. Per call it
launches
- the decode kernel: one program per (decode sequence, KV head, KV split), all GQA query
  heads of the KV head in one ``[BLOCK_H, HEAD]`` tile, so each K/V byte is read once;
  with more than one split (flash-decoding) each program covers a slice of the context and
  writes partial sums that ``_decode_reduce_kernel`` merges;
- the prefix-prefill kernel (``prefix_prefill.py``) for sequences with query_len > 1.
Each kernel skips the other's sequences, so a mixed batch needs no host-side split. The
number of KV splits comes from host shapes only (no device sync: CUDA-graph capturable).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor  # host-side TMA descriptors

from ...layout import cache_x, fp8_max, is_fp8_dtype, k_view, v_view
from .paged_decode import _keys_inner, _keys_q_chunks, _paged_decode_streams_kernel, _store_decode
from . import prefix_prefill
from .prefix_prefill import _LOG2E, _paged_inner, _prefix_prefill_kernel, _tiles

__all__ = ["paged_attention", "decode_config", "prefill_config", "num_kv_splits"]

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _paged_decode_kernel(
    # pointers
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr,
    # scalars
    sm_scale, softcap, window,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_bt,
    stride_pa_s, stride_pa_h, stride_pa_k,  # part_acc [seqs, heads, splits, HEAD]
    # constexpr
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    TILE_N: tl.constexpr, SUB: tl.constexpr, NUM_SPLITS: tl.constexpr, COMPUTE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr, INTERLEAVED_V: tl.constexpr,
    USE_OUT_SCALE: tl.constexpr, OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_LOOP: tl.constexpr, KEYS_MAJOR: tl.constexpr, RESCALE_MARGIN: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads * HEAD_CHUNKS, NUM_SPLITS)``; only query_len == 1.

    q/out ``[num_tokens, num_heads, HEAD_SIZE]``; the decode token is the sequence's last,
    at position ``seq_len - 1``, and every key (its own too) is read from the cache.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    chunk = tl.program_id(1) % HEAD_CHUNKS
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GQA
    d_ok = offs_d < HEAD_SIZE
    heads = kv_head * GQA + offs_h
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    q_pos = tl.zeros([BLOCK_H], tl.int32) + (seq_len - 1)

    # Keys [lo, seq_len) are visible (every key is <= the query position: causal or not).
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    t_lo, f_lo, f_hi, t_hi = _tiles(lo, seq_len, lo, seq_len, seq_len * 0, TILE_N)
    if NUM_SPLITS > 1:  # this split's share of the tiles; clamp the unmasked middle to it
        per = (t_hi - t_lo + NUM_SPLITS - 1) // NUM_SPLITS
        s_lo = tl.minimum(t_lo + split * per, t_hi)
        s_hi = tl.minimum(s_lo + per, t_hi)
        f_lo = tl.minimum(tl.maximum(f_lo, s_lo), s_hi)
        f_hi = tl.minimum(tl.maximum(f_hi, f_lo), s_hi)
        t_lo = s_lo
        t_hi = s_hi

    sm = sm_scale
    v_scale = 1.0
    if FP8_KV:
        sm = sm_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = tl.zeros([BLOCK_H], tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.zeros([BLOCK_H], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if USE_SINKS:
        if split == 0:  # the sink joins once, in split 0's partial sums
            m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
            l_i += 1.0
            # V is accumulated in cache units and scaled at the end; the sink's value is 0.

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if KEYS_MAJOR:  # products transposed: both cache tiles load in memory order (paged_decode.py)
        acc_t = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
        q_t = _keys_q_chunks(q_ptr + q_start.to(tl.int64) * stride_qt, heads, h_ok, stride_qh,
                             COMPUTE, HEAD_SIZE, BLOCK_D, BLOCK_H)
        if ONE_LOOP:
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, BLOCK_H, X, TILE_N, SUB, INTERLEAVED_V,
                USE_ALIBI, USE_SOFTCAP, True, DOT_PRECISION)
        else:
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, f_lo, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, BLOCK_H, X, TILE_N, SUB, INTERLEAVED_V,
                USE_ALIBI, USE_SOFTCAP, True, DOT_PRECISION)
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_lo, f_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, BLOCK_H, X, TILE_N, SUB, INTERLEAVED_V,
                USE_ALIBI, USE_SOFTCAP, False, DOT_PRECISION)
            acc_t, m_i, l_i = _keys_inner(
                acc_t, m_i, l_i, q_t, q_pos, slope, sm, softcap, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_hi, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, BLOCK_H, X, TILE_N, SUB, INTERLEAVED_V,
                USE_ALIBI, USE_SOFTCAP, True, DOT_PRECISION)
        acc = tl.trans(acc_t)
    else:
        if ONE_LOOP:
            # One software pipeline over all tiles (masks everywhere): a split holds few tiles,
            # and three loops would each start their pipeline cold.
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, X, TILE_N, SUB, INTERLEAVED_V,
                False, False, USE_ALIBI, USE_SOFTCAP, True, DOT_PRECISION, RESCALE_MARGIN, True, K_ROWS)
        else:  # masked first tile, unmasked middle, masked last tile
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, t_lo, f_lo, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, X, TILE_N, SUB, INTERLEAVED_V,
                False, False, USE_ALIBI, USE_SOFTCAP, True, DOT_PRECISION, RESCALE_MARGIN, True, K_ROWS)
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_lo, f_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, X, TILE_N, SUB, INTERLEAVED_V,
                False, False, USE_ALIBI, USE_SOFTCAP, False, DOT_PRECISION, RESCALE_MARGIN, True, K_ROWS)
            acc, m_i, l_i = _paged_inner(
                acc, m_i, l_i, q, q_pos, slope, sm, softcap, window, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head, f_hi, t_hi, lo, seq_len, stride_kcb, stride_kch, stride_vcb, stride_vch,
                COMPUTE, BLOCK_SIZE, HEAD_SIZE, BLOCK_D, X, TILE_N, SUB, INTERLEAVED_V,
                False, False, USE_ALIBI, USE_SOFTCAP, True, DOT_PRECISION, RESCALE_MARGIN, True, K_ROWS)

    _store_decode(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, heads, offs_d, h_ok, d_ok,
                  seq, q_start, split, v_scale, out_scale_ptr,
                  stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
                  NUM_SPLITS, USE_OUT_SCALE, OUT_MAX)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, v_scale_ptr, out_scale_ptr,
    stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_k,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, FP8_KV: tl.constexpr, USE_OUT_SCALE: tl.constexpr,
    OUT_MAX: tl.constexpr,
):
    """Grid ``(num_seqs, num_heads)``: merge the splits' (acc, max, sum) of one decode row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_start != 1:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_SIZE
    row = (seq.to(tl.int64) * stride_pa_s + head * stride_pa_h) // stride_pa_k + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * stride_pa_k + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits have m = -inf: weight 0
    l_sum = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0)
    v_scale = 1.0
    if FP8_KV:
        v_scale = tl.load(v_scale_ptr)
    out = out * tl.where(l_sum > 0.0, v_scale / tl.where(l_sum > 0.0, l_sum, 1.0), 0.0)
    if USE_OUT_SCALE:
        out = tl.minimum(tl.maximum(out / tl.load(out_scale_ptr), -OUT_MAX), OUT_MAX)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


# --- configs ---------------------------------------------------------------------------------

# Tuned on an H200 (benchmarks/bench_decode.py, bench_prefill.py), keyed by (head_size, gqa,
# block_size, dtype: the cache dtype for decode, the compute dtype for prefill). Only measured
# entries (benchmarks/results/run1, run2); anything else takes the heuristics below.
# decode: (TILE_N, num_warps, num_stages, kind), kind one of DECODE_KINDS; prefill: (BLOCK_M,
# BLOCK_N, num_warps, num_stages).
DECODE_KINDS = (
    "streams",  # paged_decode.py: one key stream per warp, TILE_N // num_warps keys each
    "streams3",  # the same, masked first / unmasked middle / masked last tile
    "rows",  # _paged_decode_kernel, one masked loop: warps share a [BLOCK_H, TILE_N] tile
    "rows3",  # _paged_decode_kernel, masked first / unmasked middle / masked last tile
    "keys",  # _paged_decode_kernel keys-major (paged_decode.py), one masked loop
    "keys3",  # the same, masked first / unmasked middle / masked last tile
)
_DECODE_TUNED: dict[tuple, tuple[int, int, int, str]] = {
    # key: (head_size, gqa, block_size, cache dtype, interleaved V). Results: s7_decode_sweep*,
    # s8_*. B=64, L=4096: 1 warp, tile 16, three loops 323 us (one masked loop 333; 2 warps
    # as streams 337; 4 warps sharing a 64-key tile 417: cross-warp barriers). B=16: 98.9 us
    # (one loop 100.9); B=128: 612 (638). B=1 (64 splits of 4 tiles) prefers one loop, 17.5
    # vs 18.1 us: see ONE_LOOP_MAX_TILES.
    (128, 4, 16, torch.bfloat16, False): (16, 1, 3, "rows3"),
    # The end-to-end model's layers (16/8 heads, interleaved V after the QK-norm fusion),
    # B=64, L=2048, V loaded as packets (_load_paged_kv): 1 warp 172 us (one loop 174); with
    # the 2-D V gather it took 269, and 4 warps 245-301 (results/s8_*).
    (128, 2, 16, torch.bfloat16, True): (16, 1, 3, "rows3"),
}
_PREFILL_TUNED: dict[tuple, tuple[int, int, int, int]] = {
    # B=4, 4096 new tokens, causal, with the new tokens' K/V fetched by TMA (session 11,
    # results/s11_call2_probe): 128x128x8x3 423 TFLOP/s (128x64x8x3 420), with a 4096-token
    # prefix 331 (303). 224 KB of shared memory: NVIDIA sm_90 only (see prefill_config).
    (128, 4, 16, torch.bfloat16): (128, 128, 8, 3),
}


def _pow2_part(n: int) -> int:
    return n & -n


@functools.cache  # called on every attention call: one dict lookup after the first
def decode_config(head_size: int, gqa: int, block_size: int, cache_dtype: torch.dtype,
                  interpret: bool = False, interleaved_v: bool = False) -> tuple[int, int, int, str]:
    """(TILE_N, num_warps, num_stages, kind) of the decode kernel (kind: ``DECODE_KINDS``)."""
    if interpret:
        return 32, 4, 1, "rows"
    tuned = _DECODE_TUNED.get((head_size, gqa, block_size, cache_dtype, interleaved_v))
    if tuned is not None:
        return tuned
    elem = cache_dtype.itemsize
    if elem == 2 and head_size <= 128 and gqa <= 16:
        # One warp per program: the GQA rows' max/sum stay inside the warp (no barriers);
        # wider tiles (more heads or channels) would not fit one warp's registers.
        return 16, 1, 3, "rows3"
    tile = 64 if head_size * elem <= 256 else 32
    if elem == 1:
        tile = 128 if head_size <= 128 else 64
    return tile, 4, 3, "rows"


def prefill_config(head_size: int, gqa: int, block_size: int, dtype: torch.dtype,
                   interpret: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefix-prefill (and encoder) kernel."""
    if interpret:
        return 16, 16, 4, 1
    # The table was measured on an H200; AMD GPUs have 64 KB of LDS: the heuristics below.
    tuned = None if torch.version.hip else _PREFILL_TUNED.get((head_size, gqa, block_size, dtype))
    if tuned is not None:
        return tuned
    if dtype == torch.float32:
        return (64, 32, 4, 2) if head_size <= 128 else (32, 32, 4, 2)
    if head_size <= 64:
        return 128, 64, 4, 3
    if head_size <= 128:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MIN_SPLIT_TOKENS = 64  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 64
# A split of at most this many tiles runs the heuristic's "rows3" config as one masked loop
# ("rows"): three loops would each start their software pipeline cold (B=1: 17.5 vs 18.1 us).
ONE_LOOP_MAX_TILES = 8
# Lazy softmax rescale margin (log2 units) of the decode kernel (prefill's: in
# ``prefix_prefill``); 0 rescales the accumulator on every tile. H200 (session 10): 8 is no
# faster (B=64 L=4096 328 vs 325 us; e2e shape 173.5 vs 172.3): the loop is not issue-bound.
DECODE_RESCALE_MARGIN = 0.0
# Causal prefill runs each sequence's row blocks last-first (longest first: a shorter tail).
# H200 (session 10): 397 vs 395 TFLOP/s without a prefix, 287 vs 283 with 4096 (noise ~2%).
PREFILL_LONGEST_FIRST = True
# How cache tiles read K (prefix_prefill._load_paged_kv): 0 = a [HEAD, TILE_N] gather (a
# warp's lanes on 16 packets 256 bytes apart); 1 = a tile that is one run of a block (decode's
# 16-key tiles) as the page's packet rows, TILE_N * 16 contiguous bytes each; 2 = tiles of
# several runs as well ([runs, HEAD/X, SUB*X]). H200 (session 11), decode B=64 L=4096:
# 258 us with 1, 326 with 0. Prefill's wgmma needs K in its own shared layout, so there the
# rows cost a register round trip; still, with a 4096-token prefix level 2 ran 361 TFLOP/s
# against 337 (level 1) and 334 (0), no prefix 432 / 431 / 429 (results/s11_call4_ffma).
# Level 2 passed the CPU interpreter matrix and the bench's check against SDPA, not yet the
# GPU test matrix: it becomes the prefill default once that has run.
PAGED_K_ROWS = 1
PREFILL_K_ROWS = 1
# Prefill fetches the new tokens' K/V tiles with TMA (tensor descriptors, NVIDIA sm_90+)
# instead of per-lane async copies. H200 (session 10): 407 vs 395 TFLOP/s without a prefix.
PREFILL_DENSE_TMA = True


@functools.cache
def _tma_capable(device_index: int) -> bool:
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _dense_descriptors(key: torch.Tensor, value: torch.Tensor, head_size: int, block_n: int,
                       interpret: bool):
    """TMA descriptors of key/value viewed as ``[tokens, kv_heads * head_size]`` with
    ``[block_n, head_size]`` boxes, or None where TMA cannot fetch them (then pointers)."""
    if not PREFILL_DENSE_TMA or triton.next_power_of_2(head_size) != head_size:
        return None
    if not interpret and not _tma_capable(key.device.index or 0):
        return None
    descs = []
    for t in (key, value):
        # TMA: 16-byte aligned base and row stride, contiguous heads and channels.
        if (t.stride(2) != 1 or t.stride(1) != head_size or t.data_ptr() % 16
                or (t.stride(0) * t.element_size()) % 16 or t.shape[0] == 0):
            return None
        descs.append(TensorDescriptor(t, [t.shape[0], t.shape[1] * head_size], [t.stride(0), 1],
                                      [block_n, head_size]))
    return descs


def num_kv_splits(num_seqs: int, num_kv_heads: int, head_chunks: int, max_ctx: int,
                  num_sms: int) -> int:
    """KV splits of the decode kernel, from host shapes only.

    One split while (seqs x KV heads) already fills the GPU twice; else enough splits for
    about 8 programs per SM, never shorter than ``MIN_SPLIT_TOKENS`` keys.
    """
    base = max(1, num_seqs * num_kv_heads * head_chunks)
    if base >= 2 * num_sms:
        return 1
    want = triton.cdiv(8 * num_sms, base)
    cap = max(1, triton.cdiv(max_ctx, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


# --- entry point -----------------------------------------------------------------------------


def _compute_dtype(query: torch.Tensor, key: torch.Tensor | None, cache_dtype: torch.dtype):
    for t in (query.dtype, None if key is None else key.dtype, cache_dtype):
        if t in _TL_DTYPES:
            return t
    return torch.bfloat16  # fp8 query and fp8 cache, no key: compute in bf16


def paged_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    causal: bool,
    sliding_window: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float,
    interleaved_v: bool,
    output_scale: torch.Tensor | None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
    decode_cfg: tuple[int, int, int, str] | None = None,
    prefill_cfg: tuple[int, int, int, int] | None = None,
    rescale_margin: float | None = None,
) -> None:
    """Chunked prefill + paged decode over the cache (semantics: ``reference.paged_attention``).

    output/query ``[num_tokens, num_heads, head_size]``; key/value
    ``[num_tokens, num_kv_heads, head_size]`` or None; kv_cache
    ``[num_blocks, 2, block_size, num_kv_heads * head_size]`` (LHBNC or LBHNC);
    query_start_loc ``[num_seqs + 1]``, seq_lens ``[num_seqs]``, block_table
    ``[num_seqs, max_blocks]`` (int32/int64); k_scale/v_scale/output_scale ``[1]`` fp32;
    alibi_slopes/sinks ``[num_heads]``. ``max_query_len``/``max_seq_len`` (host ints, optional)
    only steer launches: max_query_len == 1 skips the prefill launch, max_seq_len bounds the
    KV split count. ``num_splits``/``decode_cfg``/``prefill_cfg``/``rescale_margin`` override
    the heuristics (tests, benchmarks; ``rescale_margin`` 0 rescales on every tile).
    """
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    num_kv_heads = key.shape[1] if key is not None else kv_cache.shape[3] // head_size
    gqa = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    cache_dtype = kv_cache.dtype
    fp8_kv = is_fp8_dtype(cache_dtype)
    x = cache_x(cache_dtype)
    kc = k_view(kv_cache, num_kv_heads)
    vc = v_view(kv_cache, num_kv_heads, interleaved_v)
    compute = _compute_dtype(query, key, cache_dtype)
    interpret = _interpret()
    block_d = triton.next_power_of_2(head_size)
    use_window = sliding_window is not None and sliding_window > 0
    window = int(sliding_window) if use_window else 0
    use_out_scale = output_scale is not None
    out_max = fp8_max(output.dtype) if use_out_scale else 0.0
    dummy = query  # stands for absent optional tensors (never read: constexpr-disabled)
    common = dict(
        COMPUTE=_TL_DTYPES[compute], USE_WINDOW=use_window, USE_ALIBI=alibi_slopes is not None,
        USE_SINKS=sinks is not None, USE_SOFTCAP=logits_soft_cap > 0, FP8_KV=fp8_kv,
        INTERLEAVED_V=interleaved_v, USE_OUT_SCALE=use_out_scale, OUT_MAX=out_max,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
    )
    decode_margin = float(DECODE_RESCALE_MARGIN if rescale_margin is None else rescale_margin)
    context_margin, dense_margin = (
        (prefix_prefill.CONTEXT_RESCALE_MARGIN, prefix_prefill.DENSE_RESCALE_MARGIN)
        if rescale_margin is None else (rescale_margin, rescale_margin))
    ptrs = (k_scale, v_scale, alibi_slopes if alibi_slopes is not None else dummy,
            sinks if sinks is not None else dummy, output_scale if use_out_scale else dummy)
    softcap = float(logits_soft_cap) if logits_soft_cap > 0 else 1.0

    # --- decode: sequences with query_len == 1 ------------------------------------------------
    tile_n, warps, stages, kind = decode_cfg or decode_config(
        head_size, gqa, block_size, cache_dtype, interpret, interleaved_v)
    if kind not in DECODE_KINDS:
        raise ValueError(f"paged_attention: decode kind {kind!r}; supported: {DECODE_KINDS}")
    block_h = max(16, min(64, triton.next_power_of_2(gqa)))
    head_chunks = triton.cdiv(gqa, block_h)
    if num_splits is None:
        max_ctx = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
        sms = 8 if interpret else _num_sms(query.device.index or 0)
        num_splits = num_kv_splits(num_seqs, num_kv_heads, head_chunks, max_ctx, sms)
        if kind in ("rows3", "keys3") and decode_cfg is None and (
                max_ctx <= ONE_LOOP_MAX_TILES * tile_n * num_splits):
            kind = kind[:-1]
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32,
                              device=query.device)
    else:
        part_acc = part_ml = torch.empty(0, dtype=torch.float32, device=query.device)
    pa_strides = (num_heads * num_splits * head_size, num_splits * head_size, head_size)
    decode_args = (
        output, part_acc, part_ml, query, kc, vc, block_table, seq_lens, query_start_loc, *ptrs,
        scale, softcap, window,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), block_table.stride(0),
        *pa_strides,
    )
    grid = (num_seqs, num_kv_heads * head_chunks, num_splits)
    shape = dict(GQA=gqa, BLOCK_H=block_h, HEAD_CHUNKS=head_chunks, HEAD_SIZE=head_size,
                 BLOCK_D=block_d, BLOCK_SIZE=block_size, X=x, NUM_SPLITS=num_splits)
    if kind.startswith("streams"):
        # a stream's keys must sit in one block: S divides the block size's power-of-2 part
        s = min(tile_n // warps, _pow2_part(block_size))
        _paged_decode_streams_kernel[grid](
            *decode_args, W=warps, S=s, ONE_LOOP=kind == "streams", num_warps=warps,
            num_stages=stages, **shape, **common)
    else:
        _paged_decode_kernel[grid](
            *decode_args, TILE_N=tile_n, SUB=min(tile_n, _pow2_part(block_size)),
            ONE_LOOP=kind in ("rows", "keys"), KEYS_MAJOR=kind.startswith("keys"),
            RESCALE_MARGIN=decode_margin, K_ROWS=PAGED_K_ROWS,
            num_warps=warps, num_stages=stages, **shape, **common)
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            output, part_acc, part_ml, query_start_loc, v_scale, ptrs[4],
            output.stride(0), output.stride(1), *pa_strides,
            HEAD_SIZE=head_size, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), FP8_KV=fp8_kv,
            USE_OUT_SCALE=use_out_scale, OUT_MAX=out_max, num_warps=4,
        )

    # --- prefix prefill: sequences with query_len > 1 -----------------------------------------
    if max_query_len is not None and max_query_len <= 1:
        return
    block_m, block_n, warps, stages = prefill_cfg or prefill_config(
        head_size, gqa, block_size, compute, interpret)
    has_new = key is not None
    k_new = key if has_new else dummy.view(num_tokens, num_heads, head_size)
    v_new = value if has_new else k_new
    descs = _dense_descriptors(k_new, v_new, head_size, block_n, interpret) if has_new else None
    _prefix_prefill_kernel[(num_tokens // block_m + num_seqs, num_heads)](
        output, query, *(descs or (k_new, v_new)), kc, vc, block_table, seq_lens, query_start_loc, *ptrs,
        scale, softcap, window, num_seqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), block_table.stride(0),
        GQA=gqa, HEAD_SIZE=head_size, BLOCK_D=block_d, BLOCK_SIZE=block_size, X=x,
        SUB=min(block_n, _pow2_part(block_size)), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_NEW_KV=has_new, CAUSAL=bool(causal), RESCALE_MARGIN=float(context_margin),
        DENSE_MARGIN=float(dense_margin),
        LONGEST_FIRST=PREFILL_LONGEST_FIRST and bool(causal), DENSE_TMA=descs is not None,
        K_ROWS=PREFILL_K_ROWS,
        num_warps=warps, num_stages=stages, **common,
    )
