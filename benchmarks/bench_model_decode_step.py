"""End-to-end step benchmark: eager vs torch.compile vs the plugin vs plugin + graphs.

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query / 8 KV heads, d=128, random
weights, bf16, vocab 8192) decodes one token per sequence at batch 1/8/32/64 with 2048
cached tokens per sequence (blocks placed at random, cache filled with random values).
Step latency (the model forward of one decode step, metadata prepared) for:

- ``eager``: the model as written (HF-form RoPE/RMSNorm, our layer-level ops);
- ``compile``: ``torch.compile(model, fullgraph=True)``, plugin off;
- ``compile_plugin``: the same with ``inductor_rocm_attn.plugin()`` on;
- ``piecewise_graphs``: ``compile_piecewise(model)`` (plugin on) with piecewise graphs:
  pieces replayed from CUDA graphs, attention eager between them;
- ``decode_graphs``: the same runner's whole-step decode graph: one CUDA graph of the whole
  step, attention included (``*_with_plan``: plus the metadata plan and its host-to-device
  copies); ``mixed_graph``: the same decode step through the size's mixed whole-step graph
  (verify and prefill launches too: what the decode graph saves).

A mixed step (``--mixed``, default 8 prefills of 512 new tokens + 56 decodes with 2048
cached tokens = 4152 tokens, padded to the captured 4160): eager, the compiled pieces
without graphs, piecewise graphs (attention eager) and the whole-step mixed graph, its
output checked against the same step without graphs (bitwise) and eager.

Memory floor = (weight bytes read per step + KV bytes) / 4.19 TB/s (FACTS.md read ceiling);
goal: B=64 decode within 1.3x of it. Before timing, a mixed schedule (``--check-steps``)
checks graph replay against eager (and bitwise against the compiled pieces without graphs).
Compile time: cold in this process (fresh cache dirs), warm in a second process over the
same caches (``--compile-only``), with the trace cache on (``--no-trace-cache``: off).

    PYTHONUNBUFFERED=1 python benchmarks/bench_model_decode_step.py --out $OUT [--deadline-s 230]

Writes ``model_decode_step_<date>.json`` and ``.md`` to --out (then commit them under
benchmarks/results/). Stages past ``--deadline-s`` are skipped and reported as skipped.
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

T_START = time.perf_counter()

# Fresh compile caches (cold compile) unless given: set before torch is imported.
if "--cache-dir" in sys.argv:
    _cache = sys.argv[sys.argv.index("--cache-dir") + 1]
else:
    _cache = tempfile.mkdtemp(prefix="e2e_cache_")
    sys.argv += ["--cache-dir", _cache]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cache, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_cache, "triton")

import torch  # noqa: E402

import inductor_rocm_attn as ira  # noqa: E402
from inductor_rocm_attn.compilation import compile_piecewise  # noqa: E402
from inductor_rocm_attn.decode_check import run_mixed_decode  # noqa: E402
from inductor_rocm_attn.models import TinyDecoder, qwen3_0_6b_config  # noqa: E402

READ_CEILING_TBS = 4.19
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
CTX = 2048
FLOOR_GOAL = 1.3  # B=64 decode step / memory floor


def log(msg):
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def build(args, device, dtype, num_blocks, seed=0):
    cfg = qwen3_0_6b_config(**(dict(num_layers=args.layers) if args.layers else {}))
    if args.tiny:
        cfg = qwen3_0_6b_config(num_layers=args.layers or 2, hidden_size=256, intermediate_size=512,
                                num_heads=4, num_kv_heads=2, head_size=64, vocab_size=512)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device (fast)
        model = TinyDecoder(cfg).to(dtype=dtype).eval()
    ira.bind_kv_caches(model, num_blocks, dtype, device, poison=True)
    return model


def mixed_size(args) -> int:
    """The captured size of the mixed step: its tokens rounded up to a multiple of 64."""
    n = args.mixed[0] * args.mixed[1] + args.mixed[2]
    return -(-n // 64) * 64 if n else 0


def compile_runner(model, args, max_num_blocks_per_seq_tokens, capture=True):
    t0 = time.perf_counter()
    sizes = CAPTURE_SIZES + ([mixed_size(args)] if mixed_size(args) else [])
    runner = compile_piecewise(model, capture_sizes=sizes, max_num_seqs=64,
                               max_model_len=max_num_blocks_per_seq_tokens, capture=False,
                               decode_graphs=True, mixed_graphs=True, piecewise_graphs=True,
                               trace_cache=None if args.no_trace_cache else os.path.join(args.cache_dir, "traces"))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if capture:
        runner.capture()
    return runner, compile_s, time.perf_counter() - t0


def weight_bytes_per_step(model, batch):
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed."):
            total += batch * p.shape[1] * p.element_size()  # gathered rows only
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes(model, batch, ctx):
    cfg = model.cfg
    return batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_size * 2  # bf16


def time_steps(fn, device, iters, repeats=3, warmup=2):
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    times.sort()
    return times[len(times) // 2]


class DecodeBatch:
    """B sequences with CTX cached tokens each, decoding one token (random block placement)."""

    def __init__(self, b, block_size, num_blocks, vocab, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        per = -(-(CTX + 1) // block_size)
        perm = torch.randperm(num_blocks, generator=g)[: b * per].view(b, per).tolist()
        self.qlens, self.clens, self.tables = [1] * b, [CTX] * b, perm
        self.ids = torch.randint(0, vocab, (b,), generator=g).to(device)
        self.md = ira.build_attention_metadata(self.qlens, self.clens, self.tables, block_size, device)


class MixedBatch:
    """``p`` prefills of ``q`` new tokens (no context) and ``d`` decodes with CTX cached tokens."""

    def __init__(self, p, q, d, block_size, num_blocks, vocab, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        need = [-(-q // block_size)] * p + [-(-(CTX + 1) // block_size)] * d
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.tables, i = [], 0
        for n in need:
            self.tables.append(perm[i: i + n])
            i += n
        self.qlens, self.clens = [q] * p + [1] * d, [0] * p + [CTX] * d
        self.ids = torch.randint(0, vocab, (sum(self.qlens),), generator=g).to(device)
        self.md = ira.build_attention_metadata(self.qlens, self.clens, self.tables, block_size, device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--cache-dir")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--check-steps", type=int, default=200)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip stages that start later")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="small model (CPU smoke test)")
    ap.add_argument("--compile-only", action="store_true", help="(warm-compile child process)")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="stages to skip: check mixed compile compile_plugin warm")
    ap.add_argument("--mixed", type=int, nargs=3, default=[8, 512, 56], metavar=("PREFILLS", "TOKENS", "DECODES"),
                    help="the mixed step (0 0 0: none)")
    ap.add_argument("--no-trace-cache", action="store_true", help="compile without the trace cache")
    ap.add_argument("--num-blocks", type=int, default=0, help="KV cache blocks (default: what the steps need; "
                                                              "--compile-only: 64)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bs = 16
    max_b = max(args.batches)
    seqs = max(max_b, args.mixed[0] + args.mixed[2])
    num_blocks = args.num_blocks or seqs * (-(-(CTX + 64) // bs)) + 64
    max_len = CTX + 256

    if args.compile_only:  # warm compile in a second process over the same caches
        model = build(args, device, dtype, num_blocks)  # the first process's caches: max_len fits them
        t0 = time.perf_counter()
        runner, compile_s, capture_s = compile_runner(model, args, max_len, capture=device.type == "cuda")
        print(json.dumps({"warm_compile_s": compile_s, "warm_capture_s": capture_s,
                          "warm_total_s": time.perf_counter() - t0, "trace_s": runner.stats.trace_s,
                          "trace_loaded": runner.stats.trace_loaded,
                          "unique_compiles": runner.stats.num_unique_compiles,
                          "process_s": time.perf_counter() - T_START}))
        return

    from common import run_meta, stamp, write_json  # the shared result JSON (benchmarks/common.py)

    os.makedirs(args.out, exist_ok=True)
    res = {
        "meta": run_meta(device=str(device), timing="step latency: CUDA events around --iters "
                                                   "steps, median of 3 runs"),
        "model": {}, "check": None, "compile": {}, "latency_ms": {}, "floor_ms": {}, "skipped": [],
        "errors": {}, "mixed": {}, "trace_cache": not args.no_trace_cache,
    }
    out_json = os.path.join(args.out, f"model_decode_step_{stamp()}.json")

    def save():
        write_json(out_json, res)
        write_md(res, out_json[:-5] + ".md")

    def stage_ok(name):
        if name in args.skip or name.split("_B[")[0] in args.skip:  # "compile_B[8, 32]" -> compile
            res["skipped"].append(f"{name} (--skip)")
            return False
        if time.perf_counter() - T_START > args.deadline_s:
            res["skipped"].append(f"{name} (deadline {args.deadline_s:.0f}s)")
            log(f"skip {name}: past the deadline")
            return False
        return True

    log(f"build model on {device} ({num_blocks} cache blocks)")
    model = build(args, device, dtype, num_blocks)
    cfg = model.cfg
    res["model"] = dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                        kv_heads=cfg.num_kv_heads, head_size=cfg.head_size, vocab=cfg.vocab_size,
                        intermediate=cfg.intermediate_size, dtype=str(dtype), block_size=bs, ctx=CTX,
                        params=sum(p.numel() for p in model.parameters()))

    # --- piecewise compile (cold) + capture ----------------------------------------------
    log("compile_piecewise (cold caches)")
    runner, compile_s, _ = compile_runner(model, args, max_len, capture=False)
    t0 = time.perf_counter()
    try:
        if runner.use_cuda_graphs:  # on CPU the runner has no graphs to capture
            runner.capture()
    except Exception as e:  # keep the eager numbers; graph modes are skipped (a failed capture leaves none)
        res["errors"]["capture"] = repr(e)[:3000]
        log(f"capture failed: {e!r}")
    capture_s = time.perf_counter() - t0
    st = runner.stats
    res["compile"]["cold"] = dict(total_s=compile_s, trace_s=st.trace_s, inductor_s=st.compile_s,
                                  trace_loaded=st.trace_loaded,
                                  capture_s=capture_s, captures=st.num_captures,
                                  unique_compiles=st.num_unique_compiles,
                                  compiled_pieces=st.num_compiled_pieces,
                                  attention_pieces=st.num_attention_pieces,
                                  plugin_active=st.plugin_active,
                                  fused_layers_interleaved_v=sum(l.interleaved_v for l in ira.attention_layers(model)))
    log(f"cold compile {compile_s:.1f}s (trace {st.trace_s:.1f}s), capture {capture_s:.1f}s, "
        f"{st.num_captures} graphs, {st.num_unique_compiles} unique compiles, plugin={st.plugin_active}")
    save()

    # --- 200-step mixed check --------------------------------------------------------------
    if stage_ok("check"):
        try:
            with torch.device(device):
                ref = TinyDecoder(cfg).to(dtype=dtype).eval()
            ref.load_state_dict(model.state_dict())
            ira.bind_kv_caches(ref, 1600, dtype, device, poison=True)
            t0 = time.perf_counter()
            r = run_mixed_decode(runner, ref, steps=args.check_steps, max_seqs=24, max_len=500,
                                 num_blocks=min(1600, num_blocks), seed=0, max_tokens=max(CAPTURE_SIZES))
            res["check"] = dict(r.as_dict(), seconds=time.perf_counter() - t0)
            log(f"check: {res['check']}")
            del ref
        except Exception as e:  # keep going: the timings are still worth having
            res["errors"]["check"] = repr(e)
            log(f"check failed: {e!r}")
        save()

    # random cache contents for timing (never time on poison/zeros)
    with torch.no_grad():
        for layer in ira.attention_layers(model):
            layer.kv_cache.view(dtype).normal_() if layer.kv_cache.dtype == dtype else None

    batches = {b: DecodeBatch(b, bs, num_blocks, cfg.vocab_size, device, seed=b) for b in args.batches}
    for b in args.batches:
        wb, kb = weight_bytes_per_step(model, b), kv_bytes(model, b, CTX)
        res["floor_ms"][str(b)] = dict(weight_bytes=wb, kv_bytes=kb,
                                       floor_ms=(wb + kb) / (READ_CEILING_TBS * 1e12) * 1e3)

    def record(mode, b, fn, iters):
        try:
            ms = time_steps(fn, device, iters)
        except Exception as e:
            res["errors"][f"{mode}_B{b}"] = repr(e)[:2000]
            log(f"{mode} B={b} failed: {e!r}"[:2000])
            return
        res["latency_ms"].setdefault(mode, {})[str(b)] = ms
        log(f"{mode:18s} B={b:3d}: {ms:8.3f} ms")
        save()

    # --- eager and piecewise graphs ------------------------------------------------------------
    for b in args.batches:
        db = batches[b]

        def eager_step():
            with torch.no_grad(), ira.set_forward_context(db.md):
                model(db.ids, db.md.positions)

        iters = max(3, args.iters // 2) if device.type == "cuda" else 2
        record("eager", b, eager_step, iters)
        md = runner.prepare(db.qlens, db.clens, db.tables, whole_step=False)
        if runner._captured:
            record("piecewise_graphs", b, lambda: runner(db.ids, md), args.iters)
        record("piecewise_no_graphs", b, lambda: runner(db.ids, md, use_graphs=False), args.iters)

        def full_step(whole):  # plan + H2D + replay
            m = runner.prepare(db.qlens, db.clens, db.tables, whole_step=whole)
            runner(db.ids, m)

        if runner._captured:
            record("piecewise_graphs_with_plan", b, lambda: full_step(False), args.iters)
        md_step = runner.prepare(db.qlens, db.clens, db.tables)
        if runner.replays_whole_step(md_step):
            record("decode_graphs", b, lambda: runner(db.ids, md_step), args.iters)
            record("decode_graphs_with_plan", b, lambda: full_step(True), args.iters)
        md_mixed = runner.prepare(db.qlens, db.clens, db.tables, whole_step="mixed")
        if runner.replays_whole_step(md_mixed):
            record("mixed_graph", b, lambda: runner(db.ids, md_mixed), args.iters)

    # --- the mixed step ---------------------------------------------------------------------
    if mixed_size(args) and stage_ok("mixed"):
        try:
            mixed_stage(res, args, runner, model, device, num_blocks, bs, save)
        except Exception as e:
            res["errors"]["mixed"] = repr(e)[:3000]
            log(f"mixed step failed: {e!r}")
        save()

    # --- warm compile (second process, same caches) ------------------------------------------
    if stage_ok("warm"):
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--compile-only", "--cache-dir", args.cache_dir]
        if args.tiny:
            cmd.append("--tiny")
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        if args.no_trace_cache:
            cmd.append("--no-trace-cache")
        cmd += ["--mixed", *map(str, args.mixed), "--num-blocks", str(num_blocks)]  # the same trace key
        p = subprocess.run(cmd, capture_output=True, text=True)
        try:
            warm = json.loads(p.stdout.strip().splitlines()[-1])
            warm["process_wall_s"] = time.perf_counter() - t0
            res["compile"]["warm"] = warm
            log(f"warm: {warm}")
        except Exception:
            res["errors"]["warm"] = (p.stdout[-2000:] + p.stderr[-3000:])
            log("warm compile failed:\n" + p.stderr[-3000:])
        save()

    # --- torch.compile, whole model, without / with the plugin -----------------------------------
    # One compile with the token dim dynamic serves B=8/32/64 (both modes first); B=1 needs a
    # second compile (Dynamo specializes size 1), done last, when time is left.
    big = [b for b in args.batches if b != 1]
    phases = [("compile", big), ("compile_plugin", big)]
    if 1 in args.batches:
        phases += [("compile", [1]), ("compile_plugin", [1])]
    for mode, bs_ in phases:
        if not bs_ or not stage_ok(f"{mode}_B{bs_}"):
            continue
        torch._dynamo.reset()
        if mode == "compile_plugin":
            ira.enable()
        else:
            ira.disable()
        cm = torch.compile(model, fullgraph=True)
        for b in bs_:
            db = batches[b]
            ids, pos = db.ids.clone(), db.md.positions.clone()
            if b > 1:
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)
            try:
                t0 = time.perf_counter()
                with torch.no_grad(), ira.set_forward_context(db.md):
                    cm(ids, pos)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
                res["compile"].setdefault(mode + "_first_call_s", {})[str(b)] = first
                log(f"{mode}: first call at B={b} took {first:.1f}s")
            except Exception as e:
                res["errors"][f"{mode}_B{b}"] = repr(e)[:2000]
                log(f"{mode} B={b} failed: {e!r}"[:2000])
                continue

            def step(db=db):
                with torch.no_grad(), ira.set_forward_context(db.md):
                    cm(db.ids, db.md.positions)

            record(mode, b, step, args.iters)
        ira.disable()
        save()

    res["total_s"] = time.perf_counter() - T_START
    save()
    log(f"wrote {out_json}")
    print(open(out_json[:-5] + ".md").read())


def mixed_stage(res, args, runner, model, device, num_blocks, bs, save):
    """The mixed step: check the whole-step graph, then time every mode."""
    p, q, d = args.mixed
    mb = MixedBatch(p, q, d, bs, num_blocks, model.cfg.vocab_size, device, seed=7)
    n = len(mb.ids)
    mixed = res["mixed"]
    mixed.update(prefills=p, prefill_tokens=q, decodes=d, tokens=n, captured_size=runner.padded_size(n))
    md = runner.prepare(mb.qlens, mb.clens, mb.tables)
    mixed["whole_step_graph"] = runner.replays_whole_step(md)
    with torch.no_grad(), ira.set_forward_context(mb.md):
        want = model(mb.ids, mb.md.positions).float()
    got = runner(mb.ids, md).float()
    no_graphs = runner(mb.ids, md, use_graphs=False).float()
    mixed["check"] = dict(bitwise_equal_no_graphs=bool(torch.equal(got, no_graphs)),
                          rel_err_vs_eager=float((got - want).norm() / want.norm()),
                          argmax_agreement=float((got.argmax(-1) == want.argmax(-1)).float().mean()))
    log(f"mixed step ({p} x {q} + {d} decodes = {n} tokens, size {mixed['captured_size']}): {mixed['check']}")
    save()
    lat = mixed.setdefault("latency_ms", {})
    iters = max(3, args.iters // 2) if device.type == "cuda" else 1

    def record(mode, fn):
        try:
            lat[mode] = time_steps(fn, device, iters)
            log(f"mixed {mode:24s}: {lat[mode]:8.3f} ms")
        except Exception as e:
            res["errors"][f"mixed_{mode}"] = repr(e)[:2000]
        save()

    def eager():
        with torch.no_grad(), ira.set_forward_context(mb.md):
            model(mb.ids, mb.md.positions)

    record("eager", eager)
    md_pieces = runner.prepare(mb.qlens, mb.clens, mb.tables, whole_step=False)
    record("piecewise_no_graphs", lambda: runner(mb.ids, md_pieces, use_graphs=False))
    if runner._piece_sizes:
        record("piecewise_graphs", lambda: runner(mb.ids, md_pieces))
    md = runner.prepare(mb.qlens, mb.clens, mb.tables)
    if runner.replays_whole_step(md):
        record("mixed_graph", lambda: runner(mb.ids, md))

        def with_plan():
            runner(mb.ids, runner.prepare(mb.qlens, mb.clens, mb.tables))

        record("mixed_graph_with_plan", with_plan)


def write_md(res, path):
    lat, floor = res["latency_ms"], res["floor_ms"]
    batches = list(floor)
    modes = ["eager", "compile", "compile_plugin", "piecewise_no_graphs", "piecewise_graphs",
             "piecewise_graphs_with_plan", "decode_graphs", "decode_graphs_with_plan", "mixed_graph"]
    meta = res["meta"]
    lines = [f"# End-to-end decode: Qwen3-0.6B-shaped model ({meta['date']})", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']} ({meta['host']}, {meta['cpus']} CPUs); torch {meta['torch']}, "
             f"triton {meta['triton']}, python {meta['python']}  ", f"Model: {res['model']}", "",
             "Step latency, ms (one decode step, 2048 cached tokens per sequence; median of 3 timed runs):", "",
             "| mode | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for m in modes:
        if m in lat:
            lines.append(f"| {m} | " + " | ".join(f"{lat[m][b]:.3f}" if b in lat[m] else "-" for b in batches) + " |")
    lines.append("| memory floor (4.19 TB/s) | " + " | ".join(f"{floor[b]['floor_ms']:.3f}" for b in batches) + " |")
    for mode, label in (("piecewise_graphs", "graphs"), ("decode_graphs", "decode graphs")):
        if "eager" in lat and mode in lat:
            t = lat[mode]
            lines.append(f"| eager / {label} | " + " | ".join(
                f"{lat['eager'][b] / t[b]:.2f}x" if b in t else "-" for b in batches) + " |")
            lines.append(f"| {label} / floor | " + " | ".join(
                f"{t[b] / floor[b]['floor_ms']:.2f}x" if b in t else "-" for b in batches) + " |")
    if "64" in floor and "64" in lat.get("decode_graphs", {}):
        ratio = lat["decode_graphs"]["64"] / floor["64"]["floor_ms"]
        lines += ["", f"B=64 decode (whole-step decode graph): {lat['decode_graphs']['64']:.3f} ms = "
                      f"{ratio:.2f}x the memory floor {floor['64']['floor_ms']:.3f} ms; goal <= {FLOOR_GOAL}x: "
                      f"{'met' if ratio <= FLOOR_GOAL else 'not met'}"]
    mixed = res.get("mixed") or {}
    if mixed.get("latency_ms"):
        ml = mixed["latency_ms"]
        lines += ["", f"Mixed step: {mixed['prefills']} prefills of {mixed['prefill_tokens']} tokens + "
                      f"{mixed['decodes']} decodes ({CTX} cached) = {mixed['tokens']} tokens, captured size "
                      f"{mixed['captured_size']}; check {json.dumps(mixed.get('check'))}", "",
                  "| mode | ms | eager / mode |", "|---|---|---|"]
        for m in ("eager", "piecewise_no_graphs", "piecewise_graphs", "mixed_graph", "mixed_graph_with_plan"):
            if m in ml:
                ratio = f"{ml['eager'] / ml[m]:.2f}x" if "eager" in ml else "-"
                lines.append(f"| {m} | {ml[m]:.3f} | {ratio} |")
    lines += ["", f"Compile: `{json.dumps(res['compile'])}`", "", f"Mixed-batch check: `{json.dumps(res['check'])}`",
              "", f"Skipped: {res['skipped']}", "", f"Errors: `{json.dumps(res['errors'])[:3000]}`", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
