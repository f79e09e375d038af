"""Fused RoPE + KV-cache writers against the unfused sequence and the memory roofline.

    python benchmarks/bench_cache_writers.py [--out DIR] [--tokens 1,64,...] [--sweep]
    python benchmarks/bench_cache_writers.py --ptx-report   # no GPU: sm_90 regs / 16-byte accesses

Shapes: bf16, 32 query heads, 8 KV heads, head_size 128, block 16, NeoX RoPE (fp32
cos/sin table), LHBNC cache, interleaved V (what the fusion passes switch a layer to).
Every variant is timed inside a CUDA graph (``common.graph_time_us``: N calls captured,
graph replayed back to back, CUDA events, median of the replays; no L2 flush), so launch
gaps are those of a captured model step. ``--sweep`` passes ``WriterConfig`` objects in.

- ``rope``: our ``rope_and_cache`` (one kernel) vs ``rotary_embedding`` + ``reshape_and_cache``
  (ours, two kernels); AITER's ``fused_qk_rope_reshape_and_cache`` (through our ``aiter``
  provider) when importable.
- ``qknorm``: our ``qk_norm_rope_and_cache`` (one kernel) vs RMSNorm(q) + RMSNorm(k) (a
  one-kernel-per-tensor Triton RMSNorm below) + ``rotary_embedding`` + ``reshape_and_cache``
  (four kernels), and AITER's split+norm+rope kernel alone writing its own HND cache
  (``aiter_hnd``, not our layout: a reference point only; the ``aiter`` provider takes no
  QK-norm writer, see kernels/aiter.py).

Roofline: the fewest bytes the op must move (every input read once, every output written
once) over the measured 4.27 TB/s device-to-device copy ceiling (FACTS.md). T <= 256 uses
one random slot per token (decode batches), larger T fills random blocks in order (prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import graph_time_us, write_json  # noqa: E402

from inductor_rocm_attn.kernels import reference as ref  # noqa: E402
from inductor_rocm_attn.kernels.triton import (  # noqa: E402
    qk_norm_rope_and_cache,
    reshape_and_cache,
    rope_and_cache,
    rotary_embedding,
)
from inductor_rocm_attn.kernels.triton.configs import WriterConfig, writer_block_t  # noqa: E402
from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache  # noqa: E402

COPY_CEILING = 4.27e12  # B/s, measured (FACTS.md)
HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
TOKENS = (1, 64, 256, 1024, 4096, 16384)
SWEEP = ((1, 1), (2, 1), (4, 1), (8, 2), (8, 4), (16, 2), (16, 4))  # (block_t, num_warps)


# --- the unfused baseline's RMSNorm: one kernel per tensor ------------------------------------


@triton.jit
def _rms_norm_rows_kernel(x_ptr, w_ptr, out_ptr, num_rows, heads, stride_xt, eps,
                          D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Per-head RMSNorm: rows ``t * heads + h`` of a ``[T, heads * D]`` view (any token stride)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    mask = (offs_r < num_rows)[:, None]
    rows = offs_r.to(tl.int64)
    x_ptrs = x_ptr + (rows // heads * stride_xt + rows % heads * D)[:, None] + offs_d[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_d).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_heads(x2d, heads, w, eps):
    t = x2d.shape[0]
    out = torch.empty(t, heads, D, dtype=x2d.dtype, device=x2d.device)
    rows = t * heads
    _rms_norm_rows_kernel[(triton.cdiv(rows, 8),)](x2d, w, out, rows, heads, x2d.stride(0), eps,
                                                   D=D, BLOCK_R=8, num_warps=2)
    return out


# --- timing ---------------------------------------------------------------------------------


def time_graph(fn, n_inner, reps=15):
    """Median microseconds per call of ``fn`` over graph replays of ``n_inner`` captured calls."""
    return graph_time_us(fn, calls=n_inner, warmup_calls=1, flush_l2=False, replays=reps)


def n_inner_for(t):
    return 200 if t <= 256 else (100 if t <= 1024 else (40 if t <= 4096 else 15))


# --- problem setup --------------------------------------------------------------------------


def make_problem(t, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = (t + BS - 1) // BS + 8
    spec = KVCacheSpec(BS, HKV, D, DTYPE, CacheLayout.LHBNC)
    cache = allocate_kv_cache(spec, num_blocks, "cuda")
    cache.view(torch.uint8).fill_(0xFF)
    if t <= 256:
        slots = torch.randperm(num_blocks * BS, device="cuda", generator=g)[:t]
    else:
        blocks = torch.randperm(num_blocks, device="cuda", generator=g)
        i = torch.arange(t, device="cuda")
        slots = blocks[i // BS] * BS + i % BS
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=g).to(DTYPE)
    positions = torch.randint(0, 8192, (t,), device="cuda", generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64, device="cuda") / D))
    f = torch.arange(8192, dtype=torch.float64, device="cuda")[:, None] * inv[None, :]
    cos_sin = torch.cat((f.cos(), f.sin()), -1).float()
    w = (1 + 0.1 * torch.randn(2, D, device="cuda", generator=g)).to(DTYPE)
    one = torch.ones(1, device="cuda")
    return dict(cache=cache, slots=slots, qkv=qkv, positions=positions, cos_sin=cos_sin,
                q_w=w[0], k_w=w[1], ks=one, vs=one)


def split(qkv):
    t = qkv.shape[0]
    return (qkv[:, : HQ * D], qkv[:, HQ * D: (HQ + HKV) * D],
            qkv[:, (HQ + HKV) * D:].view(t, HKV, D))


def bytes_rope(t):
    e = 2
    qk = t * (HQ + HKV) * D * e * 2  # q, k read + written
    v = t * HKV * D * e
    cache = 2 * t * HKV * D * e
    side = t * (8 + 8) + t * D * 4  # positions, slots, cos/sin rows (fp32)
    return qk + v + cache + side


def bytes_qknorm(t):
    e = 2
    qkv = 2 * t * (HQ + 2 * HKV) * D * e  # qkv read, q/k/v written
    cache = 2 * t * HKV * D * e
    side = t * (8 + 8) + t * D * 4
    return qkv + cache + side


# --- variants -------------------------------------------------------------------------------


def rope_variants(p, aiter_mod):
    q, k, v = split(p["qkv"])
    t = q.shape[0]
    args = (p["positions"], q, k, v, p["cache"], p["slots"], p["cos_sin"], True, p["ks"], p["vs"], True)
    out = {
        "fused": lambda: rope_and_cache(*args),
        "unfused": lambda: (rotary_embedding(p["positions"], q, k, D, p["cos_sin"], True),
                            reshape_and_cache(k.view(t, HKV, D), v, p["cache"], p["slots"],
                                              p["ks"], p["vs"], True)),
    }
    if aiter_mod is not None:
        out["aiter"] = lambda: aiter_mod.rope_and_cache(*args)
    return out


def qknorm_variants(p, aiter_mod, aiter_hnd):
    qkv = p["qkv"]
    t = qkv.shape[0]
    q2, k2, v = split(qkv)
    tail = (p["cache"], p["slots"], p["ks"], p["vs"], True, HQ, HKV, D)
    head = (qkv, p["q_w"], p["k_w"], 1e-6, p["positions"], p["cos_sin"], True)

    def unfused():
        qn = rms_norm_heads(q2, HQ, p["q_w"], 1e-6)
        kn = rms_norm_heads(k2, HKV, p["k_w"], 1e-6)
        rotary_embedding(p["positions"], qn, kn, D, p["cos_sin"], True)
        reshape_and_cache(kn, v, p["cache"], p["slots"], p["ks"], p["vs"], True)
        return qn, kn, v

    out = {"fused": lambda: qk_norm_rope_and_cache(*head, *tail), "unfused": unfused}
    if aiter_hnd is not None:
        nb = (t + BS - 1) // BS + 8
        kc = torch.empty(nb, HKV, BS, D, device="cuda", dtype=DTYPE)
        vc = torch.empty_like(kc)
        wq, wk = p["q_w"].float() - 1, p["k_w"].float() - 1
        cos, sin = p["cos_sin"][:, : D // 2], p["cos_sin"][:, D // 2:]
        out["aiter_hnd"] = lambda: aiter_hnd(qkv, wq, wk, cos, sin, p["positions"], kc, vc, p["slots"],
                                             HQ, HKV, D, is_neox=True, eps=1e-6)
    return out


def check_fused_matches(p):
    """Fused vs the float64 reference at this T (bf16 tolerance), before timing."""
    t = p["qkv"].shape[0]
    qkv0 = p["qkv"].clone()
    c1 = p["cache"].clone()
    q, k, v = split(p["qkv"])
    rope_and_cache(p["positions"], q, k, v, c1, p["slots"], p["cos_sin"], True, p["ks"], p["vs"], True)
    qkv_ref = qkv0.double().cpu().to(DTYPE)
    c2 = p["cache"].cpu()
    qr, kr, vr = split(qkv_ref)
    ref.rope_and_cache(p["positions"].cpu(), qr, kr, vr, c2, p["slots"].cpu(), p["cos_sin"].cpu(), True,
                       p["ks"].cpu(), p["vs"].cpu(), True)
    err = ((p["qkv"].double().cpu() - qkv_ref.double()).norm() / qkv_ref.double().norm()).item()
    cerr = ((c1.double().cpu().nan_to_num() - c2.double().nan_to_num()).norm()
            / c2.double().nan_to_num().norm()).item()
    p["qkv"].copy_(qkv0)
    assert err < 1e-2 and cerr < 1e-2, (t, err, cerr)
    return max(err, cerr)


def load_aiter():
    try:
        from inductor_rocm_attn.kernels import aiter as aiter_mod
        from aiter.ops.triton.rope.fused_qkv_split_qk_norm_rope_cache import (
            fused_qkv_split_qk_norm_rope_cache,
        )

        aiter_mod._fused_kv_cache()
        return aiter_mod, fused_qkv_split_qk_norm_rope_cache, None
    except Exception as e:  # noqa: BLE001 - report why the peer column is missing
        return None, None, f"{type(e).__name__}: {e}"


def ptx_report():
    """Compile the fused kernels for sm_90 here (no GPU needed) and print, per (block_t, warps),
    ptxas registers/spills and how many global loads/stores are 16-byte vectors.

    Argument specialisation is mimicked as Triton's JIT does it at run time: unit channel
    strides become constants, the other strides and all pointers are 16-divisible.
    """
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mods = {n: sys.modules["inductor_rocm_attn.kernels.triton." + n]
            for n in ("rope_and_cache", "qk_norm_rope_and_cache")}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    ones = {"stride_qd", "stride_kd", "stride_vd", "stride_qkv_d"}
    div16 = {"stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs",
             "stride_cache_block", "stride_cache_group", "stride_qkv_t"}
    ptr = {"positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32",
           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}

    def build(fn, const, num_warps):
        const = dict(const, **{n: 1 for n in ones if n in fn.arg_names})
        sig = {p.name: ptr.get(p.name) or ("*bf16" if p.name.endswith("_ptr") else
               "constexpr" if p.name in const else "fp32" if p.name == "eps" else "i32") for p in fn.params}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                        attrs={(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
                               if p.name.endswith("_ptr") or p.name in div16})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "k.ptx"), "w").write(ptx)
            err = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
        regs = re.findall(r"Used (\d+) registers", err)
        spills = re.findall(r"(\d+) bytes spill stores", err)
        mem = re.findall(r"(ld|st)\.global[^;\n]*", ptx)
        vec = len(re.findall(r"(?:ld|st)\.global[^;\n]*\.v4", ptx))
        return f"regs {regs[0] if regs else '?'} spills {spills[0] if spills else '?'} v4 {vec}/{len(mem)} ld+st"

    base = dict(HEAD_SIZE=D, ROT_HALF=D // 2, IS_NEOX=True, BLOCK_SIZE=BS, X=8, INTERLEAVED_V=True,
                IS_FP8=False, FP8_MAX=0.0, BLOCK_R=D // 2, BLOCK_P=1, BLOCK_D=D)
    for bt, nw in SWEEP:
        c = dict(base, BLOCK_T=bt)
        rope = build(mods["rope_and_cache"]._rope_and_cache_kernel, c, nw)
        qk = build(mods["qk_norm_rope_and_cache"]._qk_norm_rope_and_cache_kernel,
                   dict(c, NUM_HEADS=HQ, NUM_KV_HEADS=HKV), nw)
        print(f"block_t {bt:2d} warps {nw}: rope_and_cache {rope} | qk_norm_rope_and_cache {qk}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", action="store_true", help="also time (block_t, num_warps) in SWEEP for the fused kernels")
    ap.add_argument("--ptx-report", action="store_true", help="no GPU needed: sm_90 registers and vector accesses")
    args = ap.parse_args()
    if args.ptx_report:
        return ptx_report()
    tokens = [int(x) for x in args.tokens.split(",")]
    aiter_mod, aiter_hnd, aiter_why = load_aiter()
    rows = []
    for t in tokens:
        p = make_problem(t)
        err = check_fused_matches(p)
        n = n_inner_for(t)
        for op, variants, nbytes in (("rope", rope_variants(p, aiter_mod), bytes_rope(t)),
                                     ("qknorm", qknorm_variants(p, aiter_mod, aiter_hnd), bytes_qknorm(t))):
            row = {"op": op, "T": t, "bytes": nbytes, "roofline_us": nbytes / COPY_CEILING * 1e6,
                   "block_t": writer_block_t(t), "check_rel_err": err}
            for name, fn in variants.items():
                try:
                    row[name + "_us"] = time_graph(fn, n)
                except Exception as e:  # noqa: BLE001
                    row[name + "_us"] = None
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
            if args.sweep:
                sweep = {}
                for bt, nw in SWEEP:
                    kw = dict(cfg=WriterConfig(bt, nw))
                    if op == "rope":
                        q, k, v = split(p["qkv"])
                        fn = lambda kw=kw: rope_and_cache(  # noqa: E731
                            p["positions"], q, k, v, p["cache"], p["slots"], p["cos_sin"], True,
                            p["ks"], p["vs"], True, **kw)
                    else:
                        fn = lambda kw=kw: qk_norm_rope_and_cache(  # noqa: E731
                            p["qkv"], p["q_w"], p["k_w"], 1e-6, p["positions"], p["cos_sin"], True,
                            p["cache"], p["slots"], p["ks"], p["vs"], True, HQ, HKV, D, **kw)
                    sweep[f"bt{bt}_w{nw}"] = time_graph(fn, n)
                row["sweep_us"] = sweep
            f = row["fused_us"]
            row["speedup_vs_unfused"] = row["unfused_us"] / f if f and row.get("unfused_us") else None
            row["fused_TBps"] = nbytes / (f * 1e-6) / 1e12 if f else None
            if row.get("aiter_us"):
                row["aiter_TBps"] = nbytes / (row["aiter_us"] * 1e-6) / 1e12
            rows.append(row)
            print(json.dumps(row), flush=True)
        del p
        torch.cuda.empty_cache()

    meta = {
        "shape": {"dtype": "bf16", "num_heads": HQ, "num_kv_heads": HKV, "head_size": D,
                  "block_size": BS, "layout": "LHBNC", "interleaved_v": True, "rope": "neox"},
        "copy_ceiling_TBps": COPY_CEILING / 1e12,
        "aiter": "imported (AITER_TRITON_ONLY=1)" if aiter_mod else f"not available: {aiter_why}",
        "targets": "fused >= 1.5x unfused at T <= 256; >= 3.5 TB/s at T = 16384",
    }
    meta = write_json(os.path.join(args.out, "bench_cache_writers.json"), {"rows": rows}, **meta)["meta"]
    cols = ["fused_us", "unfused_us", "aiter_us", "aiter_hnd_us", "roofline_us"]
    lines = [f"# Fused cache writers ({meta['machine']}, {meta['date']})", "",
             f"`{meta['command']}` - torch {meta['torch']}, triton {meta['triton']}; AITER: {meta['aiter']}",
             "", "bf16, 32 q heads / 8 kv heads, d=128, block 16, LHBNC, interleaved V, CUDA-graph timing (us per call)",
             "", "| op | T | " + " | ".join(c[:-3] for c in cols) + " | fused vs unfused | fused TB/s |",
             "|---|---|" + "---|" * len(cols) + "---|---|"]
    for r in rows:
        cells = [f"{r[c]:.2f}" if r.get(c) else "-" for c in cols]
        sp = f"{r['speedup_vs_unfused']:.2f}x" if r.get("speedup_vs_unfused") else "-"
        bw = f"{r['fused_TBps']:.2f}" if r.get("fused_TBps") else "-"
        lines.append(f"| {r['op']} | {r['T']} | " + " | ".join(cells) + f" | {sp} | {bw} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_cache_writers.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
