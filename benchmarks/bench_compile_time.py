"""Compile time of a Qwen3-style decoder with and without the fusion plugin.

Each variant compiles in a fresh, private Inductor cache (a cache hit would skip the work
being measured) and times the first call (Dynamo + AOT + Inductor + codegen + one run).
The passes' own time is also reported (sum over the graphs of that compile).

    python benchmarks/bench_compile_time.py [--device cuda] [--dtype bfloat16] [--layers 28] [--out DIR]

Writes ``compile_time_<device>_<date>.json`` to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import compilation
from inductor_rocm_attn.models import TinyDecoder, qwen3_0_6b_config, qwen3_config

_names = itertools.count()


def _fresh_cache():
    import torch._inductor.utils as u

    return u.fresh_cache() if hasattr(u, "fresh_cache") else u.fresh_inductor_cache()


def compile_once(cfg, device, dtype, with_plugin: bool) -> dict:
    torch._dynamo.reset()
    model = TinyDecoder(cfg, name=f"ovh{next(_names)}").to(device=device, dtype=dtype).eval()
    ira.bind_kv_caches(model, 16, dtype, device)
    alloc = ira.BlockAllocator(16, cfg.block_size)
    alloc.allocate(0, 24)
    md = ira.build_attention_metadata([24], [0], [alloc.block_table(0)], cfg.block_size, device)
    ids = torch.randint(0, cfg.vocab_size, (24,), device=device)
    torch._dynamo.mark_dynamic(ids, 0)
    pos = md.positions.clone()
    torch._dynamo.mark_dynamic(pos, 0)
    with _fresh_cache():
        mgr = compilation.enable() if with_plugin else None
        try:
            compiled = torch.compile(model, backend="inductor")
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad(), ira.set_forward_context(md):
                compiled(ids, pos)
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            pass_s = sum(p.total_time_s for p in mgr.passes) if mgr else 0.0
            fused = sum(p.matched_count for p in mgr.passes) if mgr else 0
        finally:
            compilation.disable()
    return {"plugin": with_plugin, "compile_s": wall, "passes_s": pass_s, "fusions": fused}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="hidden 256 (CPU-friendly) instead of Qwen3-0.6B's shape")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = (qwen3_config(num_layers=args.layers) if args.small else qwen3_0_6b_config(num_layers=args.layers))
    compile_once(qwen3_config(num_layers=1), args.device, dtype, True)  # warm imports, pattern traces
    rows = [compile_once(cfg, args.device, dtype, p) for _ in range(args.repeat) for p in (False, True)]
    print(f"Qwen3-style, {cfg.num_layers} layers, hidden {cfg.hidden_size}, {args.dtype}, {args.device}")
    print(f"{'plugin':>7} {'compile+1st call (s)':>21} {'passes (ms)':>12} {'fusions':>8}")
    for r in rows:
        print(f"{str(r['plugin']):>7} {r['compile_s']:21.2f} {r['passes_s'] * 1e3:12.1f} {r['fusions']:8d}")
    from common import stamp, write_json  # the shared result JSON (benchmarks/common.py)

    out = os.path.join(args.out, f"compile_time_{args.device}_{stamp()}.json")
    write_json(out, {"rows": rows}, device=args.device, dtype=args.dtype, layers=cfg.num_layers,
               hidden=cfg.hidden_size, timing="wall time of the first call (fresh Inductor cache)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
