"""Warp-specialized prefix prefill in Gluon (NVIDIA Hopper, sm_90 only).

The prefill part of the Triton provider's ``paged_attention`` (``kernels/triton/
prefix_prefill.py``) for the common case: 16-bit query and cache of one dtype, causal, no
window / soft cap / sinks / ALiBi / output scale, new K/V given (``eligibility.py`` says why
a launch is not covered; those run the Triton kernel). Same grid semantics: one
program per (virtual 128-row block of the varlen batch, query head); sequences with
``query_len <= SHORT_QUERY_MAX`` belong to the decode/verify kernels and are skipped, as are
padding blocks. Everything per sequence is read on the device (capturable).

Per program, FA3-style (``benchmarks/probe_prefill_gluon.py`` measured the structure on the
dense part: 508 TFLOP/s against SDPA's 504 on an H100):

- a load partition (``LOAD_WARPS`` warps) brings Q by TMA, then every key tile into a ring
  of ``STAGES`` shared-memory stages: first the cached context, page by page (16-byte
  packets: a K packet is 8 channels of one token, a row chunk of the ``[keys, D]`` tile; a V
  packet is 8 tokens of one channel, so context V fills a ``[D, keys]`` tile, the stage's
  bytes reinterpreted), gathered by cp.async (``DEFAULT_CONFIG``) or, for the standard V
  interior, K through registers and V a TMA box a page (``K_REGS_V_TMA_CONFIG``), for the
  interleaved one K and V through registers (``KV_REGS_CONFIG``; which one a launch runs:
  ``default_config``), then the new tokens by TMA from
  ``key``/``value`` (``[keys, D]``). A stage's K and V each have a ready mbarrier, the stage
  one empty mbarrier (one arrival per consumer partition). cp.async arrivals are tracked on
  the ready mbarrier (``async_copy.mbarrier_arrive``); the last context tile, when partial,
  loads V with masked loads (keys past the context are zeros, not stale cache slots: 0 * NaN
  would poison the row);
- two consumer warpgroups (64 rows each) run S = Q K^T and O += P V as async wgmma with the
  online softmax in fp32 (exp2, scale folded in) between them, tile j's S in flight with
  tile j-1's P V (``PIPE``), taking turns at the tensor cores (ping-pong). The context phase
  reads V through the transposed ``[D, keys]`` view, the new-token phase directly; the phase
  boundary drains the pipeline once. Only the partial last context tile and the diagonal
  tiles mask.

The consumers fence the async proxy after each cp.async-filled stage lands (the wgmma reads
shared memory through the async proxy; cp.async wrote it through the generic one).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

_LOG2E = 1.4426950408889634
# V_TMA: a row coordinate past any V-cache descriptor (launch() refuses caches of more rows),
# for pages past the context: TMA fills the box with zeros
_ROW_PAST_DESCRIPTOR = gl.constexpr(2**31 - 1024)
CONSUMER_WARPS = gl.constexpr(4)  # a consumer partition: one warpgroup, 64 rows


# --- program -> (sequence, row block) ------------------------------------------------------

@gluon.jit
def _find_seq(cu_ptr, num_seqs, vblock, BLOCK_M: gl.constexpr):
    """The largest sequence s whose first virtual block ``cu[s] // BLOCK_M + s`` is <= vblock
    (the Triton kernels' varlen grid: ``attention_common._find_seq``)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        v = gl.load(cu_ptr + mid).to(gl.int32) // BLOCK_M + mid
        if v <= vblock:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- shared memory of the pipeline (also the probe's, benchmarks/probe_prefill_gluon.py) -----

@gluon.jit
def allocate_pipeline(q_desc, k_desc, v_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                      READY_ARRIVALS: gl.constexpr = 1):
    """A row block's shared memory, allocated and its mbarriers initialized: the Q tile, a
    ring of ``STAGES`` K and V stages (each the shape and layout of its descriptor's block),
    Q's ready mbarrier, a stage's K and V ready mbarriers (``READY_ARRIVALS`` arrivals each:
    1, or every load thread for ``publish="noinc"``), a stage's empty
    mbarrier (one arrival per consumer partition: ``CONSUMERS``) and the consumers'
    two ping-pong turn mbarriers (one arrival each)."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(v_ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)
    fence_async_shared()  # the initialized barriers visible to the TMA unit
    return q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn


# --- load partition --------------------------------------------------------------------------

@gluon.jit
def _gather_k(k_buf, kc_head, bt_row, stride_kcb, ctx_len, key0,
              BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
              LOAD_WARPS: gl.constexpr, MASKED: gl.constexpr):
    """K of context keys key0 .. key0 + BLOCK_N into the ``[BLOCK_N, HEAD]`` stage by cp.async,
    in chunks of ``CH`` keys that lie in one page (``BLOCK_SIZE % CH == 0``): one block-table
    read per chunk (a scalar), one 16-byte packet (8 channels of a token) per thread, whose
    offset inside the chunk is the same for every chunk. ``MASKED`` (the partial last tile):
    chunks wholly past the context are not read; the rest of a partly used chunk is its
    page's stale slots, whose S the consumer masks."""
    TPW_C: gl.constexpr = HEAD // 8
    TPW_R: gl.constexpr = 32 // TPW_C
    CH: gl.constexpr = TPW_R * LOAD_WARPS
    gl.static_assert(BLOCK_SIZE % CH == 0, "a K chunk lies in one page")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_R, TPW_C], [LOAD_WARPS, 1], [1, 0])
    rows = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
    # page interior [HEAD // 8, BLOCK_SIZE, 8]: channel c of slot t at (c // 8) * BLOCK_SIZE * 8 + t * 8 + c % 8
    in_chunk = gl.expand_dims(rows * 8, 1) + gl.expand_dims((cols // 8) * (BLOCK_SIZE * 8) + cols % 8, 0)
    for c in gl.static_range(BLOCK_N // CH):
        k0 = key0 + c * CH
        if MASKED:
            if k0 < ctx_len:
                blk = gl.load(bt_row + k0 // BLOCK_SIZE).to(gl.int64)
                base = kc_head + (blk * stride_kcb + (k0 % BLOCK_SIZE) * 8)
                async_copy.async_copy_global_to_shared(k_buf.slice(c * CH, CH), base + in_chunk)
        else:
            blk = gl.load(bt_row + k0 // BLOCK_SIZE).to(gl.int64)
            base = kc_head + (blk * stride_kcb + (k0 % BLOCK_SIZE) * 8)
            async_copy.async_copy_global_to_shared(k_buf.slice(c * CH, CH), base + in_chunk)


@gluon.jit
def _gather_k_tile(k_buf, kc_head, bt_row, stride_kcb, ctx_len, key0,
                   BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                   LOAD_WARPS: gl.constexpr, MASKED: gl.constexpr, PAGE_MAJOR: gl.constexpr):
    """``GATHER_TILE_K`` variant of ``_gather_k``: the whole ``[BLOCK_N, HEAD]`` stage in one
    cp.async op, a thread per key (its page read once, its ``HEAD // 8`` packets at fixed
    offsets from one address). One op per tile: the chunked gather's copies are writes to
    slices of a dynamically indexed stage, which Triton's shared-memory barrier analysis
    separates with a thread barrier each. ``MASKED``: keys past the context are zero-filled
    (their block-table entries are not read). ``PAGE_MAJOR`` (``gather="pages"``): a warp on
    the keys of one page (16 at block 16), its lanes on two channel packets of a key first, so
    a warp's 512 bytes are two 256-byte runs of one page (Nsight Compute still counts each
    copy at 32 L2 sectors a warp instruction, as the other K gathers: docs/performance.md)."""
    if PAGE_MAJOR:
        TPW_K: gl.constexpr = BLOCK_SIZE if BLOCK_SIZE < 32 else 32
        TPW_C: gl.constexpr = 32 // TPW_K
        WARPS_C: gl.constexpr = HEAD // 8 // TPW_C if LOAD_WARPS > HEAD // 8 // TPW_C else LOAD_WARPS
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_K, TPW_C], [LOAD_WARPS // WARPS_C, WARPS_C], [1, 0])
    else:
        WARPS_R: gl.constexpr = BLOCK_N // 32 if LOAD_WARPS > BLOCK_N // 32 else LOAD_WARPS
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [WARPS_R, LOAD_WARPS // WARPS_R], [1, 0])
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
    if MASKED:
        ok = keys < ctx_len
        blk = gl.load(bt_row + keys // BLOCK_SIZE, mask=ok, other=0)
    else:
        blk = gl.load(bt_row + keys // BLOCK_SIZE)
    # page interior [HEAD // 8, BLOCK_SIZE, 8]: channel c of slot t at (c // 8) * BLOCK_SIZE * 8 + t * 8 + c % 8
    key_off = blk.to(gl.int64) * stride_kcb + (keys % BLOCK_SIZE) * 8
    offs = gl.expand_dims(key_off, 1) + gl.expand_dims((cols // 8) * (BLOCK_SIZE * 8) + cols % 8, 0)
    if MASKED:
        async_copy.async_copy_global_to_shared(k_buf, kc_head + offs, mask=gl.expand_dims(ok, 1))
    else:
        async_copy.async_copy_global_to_shared(k_buf, kc_head + offs)


@gluon.jit
def _load_k_regs(k_buf, kc_head, bt_row, stride_kcb, ctx_len, key0,
                 BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                 LOAD_WARPS: gl.constexpr, MASKED: gl.constexpr, SUB: gl.constexpr):
    """``k_load="regs"`` variant of ``_gather_k``: K of context keys key0 .. key0 + BLOCK_N into
    the ``[BLOCK_N, HEAD]`` stage through registers, ``SUB`` keys a pass (32 or 64). A warp's
    16-byte loads cover 16 consecutive keys of two channel packets: whole 128-byte runs of a
    page (cp.async of the same packets costs twice the L2 sectors and 8x the shared-memory
    wavefronts: Nsight Compute, docs/performance.md); its stores, 8 lanes on 8 consecutive
    rows of one 16-byte column of the 128-byte-swizzled tile, hit distinct banks. ``MASKED``:
    keys past the context are zeros. The caller publishes the stage (generic-proxy stores)."""
    WARPS_K: gl.constexpr = SUB // 16  # warps along the keys, the others along the channels
    gl.static_assert(BLOCK_N % SUB == 0 and LOAD_WARPS % WARPS_K == 0, "whole passes a tile")
    gl.static_assert(BLOCK_SIZE % 16 == 0, "16 consecutive keys lie in one page")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [WARPS_K, LOAD_WARPS // WARPS_K], [0, 1])
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
    # page interior [HEAD // 8, BLOCK_SIZE, 8]: channel c of slot t at (c // 8) * BLOCK_SIZE * 8 + t * 8 + c % 8
    col_off = gl.expand_dims((cols // 8) * (BLOCK_SIZE * 8) + cols % 8, 0)
    for c in gl.static_range(BLOCK_N // SUB):
        keys = key0 + c * SUB + gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
        if MASKED:
            ok = keys < ctx_len
            blk = gl.load(bt_row + keys // BLOCK_SIZE, mask=ok, other=0)
        else:
            blk = gl.load(bt_row + keys // BLOCK_SIZE)
        offs = gl.expand_dims(blk.to(gl.int64) * stride_kcb + (keys % BLOCK_SIZE) * 8, 1) + col_off
        offs = gl.max_contiguous(gl.multiple_of(offs, [1, 8]), [1, 8])
        if MASKED:
            vals = gl.load(kc_head + offs, mask=gl.expand_dims(ok, 1), other=0.0)
        else:
            vals = gl.load(kc_head + offs)
        k_buf.slice(c * SUB, SUB).store(vals)


@gluon.jit
def _load_vt_regs(vt_buf, vc_head, bt_row, stride_vcb, ctx_len, key0,
                  BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                  LOAD_WARPS: gl.constexpr, MASKED: gl.constexpr, SUB: gl.constexpr):
    """``v_load="regs"`` variant of ``_gather_vt`` (interleaved V interior only): V of context
    keys key0 .. key0 + BLOCK_N into the ``[HEAD, BLOCK_N]`` view through registers, ``SUB``
    channels a pass (32 or 64). A warp's 16 lanes on 16 consecutive channels of one 8-key
    packet read 256 contiguous bytes of a page (the interleaved interior keeps a packet's
    channels together), two packets a warp instruction; its stores, 8 lanes on 8 consecutive
    rows of one 16-byte column of the 128-byte-swizzled tile, hit distinct banks. ``MASKED``:
    keys past the context are zeros (no stale slot reaches the tile). The caller publishes."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, LOAD_WARPS], [0, 1])
    key_off, packet_ok = _v_key_offsets(bt_row, stride_vcb, ctx_len, key0, layout, BLOCK_N, HEAD,
                                        BLOCK_SIZE, True, MASKED)
    key_off = gl.expand_dims(key_off, 0)
    if MASKED:
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        key_ok = gl.expand_dims(keys < ctx_len, 0)
        packet_ok = gl.expand_dims(packet_ok, 0)
    chans = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(HEAD // SUB):
        # interleaved page interior [BLOCK_SIZE // 8, HEAD, 8]: channel d of slot t at (t // 8) * HEAD * 8 + d * 8 + t % 8
        offs = gl.expand_dims((c * SUB + chans) * 8, 1) + key_off
        offs = gl.max_contiguous(gl.multiple_of(offs, [1, 8]), [1, 8])
        if MASKED:
            vals = gl.load(vc_head + offs, mask=packet_ok, other=0.0)
            vals = gl.where(key_ok, vals, gl.zeros_like(vals))  # the packet the context ends in
        else:
            vals = gl.load(vc_head + offs)
        vt_buf.slice(c * SUB, SUB).store(vals)


@gluon.jit
def _v_key_offsets(bt_row, stride_vcb, ctx_len, key0, layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                   INTERLEAVED_V: gl.constexpr, MASKED: gl.constexpr):
    """Per key of the tile: its offset in the V cache (channel 0), and (``MASKED``) whether its
    16-byte packet (8 keys, one page) holds a context key."""
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    packet_ok = (keys // 8) * 8 < ctx_len
    if MASKED:
        blk = gl.load(bt_row + keys // BLOCK_SIZE, mask=packet_ok, other=0)
    else:
        blk = gl.load(bt_row + keys // BLOCK_SIZE)
    # 8 consecutive keys (a packet) share a page: block sizes are multiples of 8
    blk = gl.max_constancy(blk, [8])
    slot = keys % BLOCK_SIZE
    if INTERLEAVED_V:  # [BLOCK_SIZE // 8, HEAD, 8]
        off = (slot // 8) * (HEAD * 8) + slot % 8
    else:  # [HEAD, BLOCK_SIZE]
        off = slot
    key_off = blk.to(gl.int64) * stride_vcb + off
    # runs of 8 keys are 8 contiguous elements starting 16-byte aligned (page and head strides
    # are multiples of 8, the cache 16-byte aligned): one cp.async packet each
    return gl.max_contiguous(gl.multiple_of(key_off, [8]), [8]), packet_ok


@gluon.jit
def _gather_vt(vt_buf, vc_head, bt_row, stride_vcb, ctx_len, key0,
               BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               LOAD_WARPS: gl.constexpr, INTERLEAVED_V: gl.constexpr, MASKED: gl.constexpr):
    """V of context keys key0 .. key0 + BLOCK_N into the ``[HEAD, BLOCK_N]`` view of the stage
    by cp.async, packets of 8 keys of one channel. ``MASKED`` (the partial last tile): packets
    wholly past the context are zero-filled; the stale slots of the packet the context ends
    in are zeroed afterwards (``_zero_stale_v``)."""
    TPW_C: gl.constexpr = BLOCK_N // 8
    TPW_R: gl.constexpr = 32 // TPW_C
    CH: gl.constexpr = TPW_R * LOAD_WARPS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_R, TPW_C], [LOAD_WARPS, 1], [1, 0])
    key_off, packet_ok = _v_key_offsets(bt_row, stride_vcb, ctx_len, key0, layout, BLOCK_N, HEAD,
                                        BLOCK_SIZE, INTERLEAVED_V, MASKED)
    key_off = gl.expand_dims(key_off, 0)
    packet_ok = gl.expand_dims(packet_ok, 0)
    chans = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
    if INTERLEAVED_V:
        CH_STRIDE: gl.constexpr = 8
    else:
        CH_STRIDE: gl.constexpr = BLOCK_SIZE
    for c in gl.static_range(HEAD // CH):
        ptrs = vc_head + (gl.expand_dims((c * CH + chans) * CH_STRIDE, 1) + key_off)
        if MASKED:
            async_copy.async_copy_global_to_shared(vt_buf.slice(c * CH, CH), ptrs, mask=packet_ok)
        else:
            async_copy.async_copy_global_to_shared(vt_buf.slice(c * CH, CH), ptrs)


@gluon.jit
def _gather_vt_tile(vt_buf, vc_head, bt_row, stride_vcb, ctx_len, key0,
                    BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                    LOAD_WARPS: gl.constexpr, INTERLEAVED_V: gl.constexpr, MASKED: gl.constexpr,
                    PAGE_MAJOR: gl.constexpr):
    """``GATHER_TILE_V`` variant of ``_gather_vt``: the whole ``[HEAD, BLOCK_N]`` view in one
    cp.async op (same packets, same per-thread key offsets, no barrier between chunks).
    ``PAGE_MAJOR`` (``gather="pages"``): a warp's lanes on the packets of one page in the page
    interior's order (standard V: a channel's packets, then the next channels; interleaved V:
    consecutive channels of one packet row), whole 128-byte runs of one page."""
    if PAGE_MAJOR:
        if INTERLEAVED_V:
            TPW_C: gl.constexpr = 1
        else:
            TPW_C: gl.constexpr = BLOCK_SIZE // 8 if BLOCK_SIZE < BLOCK_N else BLOCK_N // 8
        TPW_R: gl.constexpr = 32 // TPW_C
        WARPS_R: gl.constexpr = HEAD // TPW_R if LOAD_WARPS > HEAD // TPW_R else LOAD_WARPS
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_R, TPW_C], [WARPS_R, LOAD_WARPS // WARPS_R], [1, 0])
    else:
        TPW_C: gl.constexpr = BLOCK_N // 8
        TPW_R: gl.constexpr = 32 // TPW_C
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_R, TPW_C], [LOAD_WARPS, 1], [1, 0])
    key_off, packet_ok = _v_key_offsets(bt_row, stride_vcb, ctx_len, key0, layout, BLOCK_N, HEAD,
                                        BLOCK_SIZE, INTERLEAVED_V, MASKED)
    chans = gl.arange(0, HEAD, layout=gl.SliceLayout(1, layout))
    if INTERLEAVED_V:
        CH_STRIDE: gl.constexpr = 8
    else:
        CH_STRIDE: gl.constexpr = BLOCK_SIZE
    ptrs = vc_head + (gl.expand_dims(chans * CH_STRIDE, 1) + gl.expand_dims(key_off, 0))
    if MASKED:
        async_copy.async_copy_global_to_shared(vt_buf, ptrs, mask=gl.expand_dims(packet_ok, 0))
    else:
        async_copy.async_copy_global_to_shared(vt_buf, ptrs)


@gluon.jit
def _zero_stale_v(vt_buf, ctx_len, key0, BLOCK_N: gl.constexpr, HEAD: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """Zero the ``[HEAD, BLOCK_N]`` V tile's columns of keys past the context (landed: the
    caller waited for its copies). Their P is 0, but 0 * a stale NaN would be NaN."""
    TPW_C: gl.constexpr = BLOCK_N // 8
    TPW_R: gl.constexpr = 32 // TPW_C
    CH: gl.constexpr = TPW_R * LOAD_WARPS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_R, TPW_C], [LOAD_WARPS, 1], [1, 0])
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ok = gl.expand_dims(keys < ctx_len, 0)
    for c in gl.static_range(HEAD // CH):
        part = vt_buf.slice(c * CH, CH)
        v = part.load(layout)
        part.store(gl.where(ok, v, gl.zeros_like(v)))


@gluon.jit
def _gather_v_tail(v_buf, v_head, stride_vt, row0, rows_left,
                   BLOCK_N: gl.constexpr, HEAD: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """V of new tokens ``row0 ..`` (rows of ``value``; ``v_head``: its KV head's channel 0)
    into the ``[BLOCK_N, HEAD]`` stage by cp.async, rows from ``rows_left`` on (past the
    sequence: the next sequence's tokens or graph padding, which may hold NaN) zero-filled:
    their P is 0, but 0 * NaN is NaN."""
    TPW_C: gl.constexpr = HEAD // 8
    TPW_R: gl.constexpr = 32 // TPW_C
    CH: gl.constexpr = TPW_R * LOAD_WARPS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_R, TPW_C], [LOAD_WARPS, 1], [1, 0])
    rows = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
    in_chunk = gl.expand_dims(rows * stride_vt, 1) + gl.expand_dims(cols, 0)
    # 8 channels of a row are a 16-byte packet (the row stride is a multiple of 8: eligibility)
    in_chunk = gl.max_contiguous(gl.multiple_of(in_chunk, [1, 8]), [1, 8])
    for c in gl.static_range(BLOCK_N // CH):
        base = v_head + (row0 + c * CH).to(gl.int64) * stride_vt
        ok = gl.expand_dims(c * CH + rows < rows_left, 1)
        async_copy.async_copy_global_to_shared(v_buf.slice(c * CH, CH), base + in_chunk, mask=ok)


@gluon.jit
def _tma_vt(vt_buf, vc_desc, bar, bt_row, blk_rows, head_row, ctx_len, key0,
            BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, MASKED: gl.constexpr):
    """``V_TMA`` variant of ``_gather_vt`` (standard V interior): a page's V of one head,
    ``[HEAD, BLOCK_SIZE]``, is contiguous, so it is one TMA box (``vc_desc``: the cache as rows of
    ``BLOCK_SIZE`` keys; page ``blk`` of this head starts at row ``blk * blk_rows + head_row``)
    into its column chunk of the ``2 * BLOCK_SIZE``-byte-swizzled ``[HEAD, BLOCK_N]`` tile (the
    chunks are contiguous in that layout). Completes on ``bar``, whose expect the caller set for
    the whole tile. ``MASKED``: a page wholly past the context is read at a row past the
    descriptor, which TMA fills with zeros (its block-table entry is not read). TMA takes 32-bit
    coordinates: the row is one (``launch`` refuses caches of 2^31 rows), also from an int64
    block table."""
    for p in gl.static_range(BLOCK_N // BLOCK_SIZE):
        k0 = key0 + p * BLOCK_SIZE
        if MASKED:
            in_ctx = k0 < ctx_len
            blk = gl.load(bt_row + k0 // BLOCK_SIZE, mask=in_ctx, other=0)
            row = gl.where(in_ctx, blk * blk_rows + head_row, _ROW_PAST_DESCRIPTOR)
        else:
            row = gl.load(bt_row + k0 // BLOCK_SIZE) * blk_rows + head_row
        tma.async_copy_global_to_shared(vc_desc, [row.to(gl.int32), 0], bar,
                                        vt_buf.slice(p * BLOCK_SIZE, BLOCK_SIZE, dim=1))


@gluon.jit
def _publish_stores(bar):
    """The load partition's stores to a stage (generic proxy) published on ``bar``: each
    thread's fenced for the wgmma's async-proxy reads, all of them before the one arrival."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _publish_cp_async(bar):
    """Every thread's cp.async so far counts on ``bar`` (each thread's tracking arrive adds a
    pending arrival), then one arrival completes the phase once they have all landed."""
    async_copy.mbarrier_arrive(bar)
    gl.thread_barrier()  # all tracking arrives registered before the one that can complete it
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _load_context_tile(k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, kc_head, vc_head, bt_row, stride_kcb,
                       stride_vcb, ctx_len, j,
                       BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr,
                       BLOCK_SIZE: gl.constexpr, LOAD_WARPS: gl.constexpr, INTERLEAVED_V: gl.constexpr,
                       VT_LAYOUT: gl.constexpr, PARTIAL: gl.constexpr, GATHER_TILE_K: gl.constexpr,
                       GATHER_TILE_V: gl.constexpr, JOINT_PUBLISH: gl.constexpr, NOINC_PUBLISH: gl.constexpr,
                       SPLIT_RELEASE: gl.constexpr, v_fill, v_head_row, V_TMA: gl.constexpr):
    """Context key tile ``j`` into its stage: K and V gathered by cp.async, each published on
    its ready mbarrier. ``PARTIAL`` (the last tile, keys past the context): only the chunks
    and packets that hold context keys are read, and V's stale slots are zeroed once its
    packets landed, before V is published.

    Variants (``GluonPrefillConfig``; the default is none): ``GATHER_TILE_K`` /
    ``GATHER_TILE_V``, K / V in one cp.async op (``_gather_k_tile``, ``_gather_vt_tile``);
    ``JOINT_PUBLISH``, one thread barrier publishes K and V together after both were issued:
    each thread's tracking arrive
    on ``k_ready`` follows its K packets, the one on ``v_ready`` its V packets, and the single
    thread barrier puts every tracking arrive before the two completing arrivals (K is
    published once V is issued, not once K is); ``NOINC_PUBLISH``, the ready mbarriers count
    an arrival per load thread: each thread's non-incrementing tracking arrive is its arrival,
    once its packets landed, so no thread barrier publishes a tile; ``SPLIT_RELEASE``, K's
    buffer waits on ``kv_empty`` (released once both consumers' S of the tile is done), V's on
    ``v_empty`` (once their P V is), not both on ``kv_empty``; ``V_TMA`` (separate publication
    only), V by TMA (``_tma_vt``; ``vc_head`` is the V cache's descriptor, ``v_head_row`` this
    head's row in a page): published by its expect; the partial last tile lands on ``v_fill``
    first, its stale slots are zeroed, then V is published; ``GATHER_TILE_K`` 3 / 4
    (``k_load="regs"`` / ``"regs32"``), V issued first, then K through registers
    (``_load_k_regs``, 64 / 32 keys a pass), published after its stores; ``GATHER_TILE_V`` 3 / 4
    (``v_load="regs"`` / ``"regs32"``, with K through registers): K loaded and published, then
    V through registers (``_load_vt_regs``, 64 / 32 channels a pass), published after its stores."""
    s = j % STAGES
    # a fresh mbarrier reads as if its phase before 0 completed: the first round passes
    mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
    if GATHER_TILE_V >= 3:  # K and V through registers (v_load "regs" / "regs32"): K published, then V
        _load_k_regs(k_bufs.index(s), kc_head, bt_row, stride_kcb, ctx_len, j * BLOCK_N, BLOCK_N, HEAD, BLOCK_SIZE,
                     LOAD_WARPS, PARTIAL, 64 if GATHER_TILE_K == 3 else 32)
        _publish_stores(k_ready.index(s))
        vt = v_bufs.index(s)._reinterpret(v_bufs.dtype, [HEAD, BLOCK_N], VT_LAYOUT)
        _load_vt_regs(vt, vc_head, bt_row, stride_vcb, ctx_len, j * BLOCK_N, BLOCK_N, HEAD, BLOCK_SIZE, LOAD_WARPS,
                      PARTIAL, 64 if GATHER_TILE_V == 3 else 32)
        _publish_stores(v_ready.index(s))
        return
    if GATHER_TILE_K >= 3:  # K through registers (k_load "regs" / "regs32"): V issued first, K published last
        _load_tile_v(v_bufs, v_ready, vc_head, bt_row, stride_vcb, ctx_len, j, s, BLOCK_N, HEAD, BLOCK_SIZE,
                     LOAD_WARPS, INTERLEAVED_V, VT_LAYOUT, PARTIAL, GATHER_TILE_V, False, False, v_fill, v_head_row,
                     V_TMA, k_ready)
        _load_k_regs(k_bufs.index(s), kc_head, bt_row, stride_kcb, ctx_len, j * BLOCK_N, BLOCK_N, HEAD, BLOCK_SIZE,
                     LOAD_WARPS, PARTIAL, 64 if GATHER_TILE_K == 3 else 32)
        _publish_stores(k_ready.index(s))
        return
    if GATHER_TILE_K:
        _gather_k_tile(k_bufs.index(s), kc_head, bt_row, stride_kcb, ctx_len, j * BLOCK_N,
                       BLOCK_N, HEAD, BLOCK_SIZE, LOAD_WARPS, PARTIAL, GATHER_TILE_K == 2)
    else:
        _gather_k(k_bufs.index(s), kc_head, bt_row, stride_kcb, ctx_len, j * BLOCK_N,
                  BLOCK_N, HEAD, BLOCK_SIZE, LOAD_WARPS, PARTIAL)
    if NOINC_PUBLISH:  # this thread's arrival, once its K packets (and earlier ones) landed
        async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
    elif JOINT_PUBLISH:
        async_copy.mbarrier_arrive(k_ready.index(s))  # this thread's K packets (and earlier ones)
    else:
        _publish_cp_async(k_ready.index(s))
    if SPLIT_RELEASE:
        mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
    _load_tile_v(v_bufs, v_ready, vc_head, bt_row, stride_vcb, ctx_len, j, s, BLOCK_N, HEAD, BLOCK_SIZE, LOAD_WARPS,
                 INTERLEAVED_V, VT_LAYOUT, PARTIAL, GATHER_TILE_V, JOINT_PUBLISH, NOINC_PUBLISH, v_fill, v_head_row,
                 V_TMA, k_ready)


@gluon.jit
def _load_tile_v(v_bufs, v_ready, vc_head, bt_row, stride_vcb, ctx_len, j, s,
                 BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, LOAD_WARPS: gl.constexpr,
                 INTERLEAVED_V: gl.constexpr, VT_LAYOUT: gl.constexpr, PARTIAL: gl.constexpr,
                 GATHER_TILE_V: gl.constexpr, JOINT_PUBLISH: gl.constexpr, NOINC_PUBLISH: gl.constexpr, v_fill,
                 v_head_row, V_TMA: gl.constexpr, k_ready):
    """Context V of tile ``j`` into stage ``s`` and its publication: by TMA (``V_TMA``: published
    by its expect; the partial last tile lands on ``v_fill`` first, its stale slots are zeroed,
    then V is published) or gathered (``_load_context_v``)."""
    vt = v_bufs.index(s)._reinterpret(v_bufs.dtype, [HEAD, BLOCK_N], VT_LAYOUT)
    if V_TMA:
        V_BYTES: gl.constexpr = HEAD * BLOCK_N * v_bufs.dtype.primitive_bitwidth // 8
        blk_rows = stride_vcb // BLOCK_SIZE
        if PARTIAL:  # at most one a program: v_fill's phase 0
            mbarrier.expect(v_fill, V_BYTES)
            _tma_vt(vt, vc_head, v_fill, bt_row, blk_rows, v_head_row, ctx_len, j * BLOCK_N, BLOCK_N, BLOCK_SIZE,
                    True)
            mbarrier.wait(v_fill, 0)
            _zero_stale_v(vt, ctx_len, j * BLOCK_N, BLOCK_N, HEAD, LOAD_WARPS)
            _publish_stores(v_ready.index(s))
        else:
            mbarrier.expect(v_ready.index(s), V_BYTES)
            _tma_vt(vt, vc_head, v_ready.index(s), bt_row, blk_rows, v_head_row, ctx_len, j * BLOCK_N, BLOCK_N,
                    BLOCK_SIZE, False)
    else:
        _load_context_v(vt, v_ready, vc_head, bt_row, stride_vcb, ctx_len, j, s, BLOCK_N, HEAD, BLOCK_SIZE,
                        LOAD_WARPS, INTERLEAVED_V, PARTIAL, GATHER_TILE_V, JOINT_PUBLISH, NOINC_PUBLISH, k_ready)


@gluon.jit
def _load_context_v(vt, v_ready, vc_head, bt_row, stride_vcb, ctx_len, j, s,
                    BLOCK_N: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, LOAD_WARPS: gl.constexpr,
                    INTERLEAVED_V: gl.constexpr, PARTIAL: gl.constexpr, GATHER_TILE_V: gl.constexpr,
                    JOINT_PUBLISH: gl.constexpr, NOINC_PUBLISH: gl.constexpr, k_ready):
    """Context V of tile ``j`` into stage ``s``'s ``[HEAD, BLOCK_N]`` view by cp.async, then its
    publication (and, ``JOINT_PUBLISH``, K's): ``_load_context_tile``'s gather path."""
    if GATHER_TILE_V:
        _gather_vt_tile(vt, vc_head, bt_row, stride_vcb, ctx_len, j * BLOCK_N,
                        BLOCK_N, HEAD, BLOCK_SIZE, LOAD_WARPS, INTERLEAVED_V, PARTIAL, GATHER_TILE_V == 2)
    else:
        _gather_vt(vt, vc_head, bt_row, stride_vcb, ctx_len, j * BLOCK_N,
                   BLOCK_N, HEAD, BLOCK_SIZE, LOAD_WARPS, INTERLEAVED_V, PARTIAL)
    if PARTIAL:
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's packets landed before any zeroing
        _zero_stale_v(vt, ctx_len, j * BLOCK_N, BLOCK_N, HEAD, LOAD_WARPS)
        fence_async_shared()  # this thread's stores before the wgmma's async-proxy reads
        gl.thread_barrier()
        if JOINT_PUBLISH:  # every K tracking arrive registered (the barriers above)
            mbarrier.arrive(k_ready.index(s), count=1)
        if NOINC_PUBLISH:  # every load thread's arrival at once: all their packets landed
            mbarrier.arrive(v_ready.index(s), count=LOAD_WARPS * 32)
        else:
            mbarrier.arrive(v_ready.index(s), count=1)
    elif NOINC_PUBLISH:
        async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
    elif JOINT_PUBLISH:
        async_copy.mbarrier_arrive(v_ready.index(s))
        gl.thread_barrier()  # all tracking arrives (K's and V's) registered before the completing ones
        mbarrier.arrive(k_ready.index(s), count=1)
        mbarrier.arrive(v_ready.index(s), count=1)
    else:
        _publish_cp_async(v_ready.index(s))


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, v_empty,
                    kc_head, vc_head, bt_row, stride_kcb, stride_vcb, v_head, stride_vt,
                    q_row, q_col, kv_row, kv_col, ctx_len, q_len, n_ctx, n_new,
                    BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr, LOAD_WARPS: gl.constexpr, INTERLEAVED_V: gl.constexpr,
                    VT_LAYOUT: gl.constexpr, GATHER_TILE_K: gl.constexpr, GATHER_TILE_V: gl.constexpr,
                    JOINT_PUBLISH: gl.constexpr, NOINC_PUBLISH: gl.constexpr, SPLIT_RELEASE: gl.constexpr,
                    v_fill, v_head_row, V_TMA: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    n_ctx_full = ctx_len // BLOCK_N
    for j in range(n_ctx_full):  # whole context tiles: no masks
        _load_context_tile(k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, kc_head, vc_head, bt_row, stride_kcb,
                           stride_vcb, ctx_len, j, BLOCK_N, HEAD, STAGES, BLOCK_SIZE, LOAD_WARPS, INTERLEAVED_V,
                           VT_LAYOUT, False, GATHER_TILE_K, GATHER_TILE_V, JOINT_PUBLISH, NOINC_PUBLISH,
                           SPLIT_RELEASE, v_fill, v_head_row, V_TMA)
    for j in range(n_ctx_full, n_ctx):  # the partial last context tile (at most one)
        _load_context_tile(k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, kc_head, vc_head, bt_row, stride_kcb,
                           stride_vcb, ctx_len, j, BLOCK_N, HEAD, STAGES, BLOCK_SIZE, LOAD_WARPS, INTERLEAVED_V,
                           VT_LAYOUT, True, GATHER_TILE_K, GATHER_TILE_V, JOINT_PUBLISH, NOINC_PUBLISH,
                           SPLIT_RELEASE, v_fill, v_head_row, V_TMA)
    for i in range(n_new):  # the new tokens, by TMA
        j = n_ctx + i
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + i * BLOCK_N, kv_col], k_ready.index(s), k_bufs.index(s))
        if NOINC_PUBLISH:  # the expect was one arrival of the load threads' count
            mbarrier.arrive(k_ready.index(s), count=LOAD_WARPS * 32 - 1)
        if SPLIT_RELEASE:
            mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
        if (i + 1) * BLOCK_N <= q_len:
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [kv_row + i * BLOCK_N, kv_col], v_ready.index(s),
                                            v_bufs.index(s))
            if NOINC_PUBLISH:
                mbarrier.arrive(v_ready.index(s), count=LOAD_WARPS * 32 - 1)
        else:  # the tile reaches past the sequence: those V rows must be zeros
            _gather_v_tail(v_bufs.index(s), v_head, stride_vt, kv_row + i * BLOCK_N, q_len - i * BLOCK_N,
                           BLOCK_N, HEAD, LOAD_WARPS)
            if NOINC_PUBLISH:
                async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
            else:
                _publish_cp_async(v_ready.index(s))


# --- consumer partitions ---------------------------------------------------------------------

@gluon.jit
def _issue_qk(q_rows, k_bufs, k_ready, j, STAGES: gl.constexpr, FENCE: gl.constexpr, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr):
    """S of key tile ``j`` (async) once its K has landed."""
    ROWS: gl.constexpr = q_rows.shape[0]
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)  # not read (use_acc=False)
    s = j % STAGES
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    if FENCE:  # filled by cp.async (generic proxy): visible to the wgmma's async proxy
        fence_async_shared()
    return warpgroup_mma(q_rows, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _v_operand(v_bufs, j, STAGES: gl.constexpr, VT: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
               VT_LAYOUT: gl.constexpr):
    """Stage of tile ``j`` as the ``[keys, HEAD]`` B operand: context V lies ``[HEAD, keys]``."""
    buf = v_bufs.index(j % STAGES)
    if VT:
        return buf._reinterpret(v_bufs.dtype, [HEAD, BLOCK_N], VT_LAYOUT).permute((1, 0))
    else:
        return buf


@gluon.jit
def _issue_pv(p, acc, v_bufs, v_ready, j, STAGES: gl.constexpr, VT: gl.constexpr, HEAD: gl.constexpr,
              BLOCK_N: gl.constexpr, VT_LAYOUT: gl.constexpr):
    """O += P V of key tile ``j`` (async) once its V has landed."""
    mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
    # context V and a new-token tail tile's V came by cp.async (generic proxy)
    fence_async_shared()
    return warpgroup_mma(p, _v_operand(v_bufs, j, STAGES, VT, HEAD, BLOCK_N, VT_LAYOUT), acc, is_async=True)


@gluon.jit
def _my_turn(turn_mine, j, PHASE0: gl.constexpr):
    """Ping-pong: wait until the other consumer warpgroup has issued its wgmmas of round ``j``
    (the first warpgroup's first round passes: a fresh barrier's phase "before 0" is done)."""
    mbarrier.wait(turn_mine, (j & 1) ^ PHASE0)


@gluon.jit
def _softmax(qk, m_i, l_i, col0, rows, cap, qk_scale, MASK: gl.constexpr, CTX: gl.constexpr,
             BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Online softmax of one key tile's S (unscaled): the new max and sum, P (fp32) and the
    factor that rescales O. ``MASK``: key ``col0 + c`` is visible to row r when
    ``col0 + c <= cap`` (``CTX``, the partial last context tile: cap is the last context key)
    or ``col0 + c <= rows[r]`` (the new tokens' diagonal: rows are the rows' positions)."""
    if MASK:
        cols = gl.expand_dims(col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        if CTX:
            qk = gl.where(cols <= cap, qk, float("-inf"))
        else:
            qk = gl.where(cols <= gl.expand_dims(rows, 1), qk, float("-inf"))
    # every row sees a key in the first tile it meets, so m_new is finite from then on
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    m_scaled = m_new * qk_scale
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_scaled, 1))
    alpha = gl.exp2(m_i * qk_scale - m_scaled)
    l_i = l_i * alpha + gl.sum(p, 1)
    return m_new, l_i, p, gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _p_operand(p, DTYPE: gl.constexpr, o_layout: gl.constexpr):
    return gl.convert_layout(p.to(DTYPE), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _phase(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, turn, m_i, l_i, acc, base, n_tiles, n_plain,
           rows, cap, qk_scale, DTYPE: gl.constexpr, VT: gl.constexpr, BLOCK_N: gl.constexpr,
           HEAD: gl.constexpr, STAGES: gl.constexpr, PHASE0: gl.constexpr, VT_LAYOUT: gl.constexpr,
           s_layout: gl.constexpr, o_layout: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    """Key tiles ``base .. base + n_tiles`` of one kind (context: ``VT``, or new tokens), the
    first ``n_plain`` unmasked: the first tile's S and softmax alone, then tile j's S in
    flight with tile j-1's P V, then the last P V drained. Stage and phase counters run over
    the whole key sequence (``base``); one ping-pong turn per tile. ``SPLIT_RELEASE``: a
    tile's K is released on ``kv_empty`` once its S is done, its V on ``v_empty`` after P V
    (otherwise ``v_empty`` is ``kv_empty``: both after P V)."""
    FENCE: gl.constexpr = VT
    # tile 0 masked (exact for a whole tile too)
    _my_turn(turn.index(PHASE0 ^ 1), base, PHASE0)
    qk = _issue_qk(q_rows, k_bufs, k_ready, base, STAGES, FENCE, BLOCK_N, s_layout)
    mbarrier.arrive(turn.index(PHASE0), count=1)
    qk, _ = warpgroup_mma_wait(0, deps=(qk, q_rows))
    if SPLIT_RELEASE:  # S done: this consumer is through with the tile's K
        mbarrier.arrive(kv_empty.index(base % STAGES), count=1)
    m_i, l_i, p, alpha = _softmax(qk, m_i, l_i, 0, rows, cap, qk_scale, True, VT, BLOCK_N, s_layout, o_layout)
    acc = acc * alpha
    p = _p_operand(p, DTYPE, o_layout)
    for i in range(1, n_plain):
        m_i, l_i, acc, p = _overlap_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, turn, m_i,
                                         l_i, acc,
                                         p, base, i, rows, cap, qk_scale, DTYPE, False, VT, BLOCK_N, HEAD,
                                         STAGES, PHASE0, VT_LAYOUT, s_layout, o_layout, SPLIT_RELEASE)
    for i in range(gl.maximum(n_plain, 1), n_tiles):
        m_i, l_i, acc, p = _overlap_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, turn, m_i,
                                         l_i, acc,
                                         p, base, i, rows, cap, qk_scale, DTYPE, True, VT, BLOCK_N, HEAD,
                                         STAGES, PHASE0, VT_LAYOUT, s_layout, o_layout, SPLIT_RELEASE)
    last = base + n_tiles - 1
    acc = _issue_pv(p, acc, v_bufs, v_ready, last, STAGES, VT, HEAD, BLOCK_N, VT_LAYOUT)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v_bufs.index(last % STAGES)))
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return m_i, l_i, acc


@gluon.jit
def _overlap_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, turn, m_i, l_i, acc, p, base, i, rows,
                  cap, qk_scale, DTYPE: gl.constexpr, MASK: gl.constexpr, VT: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD: gl.constexpr, STAGES: gl.constexpr, PHASE0: gl.constexpr, VT_LAYOUT: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    """Tile j = base + i: its S and tile j-1's P V in flight together; its softmax runs while
    P V of j-1 is still on the tensor cores (FA3's intra-warpgroup overlap)."""
    j = base + i
    _my_turn(turn.index(PHASE0 ^ 1), j, PHASE0)
    qk = _issue_qk(q_rows, k_bufs, k_ready, j, STAGES, VT, BLOCK_N, s_layout)
    acc = _issue_pv(p, acc, v_bufs, v_ready, j - 1, STAGES, VT, HEAD, BLOCK_N, VT_LAYOUT)
    mbarrier.arrive(turn.index(PHASE0), count=1)
    qk, _ = warpgroup_mma_wait(1, deps=(qk, q_rows))  # groups retire in order: S of j is done
    if SPLIT_RELEASE:  # this consumer is through with tile j's K
        mbarrier.arrive(kv_empty.index(j % STAGES), count=1)
    m_i, l_i, p_next, alpha = _softmax(qk, m_i, l_i, i * BLOCK_N, rows, cap, qk_scale, MASK, VT, BLOCK_N, s_layout,
                                       o_layout)
    p_next = _p_operand(p_next, DTYPE, o_layout)
    # P of j-1 is a register operand of the wgmma in flight: kept alive until it is done
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v_bufs.index((j - 1) % STAGES)))
    mbarrier.arrive(v_empty.index((j - 1) % STAGES), count=1)
    return m_i, l_i, acc * alpha, p_next


@gluon.jit
def _compute_partition(q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, v_empty, turn, out_base, stride_ot,
                       q_tile_row, q_len, ctx_len, n_ctx, n_new, qk_scale,
                       ROWS: gl.constexpr, ROW_OFF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HEAD: gl.constexpr, STAGES: gl.constexpr, VT_LAYOUT: gl.constexpr,
                       s_layout: gl.constexpr, o_layout: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    """Rows ``q_tile_row + ROW_OFF .. + ROWS`` of the row block: the context phase, the
    new-token phase, the normalized output stored (rows past the sequence are not). The two
    consumer partitions take turns issuing their wgmmas (``turn``: the first warpgroup waits
    on barrier 0 and signals barrier 1, the second the other way round)."""
    PHASE0: gl.constexpr = 1 if ROW_OFF == 0 else 0
    DTYPE: gl.constexpr = q_smem.dtype
    q_rows = q_smem.slice(ROW_OFF, ROWS)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD], gl.float32, o_layout)
    # new-token positions of this warpgroup's rows (the causal diagonal's mask)
    rows = q_tile_row + ROW_OFF + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar, 0)
    if n_ctx > 0:
        m_i, l_i, acc = _phase(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, turn, m_i, l_i, acc,
                               0, n_ctx,
                               ctx_len // BLOCK_N, rows, ctx_len - 1, qk_scale, DTYPE, True,
                               BLOCK_N, HEAD, STAGES, PHASE0, VT_LAYOUT, s_layout, o_layout, SPLIT_RELEASE)
    m_i, l_i, acc = _phase(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_empty, turn, m_i, l_i, acc,
                           n_ctx, n_new,
                           q_tile_row // BLOCK_N, rows, 0, qk_scale, DTYPE, False,
                           BLOCK_N, HEAD, STAGES, PHASE0, VT_LAYOUT, s_layout, o_layout, SPLIT_RELEASE)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    r = q_tile_row + ROW_OFF + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims(r.to(gl.int64) * stride_ot, 1) + gl.expand_dims(cols, 0)
    gl.store(out_base + offs, acc.to(out_base.dtype.element_ty), mask=gl.expand_dims(r < q_len, 1))


@gluon.jit
def _v_cache_head(vc_ptr, kv_head, stride_vch, V_TMA: gl.constexpr):
    """The load partition's V cache: this KV head's base, or (``V_TMA``) the cache's TMA
    descriptor, the head being a row coordinate."""
    if V_TMA:
        return vc_ptr
    else:
        return vc_ptr + kv_head * stride_vch


@gluon.jit
def _gluon_prefix_prefill_kernel(
    q_desc, k_desc, v_desc, v_ptr, out_ptr, kc_ptr, vc_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_seqs, stride_vt, stride_ot, stride_oh, stride_kcb, stride_kch, stride_vcb, stride_vch, stride_bt,
    NUM_HEADS: gl.constexpr, GQA: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    INTERLEAVED_V: gl.constexpr,
    SHORT_QUERY_MAX: gl.constexpr, GATHER_TILE_K: gl.constexpr, GATHER_TILE_V: gl.constexpr,
    JOINT_PUBLISH: gl.constexpr, NOINC_PUBLISH: gl.constexpr, SPLIT_RELEASE: gl.constexpr,
    V_TMA: gl.constexpr = False,
):
    """Grid ``((num_tokens // BLOCK_M + num_seqs) * NUM_HEADS,)``: program ``pid`` is query
    head ``pid % NUM_HEADS`` (a KV head's query heads adjacent: they share its K/V tiles in
    L2) of virtual row block ``pid // NUM_HEADS`` (``_find_seq``); each sequence's row blocks
    run last first (a later block sees more keys). Blocks without rows of a prefill sequence
    (padding, an empty, decode or verify sequence, a spare block) return at once.

    Partitions: the default one (``num_warps`` = ``LOAD_WARPS``, 4 by default) loads, with what
    the consumers leave of the register pool (3 x 168 - 2 x ``CONSUMER_REGS`` = 24 at 240: the
    load code is address arithmetic only); two 4-warp consumer partitions compute 64 rows each. Values
    computed before the split stay live in the default partition's registers: with a
    consumer there it spilled at 240."""
    gl.static_assert(BLOCK_M % BLOCK_N == 0, "a row block's diagonal must be whole key tiles")
    gl.static_assert(STAGES >= 2, "tile j's K is loaded while tile j-1's stage is held")
    gl.static_assert(BLOCK_SIZE % 8 == 0, "a V packet (8 keys) lies in one page")
    gl.static_assert(BLOCK_N % BLOCK_SIZE == 0 or BLOCK_SIZE % BLOCK_N == 0, "pages tile the key tiles")
    ROWS: gl.constexpr = BLOCK_M // 2
    gl.static_assert(ROWS == 16 * CONSUMER_WARPS, "16 rows a warp, 4 warps a consumer warpgroup")
    LOAD_WARPS: gl.constexpr = gl.num_warps()  # the default partition loads
    pid = gl.program_id(0)
    head = pid % NUM_HEADS
    vblock = pid // NUM_HEADS
    seq = _find_seq(query_start_loc_ptr, num_seqs, vblock, BLOCK_M)
    q_start = gl.load(query_start_loc_ptr + seq).to(gl.int32)
    q_len = gl.load(query_start_loc_ptr + seq + 1).to(gl.int32) - q_start
    tile = vblock - (q_start // BLOCK_M + seq)
    n_blocks = (q_len + BLOCK_M - 1) // BLOCK_M
    if (tile < 0) | (tile >= n_blocks) | (q_len <= SHORT_QUERY_MAX):
        return
    tile = n_blocks - 1 - tile  # last first
    seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
    ctx_len = seq_len - q_len
    kv_head = head // GQA
    q_tile_row = tile * BLOCK_M
    n_ctx = (ctx_len + BLOCK_N - 1) // BLOCK_N
    # key tiles of the new tokens up to the block's diagonal, none wholly past the sequence
    n_new = gl.minimum(q_tile_row // BLOCK_N + BLOCK_M // BLOCK_N, (q_len + BLOCK_N - 1) // BLOCK_N)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    out_base = out_ptr + (q_start.to(gl.int64) * stride_ot + head * stride_oh)  # the sequence's row 0, this head

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD, 16])
    # V_TMA: a page's V box lands in a column chunk of BLOCK_SIZE keys (2 * BLOCK_SIZE bytes)
    VT_LAYOUT: gl.constexpr = (gl.NVMMASharedLayout(swizzle_byte_width=2 * BLOCK_SIZE, element_bitwidth=16, rank=2)
                               if V_TMA else gl.NVMMASharedLayout.get_default_for([HEAD, BLOCK_N], q_desc.dtype))
    READY_ARRIVALS: gl.constexpr = LOAD_WARPS * 32 if NOINC_PUBLISH else 1
    # two consumer partitions release each stage
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn = allocate_pipeline(q_desc, k_desc, v_desc,
                                                                                         STAGES, 2, READY_ARRIVALS)
    if SPLIT_RELEASE:  # kv_empty releases a stage's K, v_empty its V (one arrival per consumer each)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(v_empty.index(i), count=2)
    else:
        v_empty = kv_empty
    if V_TMA:  # vc_ptr is the V cache's TMA descriptor; the partial last tile lands on v_fill
        v_head_row = kv_head * (stride_vch // BLOCK_SIZE)
        v_fill = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(v_fill, count=1)
    else:  # not used
        v_head_row = kv_head
        v_fill = q_bar

    gl.warp_specialize([
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, v_empty,
                           kc_ptr + kv_head * stride_kch, _v_cache_head(vc_ptr, kv_head, stride_vch, V_TMA),
                           bt_row, stride_kcb,
                           stride_vcb, v_ptr + kv_head * HEAD, stride_vt, q_start + q_tile_row, head * HEAD,
                           q_start, kv_head * HEAD, ctx_len, q_len, n_ctx, n_new,
                           BLOCK_N, HEAD, STAGES, BLOCK_SIZE, LOAD_WARPS, INTERLEAVED_V, VT_LAYOUT, GATHER_TILE_K,
                           GATHER_TILE_V, JOINT_PUBLISH, NOINC_PUBLISH, SPLIT_RELEASE, v_fill, v_head_row, V_TMA)),
        (_compute_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, v_empty, turn, out_base,
                              stride_ot,
                              q_tile_row, q_len, ctx_len, n_ctx, n_new, qk_scale,
                              ROWS, 0, BLOCK_M, BLOCK_N, HEAD, STAGES, VT_LAYOUT, s_layout, o_layout, SPLIT_RELEASE)),
        (_compute_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, v_empty, turn, out_base,
                              stride_ot,
                              q_tile_row, q_len, ctx_len, n_ctx, n_new, qk_scale,
                              ROWS, ROWS, BLOCK_M, BLOCK_N, HEAD, STAGES, VT_LAYOUT, s_layout, o_layout,
                              SPLIT_RELEASE)),
    ], [CONSUMER_WARPS, CONSUMER_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


# --- host side -------------------------------------------------------------------------------

BLOCK_M = 128  # two consumer warpgroups of 64 rows
NUM_WARPS = 4  # the default partition: the load warps


@dataclasses.dataclass(frozen=True)
class GluonPrefillConfig:
    """Launch config. The default is the probe's fastest (``128,3,1,2``: 128-key tiles, three
    stages, intra-warpgroup overlap, ping-pong), with the load partition grown to 4 warps for
    the context gather. Registers: 3 warpgroups x 128 threads x ``maxnreg`` (168) = 64512 of
    65536, shared out by setmaxnreg: each consumer ``consumer_regs``, the load partition
    what they leave (24, FA3's split). Compiled for sm_90: no spills (every dtype, block
    size, V interior and head size the GPU tests run).

    Context-gather variants for a GPU sweep (``SWEEP_VARIANTS``; the defaults are today's code):

    - ``load_warps``: warps of the load partition, 4 or 8 (a multiple of a warpgroup: the
      partitions' setmaxnreg is per warpgroup). 8 warps (512 threads) need ``maxnreg`` <= 128;
      the load partition keeps ``maxnreg + (maxnreg - consumer_regs) * 8 / load_warps``
      registers (rounded down to 8), which must be >= 24: ``consumer_regs=232, maxnreg=128``;
    - ``gather``: ``"chunks"`` (K in chunks of keys of one page, V in chunks of channels, one
      cp.async op each), ``"tile"`` (K and V each one cp.async op for the whole tile, a
      thread per key for K: no thread barrier between the chunks, one block-table read a
      thread and tile for K), ``"tile_k"`` (K so, V in chunks) or ``"pages"`` (K and V each one
      op, a warp on one page: whole 128-byte runs of it, where the others read 32-byte pieces
      of 8 to 16 lines; its K copies cost the same L2 sectors as the others', ncu);
    - ``publish``: ``"separate"`` (K published once its packets are issued, then V: a thread
      barrier each), ``"joint"`` (one thread barrier publishes both after V is issued) or
      ``"noinc"`` (no thread barrier: the ready mbarriers count an arrival per load thread,
      each thread's own once its packets landed, cp.async's non-incrementing arrive, as
      CUTLASS's cp.async pipelines publish; for a tile loaded by TMA the expect is one of the
      arrivals and the issuing thread makes the rest);
    - ``release``: ``"joint"`` (a stage's K and V are released together, once both consumers'
      P V of the tile is done) or ``"split"`` (K once their S is done, V after P V, as
      FlashInfer's FA3 does: the load partition may refill K a softmax earlier);
    - ``v_load``: ``"gather"`` (V by cp.async, as ``gather`` says) or ``"tma"`` (standard V
      interior, cache blocks 16 / 32 / 64: a page's V of one head is one TMA box into a
      ``2 * block_size``-byte-swizzled tile), ``"regs"`` or ``"regs32"`` (interleaved V
      interior, with K through registers: ``_load_vt_regs``, 64 or 32 channels a pass, after
      K is published);
    - ``k_load``: ``"cp_async"`` (K gathered as ``gather`` says), ``"regs"`` or ``"regs32"`` (K
      through registers, ``_load_k_regs``, 64 or 32 keys a pass: whole 128-byte runs of a page
      a warp's loads, conflict-free stores; V issued first, K published after its stores;
      cache blocks that are multiples of 16, ``publish="separate"``, ``release="joint"``)."""

    block_n: int = 128
    stages: int = 3
    consumer_regs: int = 240
    maxnreg: int = 168
    load_warps: int = NUM_WARPS
    gather: str = "chunks"
    publish: str = "separate"
    release: str = "joint"
    v_load: str = "gather"
    k_load: str = "cp_async"

    def __post_init__(self):
        bad = []
        if self.load_warps not in (4, 8):
            bad.append(f"load_warps={self.load_warps} (supported: 4, 8)")
        if self.gather not in ("chunks", "tile", "tile_k", "pages"):
            bad.append(f"gather={self.gather!r} (supported: 'chunks', 'tile', 'tile_k', 'pages')")
        if self.publish not in ("separate", "joint", "noinc"):
            bad.append(f"publish={self.publish!r} (supported: 'separate', 'joint', 'noinc')")
        if self.release not in ("joint", "split"):
            bad.append(f"release={self.release!r} (supported: 'joint', 'split')")
        if self.v_load not in ("gather", "tma", "regs", "regs32"):
            bad.append(f"v_load={self.v_load!r} (supported: 'gather', 'tma', 'regs', 'regs32')")
        elif self.v_load == "tma" and self.publish != "separate":
            bad.append(f"v_load='tma' with publish={self.publish!r} (supported: publish='separate')")
        elif self.v_load in ("regs", "regs32") and self.k_load == "cp_async":
            bad.append(f"v_load={self.v_load!r} with k_load='cp_async' (supported: k_load='regs' or 'regs32')")
        if self.k_load not in ("cp_async", "regs", "regs32"):
            bad.append(f"k_load={self.k_load!r} (supported: 'cp_async', 'regs', 'regs32')")
        elif self.k_load != "cp_async" and (self.publish != "separate" or self.release != "joint"):
            bad.append(f"k_load={self.k_load!r} with publish={self.publish!r}, release={self.release!r} "
                       f"(supported: publish='separate', release='joint')")
        if self.consumer_regs % 8 or not 24 <= self.consumer_regs <= 256:
            bad.append(f"consumer_regs={self.consumer_regs} (a multiple of 8 in 24..256)")
        if not bad:
            warps = self.load_warps + 2 * CONSUMER_WARPS.value
            if warps * 32 * self.maxnreg > 65536:
                bad.append(f"maxnreg={self.maxnreg}: {warps} warps x 32 x {self.maxnreg} registers exceed 65536")
            elif self.load_regs() < 24:
                bad.append(f"consumer_regs={self.consumer_regs} with maxnreg={self.maxnreg} leaves the "
                           f"{self.load_warps} load warps {self.load_regs()} registers (< 24: no setmaxnreg at all)")
        if bad:
            raise ValueError("GluonPrefillConfig: " + "; ".join(bad))

    def load_regs(self) -> int:
        """The load partition's setmaxnreg budget (Triton's rule: what the consumers leave of
        ``maxnreg`` x all warps, per load thread, rounded down to 8)."""
        consumers = 2 * CONSUMER_WARPS.value
        return (self.maxnreg * self.load_warps + (self.maxnreg - self.consumer_regs) * consumers) \
            // self.load_warps // 8 * 8


DEFAULT_CONFIG = GluonPrefillConfig()

# named context-gather variants for the GPU sweep (benchmarks/bench_prefill.py --gluon-cfgs) and
# their correctness test (tests/kernels/test_gluon_prefill.py). The one-op tile gather keeps a
# thread's swizzled shared-memory offsets live: at 24 load registers it spills, so its
# variants give the load partition more (consumer_regs 232: 40 at 4 load warps; 224: 56 at 4,
# 32 at 8); "regs224" is the chunked gather at 224 consumer registers, the control for that
# (232 spills 8 bytes with the chunked gather at fp16, head 128, block 32, interleaved V).
_LOAD8 = dict(load_warps=8, maxnreg=128)
SWEEP_VARIANTS = {
    "default": DEFAULT_CONFIG,
    "regs224": GluonPrefillConfig(consumer_regs=224),
    "joint": GluonPrefillConfig(publish="joint"),
    "load8": GluonPrefillConfig(**_LOAD8, consumer_regs=232),
    "load8_joint": GluonPrefillConfig(**_LOAD8, consumer_regs=232, publish="joint"),
    "tile": GluonPrefillConfig(gather="tile", consumer_regs=232),
    "tile_r224": GluonPrefillConfig(gather="tile", consumer_regs=224),
    "tile_k": GluonPrefillConfig(gather="tile_k", consumer_regs=232),
    "tile_joint": GluonPrefillConfig(gather="tile", consumer_regs=232, publish="joint"),
    "load8_tile": GluonPrefillConfig(**_LOAD8, gather="tile", consumer_regs=224),
    "load8_tile_joint": GluonPrefillConfig(**_LOAD8, gather="tile", consumer_regs=224, publish="joint"),
    "noinc": GluonPrefillConfig(publish="noinc"),
    "tile_noinc": GluonPrefillConfig(gather="tile", consumer_regs=232, publish="noinc"),
    "load8_tile_noinc": GluonPrefillConfig(**_LOAD8, gather="tile", consumer_regs=224, publish="noinc"),
    "split": GluonPrefillConfig(release="split"),
    "load8_split": GluonPrefillConfig(**_LOAD8, consumer_regs=224, release="split"),
    "tile_noinc_split": GluonPrefillConfig(gather="tile", consumer_regs=232, publish="noinc", release="split"),
    "pages": GluonPrefillConfig(gather="pages", consumer_regs=224),
    "pages_noinc": GluonPrefillConfig(gather="pages", consumer_regs=224, publish="noinc"),
    "v_tma": GluonPrefillConfig(v_load="tma"),
    "v_tma_split": GluonPrefillConfig(v_load="tma", release="split"),
    "k_regs": GluonPrefillConfig(k_load="regs32", consumer_regs=224),  # 64 keys a pass spill with V gathered
    "k_regs_v_tma": GluonPrefillConfig(k_load="regs", consumer_regs=224, v_load="tma"),
    # interleaved V: K and V through registers (64-key / 64-channel passes spill 24 bytes at
    # consumer_regs=224: 216 leaves the load partition 72 registers)
    "kv_regs": GluonPrefillConfig(k_load="regs", v_load="regs", consumer_regs=216),
    "kv_regs32": GluonPrefillConfig(k_load="regs32", v_load="regs32", consumer_regs=224),
}


# K through registers (whole 128-byte runs of a page a warp load) and V by TMA (a page's V of
# one head one box), where the cache allows it: measured on an H100 (B=4 x 4096 new tokens +
# 4096-token prefix, block 16) at 499 TFLOP/s against 395-429 for DEFAULT_CONFIG and FA3's 495,
# the context-heavy case (B=32 x 128 + 4096) at 382-384 against 311; the dense phase unchanged.
# DEFAULT_CONFIG (K and V gathered by cp.async) serves the rest (``default_config``).
K_REGS_V_TMA_CONFIG = SWEEP_VARIANTS["k_regs_v_tma"]
# Interleaved V (the layout a fused cache write leaves): K and V both through registers (V's
# lanes on 16 consecutive channels of one 8-key packet, 256 contiguous bytes a half-warp):
# H100 420-424 TFLOP/s on the 4096-prefix case against 357-366 gathered, context-heavy 311-312
# against 255. Triton 3.6 has no TMA box for the interleaved interior (16-byte inner dimension).
KV_REGS_CONFIG = SWEEP_VARIANTS["kv_regs"]


def default_config(vc: torch.Tensor, block_size: int, interleaved_v: bool,
                   index_dtype: torch.dtype = torch.int32) -> GluonPrefillConfig:
    """The config a launch without one runs. Interleaved V at block sizes that are multiples of
    16: ``KV_REGS_CONFIG`` (K and V through registers). Standard V at cache blocks 16 / 32 / 64
    whose V cache fits the descriptor's 32-bit rows: ``K_REGS_V_TMA_CONFIG`` (the kernel addresses
    a page's V of one head as a row of the descriptor, so block and head strides must be whole
    rows: ``v_view``'s are; the 16-byte alignment TMA needs is the eligibility's). Else
    ``DEFAULT_CONFIG`` (both gathered by cp.async). ``index_dtype`` does not change the choice:
    TMA rows are narrowed to 32 bits, which the row bound guarantees."""
    del index_dtype  # both index dtypes run every config (GPU matrix: int64 rows of each)
    if interleaved_v:
        return KV_REGS_CONFIG if block_size % 16 == 0 else DEFAULT_CONFIG
    if (block_size not in (16, 32, 64) or vc.stride(0) % block_size or vc.stride(1) % block_size
            or _v_cache_rows(vc, block_size) >= _ROW_PAST_DESCRIPTOR.value):
        return DEFAULT_CONFIG
    return K_REGS_V_TMA_CONFIG


@functools.cache
def _smem_layout(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _constexprs(num_heads: int, gqa: int, head_size: int, block_size: int, interleaved_v: bool,
                short_query_max: int, cfg: GluonPrefillConfig) -> dict:
    return dict(NUM_HEADS=num_heads, GQA=gqa, HEAD=head_size, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
                BLOCK_N=cfg.block_n, STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs,
                INTERLEAVED_V=bool(interleaved_v),
                SHORT_QUERY_MAX=max(int(short_query_max), 1),
                **_variant_constexprs(cfg))


def _variant_constexprs(cfg: GluonPrefillConfig) -> dict:
    """The variant's constexprs (gather, publication, release; ``tests/gluon_sm90_sass.py``
    leaves them out of a specialization's name at the default's values). ``GATHER_TILE_K``: 0
    chunks, 1 one op a tile, 2 page-major lanes, 3 / 4 through registers, 64 / 32 keys a pass;
    ``GATHER_TILE_V`` the same for V (3 / 4: 64 / 32 channels a pass)."""
    pages = cfg.gather == "pages"  # 2: the tile gathers with page-major lanes
    k_tile = {"regs": 3, "regs32": 4}.get(cfg.k_load) or (2 if pages else cfg.gather in ("tile", "tile_k"))
    v_tile = {"regs": 3, "regs32": 4}.get(cfg.v_load) or (2 if pages else cfg.gather == "tile")
    return dict(GATHER_TILE_K=k_tile,
                GATHER_TILE_V=v_tile,
                JOINT_PUBLISH=cfg.publish == "joint", NOINC_PUBLISH=cfg.publish == "noinc",
                SPLIT_RELEASE=cfg.release == "split", V_TMA=cfg.v_load == "tma")


def _options(cfg: GluonPrefillConfig) -> dict:
    return dict(num_warps=cfg.load_warps, maxnreg=cfg.maxnreg)


def _check_variant(cfg: GluonPrefillConfig, head_size: int, block_size: int, interleaved_v: bool = False) -> None:
    """A variant's limits that depend on the launch (the default has none)."""
    if cfg.v_load == "tma" and (interleaved_v or block_size not in (16, 32, 64)):
        raise ValueError(f"Gluon prefill: v_load='tma' with {'interleaved' if interleaved_v else 'standard'} V at "
                         f"block size {block_size}; supported: standard V at block sizes 16, 32, 64")
    if cfg.v_load in ("regs", "regs32") and not interleaved_v:
        raise ValueError(f"Gluon prefill: v_load={cfg.v_load!r} with standard V; supported: interleaved V")
    if cfg.k_load != "cp_async" and block_size % 16:
        raise ValueError(f"Gluon prefill: k_load={cfg.k_load!r} at block size {block_size}; supported: multiples of 16")
    chunk = 32 // (head_size // 8) * cfg.load_warps  # _gather_k's keys a chunk
    if cfg.k_load == "cp_async" and cfg.gather == "chunks" and block_size % chunk:
        raise ValueError(f"Gluon prefill: load_warps={cfg.load_warps} with gather='chunks' gathers K in chunks of "
                         f"{chunk} keys at head size {head_size}, more than a block of {block_size}; "
                         f"supported: gather='tile' or 'tile_k', or block sizes that are multiples of {chunk}")


def _v_cache_rows(vc: torch.Tensor, block_size: int) -> int:
    """The V cache's extent (elements from its first to past its last) in rows of ``block_size``."""
    return (1 + sum((n - 1) * st for n, st in zip(vc.shape, vc.stride()))) // block_size


def _v_cache_descriptor(vc: torch.Tensor, head_size: int, block_size: int) -> TensorDescriptor:
    """``v_load="tma"``: the V cache (``[blocks, kv_heads, head_size, block_size]``, the standard
    interior, any block and head strides) as rows of ``block_size`` keys, a box of ``head_size``
    rows: a page's V of one head. Rows past it are read as zeros (pages past the context)."""
    rows = _v_cache_rows(vc, block_size)
    if rows >= _ROW_PAST_DESCRIPTOR.value:
        raise ValueError(f"Gluon prefill: v_load='tma' addresses the V cache in 32-bit rows: {rows} rows of "
                         f"{block_size} keys is too many (supported: < {_ROW_PAST_DESCRIPTOR.value})")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=2 * block_size, element_bitwidth=16, rank=2)
    return TensorDescriptor(vc, [rows, block_size], [block_size, 1], [head_size, block_size], layout)


def launch(output, query, key, value, kc, vc, block_table, seq_lens, query_start_loc, scale: float,
           interleaved_v: bool, short_query_max: int, cfg: GluonPrefillConfig | None = None) -> None:
    """The prefill of every sequence with query_len > ``short_query_max`` (and > 1): the same
    programs and results as the Triton ``_prefix_prefill_kernel`` launch of ``paged_attention``
    for a launch ``eligibility.prefill_kernel_for`` finds eligible. kc/vc: ``layout.k_view`` /
    ``layout.v_view`` of the cache; ``cfg``: the kernel variant (None: ``default_config``)."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    num_seqs = seq_lens.shape[0]
    block_size = kc.shape[3]
    dtype = query.dtype
    if cfg is None:
        cfg = default_config(vc, block_size, interleaved_v, block_table.dtype)
    elif cfg is not DEFAULT_CONFIG:
        _check_variant(cfg, head_size, block_size, interleaved_v)
    q_layout = _smem_layout((BLOCK_M, head_size), dtype)
    kv_layout = _smem_layout((cfg.block_n, head_size), dtype)
    q_desc = TensorDescriptor(query, [num_tokens, num_heads * head_size], [query.stride(0), 1],
                              [BLOCK_M, head_size], q_layout)
    k_desc = TensorDescriptor(key, [key.shape[0], num_kv_heads * head_size], [key.stride(0), 1],
                              [cfg.block_n, head_size], kv_layout)
    v_desc = TensorDescriptor(value, [value.shape[0], num_kv_heads * head_size], [value.stride(0), 1],
                              [cfg.block_n, head_size], kv_layout)
    grid = ((num_tokens // BLOCK_M + num_seqs) * num_heads,)
    # v_load="tma": the kernel's V-cache argument is the cache's TMA descriptor
    vc_arg = _v_cache_descriptor(vc, head_size, block_size) if cfg.v_load == "tma" else vc
    _gluon_prefix_prefill_kernel[grid](
        q_desc, k_desc, v_desc, value, output, kc, vc_arg, block_table, seq_lens, query_start_loc,
        float(scale) * _LOG2E, num_seqs, value.stride(0), output.stride(0), output.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), block_table.stride(0),
        **_constexprs(num_heads, num_heads // num_kv_heads, head_size, block_size, interleaved_v, short_query_max,
                      cfg),
        **_options(cfg))
