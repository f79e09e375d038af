"""The main job: a small Qwen3-style decoder served through the paged path, checked against
dense attention computed without any cache.

Step 1 prefills some sequences; step 2 is a mixed batch: a decode, a chunked prefill on top
of a cached prefix, and a fresh prefill. Logits of both steps are compared with a dense
causal-SDPA forward over the whole sequences.
"""

from __future__ import annotations

import time

import torch

from . import BlockAllocator, bind_kv_caches, build_attention_metadata, set_forward_context
from .models import TinyDecoder, qwen3_config


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
    if compile:
        from . import compilation

        compilation.enable()
        runner = torch.compile(model, backend="inductor", dynamic=True)
    out(f"model: Qwen3-style, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
        f"d={cfg.head_size}, block {cfg.block_size}, {dtype}, {device}, "
        f"{'torch.compile + plugin' if compile else 'eager'}")
    with torch.no_grad():
        step1 = _step(runner, alloc, seqs, {"a": (0, 30), "b": (0, 33)}, device)
        step2 = _step(runner, alloc, seqs, {"a": (30, 1), "b": (33, 17), "c": (0, 12)}, device)
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
