"""Probe: does Triton's automatic Hopper warp specialization speed up causal prefill?

Triton 3.6 splits a ``tl.range(..., warp_specialize=True)`` loop on sm_90 into a TMA producer
warpgroup and two consumer warpgroups of 64 rows each (FA3's structure) when the kernel is
launched with 4 warps and every tile (Q included) comes through a tensor descriptor. The
pass is fragile: a second key loop, an early return or a data-dependent ``while`` before
the loop make it crash or silently skip (checked by compiling for sm_90 on the CPU). So
this probe kernel has one key loop over all of a row block's tiles, the causal and
sequence masks applied to every tile, and its (sequence, row block) pairs read from a table
built on the host.

It times that kernel with and without warp specialization against the project's prefill
(``paged_attention``) and SDPA on the prefill benchmark's no-prefix case (B=4 x 4096 new
tokens, causal, 32/8 heads, d=128, bf16), each output checked against SDPA first.
Writes ``probe_prefill_warp_specialize_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from common import graph_time_us, stamp, write_json

from inductor_rocm_attn.kernels.triton import paged_attention
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache

HQ, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16


@triton.jit
def _causal_ws_kernel(q_desc, k_desc, v_desc, out_ptr, table_ptr, stride_ot, sm_scale,
                      GQA: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(table_ptr + 3 * pid)
    tile = tl.load(table_ptr + 3 * pid + 1)
    q_len = tl.load(table_ptr + 3 * pid + 2)
    kv_col = (head // GQA) * HEAD
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q = q_desc.load([q_start + tile * BLOCK_M, head * HEAD])
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    for s in tl.range(0, tl.minimum((tile + 1) * BLOCK_M, q_len), BLOCK_N, warp_specialize=WS):
        k = k_desc.load([q_start + s, kv_col])
        v = v_desc.load([q_start + s, kv_col])
        offs_n = s + tl.arange(0, BLOCK_N)
        qk = tl.dot(q, k.T)
        keep = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < q_len)
        qk = tl.where(keep, qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk * sm_scale - (m_new * sm_scale)[:, None])
        alpha = tl.math.exp2((m_i - m_new) * sm_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.where((offs_n < q_len)[:, None], v, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    rows = (q_start + offs_m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * HEAD + tl.arange(0, HEAD)[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def row_block_table(q_lens: list[int], block_m: int, device) -> torch.Tensor:
    """(q_start, row block, q_len) per program, each sequence's row blocks last-first."""
    rows, start = [], 0
    for n in q_lens:
        tiles = triton.cdiv(n, block_m)
        rows += [(start, t, n) for t in reversed(range(tiles))]
        start += n
    return torch.tensor(rows, dtype=torch.int32, device=device).flatten()


def run_probe(q, k, v, out, table, block_m, block_n, warps, stages, ws):
    qd = TensorDescriptor.from_tensor(q.view(q.shape[0], -1), [block_m, D])
    kd = TensorDescriptor.from_tensor(k.view(k.shape[0], -1), [block_n, D])
    vd = TensorDescriptor.from_tensor(v.view(v.shape[0], -1), [block_n, D])
    grid = (table.numel() // 3, HQ)
    scale = D ** -0.5 * 1.4426950408889634

    def call():
        _causal_ws_kernel[grid](qd, kd, vd, out, table, out.stride(0), scale, GQA=HQ // HKV, HEAD=D,
                                BLOCK_M=block_m, BLOCK_N=block_n, WS=ws, num_warps=warps, num_stages=stages)
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--cfgs", nargs="+", default=["128,128,4,2,1", "128,64,4,2,1", "128,64,4,3,1",
                                                  "128,128,8,2,0", "128,128,8,3,0", "128,64,8,3,0"],
                    help="BLOCK_M,BLOCK_N,warps,stages,warp_specialize")
    ap.add_argument("--no-peers", action="store_true", help="only the probe configs (no SDPA, no paged_attention)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    b, n = args.batch, args.new
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(b * n, HQ, D, generator=g, device="cuda", dtype=DTYPE)
    k = torch.randn(b * n, HKV, D, generator=g, device="cuda", dtype=DTYPE)
    v = torch.randn(b * n, HKV, D, generator=g, device="cuda", dtype=DTYPE)
    flops = 4 * b * HQ * D * (n * (n + 1) / 2)
    qs = q.view(b, n, HQ, D).transpose(1, 2)
    ks = k.view(b, n, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vs = v.view(b, n, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(b * n, HQ, D)
    rows = []

    def record(name, call, out, **extra):
        out.fill_(float("nan"))
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # a config the compiler refuses: say so, go on
            rows.append(dict(name=name, error=str(e).strip().splitlines()[-1][:300], **extra))
            print(f"{name:>28}: failed: {rows[-1]['error']}", flush=True)
            return
        err = (out.float() - ref.float()).abs().max().item()
        us = graph_time_us(call, warmup_calls=1, warmup_ms=50, rep_ms=300)
        tfs = flops / (us * 1e-6) / 1e12
        rows.append(dict(name=name, us=us, tflops=tfs, max_abs_err=err, **extra))
        print(f"{name:>28}: {us:8.1f} us {tfs:5.0f} TFLOP/s  max err {err:.2e}", flush=True)

    if not args.no_peers:  # SDPA and the project's prefill on the same values
        sdpa_out = torch.empty_like(ref)
        record("sdpa", lambda: sdpa_out.copy_(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                                               .transpose(1, 2).reshape(b * n, HQ, D)), sdpa_out)
        cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, DTYPE, CacheLayout.LHBNC), 8, "cuda")
        ours_out = torch.empty_like(q)
        qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * n
        seq_lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        table_bt = torch.zeros(b, triton.cdiv(n, BS), dtype=torch.int32, device="cuda")
        one = torch.ones(1, device="cuda")
        record("paged_attention (default)", lambda: paged_attention(
            ours_out, q, k, v, cache, qsl, seq_lens, table_bt, D ** -0.5, one, one, True, -1, None, None,
            0.0, False, None, max_query_len=n, max_seq_len=n), ours_out)
    for cfg in args.cfgs:
        bm, bn, w, st, ws = (int(x) for x in cfg.split(","))
        out = torch.empty_like(q)
        table = row_block_table([n] * b, bm, "cuda")
        record(f"probe {cfg}", run_probe(q, k, v, out, table, bm, bn, w, st, bool(ws)), out,
               block_m=bm, block_n=bn, warps=w, stages=st, warp_specialize=bool(ws))
    path = os.path.join(args.out, f"probe_prefill_warp_specialize_{stamp()}.json")
    write_json(path, dict(case=dict(batch=b, new=n, q_heads=HQ, kv_heads=HKV, head_size=D, causal=True),
                          rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
