"""Compile time of a Qwen3-style decoder.

Default mode: ``torch.compile`` of the whole model with and without the fusion plugin, each
in a fresh, private Inductor cache (a cache hit would skip the work being measured), timing
the first call (Dynamo + AOT + Inductor + codegen + one run) and the passes' own time.

``--piecewise``: ``compile_piecewise`` (what serving uses) cold and warm, each start in its
own process, as a restarted server pays it: for the trace cache off and on
(``--trace-cache-modes``) and each ``--compile-threads`` setting (the capture's parallel
Triton compiles), a fresh cache directory, one cold start, then ``--warm-runs`` warm starts
over the same caches. Reported per start: the compile (trace or stored-trace load, split,
Inductor) in ``compile_s`` with its parts, CUDA/HIP graph capture on a GPU (with the
precompile's share), and the process's wall time (imports, model build included); also
``cpu_s``, the CPU time of ``compile_piecewise`` in the start's own process (Inductor's compile
workers not included: steadier than wall time on a shared machine, for warm starts nearly the
whole compile), the 1-minute load average, and the layer-region calls of the trace and how many
of them were traced (``layer_regions``). Goals (28 layers): warm < 5 s, cold < 10 s.

    python benchmarks/bench_compile_time.py [--device cuda] [--dtype bfloat16] [--layers 28] [--out DIR]
    python benchmarks/bench_compile_time.py --piecewise [--tiny] [--layers 28] [--warm-runs 2]
        [--compile-threads 1 auto] [--trace-cache-modes off|on|both] [--profile]

``--profile`` runs each start under cProfile and writes its top functions (by cumulative and
by own time) to ``profile_<threads>_<trace|notrace>_<start>.txt`` in --out.

Writes ``compile_time_<device>_<date>.json`` (``compile_time_piecewise_...`` with
``--piecewise``) to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import subprocess
import sys
import tempfile
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


def write_profile(profiler: "cProfile.Profile", path: str) -> None:
    """The start's Python profile as text: the top functions by cumulative and by own time
    (where a compile's seconds go: Dynamo, AOT, Inductor, our passes, capture), and the raw
    profile beside it (``.prof``, for pstats' callers / callees)."""
    profiler.dump_stats(os.path.splitext(path)[0] + ".prof")
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf).strip_dirs()
    for key in ("cumulative", "tottime"):
        buf.write(f"=== sorted by {key}\n")
        stats.sort_stats(key).print_stats(60)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def piecewise_child(args) -> None:
    """One start: build the model, compile_piecewise (capture on a GPU), print JSON."""
    t_process = float(os.environ["BENCH_T0"])
    from inductor_rocm_attn.compilation import compile_piecewise

    dtype = getattr(torch, args.dtype) if args.device == "cuda" else torch.float32
    cfg = (qwen3_0_6b_config(num_layers=args.layers, hidden_size=256, intermediate_size=512, num_heads=4,
                             num_kv_heads=2, head_size=64, vocab_size=512)
           if args.tiny else qwen3_0_6b_config(num_layers=args.layers))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = TinyDecoder(cfg).to(dtype=dtype).eval()
    ira.bind_kv_caches(model, -(-2304 // cfg.block_size), dtype, args.device)  # max_model_len's blocks
    profiler = cProfile.Profile() if args.profile_out else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_seqs=64,
                               max_model_len=2304, trace_cache=args.trace_cache or False,
                               compile_threads=None if args.compile_threads == ["auto"]
                               else int(args.compile_threads[0]))
    if profiler:
        profiler.disable()
        write_profile(profiler, args.profile_out)
    st = runner.stats
    from torch._dynamo.utils import counters

    print(json.dumps(dict(
        total_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0, load=os.getloadavg()[0],
        compile_s=st.trace_s + st.compile_s, trace_s=st.trace_s,
        trace_loaded=st.trace_loaded, build_s=st.compile_s, capture_s=st.capture_s, captures=st.num_captures,
        precompile_s=st.precompile_s, precompiled_kernels=st.precompiled_kernels,
        precompile_times=st.precompile_times,
        unique_compiles=st.num_unique_compiles, process_s=time.time() - t_process,
        region_calls=getattr(st, "region_calls", None), region_subgraphs=getattr(st, "region_subgraphs", None),
        cache=dict(counters["aot_autograd"]) | dict((k, v) for k, v in counters["inductor"].items()
                                                    if k.startswith("fxgraph")))))


def piecewise_main(args) -> None:
    rows = []
    trace_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.trace_cache_modes]
    for threads in args.compile_threads:  # each setting from empty caches
        for trace_cache in trace_modes:
            root = tempfile.mkdtemp(prefix="compile_time_")
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"))
            for start in ["cold"] + [f"warm{i + 1}" for i in range(args.warm_runs)]:
                cmd = [sys.executable, os.path.abspath(__file__), "--piecewise-child", "--layers",
                       str(args.layers), "--device", args.device, "--dtype", args.dtype]
                cmd += (["--tiny"] if args.tiny else []) + ([] if threads == "auto" else ["--compile-threads", threads])
                if trace_cache:
                    cmd += ["--trace-cache", os.path.join(root, "traces")]
                if args.profile:
                    os.makedirs(args.out, exist_ok=True)
                    cmd += ["--profile-out", os.path.join(
                        args.out, f"profile_{threads}_{'trace' if trace_cache else 'notrace'}_{start}.txt")]
                env["BENCH_T0"] = repr(time.time())
                p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                try:
                    row = json.loads(p.stdout.strip().splitlines()[-1])
                except Exception:  # keep the other rows: the error goes into the JSON
                    row = {"error": (p.stdout[-1000:] + p.stderr[-3000:])}
                row.update(start=start, trace_cache=trace_cache, compile_threads=threads)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'threads':>7} {'trace cache':>11} {'start':>6} {'compile s':>9} {'trace s':>8} {'build s':>8} "
          f"{'capture s':>9} {'of it precompile':>16} {'process s':>9}")
    for r in rows:
        if "error" not in r:
            pre = f"{r['precompile_s']:.2f} ({r['precompiled_kernels']} kernels)"
            print(f"{r['compile_threads']:>7} {str(r['trace_cache']):>11} {r['start']:>6} {r['compile_s']:9.2f} "
                  f"{r['trace_s']:8.2f} {r['build_s']:8.2f} {r['capture_s']:9.2f} {pre:>16} {r['process_s']:9.2f}")
    from common import stamp, write_json  # the shared result JSON (benchmarks/common.py)

    out = os.path.join(args.out, f"compile_time_piecewise_{args.device}_{stamp()}.json")
    write_json(out, {"rows": rows}, device=args.device, layers=args.layers, tiny=args.tiny,
               timing="per start, its own process: compile_piecewise (compile_s = trace or stored-trace "
                      "load + split + Inductor), capture on a GPU, process wall time (from launch)")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="hidden 256 (CPU-friendly) instead of Qwen3-0.6B's shape")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--piecewise", action="store_true", help="compile_piecewise cold and warm starts")
    ap.add_argument("--tiny", action="store_true", help="--piecewise: hidden 256 (the graph, not the sizes, "
                                                        "sets compile time)")
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--compile-threads", nargs="+", default=["auto"],
                    help="--piecewise: compile_threads settings to start with, each from empty caches "
                         "(auto: the default; 1: kernels compile at their first launch)")
    ap.add_argument("--trace-cache-modes", choices=["off", "on", "both"], default="both",
                    help="--piecewise: starts with the trace cache off, on, or both")
    ap.add_argument("--profile", action="store_true",
                    help="--piecewise: cProfile each start's compile_piecewise; top functions to profile_*.txt in --out")
    ap.add_argument("--piecewise-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--trace-cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.piecewise_child:
        return piecewise_child(args)
    if args.piecewise:
        return piecewise_main(args)
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
