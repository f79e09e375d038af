"""Probe: does explicit (FA3-style) warp specialization, written in Gluon, speed up causal prefill?

Triton's automatic warp specialization failed on the prefill kernel
(``probe_prefill_warp_specialize.py``); this probe writes the producer/consumer split by
hand in Gluon (``triton.experimental.gluon``, Triton 3.6) for dense causal attention over
the new tokens, the prefill benchmark's no-prefix case (B sequences of L new tokens packed
as q [B*L, Hq, D], k/v [B*L, Hkv, D], causal, 32/8 heads, d=128, bf16):

- a load partition (1 warp, 24 registers) brings the row block's Q tile and then every K
  and V tile of its causal range through TMA into a ring of ``STAGES`` shared-memory buffers;
  K and V of a stage each have a ready mbarrier (the TMA's byte count), the stage one empty
  mbarrier (one arrival per consumer partition);
- two consumer warpgroups compute the 128-row block, 64 rows each (``BLOCK_M = 128``, an
  NVMMA v3 layout over 4 warps a warpgroup): S = Q K^T by async wgmma from shared memory, the
  online softmax in fp32 with exp2 (scale folded into one FMA), P in bf16 as the register
  operand of O += P V, the second wgmma. The key loop is split: tiles left of the diagonal
  run unmasked, only the diagonal tiles mask. A stage is released once the wgmmas that read
  it are done. ``SPLIT=0``: both warpgroups are the 8-warp default partition, whose
  mbarrier arrive is one thread's, so a thread barrier of both warpgroups precedes each
  release; ``SPLIT=1``: each warpgroup is its own 4-warp partition (240 registers each) and
  releases the stages on its own; ``SPLIT=2``: as 1, and the two take turns issuing their
  wgmmas (two mbarriers), so one's softmax runs under the other's matrix products (FA3's
  warpgroup ping-pong).
  ``PIPE=1`` is FA3's intra-warpgroup overlap: tile j's S and tile j-1's P V are issued
  together, tile j's softmax runs while P V of j-1 is on the tensor cores (needs 2+ stages:
  tile j's K lands while tile j-1's stage is still held).
- Row blocks run longest first (grid axis 1 counts the diagonal down), the 4 query heads of
  a KV head next to each other (grid axis 0) so their K/V tiles share L2.

The shared memory and its mbarriers are the library kernel's (``allocate_pipeline`` of
``inductor_rocm_attn/kernels/gluon/prefix_prefill.py``, imported from this checkout).

A config is ``BLOCK_N,STAGES,PIPE,SPLIT``. A length that is not a multiple of BLOCK_M works:
TMA zero-fills past the packed tensor, keys of the next sequence are masked by causality for
every valid row, rows past the sequence are not stored.

``--compile-only`` compiles each config for sm_90 on a machine without a GPU and prints its
registers, spills (stack), shared memory and the partitions' setmaxnreg budgets. On a GPU
each config runs in a subprocess (``--one``; a fault or a hang loses only that row): output
NaN-poisoned, checked against a float64 reference (B=2 x 512, B=2 x 300) and an fp32 SDPA
reference (the timed case) on fresh inputs, max abs error at most 2e-2 (or within 1.25x
SDPA-bf16's own error on the same inputs); then timed with CUDA-graph replay next to SDPA
and the project's ``paged_attention`` on the same data. TFLOP/s count 4 * B * Hq * D * L^2 / 2.
Writes ``probe_prefill_gluon_<stamp>.json``:

    python benchmarks/probe_prefill_gluon.py --compile-only     # no GPU needed
    python benchmarks/probe_prefill_gluon.py                     # Hopper: checks, timings
    STAGES=probe_gluon bash benchmarks/device_run.sh              # the same in one device call
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from inductor_rocm_attn.kernels.gluon.prefix_prefill import allocate_pipeline  # noqa: E402

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
BLOCK_M, NUM_WARPS = 128, 8
LOAD_REGS = gl.constexpr(24)  # the load partition only issues TMA copies
CONSUMER_REGS = gl.constexpr(240)  # the second consumer warpgroup's partition (SPLIT=1)
# 12 warps (two consumer warpgroups, the load warp padded to a warpgroup) x 32 x 168 = 64512
# registers: the default partition gets what the others leave, 240 a thread
MAX_REGS = 168
DEFAULT_CFGS = ["128,2,0,0", "128,2,1,0", "128,2,0,1", "128,2,1,1", "128,2,1,2", "128,3,1,2", "64,3,1,1"]
TOL = 2e-2


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                    q_row, q_col, kv_row, kv_col, n_tiles,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    for j in range(n_tiles):
        s = j % STAGES
        # a fresh mbarrier reads as if its phase before 0 completed: the first round passes
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], k_ready.index(s), k_bufs.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _issue_qk(q_rows, k_bufs, k_ready, j, STAGES: gl.constexpr, s_zero):
    """S of key tile ``j`` (async) once its K has landed."""
    s = j % STAGES
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    return warpgroup_mma(q_rows, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, acc, v_bufs, v_ready, j, STAGES: gl.constexpr):
    """O += P V of key tile ``j`` (async) once its V has landed."""
    s = j % STAGES
    mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
    return warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)


@gluon.jit
def _release(kv_empty, j, STAGES: gl.constexpr, SYNC: gl.constexpr):
    """Hand key tile ``j``'s stage back to the load partition. mbarrier.arrive is one thread's
    of the partition: with two warpgroups in it (``SYNC``) both must be past their wgmma wait."""
    if SYNC:
        gl.thread_barrier()
    mbarrier.arrive(kv_empty.index(j % STAGES), count=1)


@gluon.jit
def _my_turn(turn_mine, j, PING: gl.constexpr, PHASE0: gl.constexpr):
    """Ping-pong: wait until the other consumer warpgroup has issued its wgmmas of round ``j``
    (the first warpgroup's first round passes: a fresh barrier's phase "before 0" is done)."""
    if PING:
        mbarrier.wait(turn_mine, (j & 1) ^ PHASE0)


@gluon.jit
def _pass_turn(turn_other, PING: gl.constexpr):
    if PING:
        mbarrier.arrive(turn_other, count=1)


@gluon.jit
def _softmax(qk, m_i, l_i, j, row0, qk_scale, MASK: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Online softmax of key tile ``j``'s S (unscaled): the new max and sum, P as the bf16
    register operand of the P V wgmma, and the factor that rescales O."""
    if MASK:  # a diagonal tile: key j*BLOCK_N + c is visible to row row0 + r when it is not later
        rows = row0 + gl.arange(0, qk.shape[0], layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        qk = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), qk, float("-inf"))
    # every row sees key 0 in the first tile, so m_new is finite from then on
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    m_scaled = m_new * qk_scale
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_scaled, 1))
    alpha = gl.exp2(m_i * qk_scale - m_scaled)
    l_i = l_i * alpha + gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return m_new, l_i, p_op, gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _serial_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, m_i, l_i, acc, j, row0, qk_scale,
                 s_zero, MASK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SYNC: gl.constexpr,
                 PING: gl.constexpr, PHASE0: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    _my_turn(turn.index(PHASE0 ^ 1), j, PING, PHASE0)
    qk = _issue_qk(q_rows, k_bufs, k_ready, j, STAGES, s_zero)
    _pass_turn(turn.index(PHASE0), PING)
    qk, _ = warpgroup_mma_wait(0, deps=(qk, q_rows))
    m_i, l_i, p, alpha = _softmax(qk, m_i, l_i, j, row0, qk_scale, MASK, BLOCK_N, s_layout, o_layout)
    acc = _issue_pv(p, acc * alpha, v_bufs, v_ready, j, STAGES)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v_bufs.index(j % STAGES)))
    _release(kv_empty, j, STAGES, SYNC)
    return m_i, l_i, acc


@gluon.jit
def _overlap_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, m_i, l_i, acc, p, j, row0, qk_scale,
                  s_zero, MASK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SYNC: gl.constexpr,
                  PING: gl.constexpr, PHASE0: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Tile ``j``'s S and tile j-1's P V in flight together; tile j's softmax runs while P V
    of j-1 is still on the tensor cores (FA3's intra-warpgroup overlap)."""
    _my_turn(turn.index(PHASE0 ^ 1), j, PING, PHASE0)
    qk = _issue_qk(q_rows, k_bufs, k_ready, j, STAGES, s_zero)
    acc = _issue_pv(p, acc, v_bufs, v_ready, j - 1, STAGES)
    _pass_turn(turn.index(PHASE0), PING)
    qk, _ = warpgroup_mma_wait(1, deps=(qk, q_rows))  # groups retire in order: S of j is done
    m_i, l_i, p_next, alpha = _softmax(qk, m_i, l_i, j, row0, qk_scale, MASK, BLOCK_N, s_layout, o_layout)
    # P of j-1 is a register operand of the wgmma in flight: kept alive until it is done
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v_bufs.index((j - 1) % STAGES)))
    _release(kv_empty, j - 1, STAGES, SYNC)
    return m_i, l_i, acc * alpha, p_next


@gluon.jit
def _compute_partition(q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, stride_ot,
                       row0, q_len, out_row, out_col, n_full, n_tiles, qk_scale,
                       ROWS: gl.constexpr, ROW_OFF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr,
                       STAGES: gl.constexpr, PIPE: gl.constexpr, SYNC: gl.constexpr, PING: gl.constexpr,
                       s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Rows ``row0 + ROW_OFF`` .. ``+ ROWS`` of the row block: every key tile's S, softmax and
    P V, then the normalized output stored (rows past the sequence are not). ``PING``: the
    two consumer partitions take turns issuing their wgmmas (``turn``: the first warpgroup
    waits on barrier 0 and signals barrier 1, the second the other way round)."""
    PHASE0: gl.constexpr = 1 if ROW_OFF == 0 else 0
    row0 = row0 + ROW_OFF
    q_rows = q_smem.slice(ROW_OFF, ROWS)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    if PIPE:
        # tile 0's softmax alone (masked: exact for a full tile too), then one tile behind
        _my_turn(turn.index(PHASE0 ^ 1), 0, PING, PHASE0)
        qk = _issue_qk(q_rows, k_bufs, k_ready, 0, STAGES, s_zero)
        _pass_turn(turn.index(PHASE0), PING)
        qk, _ = warpgroup_mma_wait(0, deps=(qk, q_rows))
        m_i, l_i, p, alpha = _softmax(qk, m_i, l_i, 0, row0, qk_scale, True, BLOCK_N, s_layout, o_layout)
        for j in range(1, n_full):
            m_i, l_i, acc, p = _overlap_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, m_i, l_i,
                                             acc, p, j, row0, qk_scale, s_zero, False, BLOCK_N, STAGES, SYNC,
                                             PING, PHASE0, s_layout, o_layout)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            m_i, l_i, acc, p = _overlap_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, m_i, l_i,
                                             acc, p, j, row0, qk_scale, s_zero, True, BLOCK_N, STAGES, SYNC,
                                             PING, PHASE0, s_layout, o_layout)
        acc = _issue_pv(p, acc, v_bufs, v_ready, n_tiles - 1, STAGES)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v_bufs.index((n_tiles - 1) % STAGES)))
        _release(kv_empty, n_tiles - 1, STAGES, SYNC)
    else:
        for j in range(0, n_full):
            m_i, l_i, acc = _serial_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, m_i, l_i, acc, j,
                                         row0, qk_scale, s_zero, False, BLOCK_N, STAGES, SYNC, PING, PHASE0,
                                         s_layout, o_layout)
        for j in range(n_full, n_tiles):
            m_i, l_i, acc = _serial_step(q_rows, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, m_i, l_i, acc, j,
                                         row0, qk_scale, s_zero, True, BLOCK_N, STAGES, SYNC, PING, PHASE0,
                                         s_layout, o_layout)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims((out_row + rows).to(gl.int64) * stride_ot, 1) + gl.expand_dims(out_col + cols, 0)
    gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def _causal_gluon_kernel(q_desc, k_desc, v_desc, out_ptr, stride_ot, seq_len, qk_scale,
                         NUM_HEADS: gl.constexpr, GQA: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr, SPLIT: gl.constexpr,
                         PING: gl.constexpr):
    """``SPLIT=0``: one default partition of 8 warps (two warpgroups, 64 rows each) computes
    all 128 rows; ``SPLIT=1``: the default partition (4 warps) and a 4-warp worker partition
    compute 64 rows each and release the K/V stages independently (no cross-warpgroup sync);
    ``PING`` (with ``SPLIT``): they issue their wgmmas in turn, each one's softmax under the
    other's matrix products (FA3's warpgroup ping-pong)."""
    gl.static_assert(PING <= SPLIT, "ping-pong needs the two consumer partitions (SPLIT)")
    gl.static_assert(STAGES >= 1 + PIPE, "PIPE reads tile j's K while tile j-1's stage is held")
    gl.static_assert(BLOCK_M % BLOCK_N == 0, "a row block's diagonal must be whole key tiles")
    ROWS: gl.constexpr = BLOCK_M // (SPLIT + 1)
    gl.static_assert(ROWS == 16 * gl.num_warps(), "16 rows a warp, 4 warps a warpgroup")
    # axis 0: (sequence, head), the GQA heads of one KV head adjacent; axis 1: the row block,
    # the diagonal first (longest first)
    pid = gl.program_id(0)
    head = pid % NUM_HEADS
    seq = pid // NUM_HEADS
    tile = gl.num_programs(1) - 1 - gl.program_id(1)
    row0 = tile * BLOCK_M
    n_full = row0 // BLOCK_N
    n_tiles = n_full + BLOCK_M // BLOCK_N
    seq_start = seq * seq_len

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, HEAD, 16])
    # the library kernel's shared memory and mbarriers; a stage is released by each consumer
    # partition (SPLIT + 1 of them)
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn = allocate_pipeline(q_desc, k_desc, v_desc,
                                                                                         STAGES, SPLIT + 1)

    load_args = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                 seq_start + row0, head * HEAD, seq_start, (head // GQA) * HEAD, n_tiles, BLOCK_N, STAGES)
    if SPLIT:
        gl.warp_specialize([
            (_compute_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, stride_ot,
                                  row0, seq_len, seq_start, head * HEAD, n_full, n_tiles, qk_scale,
                                  ROWS, 0, BLOCK_N, HEAD, STAGES, PIPE, False, PING, s_layout, o_layout)),
            (_load_partition, load_args),
            (_compute_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, stride_ot,
                                  row0, seq_len, seq_start, head * HEAD, n_full, n_tiles, qk_scale,
                                  ROWS, ROWS, BLOCK_N, HEAD, STAGES, PIPE, False, PING, s_layout, o_layout)),
        ], [1, gl.num_warps()], [LOAD_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_compute_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, stride_ot,
                                  row0, seq_len, seq_start, head * HEAD, n_full, n_tiles, qk_scale,
                                  ROWS, 0, BLOCK_N, HEAD, STAGES, PIPE, True, False, s_layout, o_layout)),
            (_load_partition, load_args),
        ], [1], [LOAD_REGS])


def parse_cfg(text: str) -> tuple[int, int, int, int]:
    """``BLOCK_N,STAGES,PIPE,SPLIT`` checked: BLOCK_N a power of two in 16..BLOCK_M, 1..4
    stages, PIPE 0/1, SPLIT 0 (one 8-warp consumer partition), 1 (two 4-warp ones) or 2 (two,
    in ping-pong)."""
    try:
        bn, stages, pipe, split = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"probe_prefill_gluon: config {text!r} is not BLOCK_N,STAGES,PIPE,SPLIT (four ints)")
    if bn not in (16, 32, 64, 128) or not 1 <= stages <= 4 or pipe not in (0, 1) or split not in (0, 1, 2):
        raise SystemExit(f"probe_prefill_gluon: config {text!r} unsupported: BLOCK_N in 16/32/64/128 "
                         f"(a divisor of BLOCK_M={BLOCK_M}), STAGES in 1..4, PIPE 0 or 1, SPLIT 0, 1 or 2")
    if pipe and stages < 2:
        raise SystemExit(f"probe_prefill_gluon: config {text!r} unsupported: PIPE=1 needs STAGES >= 2 (tile j's K "
                         f"is loaded while tile j-1's V is still being read)")
    return bn, stages, pipe, split


def _smem_layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def _constexprs(bn: int, stages: int, pipe: int, split: int) -> dict:
    return dict(NUM_HEADS=HQ, GQA=HQ // HKV, HEAD=D, BLOCK_M=BLOCK_M, BLOCK_N=bn, STAGES=stages, PIPE=pipe,
                SPLIT=min(split, 1), PING=split == 2)


def _options(split: int) -> dict:
    """Launch options: the default partition's warps (all 128 rows, or the first consumer
    warpgroup's 64) and the register cap the partitions' setmaxnreg budgets start from."""
    return dict(num_warps=NUM_WARPS if split == 0 else NUM_WARPS // 2, maxnreg=MAX_REGS)


def compile_sm90(bn: int, stages: int, pipe: int, split: int) -> dict:
    """Compile the kernel for sm_90 without a GPU: registers, stack (spills) and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _causal_gluon_kernel

    def desc(rows):
        return f"tensordesc<bf16[{rows},{D}],{_smem_layout([rows, D])!r}>"

    sig = dict(q_desc=desc(BLOCK_M), k_desc=desc(bn), v_desc=desc(bn), out_ptr="*bf16", stride_ot="i32",
               seq_len="i32", qk_scale="fp32")
    consts = _constexprs(bn, stages, pipe, split)
    sig.update({k: "constexpr" for k in consts})
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("out_ptr", "stride_ot")}
    kernel = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=_options(split))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = usage[usage.index(f"Function {fn.__name__}:"):].splitlines()[1]
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
    return dict(regs=field["REG"], stack=field["STACK"] + field["LOCAL"], smem=kernel.metadata.shared + field["SHARED"],
                setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                                 kernel.asm["ptx"]))))


def launcher(q, k, v, out, seq_len: int, bn: int, stages: int, pipe: int, split: int):
    """A no-argument call of the kernel over packed q [B*L, HQ, D], k/v [B*L, HKV, D]."""
    t = q.shape[0]
    if t % seq_len:
        raise SystemExit(f"probe_prefill_gluon: {t} tokens are not sequences of {seq_len}")
    qd = TensorDescriptor.from_tensor(q.view(t, HQ * D), [BLOCK_M, D], _smem_layout([BLOCK_M, D]))
    kd = TensorDescriptor.from_tensor(k.view(t, HKV * D), [bn, D], _smem_layout([bn, D]))
    vd = TensorDescriptor.from_tensor(v.view(t, HKV * D), [bn, D], _smem_layout([bn, D]))
    grid = (t // seq_len * HQ, triton.cdiv(seq_len, BLOCK_M))
    scale = D ** -0.5 * 1.4426950408889634
    consts, options = _constexprs(bn, stages, pipe, split), _options(split)

    def call():
        _causal_gluon_kernel[grid](qd, kd, vd, out, out.stride(0), seq_len, scale, **consts, **options)
    return call


def inputs(b: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b * n, HQ, D, generator=g, device="cuda", dtype=DTYPE)
    k = torch.randn(b * n, HKV, D, generator=g, device="cuda", dtype=DTYPE)
    v = torch.randn(b * n, HKV, D, generator=g, device="cuda", dtype=DTYPE)
    return q, k, v


def heads_first(x, b, n):
    """[B*L, H, D] -> [B, HQ, L, D], KV heads repeated for GQA."""
    x = x.view(b, n, x.shape[1], D).transpose(1, 2)
    return x.repeat_interleave(HQ // x.shape[1], 1) if x.shape[1] != HQ else x


def reference(q, k, v, b, n, dtype):
    """Causal attention in ``dtype`` (float64: explicit softmax; float32: SDPA), as [B*L, HQ, D]."""
    qs, ks, vs = (heads_first(x, b, n).to(dtype) for x in (q, k, v))
    if dtype == torch.float64:
        s = qs @ ks.transpose(-1, -2) * D ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        o = torch.softmax(s, -1) @ vs
    else:
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    return o.transpose(1, 2).reshape(b * n, HQ, D)


def sdpa_call(q, k, v, out, b, n):
    qs, ks, vs = heads_first(q, b, n), heads_first(k, b, n), heads_first(v, b, n)
    return lambda: out.copy_(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                             .transpose(1, 2).reshape(b * n, HQ, D))


def paged_call(q, k, v, out, b, n):
    """The project's prefill on the same new tokens (no cached prefix: an empty cache)."""
    from inductor_rocm_attn.kernels.triton import paged_attention
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

    bs = 16
    cache = allocate_kv_cache(KVCacheSpec(bs, HKV, D, DTYPE, CacheLayout.LHBNC), 8, "cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * n
    seq_lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    table = torch.zeros(b, triton.cdiv(n, bs), dtype=torch.int32, device="cuda")
    one = torch.ones(1, device="cuda")
    return lambda: paged_attention(out, q, k, v, cache, qsl, seq_lens, table, D ** -0.5, one, one, True, -1, None,
                                   None, 0.0, False, None, max_query_len=n, max_seq_len=n)


def checked_error(name: str, make_call, b: int, n: int, seed: int, ref_dtype) -> dict:
    """Run ``make_call(q, k, v, out)`` on fresh inputs into a NaN-poisoned output; the max abs
    error against the reference, next to SDPA's (bf16) on the same inputs."""
    q, k, v = inputs(b, n, seed)
    out = torch.full_like(q, float("nan"))
    make_call(q, k, v, out)()
    torch.cuda.synchronize()
    ref = reference(q, k, v, b, n, ref_dtype)
    err = (out.double() - ref.double()).abs().max().item()  # NaN left anywhere: err is NaN
    sdpa_out = torch.empty_like(q)
    sdpa_call(q, k, v, sdpa_out, b, n)()
    sdpa_err = (sdpa_out.double() - ref.double()).abs().max().item()
    # bf16 output rounding alone is up to 0.016 where |out| >= 4 (a first row is one V row):
    # within SDPA's own error on the same inputs passes too. False for NaN.
    ok = err <= TOL or err <= 1.25 * sdpa_err
    print(f"  check {name} B={b} L={n}: max abs err {err:.3e} (sdpa bf16 {sdpa_err:.3e}) "
          f"{'ok' if ok else f'FAIL: above {TOL} and 1.25x sdpa'}", flush=True)
    return dict(case=f"B={b} L={n}", max_abs_err=err, sdpa_max_abs_err=sdpa_err, ok=ok)


def timed(call, flops: float) -> dict:
    from common import graph_time_us

    us = graph_time_us(call, warmup_calls=1, warmup_ms=50, rep_ms=300)
    return dict(us=us, tflops=flops / (us * 1e-6) / 1e12)


def run_one(cfg: str, b: int, n: int) -> dict:
    """Check one config on the small cases and the timed case, then time it (a wrong result
    is timed too, its row marked: whether a fix is worth it shows in the time)."""
    bn, stages, pipe, split = parse_cfg(cfg)
    row = dict(name=f"gluon {cfg}", block_n=bn, stages=stages, pipe=pipe, split=split)

    def check(nseq, length, seed, ref_dtype):
        return checked_error(cfg, lambda q, k, v, o: launcher(q, k, v, o, length, bn, stages, pipe, split),
                             nseq, length, seed, ref_dtype)

    row["checks"] = [check(2, 512, 1, torch.float64), check(2, 300, 2, torch.float64), check(b, n, 3, torch.float32)]
    wrong = [c for c in row["checks"] if not c["ok"]]
    if wrong:
        row["error"] = "wrong result: " + ", ".join(f"{c['case']} err {c['max_abs_err']:.3e}" for c in wrong)
    q, k, v = inputs(b, n, 5)
    out = torch.empty_like(q)
    row.update(timed(launcher(q, k, v, out, n, bn, stages, pipe, split), 4 * b * HQ * D * n * n / 2))
    return row


def echo_checks(stdout) -> None:
    """Print a config subprocess's check lines (``stdout``: its captured output, if any)."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    sys.stdout.write("".join(ln + "\n" for ln in (stdout or "").splitlines() if ln.startswith("  check")))
    sys.stdout.flush()


def drive(args) -> int:
    """Peers in this process, each config in a subprocess (``--one``), one table, one JSON."""
    from common import stamp, write_json

    b, n = args.batch, args.new
    flops = 4 * b * HQ * D * n * n / 2
    rows = []

    def show(row):
        if "us" in row:
            err = max((c["max_abs_err"] for c in row.get("checks", [])), default=float("nan"))
            bad = f"  {row['error']}" if "error" in row else ""
            print(f"{row['name']:>28}: {row['us']:8.1f} us {row['tflops']:5.0f} TFLOP/s  max err {err:.2e}{bad}",
                  flush=True)
        else:
            print(f"{row['name']:>28}: failed: {row.get('error')}", flush=True)

    for cfg in args.cfgs:  # a typo stops the run before any GPU time is spent
        parse_cfg(cfg)
    if not args.no_peers:
        for name, make in (("sdpa", sdpa_call), ("paged_attention (default)", paged_call)):
            q, k, v = inputs(b, n, 5)
            out = torch.full_like(q, float("nan"))
            try:
                call = make(q, k, v, out, b, n)
                call()
                torch.cuda.synchronize()
                err = (out.double() - reference(q, k, v, b, n, torch.float32).double()).abs().max().item()
                row = dict(name=name, checks=[dict(case=f"B={b} L={n}", max_abs_err=err, ok=err <= TOL)],
                           **timed(call, flops))
            except Exception as e:  # noqa: BLE001 - reported in the table
                row = dict(name=name, error=str(e).strip().splitlines()[-1][:300])
            rows.append(row)
            show(row)
    for cfg in args.cfgs:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", cfg, "--batch", str(b), "--new", str(n)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            echo_checks(p.stdout)
            if got:
                row = json.loads(got[-1][len("RESULT "):])
            else:
                tail = (p.stderr.strip() or p.stdout.strip()).splitlines()
                row = dict(name=f"gluon {cfg}", error=f"exit {p.returncode}: " + (tail[-1][:300] if tail else ""))
                print(p.stderr[-3000:], file=sys.stderr)
        except subprocess.TimeoutExpired as e:
            echo_checks(e.stdout)  # the checks that finished before the hang
            row = dict(name=f"gluon {cfg}", error=f"timed out after {args.timeout} s (a hang: barrier phases?)")
        rows.append(row)
        show(row)
    path = os.path.join(args.out, f"probe_prefill_gluon_{stamp()}.json")
    write_json(path, dict(case=dict(batch=b, new=n, q_heads=HQ, kv_heads=HKV, head_size=D, causal=True,
                                    block_m=BLOCK_M, num_warps=NUM_WARPS, maxnreg=MAX_REGS), rows=rows))
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


def root_cause(e: BaseException) -> str:
    """The innermost cause of a (nested) compilation error, one line."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip() and ln.strip() != "^"]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


@gluon.jit
def _trivial_kernel(x_ptr):
    gl.store(x_ptr + gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0])), 1.0)


def toolchain_problem() -> str | None:
    """None when a trivial Gluon kernel compiles for sm_90 here, else why not (ptxas missing...)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    try:
        triton.compile(GluonASTSource(_trivial_kernel, {"x_ptr": "*fp32"}), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=1))
    except Exception as e:  # noqa: BLE001 - the toolchain, not the probe's kernel
        return root_cause(e)
    return None


def compile_only(cfgs) -> int:
    """One line per config: registers, stack, shared memory, the partitions' setmaxnreg
    budgets. Exit 1 when one fails, spills or needs more shared memory than sm_90 has;
    3 when this machine cannot compile Gluon for sm_90 at all."""
    parsed = [parse_cfg(cfg) for cfg in cfgs]
    why = toolchain_problem()
    if why is not None:
        print(f"SKIP: triton {triton.__version__} cannot compile Gluon for sm_90 here: {why}")
        return 3
    bad = 0
    print(f"{'BLOCK_N,STAGES,PIPE,SPLIT':>26} {'regs':>5} {'stack B':>8} {'smem B':>8}  setmaxnreg")
    for cfg, parsed_cfg in zip(cfgs, parsed):
        try:
            r = compile_sm90(*parsed_cfg)
        except Exception as e:  # noqa: BLE001 - one line per config, then the next
            bad += 1
            print(f"{cfg:>26} FAIL {root_cause(e)}", flush=True)
            continue
        spill = r["stack"] > 0 or r["smem"] > 232448
        bad += spill
        print(f"{cfg:>26} {r['regs']:>5} {r['stack']:>8} {r['smem']:>8}  {','.join(r['setmaxnreg'])}"
              f"{'  FAIL (spills or smem over 227 KB)' if spill else ''}", flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--cfgs", nargs="+", default=DEFAULT_CFGS, help="BLOCK_N,STAGES,PIPE,SPLIT (BLOCK_M=128)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed), print resources")
    ap.add_argument("--one", metavar="CFG", help="check and time one config in this process (what the driver runs)")
    ap.add_argument("--no-peers", action="store_true", help="only the probe configs (no SDPA, no paged_attention)")
    ap.add_argument("--timeout", type=int, default=45, help="seconds a config's subprocess may take")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args.cfgs)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("probe_prefill_gluon: needs a Hopper GPU (sm_90); use --compile-only without one")
    if args.one:
        try:
            row = run_one(args.one, args.batch, args.new)
        except Exception as e:  # noqa: BLE001 - compile error or device fault: the driver's row says which
            row = dict(name=f"gluon {args.one}", error=root_cause(e))
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
