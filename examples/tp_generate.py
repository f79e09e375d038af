"""Greedy generation with a tensor-parallel Qwen3-style model (random weights), one process per rank.

    torchrun --nproc-per-node 2 examples/tp_generate.py                 # CPU (gloo), eager
    torchrun --nproc-per-node 2 examples/tp_generate.py --compile       # + piecewise compile
    torchrun --nproc-per-node 2 examples/tp_generate.py --device cuda --compile   # NCCL, graphs

Every rank builds the same model (rank 0's weights broadcast), keeps its shard of the heads
and of the MLP (``inductor_rocm_attn.parallel``), binds its own KV-cache shard and runs the
same steps; the two row-parallel projections of each layer all-reduce, so every rank gets
the full logits and picks the same tokens. ``--compile`` runs ``compile_piecewise`` with the
plugin (CUDA/HIP graphs on a GPU); ``--check`` compares each step's logits with the unsharded
model's on every rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import inductor_rocm_attn as ira
from inductor_rocm_attn.compilation import compile_piecewise
from inductor_rocm_attn.models import TinyDecoder, qwen3_config
from inductor_rocm_attn.parallel import TensorParallel, shard_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--compile", action="store_true", help="compile_piecewise with the plugin")
    p.add_argument("--check", action="store_true", help="compare with the unsharded model")
    args = p.parse_args()

    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    tp = TensorParallel.from_group()  # the default group: every launched process

    cfg = qwen3_config(num_layers=args.layers, hidden_size=512, intermediate_size=1024, vocab_size=1024,
                       num_heads=8, num_kv_heads=4, head_size=64)
    torch.manual_seed(0)
    full = TinyDecoder(cfg, name="full").to(device=device, dtype=dtype).eval()
    for t in full.state_dict().values():
        dist.broadcast(t, src=0)
    model = shard_model(full, tp, name="tp")
    num_blocks, block = 64, cfg.block_size
    ira.bind_kv_caches(model, num_blocks, dtype, device)
    if args.check:
        ira.bind_kv_caches(full, num_blocks, dtype, device)
    else:
        del full

    runner = None
    if args.compile:
        runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_seqs=8,
                                   max_num_tokens=64, max_model_len=256)

    alloc = ira.BlockAllocator(num_blocks, block)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
            for _ in range(args.prompts)]
    worst = 0.0
    for step in range(args.new_tokens):
        qlens = [len(s) if step == 0 else 1 for s in seqs]
        clens = [len(s) - q for s, q in zip(seqs, qlens)]
        tables = [list(alloc.allocate(i, q)) for i, q in enumerate(qlens)]
        ids = torch.tensor([t for s, q in zip(seqs, qlens) for t in s[len(s) - q:]], device=device)
        if runner is not None:
            logits = runner(ids, runner.prepare(qlens, clens, tables))
        else:
            md = ira.build_attention_metadata(qlens, clens, tables, block, device)
            with torch.no_grad(), ira.set_forward_context(md):
                logits = model(ids, md.positions)
        last = torch.tensor(qlens).cumsum(0) - 1
        if args.check:
            md = ira.build_attention_metadata(qlens, clens, tables, block, device)
            with torch.no_grad(), ira.set_forward_context(md):
                want = full(ids, md.positions)
            worst = max(worst, float((logits.float() - want.float()).abs().max()))
        for s, tok in zip(seqs, logits[last.to(device)].argmax(-1).tolist()):
            s.append(tok)

    generated = [s[args.prompt_len:] for s in seqs]
    everyone = [None] * tp.size
    dist.all_gather_object(everyone, generated)
    if tp.rank == 0:
        print(f"tensor parallel: {tp.size} ranks, {cfg.num_heads // tp.size} query heads and "
              f"{model.layers[0].num_kv_heads} KV head(s) per rank, {'compiled' if runner else 'eager'}")
        for i, g in enumerate(generated):
            print(f"  sequence {i}: {g}")
        print(f"  every rank generated the same tokens: {all(e == generated for e in everyone)}")
        if runner is not None:
            print(ira.fusion_report())
    if args.check:
        print(f"rank {tp.rank}: max |logit diff| vs the unsharded model: {worst:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
