"""transformers models: our paged backend (plugin + graphs) against transformers' own paths.

Qwen3-0.6B- and Llama-3.2-1B-shaped models built from config (random weights, bf16, no
download; ``integrations.transformers_configs``). Two measurements per model:

**Decode-step latency** at batch ``--batch`` (1 and 64), every sequence holding a ``--ctx``
token prompt: the wall time of one greedy step (host work, model forward and argmax, the
next step fed from it, synchronized at its end as a serving loop that reads its tokens is),
the median over ``--steps`` steps after ``--warmup``:

- ``ours``: ``compile_transformers`` (plugin on), decode steps replayed as whole-step CUDA
  graphs; each step's metadata planned on the host (``runner.prepare``). ``replay_us``: the
  GPU time of the step's graph alone (CUDA events, median of replays).
- ``sdpa_eager``: ``attn_implementation="sdpa"``, its ``DynamicCache``, eager.
- ``sdpa_static_compiled``: ``sdpa`` on a ``StaticCache`` with the forward compiled as
  transformers recommends (``torch.compile(model.forward, mode="reduce-overhead",
  fullgraph=True)``: Inductor + CUDA graphs), prefill eager.
- ``hf_paged``: transformers' continuous batching (``generate_batch``,
  ``attn_implementation="paged|sdpa"``, default config: its CUDA graphs): the median
  interval between a request's token timestamps during the decode phase.

**Throughput**: ``--requests`` (64) ragged prompts (lengths uniform in [ctx/2, 3ctx/2])
generate ``--new-tokens`` greedy tokens each; tokens/s over the whole call (prefill
included): ``ours_generate`` (``integrations.batching.generate`` over the same runner:
continuous batching, decode steps from whole-step graphs), ``hf_paged_generate_batch``
(``generate_batch``: from its requests' creation to their last token timestamp, so its
warm-up is left out as our compile is) and
``sdpa_generate`` (``model.generate`` on the left-padded batch, ``DynamicCache``).

**Checks before timing** (a variant failing its check is not timed): decode variants feed
one fixed token after the prompt and their logits must match eager attention
(``attn_implementation="eager"``, whole sequence, no cache) on two rows within ``--tol``
(``||got - want|| / ||want||``); generating variants' tokens are checked by teacher forcing
on two requests: each token's reference logit must be within ``--tol`` x max|logit| of the
row's best (a near-tie may flip under bf16 rounding; a wrong token is ~1 away). The bf16
default 0.1: against eager attention (CPU, bf16, 96-token prompts) ours and sdpa both
measured 1.5e-2 on the Qwen3-0.6B shape and 3.0e-2 on the Llama-3.2-1B shape (the eager
reference's own rounding); a wrong model is near 1.

    python benchmarks/bench_transformers.py --out $OUT [--model qwen3-0.6b] [--deadline-s 230]
    python benchmarks/bench_transformers.py --tiny --device cpu     # plumbing check, any machine

Writes ``transformers_<date>.json`` (``common.write_json``: command, machine, versions) and
``.md`` to --out. Variants that would start past ``--deadline-s`` are reported as skipped.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import statistics
import sys
import time
import traceback

T_START = time.perf_counter()

import torch  # noqa: E402
import transformers  # noqa: E402

from common import stamp, write_json  # noqa: E402

import inductor_rocm_attn as ira  # noqa: E402
from inductor_rocm_attn.integrations.batching import generate  # noqa: E402
from inductor_rocm_attn.integrations.transformers_configs import (  # noqa: E402
    MODEL_SHAPES, model_shape_config, tiny_config)
from inductor_rocm_attn.integrations.transformers_runner import compile_transformers  # noqa: E402

DECODE_VARIANTS = ("ours", "sdpa_eager", "hf_paged", "sdpa_static_compiled")
GENERATE_VARIANTS = ("ours_generate", "hf_paged_generate_batch", "sdpa_generate")
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
PREFILL_TOKENS = 8192  # our runner's step budget (prefill chunks)


def log(msg):
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- models and inputs ----------------------------------------------------------------------------


def build(config, impl, device, dtype, like=None, seed=0):
    """The model under ``impl``; with ``like``, sharing that model's weights (same tensors)."""
    torch.manual_seed(seed)
    with torch.device(device):  # from_config sets the implementation on the config: a copy each
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                              dtype=dtype)
    if like is not None:
        model.load_state_dict(like.state_dict(), assign=True)
    return model.eval()


def random_prompts(lens, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def gen_config(new_tokens):
    # eos -1: transformers' continuous batching reads it as "no eos"; generate() takes None
    return transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                         pad_token_id=0)


# --- checks ---------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logits(ref, prompts, token):
    """Eager attention over ``prompt + [token]`` (no cache): the logits of the last position."""
    rows = [ref(torch.tensor([p + [token]], device=ref.device), logits_to_keep=1).logits[0, -1] for p in prompts]
    return torch.stack(rows).float().cpu()


def logits_check(got, want, tol):
    got = got.float().cpu()
    rel = float((got - want).norm() / want.norm())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return {"rel_err": rel, "argmax_agreement": agree, "ok": rel < tol}


@torch.no_grad()
def tokens_check(ref, prompts, tokens, new_tokens, tol):
    """Teacher forcing: the reference's logits over ``prompt + tokens[:-1]``; every generated
    token's logit must be within ``tol`` x max|logit| of the best one."""
    worst, exact, total = 0.0, 0, 0
    for p, toks in zip(prompts, tokens):
        if len(toks) != new_tokens:
            return {"ok": False, "why": f"{len(toks)} tokens generated, {new_tokens} asked"}
        seq = torch.tensor([list(p) + toks[:-1]], device=ref.device)
        w = ref(seq, logits_to_keep=len(toks)).logits[0].float().cpu()
        t = torch.tensor(toks)
        margin = (w.max(-1).values - w.gather(-1, t[:, None]).squeeze(-1)) / w.abs().max(-1).values
        worst = max(worst, float(margin.max()))
        exact += int((w.argmax(-1) == t).sum())
        total += len(toks)
    return {"max_margin": worst, "argmax_agreement": exact / total, "ok": worst <= tol}


# --- decode-step variants: prefill(prompts) then step(ids [B]) -> logits [B, V] ------------------


class OursDecode:
    def __init__(self, runner):
        self.runner = runner
        self.alloc = ira.BlockAllocator(next(iter(runner.layers.values())).kv_cache.shape[0], runner.block_size)
        self.lengths: list[int] = []

    def prefill(self, prompts):
        self.lengths = [0] * len(prompts)
        i = 0
        while i < len(prompts):  # whole prompts, as many as fit in a step
            j, n = i, 0
            while j < len(prompts) and (j == i or n + len(prompts[j]) <= PREFILL_TOKENS) and j - i < self.runner.max_num_seqs:
                n += len(prompts[j])
                j += 1
            qlens = [len(p) for p in prompts[i:j]]
            tables = [list(self.alloc.allocate(s, q)) for s, q in zip(range(i, j), qlens)]
            md = self.runner.prepare(qlens, [0] * len(qlens), tables)
            ids = torch.tensor([t for p in prompts[i:j] for t in p], device=self.runner.device)
            self.runner(ids, md)
            for s, q in zip(range(i, j), qlens):
                self.lengths[s] = q
            i = j

    def step(self, ids):
        b = len(self.lengths)
        tables = [self.alloc.allocate(s, 1) for s in range(b)]
        md = self.runner.prepare([1] * b, self.lengths, tables)
        logits = self.runner(ids, md)
        self.lengths = [n + 1 for n in self.lengths]
        self.md = md
        return logits

    def replay_us(self, reps=20):
        """GPU time of the last step's whole-step graph (CUDA events, median)."""
        graph, _ = self.runner._step_graphs[self.md.slot_mapping.shape[0]]
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)


class SdpaDecode:
    def __init__(self, model, static_len=None, compiled=None):
        self.model, self.static_len, self.compiled = model, static_len, compiled

    def prefill(self, prompts):
        ids = torch.tensor(prompts, device=self.model.device)
        cache = (transformers.StaticCache(config=self.model.config, max_cache_len=self.static_len)
                 if self.static_len else transformers.DynamicCache(config=self.model.config))
        with torch.no_grad():
            self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.cache = cache

    def step(self, ids):
        with torch.no_grad():
            if self.compiled is not None:
                torch.compiler.cudagraph_mark_step_begin()
                out = self.compiled(input_ids=ids[:, None], past_key_values=self.cache, use_cache=True)
            else:
                out = self.model(input_ids=ids[:, None], past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]


@torch.no_grad()
def time_decode(variant, prompts, ref_logits, check_token, args, device):
    variant.prefill(prompts)
    first = variant.step(torch.full((len(prompts),), check_token, device=device))
    check = logits_check(first[: ref_logits.shape[0]], ref_logits, args.tol)
    if not check["ok"]:
        return {"check": check}
    nxt = first.argmax(-1)
    for _ in range(args.warmup):
        nxt = variant.step(nxt).argmax(-1)
    sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        nxt = variant.step(nxt).argmax(-1)
        sync(device)  # per-step wall time needs the step's end; the next launch waits on it anyway
        times.append(time.perf_counter() - t0)
    row = {"check": check, "step_ms": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3}
    if isinstance(variant, OursDecode) and device.type == "cuda" and variant.runner.replays_whole_step(variant.md):
        row["replay_us"] = variant.replay_us()
    return row


def hf_paged_decode(model, prompts, ref, args):
    """Step latency of transformers' continuous batching from its token timestamps (its
    warm-up, CUDA-graph capture included, runs before the requests start: not in them)."""
    cfg = gen_config(1 + args.warmup + args.steps)
    out = list(model.generate_batch(prompts, generation_config=cfg, record_timestamps=True).values())
    tokens = [o.generated_tokens for o in out]
    check = tokens_check(ref, prompts[:2], tokens[:2], cfg.max_new_tokens, args.tol)
    if not check["ok"]:
        return {"check": check}
    gaps = [b - a for o in out for a, b in zip(o.timestamps[1 + args.warmup:], o.timestamps[2 + args.warmup:])]
    return {"check": check, "step_ms": statistics.median(gaps) * 1e3, "step_ms_min": min(gaps) * 1e3}


# --- throughput -----------------------------------------------------------------------------------


@torch.no_grad()
def run_generate(name, state, prompts, ref, args, device):
    n = args.new_tokens
    if name == "ours_generate":
        runner = state["runner"]
        # Warm with full-budget prefill chunks: the runner is compiled and captured, but the
        # first steps of a new shape class JIT-compile kernel specializations (seconds each).
        generate(runner, prompts[: max(2, len(prompts) // 4)], 2, max_tokens_per_step=PREFILL_TOKENS)
        sync(device)
        t0 = time.perf_counter()
        res = generate(runner, prompts, n, max_tokens_per_step=PREFILL_TOKENS)
        sync(device)
        seconds, tokens = time.perf_counter() - t0, res.tokens
        extra = {"steps": len(res.steps), "whole_step_graph_steps": sum(s.whole_step_graph for s in res.steps)}
    elif name == "hf_paged_generate_batch":
        # From the requests' own times (created -> last token): its warm-up (CUDA-graph capture,
        # before the requests are added) is left out, as our compile and capture are.
        t0 = time.perf_counter()
        out = list(state["paged"].generate_batch(prompts, generation_config=gen_config(n),
                                                 record_timestamps=True).values())
        call_s = time.perf_counter() - t0
        seconds = max(o.timestamps[-1] for o in out) - min(o.created_time for o in out)
        tokens, extra = [o.generated_tokens for o in out], {"call_s_with_warmup": call_s}
    else:  # sdpa_generate
        model = state["sdpa"]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate(ids[:2], attention_mask=mask[:2], **{**kw, "max_new_tokens": 2})  # warm
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        sync(device)
        seconds = time.perf_counter() - t0
        tokens, extra = out[:, width:].tolist(), {}
    check = tokens_check(ref, prompts[:2], tokens[:2], n, args.tol)
    row = {"check": check, **extra}
    if check["ok"]:  # timed above; reported only when the output is right
        row.update(seconds=seconds, tokens_per_s=sum(map(len, tokens)) / seconds)
    return row


# --- driver ---------------------------------------------------------------------------------------


def config_for(name, args):
    if args.tiny:
        arch = "qwen3" if name.startswith("qwen3") else "llama"
        return tiny_config(arch, num_layers=2, vocab_size=512, max_position_embeddings=4096)
    return model_shape_config(name, **({"num_hidden_layers": args.layers} if args.layers else {}))


def bench_model(name, args, device, dtype, deadline, results, save):
    config = config_for(name, args)
    log(f"{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, d={config.head_dim}, vocab {config.vocab_size}")
    ours_model = build(config, "rocm_attn", device, dtype)
    state = {"ref": build(config, "eager", device, dtype, like=ours_model)}
    ref = state["ref"]
    vocab = config.vocab_size
    max_len = args.ctx * 3 // 2 + args.new_tokens + args.warmup + args.steps + 16
    rng = random.Random(1)
    gen_lens = [rng.randint(args.ctx // 2, args.ctx * 3 // 2) for _ in range(args.requests)]
    gen_prompts = random_prompts(gen_lens, vocab, seed=2)
    check_token = 7

    def record(kind, variant, batch, row):
        row = {"model": name, "kind": kind, "variant": variant, "batch": batch, "ctx": args.ctx, **row}
        results.append(row)
        save()  # after every variant: a run cut short keeps what finished
        ok = row.get("check", {}).get("ok")
        what = (f"{row['step_ms']:.3f} ms/step" if "step_ms" in row else
                f"{row['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in row else row.get("skipped") or
                row.get("error") or "check FAILED")
        log(f"  {name} {variant} B={batch}: {what} (check {'ok' if ok else ok}: {row.get('check')})")

    def run(kind, variant, batch, fn):
        if time.perf_counter() > deadline:
            record(kind, variant, batch, {"skipped": "deadline"})
            return
        try:
            record(kind, variant, batch, fn())
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others
            traceback.print_exc()
            record(kind, variant, batch, {"error": f"{type(e).__name__}: {e}"[:500]})

    def need(key, make):
        if key not in state:
            state[key] = make()
        return state[key]

    def ours_runner():
        ira.fusion_report().clear()
        t0 = time.perf_counter()
        runner = compile_transformers(
            ours_model, num_blocks=args.requests * (-(-max_len // 16)) + 64, capture_sizes=CAPTURE_SIZES,
            max_num_seqs=max(CAPTURE_SIZES), max_num_tokens=PREFILL_TOKENS, max_model_len=max_len, plugin=True,
            progress=lambda m: log(f"    {m}"))
        state["ours_compile_s"] = time.perf_counter() - t0
        report = ira.fusion_report()
        log(f"    fusion report:\n{report}")
        state["fusions"] = f"{sum(r.fused for r in report.records)} fused of {len(report.records)} sites"
        return runner

    sdpa = lambda: build(config, "sdpa", device, dtype, like=ours_model)  # noqa: E731
    paged = lambda: build(config, "paged|sdpa", device, dtype, like=ours_model)  # noqa: E731
    inputs: dict[int, tuple] = {}

    def decode_inputs(batch):  # prompts of --ctx tokens and the reference logits of the check step
        if batch not in inputs:
            prompts = random_prompts([args.ctx] * batch, vocab, seed=batch)
            inputs[batch] = prompts, reference_logits(ref, prompts[:2], check_token)
        return inputs[batch]

    def decode(variant, batch):
        prompts, want = decode_inputs(batch)
        if variant == "ours":
            return time_decode(OursDecode(need("runner", ours_runner)), prompts, want, check_token, args, device)
        if variant == "sdpa_eager":
            return time_decode(SdpaDecode(need("sdpa", sdpa)), prompts, want, check_token, args, device)
        if variant == "hf_paged":
            return hf_paged_decode(need("paged", paged), prompts, ref, args)
        model = need("sdpa", sdpa)
        compiled = need("compiled", lambda: torch.compile(model.forward, mode="reduce-overhead", fullgraph=True))
        static_len = args.ctx + 1 + args.warmup + args.steps + 8
        return time_decode(SdpaDecode(model, static_len, compiled), prompts, want, check_token, args, device)

    owner = {"ours_generate": ("runner", ours_runner), "hf_paged_generate_batch": ("paged", paged),
             "sdpa_generate": ("sdpa", sdpa)}
    # Most wanted first (a deadline cuts the tail): the compiled sdpa variant compiles per batch size.
    for kind, variant in [("decode", "ours"), ("decode", "sdpa_eager"), ("decode", "hf_paged"),
                          ("generate", "ours_generate"), ("generate", "hf_paged_generate_batch"),
                          ("generate", "sdpa_generate"), ("decode", "sdpa_static_compiled")]:
        if variant not in args.variants:
            continue
        if kind == "generate":
            run(kind, variant, args.requests, lambda v=variant: (
                need(*owner[v]), run_generate(v, state, gen_prompts, ref, args, device))[1])
            continue
        batches = sorted(args.batch, reverse=variant == "sdpa_static_compiled")
        for batch in batches:
            run(kind, variant, batch, lambda v=variant, b=batch: decode(v, b))
    meta = {"model": name, "config": {k: getattr(config, k) for k in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size")}, "ours_compile_s": state.get("ours_compile_s"), "fusions": state.get("fusions"),
        "generate_prompt_lens": [min(gen_lens), max(gen_lens), sum(gen_lens)]}
    state.clear()
    del ours_model, ref
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return meta


def markdown(results, metas):
    lines = ["# transformers models: ours vs transformers' paths", ""]
    for m in metas:
        lines.append(f"- {m['model']}: {m['config']}; our compile {m['ours_compile_s'] or 0:.1f} s; "
                     f"fusion report: {m['fusions']}; ragged prompt lengths (min, max, sum) {m['generate_prompt_lens']}")
    lines += ["", "| model | kind | variant | B | result | check |", "|---|---|---|---|---|---|"]
    for r in results:
        res = (f"{r['step_ms']:.3f} ms/step" + (f" (graph {r['replay_us']:.0f} us)" if "replay_us" in r else "")
               if "step_ms" in r else f"{r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else
               r.get("skipped") or r.get("error", "not timed"))
        c = r.get("check", {})
        chk = ("ok" if c.get("ok") else "FAILED") + "".join(
            f" {k}={v:.2g}" for k, v in c.items() if isinstance(v, float)) if c else "-"
        lines.append(f"| {r['model']} | {r['kind']} | {r['variant']} | {r['batch']} | {res} | {chk} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens per sequence (decode latency)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64, help="ragged requests (throughput)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (throughput)")
    ap.add_argument("--variants", nargs="+", default=list(DECODE_VARIANTS + GENERATE_VARIANTS),
                    choices=list(DECODE_VARIANTS + GENERATE_VARIANTS))
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quick checks)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tol", type=float, default=None, help="check tolerance (default 0.1 bf16/fp16, 1e-3 fp32)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs and sizes: checks the plumbing")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip variants that would start later")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        args.ctx, args.steps, args.warmup, args.requests, args.new_tokens = 32, 3, 2, 6, 6
        args.batch = [min(b, 4) for b in args.batch]
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    args.tol = args.tol or (1e-3 if dtype == torch.float32 else 0.1)
    if device.type == "cpu":  # transformers sizes its paged cache from free accelerator memory (or psutil)
        import transformers.generation.continuous_batching.cache as cb_cache
        cb_cache.get_device_and_memory_breakdown = lambda: (device, 8 << 30, 0, 0)
    results, metas = [], []
    path = os.path.join(args.out, f"transformers_{stamp()}.json")

    def save():
        write_json(path, {"meta": {"transformers": transformers.__version__, "dtype": str(dtype), "tol": args.tol,
                                   "models": metas}, "results": results})
        with open(path[:-5] + ".md", "w") as f:
            f.write(markdown(results, metas))

    share = (args.deadline_s - (time.perf_counter() - T_START)) / len(args.model)
    for i, name in enumerate(args.model):
        deadline = T_START + args.deadline_s if i == len(args.model) - 1 else time.perf_counter() + share
        metas.append(bench_model(name, args, device, dtype, deadline, results, save))
    save()
    print(markdown(results, metas))
    log(f"wrote {path}")
    bad = [r for r in results if "error" in r or ("check" in r and not r["check"].get("ok"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
