"""A mixed-batch serving schedule that checks a ``PiecewiseRunner`` against the eager model.

Sequences join with a prefill chunk while others decode (mixed steps), grow one token a
step, finish and free their blocks, so sequence lengths, block tables and the token count
(padded up to a captured size) change every step. Each step runs three ways on the same
inputs: the runner replaying graphs, the runner's compiled pieces without graphs at the same
padded size (must be bitwise equal: same kernels, same shapes) and the eager reference model
with its own caches (equal up to compiler rounding).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from .block_allocator import BlockAllocator
from .forward_context import set_forward_context
from .metadata import build_attention_metadata

__all__ = ["MixedDecodeResult", "run_mixed_decode"]


@dataclasses.dataclass
class MixedDecodeResult:
    steps: int = 0
    graph_steps: int = 0  # steps whose size was captured (replayed from graphs)
    whole_step_steps: int = 0  # of those, decode steps replayed as one whole-step graph
    padded_steps: int = 0  # steps whose token count was padded up
    mixed_steps: int = 0  # steps holding a prefill chunk and decodes
    token_counts: list = dataclasses.field(default_factory=list)
    max_rel_err: float = 0.0  # ||graph - eager|| / ||eager||, worst step
    max_abs_err: float = 0.0
    argmax_agreement: float = 1.0  # share of tokens whose argmax matches eager
    graphs_bitwise_equal_pieces: bool = True  # graph replay == compiled pieces without graphs
    captures_before: int = 0
    captures_after: int = 0
    finite: bool = True

    def as_dict(self):
        d = dataclasses.asdict(self)
        d["distinct_token_counts"] = sorted(set(self.token_counts))
        del d["token_counts"]
        return d


@torch.no_grad()
def run_mixed_decode(runner, ref_model, *, steps: int = 200, max_tokens: int | None = None,
                     max_seqs: int = 12, max_len: int = 256, num_blocks: int | None = None,
                     vocab: int | None = None, seed: int = 0,
                     compare_no_graphs: bool = True) -> MixedDecodeResult:
    """Drive ``runner`` (and ``ref_model`` eagerly, same weights, own caches) through a
    mixed schedule of ``steps`` steps; every step's token count stays within
    ``max_tokens`` (default: the largest captured size)."""
    rng = random.Random(seed)
    device = runner.device
    block_size = runner.block_size
    vocab = vocab or ref_model.cfg.vocab_size
    max_tokens = max_tokens or max(runner.capture_sizes)
    cache_blocks = next(iter(runner._layers.values())).kv_cache.shape[0]
    alloc = BlockAllocator(num_blocks or cache_blocks, block_size, shuffle_seed=seed)
    res = MixedDecodeResult(captures_before=runner.stats.num_captures)
    active: dict[int, dict] = {}  # seq id -> {"ctx": cached tokens, "target": final length}
    next_id = 0
    agree = total = 0
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        # Finish sequences that reached their length.
        for sid in [s for s, st in active.items() if st["ctx"] >= st["target"]]:
            alloc.free(sid)
            del active[sid]
        budget = max_tokens - len(active)
        # Join: a prefill chunk (whole prompt) when there is room.
        joins = []
        while len(active) + len(joins) < max_seqs and budget > 1 and (not active or rng.random() < 0.35):
            plen = rng.randint(2, min(24, budget))
            joins.append((next_id, plen))
            budget -= plen
            next_id += 1
            if rng.random() < 0.5:
                break
        qlens, clens, tables = [], [], []
        for sid, st in active.items():
            qlens.append(1)
            clens.append(st["ctx"])
        order = list(active)
        for sid, plen in joins:
            active[sid] = {"ctx": 0, "target": rng.randint(plen + 1, max_len - 1)}
            order.append(sid)
            qlens.append(plen)
            clens.append(0)
        for sid, q in zip(order, qlens):
            tables.append(list(alloc.allocate(sid, q)))
        n = sum(qlens)
        ids = torch.randint(0, vocab, (n,), generator=g).to(device)

        md = runner.prepare(qlens, clens, tables)
        size = md.slot_mapping.shape[0]
        res.token_counts.append(size)
        res.padded_steps += size > n
        res.mixed_steps += any(q > 1 for q in qlens) and any(q == 1 for q in qlens)
        res.graph_steps += size in runner._captured
        res.whole_step_steps += runner.replays_whole_step(md)
        if compare_no_graphs and size in runner._captured:
            pieces = runner(ids, md, use_graphs=False).clone()  # writes the same K/V as below
        out = runner(ids, md).clone()
        ref_md = build_attention_metadata(qlens, clens, tables, block_size, device)
        with set_forward_context(ref_md):
            ref = ref_model(ids, ref_md.positions)
        if compare_no_graphs and size in runner._captured and not torch.equal(pieces, out):
            res.graphs_bitwise_equal_pieces = False
        o, r = out.float(), ref.float()
        res.finite &= bool(torch.isfinite(o).all())
        res.max_abs_err = max(res.max_abs_err, (o - r).abs().max().item())
        res.max_rel_err = max(res.max_rel_err, ((o - r).norm() / r.norm()).item())
        agree += (o.argmax(-1) == r.argmax(-1)).sum().item()
        total += n
        for sid, q in zip(order, qlens):
            active[sid]["ctx"] += q
        res.steps += 1
    res.argmax_agreement = agree / max(total, 1)
    res.captures_after = runner.stats.num_captures
    return res
