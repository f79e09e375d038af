"""Decode-step latency with tensor parallelism: TP=1 vs TP=2 (vs more) for a model that fits one GPU.

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query / 8 KV heads, d=128, vocab
8192, random weights, bf16) decodes one token per sequence at batch 1/8/32/64 with 2048
cached tokens per sequence (blocks placed at random, caches filled with random values).
For each TP size the script launches ``torch.distributed.run --standalone --nproc-per-node
<tp>`` over this file; every rank builds its shard (``TinyDecoder(cfg, tp=...)``: 16/tp
query and 8/tp KV heads, 3072/tp MLP columns, all-reduce after o_proj and down_proj),
binds its KV-cache shard and times, per mode:

- ``decode_graphs``: ``compile_piecewise`` (plugin on), a decode step replays one CUDA/HIP
  graph of the whole step, the all-reduces (NCCL / RCCL) and attention included;
- ``piecewise_graphs``: the same runner, pieces replayed from graphs, attention eager;
- ``eager``: the sharded model as written.

Step latency = median over repeats of (time of ``iters`` back-to-back steps / iters), taken
per rank with CUDA events and reduced with MAX over ranks (the slowest rank sets the step).
Speed-up = latency(TP=1) / latency(TP=n); scaling efficiency = speed-up / n (1.0: ideal).
Memory floor per rank = (its weight bytes read per step + its KV bytes) / 4.19 TB/s.

    python benchmarks/bench_tensor_parallel.py --out $OUT            # needs >= 2 GPUs
    python benchmarks/bench_tensor_parallel.py --device cpu --tiny --modes eager --batches 1 4
                                                                     # plumbing check, gloo

Writes ``tensor_parallel_<date>.json`` and ``.md`` to ``--out`` (default
benchmarks/results/latest), with command, machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

T_START = time.perf_counter()
CTX = 2048
READ_TB_S = 4.19  # H200 read ceiling (docs/performance.md)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def _version(mod: str):
    try:
        return __import__(mod).__version__
    except Exception:
        return None


# === one rank ================================================================================


def _config(args):
    from inductor_rocm_attn.models import qwen3_0_6b_config

    if args.tiny:
        return qwen3_0_6b_config(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                                 num_kv_heads=2, head_size=64, vocab_size=512)
    return qwen3_0_6b_config()


def _time_steps(fn, device, iters, repeats, group) -> float:
    """Median ms per step over ``repeats`` runs of ``iters`` steps (MAX over ranks)."""
    import torch.distributed as dist

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) / iters * 1e3)
    times.sort()
    t = torch.tensor([times[len(times) // 2]], dtype=torch.float64,
                     device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _bytes_per_step(model, batch: int) -> tuple[int, int]:
    """(weight bytes read per decode step, KV bytes read) for this rank."""
    weights = 0
    for name, p in model.named_parameters():
        rows = batch if name.startswith("embed.") else p.shape[0] if p.dim() > 1 else 1
        weights += rows * (p.shape[1] if p.dim() > 1 else p.shape[0]) * p.element_size()
    layer = model.layers[0]
    kv = batch * CTX * len(model.layers) * 2 * layer.num_kv_heads * model.cfg.head_size * 2
    return weights, kv


def rank_main(args) -> None:
    import torch.distributed as dist

    import inductor_rocm_attn as ira
    from inductor_rocm_attn.compilation import compile_piecewise
    from inductor_rocm_attn.models import TinyDecoder
    from inductor_rocm_attn.parallel import TensorParallel

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    tp = TensorParallel.from_group()
    cfg = _config(args)
    max_b = max(args.batches)
    per_seq = -(-(CTX + 1) // cfg.block_size)
    num_blocks = max_b * per_seq + 1
    torch.manual_seed(0)
    with torch.device(device):
        model = TinyDecoder(cfg, name="bench", tp=tp if tp.size > 1 else None).to(dtype=dtype).eval()
    caches = ira.bind_kv_caches(model, num_blocks, dtype, device)
    for c in caches.values():
        c.normal_(0.0, 0.5)
    res = {"rank": tp.rank, "tp": tp.size, "latency_ms": {}, "floor_ms": {}, "compile": {}}
    for b in args.batches:
        w, kv = _bytes_per_step(model, b)
        res["floor_ms"][b] = (w + kv) / (READ_TB_S * 1e12) * 1e3

    runner = None
    if any(m != "eager" for m in args.modes):
        t0 = time.perf_counter()
        runner = compile_piecewise(model, capture_sizes=CAPTURE_SIZES, max_num_seqs=64,
                                   max_model_len=CTX + cfg.block_size, decode_graphs=True)
        res["compile"] = {"total_s": time.perf_counter() - t0, "compile_s": runner.stats.compile_s,
                          "capture_s": runner.stats.capture_s,
                          "unique_compiles": runner.stats.num_unique_compiles,
                          "cuda_graphs": runner.use_cuda_graphs}
        if tp.rank == 0:
            log(f"tp={tp.size}: compiled and captured in {res['compile']['total_s']:.1f} s")

    g = torch.Generator().manual_seed(1)
    for b in args.batches:
        perm = torch.randperm(num_blocks, generator=g)[: b * per_seq].view(b, per_seq).tolist()
        qlens, clens = [1] * b, [CTX] * b
        ids = torch.randint(0, cfg.vocab_size, (b,), generator=g).to(device)
        for mode in args.modes:
            if mode == "eager":
                md = ira.build_attention_metadata(qlens, clens, perm, cfg.block_size, device)

                def fn(md=md):
                    with torch.no_grad(), ira.set_forward_context(md):
                        model(ids, md.positions)
            else:
                md = runner.prepare(qlens, clens, perm, whole_step=(mode == "decode_graphs"))
                if mode == "decode_graphs" and not runner.replays_whole_step(md):
                    continue  # no whole-step graph at this size (not on a GPU)

                def fn(md=md):
                    runner(ids, md)
            ms = _time_steps(fn, device, args.iters, args.repeats, group)
            res["latency_ms"].setdefault(mode, {})[b] = ms
            if tp.rank == 0:
                log(f"tp={tp.size} {mode:>16} B={b:<3} {ms:.3f} ms")
    if device.type == "cuda":
        res["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if tp.rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier(group)
    dist.destroy_process_group()


# === driver ===================================================================================


def _launch(args, tp: int, result: str) -> str | None:
    """Run the ranks of one TP size; returns an error string or None."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
           os.path.abspath(__file__), "--rank-worker", "--result", result, "--device", args.device,
           "--iters", str(args.iters), "--repeats", str(args.repeats),
           "--modes", *args.modes, "--batches", *map(str, args.batches)] + (["--tiny"] if args.tiny else [])
    log(f"launch tp={tp}: {' '.join(cmd[1:])}")
    try:
        p = subprocess.run(cmd, timeout=args.timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        return f"timeout after {args.timeout_s} s: {(e.stdout or '')[-2000:]}"
    sys.stdout.write(p.stdout)
    if p.returncode != 0:
        return f"rc={p.returncode}: {p.stderr[-4000:]}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--modes", nargs="+", default=["decode_graphs", "piecewise_graphs", "eager"],
                    choices=["decode_graphs", "piecewise_graphs", "eager"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (plumbing check)")
    ap.add_argument("--timeout-s", type=int, default=280, help="per TP size")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        rank_main(args)
        return

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    res = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"device": torch.cuda.get_device_name() if gpus else platform.processor(),
                    "gpus": gpus, "host": platform.node(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "triton": _version("triton"),
                     "cuda": torch.version.cuda, "hip": torch.version.hip,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None},
        "model": "Qwen3-0.6B shape (28 layers, hidden 1024, 16/8 heads, d=128, vocab 8192), bf16"
                 if not args.tiny else "tiny (2 layers, hidden 256, 4/2 heads, d=64)",
        "ctx": CTX, "per_tp": {}, "skipped": {}, "errors": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp:
        for tp in args.tp_sizes:
            if args.device == "cuda" and tp > gpus:
                res["skipped"][tp] = f"needs {tp} GPUs, {gpus} visible"
                continue
            path = os.path.join(tmp, f"tp{tp}.json")
            err = _launch(args, tp, path)
            if err:
                res["errors"][tp] = err
                log(f"tp={tp} failed: {err[-500:]}")
                continue
            res["per_tp"][tp] = json.load(open(path))
    base = res["per_tp"].get(1)
    res["scaling"] = {}
    for tp, r in res["per_tp"].items():
        if base is None or tp == 1:
            continue
        for mode, lat in r["latency_ms"].items():
            for b, ms in lat.items():
                t1 = base["latency_ms"].get(mode, {}).get(b)
                if t1:
                    res["scaling"].setdefault(mode, {}).setdefault(tp, {})[b] = {
                        "speedup": t1 / ms, "efficiency": t1 / ms / tp}
    res["total_s"] = time.perf_counter() - T_START
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, f"tensor_parallel_{'tiny_' if args.tiny else ''}{res['date']}.json")
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    write_md(res, out_json[:-5] + ".md")
    log(f"wrote {out_json}")
    print(open(out_json[:-5] + ".md").read())


def write_md(res: dict, path: str) -> None:
    lines = [f"# Tensor-parallel decode step ({res['date']})", "",
             f"Command: `{res['command']}`  ", f"Machine: `{json.dumps(res['machine'])}`  ",
             f"Versions: `{json.dumps(res['versions'])}`  ",
             f"Model: {res['model']}, {res['ctx']} cached tokens a sequence", "",
             "Step latency, ms (MAX over ranks of the per-rank median); speed-up and scaling "
             "efficiency vs TP=1:", ""]
    per_tp = res["per_tp"]
    batches = sorted({b for r in per_tp.values() for lat in r["latency_ms"].values() for b in lat}, key=int)
    lines += ["| mode | TP | " + " | ".join(f"B={b}" for b in batches) + " |", "|---|---|" + "---|" * len(batches)]
    modes = sorted({m for r in per_tp.values() for m in r["latency_ms"]})
    for mode in modes:
        for tp, r in sorted(per_tp.items(), key=lambda kv: int(kv[0])):
            lat = r["latency_ms"].get(mode, {})
            cells = []
            for b in batches:
                if b not in lat:
                    cells.append("-")
                    continue
                s = res["scaling"].get(mode, {}).get(tp, {}).get(b)
                cells.append(f"{lat[b]:.3f}" + (f" ({s['speedup']:.2f}x, eff {s['efficiency']:.2f})" if s else ""))
            lines.append(f"| {mode} | {tp} | " + " | ".join(cells) + " |")
    for tp, r in sorted(per_tp.items(), key=lambda kv: int(kv[0])):
        lines.append(f"| memory floor per rank ({READ_TB_S} TB/s) | {tp} | "
                     + " | ".join(f"{r['floor_ms'].get(b, float('nan')):.3f}" for b in batches) + " |")
    lines += ["", f"Compile: `{json.dumps({tp: r['compile'] for tp, r in per_tp.items()})}`",
              "", f"Skipped: `{json.dumps(res['skipped'])}`", "", f"Errors: `{json.dumps(res['errors'])[:3000]}`", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
