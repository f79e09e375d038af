"""Shared set-up of the reliability tests: a layer with a cache holding one step's tokens, the
next step's valid metadata, and byte snapshots to show that a rejected call wrote nothing."""

from __future__ import annotations

import dataclasses
import itertools

import torch

import inductor_rocm_attn as ira

H, HKV, D, BS = 4, 2, 64, 16
NUM_BLOCKS = 8
_names = itertools.count()


def snapshot(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Bytes of each tensor (NaN-safe: compared as uint8)."""
    return [t.detach().clone().contiguous().view(torch.uint8) for t in tensors]


def unchanged(before: list[torch.Tensor], *tensors: torch.Tensor) -> bool:
    return all(torch.equal(b, t.detach().contiguous().view(torch.uint8)) for b, t in zip(before, tensors))


def qkv(t: int, g: torch.Generator, device="cpu"):
    q = torch.randn(t, H * D, generator=g).to(device)
    k = torch.randn(t, HKV * D, generator=g).to(device)
    v = torch.randn(t, HKV * D, generator=g).to(device)
    return q, k, v


@dataclasses.dataclass
class Stepped:
    """A layer whose cache holds a first step (prefill of 'a' 20 tokens, 'b' 5 tokens) and the
    planned next step (a decode of 'a', a 3-token chunk of 'b', a new 2-token 'c')."""

    layer: ira.Attention
    alloc: ira.BlockAllocator
    md: ira.AttentionMetadata  # the next step's metadata
    query_lens: list
    context_lens: list
    tables: list
    g: torch.Generator

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def stepped_layer(prefix: str = "rel", *, seed: int = 0, layout: str = "LHBNC", **layer_kw) -> Stepped:
    layer = ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"{prefix}.{next(_names)}",
                          cache_layout=layout, **layer_kw)
    ira.bind_kv_caches(layer, NUM_BLOCKS, torch.float32, poison=True)
    alloc = ira.BlockAllocator(NUM_BLOCKS, BS, shuffle_seed=seed)
    g = torch.Generator().manual_seed(seed)
    first = {"a": 20, "b": 5}
    for sid, n in first.items():
        alloc.allocate(sid, n)
    md = ira.build_attention_metadata(list(first.values()), [0, 0], [alloc.block_table(s) for s in first], BS)
    with ira.set_forward_context(md):
        layer(*qkv(sum(first.values()), g))
    plan = {"a": 1, "b": 3, "c": 2}
    ctx = [alloc.num_tokens(s) for s in plan]
    for sid, n in plan.items():
        alloc.allocate(sid, n)
    tables = [list(alloc.block_table(s)) for s in plan]
    md = ira.build_attention_metadata(list(plan.values()), ctx, tables, BS)
    return Stepped(layer, alloc, md, list(plan.values()), ctx, tables, g)


def run_layer_ops(layer: ira.Attention, md, q, k, v, out):
    """What ``Attention.forward`` emits: the cache update, then the attention into ``out``."""
    t = q.shape[0]
    q3, k3, v3 = q.view(t, H, D), k.view(t, HKV, D), v.view(t, HKV, D)
    with ira.set_forward_context(md):
        token = torch.ops.rocm_attn.unified_kv_cache_update(k3, v3, layer.layer_name)
        torch.ops.rocm_attn.unified_attention_with_output(q3, k3, v3, out, layer.layer_name, token)
