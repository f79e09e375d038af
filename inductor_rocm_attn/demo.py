"""The main job, as ``python -m inductor_rocm_attn demo [--model ...]``.

Default (``run_demo``): a small Qwen3-style decoder of this package served through the paged
path, checked against dense attention computed without any cache. Step 1 prefills some
sequences; step 2 is a mixed batch: a decode, a chunked prefill on top of a cached prefix,
and a fresh prefill. Logits of both steps are compared with a dense causal-SDPA forward over
the whole sequences.

``--model qwen3|llama|mistral|gemma2`` (``run_transformers_demo``): that transformers
architecture built from config (random weights, no download) serves a batch of ragged
prompts on our paged path, compiled piecewise with the plugin (``compile_transformers``;
CUDA graphs on a GPU), greedy, with continuous batching; every generated token's logits are
compared with the same weights under transformers' eager attention over the whole sequence.
Without transformers installed the default demo runs instead.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from . import BlockAllocator, bind_kv_caches, build_attention_metadata, set_forward_context
from .models import TinyDecoder, qwen3_config
from .validation import check_bool


def _step(model, alloc, seqs, plan, device):
    """Run one step: ``plan`` maps seq id -> (start, num_new_tokens)."""
    ids, qlens, clens, tables = [], [], [], []
    for sid, (start, n) in plan.items():
        alloc.allocate(sid, n)
        ids.append(seqs[sid][start:start + n])
        qlens.append(n)
        clens.append(start)
        tables.append(alloc.block_table(sid))
    md = build_attention_metadata(qlens, clens, tables, alloc.block_size, device)
    with set_forward_context(md):
        return model(torch.cat(ids).to(device), md.positions)


def run_demo(*, compile: bool = True, device: str | None = None, dtype=torch.float32, seed: int = 0,
             out=print) -> dict:
    check_bool("run_demo", "compile", compile)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    cfg = qwen3_config(num_layers=2, block_size=16)
    model = TinyDecoder(cfg, name="demo").to(device=device, dtype=dtype).eval()
    num_blocks = 64
    bind_kv_caches(model, num_blocks, dtype, device, poison=True)
    alloc = BlockAllocator(num_blocks, cfg.block_size, shuffle_seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen) for s, n in
            {"a": 40, "b": 50, "c": 12}.items()}

    runner = model
    report = None
    t0 = time.perf_counter()
    say = _progress(out, t0)
    if compile:
        from . import compilation

        compilation.enable()
        runner = torch.compile(model, backend="inductor", dynamic=True)
    out(f"model: Qwen3-style, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
        f"d={cfg.head_size}, block {cfg.block_size}, {dtype}, {device}, "
        f"{'torch.compile + plugin' if compile else 'eager'}")
    first = " (its first call traces and compiles: about a minute on a CPU)" if compile else ""
    with torch.no_grad():
        say(f"step 1: prefill a[0:30], b[0:33]{first}")
        step1 = _step(runner, alloc, seqs, {"a": (0, 30), "b": (0, 33)}, device)
        say("step 2: decode a, chunked prefill b[33:50], prefill c")
        step2 = _step(runner, alloc, seqs, {"a": (30, 1), "b": (33, 17), "c": (0, 12)}, device)
        say("dense reference")
        dense = model.dense_forward([seqs[s].to(device) for s in ("a", "b", "c")])
    elapsed = time.perf_counter() - t0
    ref1 = torch.cat([dense[0][:30], dense[1][:33]])
    ref2 = torch.cat([dense[0][30:31], dense[1][33:50], dense[2][:12]])
    rows = []
    for name, got, ref in (("step 1: prefill a[0:30], b[0:33]", step1, ref1),
                           ("step 2: decode a, chunked prefill b[33:50] on a 33-token prefix, prefill c",
                            step2, ref2)):
        err = float((got.float() - ref.float()).abs().max())
        rel = float((got.double() - ref.double()).norm() / ref.double().norm())
        rows.append((name, err, rel))
    out(f"{'step':<84} {'max |diff|':>11} {'rel err':>9}")
    for name, err, rel in rows:
        out(f"{name:<84} {err:11.2e} {rel:9.2e}")
    ok = all(rel < (1e-4 if dtype == torch.float32 else 2e-2) for _, _, rel in rows)
    interleaved = [l.attn.layer_name for l in model.layers if l.attn.interleaved_v]
    if compile:
        from . import compilation

        report = compilation.fusion_report()
        out(report)
        compilation.disable()
    out(f"layers switched to interleaved V: {interleaved or 'none'}")
    out(f"paged path {'MATCHES' if ok else 'DIFFERS FROM'} dense attention "
        f"({elapsed:.1f} s including compilation)")
    return {"ok": ok, "rows": rows, "report": report, "interleaved": interleaved}


def _progress(out, t0: float):
    """``out`` with the seconds since ``t0`` in front: progress lines of a demo."""
    return lambda message: out(f"  [{time.perf_counter() - t0:6.1f} s] {message}")


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def run_model_demo(model: str = "tiny", **kwargs) -> dict:
    """The demo of ``model``: ``"tiny"`` (this package's small model, ``run_demo``) or a
    transformers architecture (``run_transformers_demo``; ``run_demo`` when transformers is
    not installed)."""
    out = kwargs.get("out", print)
    if model == "tiny":
        return run_demo(**kwargs)
    if not transformers_available():
        out(f"transformers is not installed: running this package's small Qwen3-style model instead of {model}")
        return run_demo(**kwargs)
    return run_transformers_demo(model, **kwargs)


PROMPT_LENS = (7, 19, 12, 26)
STEP_TOKENS = 32  # a step's token budget: the later prompts join while the first decode


def run_transformers_demo(arch: str, *, compile: bool = True, device: str | None = None,
                          dtype=torch.float32, seed: int = 0, new_tokens: int = 8, out=print) -> dict:
    """Serve ``len(PROMPT_LENS)`` ragged prompts through a transformers ``arch`` model on the
    paged path and compare every generated token's logits with eager transformers."""
    check_bool("run_transformers_demo", "compile", compile)
    import transformers

    from .compilation import fusion_report
    from .integrations.batching import generate
    from .integrations.transformers_configs import ARCHITECTURES, tiny_config
    from .integrations.transformers_runner import compile_transformers, eager_runner

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn", dtype=dtype)
    model = model.to(device).eval()
    graphs = compile and device.startswith("cuda")
    how = ("compiled piecewise + plugin" + (" + CUDA graphs" if graphs else " (no GPU: pieces run without graphs)")
           if compile else "eager")
    out(f"model: transformers {type(model).__name__} from config, random weights ({ARCHITECTURES[arch][1]}): "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads}/{config.num_key_value_heads} heads, "
        f"d={config.head_dim}, {dtype}, {device}, {how}")
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out(f"serving {len(prompts)} ragged prompts ({', '.join(map(str, PROMPT_LENS))} tokens), {new_tokens} new "
        f"tokens each, at most {STEP_TOKENS} tokens a step")
    t0 = time.perf_counter()
    say = _progress(out, t0)
    num_blocks = 4 * sum(-(-(n + new_tokens) // 16) for n in PROMPT_LENS)
    sizes = [1, 2, 4, 8, 16, 32]
    if compile:
        fusion_report().clear()
        runner = compile_transformers(model, num_blocks=num_blocks, capture_sizes=sizes, max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, use_cuda_graphs=graphs, plugin=True,
                                      progress=say)
    else:
        runner = eager_runner(model, num_blocks=num_blocks, max_num_seqs=8, max_num_tokens=STEP_TOKENS)

    def on_step(r):
        graph = ", one whole-step graph" if r.whole_step_graph else ""
        seqs = f"{r.num_seqs} sequence{'s' if r.num_seqs != 1 else ''}"
        say(f"step {r.index}: {r.kind}, {seqs}, {r.num_tokens} tokens{graph}: "
            f"{r.seconds * 1e3:.1f} ms")

    result = generate(runner, prompts, new_tokens, max_tokens_per_step=STEP_TOKENS, return_logits=True,
                      on_step=on_step)
    say("reference: eager transformers over each whole sequence (dense attention, no cache)")
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    eager = eager.to(device).eval()
    eager.load_state_dict(model.state_dict())
    rows, ok = [], True
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        for p, toks, logits in zip(prompts, result.tokens, result.logits):
            want = eager(torch.tensor([p + toks[:-1]], device=device)).logits[0, len(p) - 1:].float().cpu()
            got = torch.stack(logits)
            rel = float((got - want).abs().max() / want.abs().max())
            same = want.argmax(-1).tolist() == toks
            ok &= rel < tol and (same or dtype != torch.float32)
            rows.append((len(p), rel, same))
    out(f"{'prompt tokens':>13} {'max rel err':>12}  greedy tokens")
    for n, rel, same in rows:
        out(f"{n:>13} {rel:12.2e}  {'same as eager' if same else 'DIFFER from eager'}")
    report = fusion_report() if compile else None
    if report is not None:
        out(report)
        # The report names a piece's layer by its slot alias: which layers each piece serves.
        for group in runner.stats.piece_groups:
            slots = [runner.pieces[[p.name for p in runner.pieces].index(n)].slots for n in group]
            served = ", ".join(layer.layer_name for s in slots for layer in s) or "no attention layer"
            out(f"  piece {group[0]}{' (shared code)' if len(group) > 1 else ''}: __rocm_attn_slot0__ = {served}")
    interleaved = [name for name, layer in runner.layers.items() if layer.interleaved_v]
    out(f"layers switched to interleaved V: {interleaved or 'none'}")
    out(f"paged path {'MATCHES' if ok else 'DIFFERS FROM'} eager transformers "
        f"({time.perf_counter() - t0:.1f} s{' including compilation' if compile else ''})")
    return {"ok": ok, "rows": rows, "report": report, "interleaved": interleaved, "tokens": result.tokens,
            "steps": result.steps}
