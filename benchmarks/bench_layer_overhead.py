"""What the per-call checks cost on the eager path: ``Attention.forward`` of a decode step, per
layer, with the checks on and with them bypassed (no-ops patched in here, in this process only).

The eager forward runs every step between captured graphs, so its Python work is paid per
layer per step. A model of ``--layers`` attention layers (Qwen3-8B's attention shape by
default) runs ``--steps`` decode steps of ``--batch`` sequences; each step gets its own
metadata object (as an engine builds one per step), so the first layer of a step pays the
step's metadata check and the others hit its memo. Steps end with a device synchronization.
Two paths: ``layer_forward`` (``Attention.forward``: cache update, then attention) and
``attention_op`` (the attention op alone: what runs eagerly between the piecewise graphs,
whose pieces hold the cache update). Variants, interleaved over ``--rounds`` so drift hits
them alike:

- ``checks_on``: the shipped path;
- ``checks_bypassed``: the per-call checks of ``step_checks`` replaced by no-ops;
- ``index_checks`` (GPU only): ``ROCM_ATTN_CHECK_INDICES=1``, the opt-in that reads the
  index tensors back every step;
- ``checks_on_gpu_path`` (CPU only): the index tensors not read (the builder's bounds
  checked instead), i.e. the host work a GPU step pays, timed on the CPU.

Also times each check alone (``micro_us``). On CPU the kernels are replaced by no-ops by
default (``--kernels noop``): the reference kernels take milliseconds and would drown the
host path being measured. Writes ``layer_overhead.json`` under ``--out``.
    python benchmarks/bench_layer_overhead.py [--device cpu] [--layers 28 --steps 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time

import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import step_checks
from inductor_rocm_attn.backend import RocmAttentionImpl
from common import stamp, write_json

# What the bypassed variant replaces (each keeps its return value where the path uses one).
_BYPASS = {
    "check_qkv": lambda *a: None,
    "check_cache_update": lambda op, layer, key, *a: key.shape[0],
    "check_attention_call": lambda op, layer, query, *a: query.shape[0],
    "check_layer_kv": lambda *a: None,
    "check_layer_query": lambda *a: None,
    "check_step_metadata": lambda *a: None,
    "check_step_positions": lambda *a: None,
    "cache_shape": lambda op, layer, kv_cache: kv_cache.shape,
}


@contextlib.contextmanager
def bypassed_checks():
    saved = {n: getattr(step_checks, n) for n in _BYPASS}
    for n, fn in _BYPASS.items():
        setattr(step_checks, n, fn)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(step_checks, n, fn)


@contextlib.contextmanager
def no_index_reads():
    """The host work of a GPU step on any device: index tensors not read back, the builder's
    bounds checked instead (what ``checks_on`` costs on a GPU without the opt-in)."""
    reads = step_checks.index_checks_on
    step_checks.index_checks_on = lambda device: False
    try:
        yield
    finally:
        step_checks.index_checks_on = reads


@contextlib.contextmanager
def index_checks():
    old = os.environ.get("ROCM_ATTN_CHECK_INDICES")
    os.environ["ROCM_ATTN_CHECK_INDICES"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["ROCM_ATTN_CHECK_INDICES"]
        else:
            os.environ["ROCM_ATTN_CHECK_INDICES"] = old


@contextlib.contextmanager
def noop_kernels():
    """Every kernel the layers resolve (after the first call's full validation) does nothing."""
    resolve = RocmAttentionImpl._resolve

    def _resolve(self, sig, *args, **kwargs):
        resolve(self, sig, *args, **kwargs)
        self._kernels[sig] = lambda *a: None
        return self._kernels[sig]

    RocmAttentionImpl._resolve = _resolve
    try:
        yield
    finally:
        RocmAttentionImpl._resolve = resolve


class Model(torch.nn.Module):
    def __init__(self, layers: int, heads: int, kv_heads: int, head_size: int, block_size: int):
        super().__init__()
        self.attn = torch.nn.ModuleList(
            ira.Attention(heads, head_size, num_kv_heads=kv_heads, layer_name=f"overhead.{i}",
                          block_size=block_size) for i in range(layers))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _run_steps(model, mds, call, device) -> float:
    """Seconds per layer per step over ``mds`` (one decode step each); ``call(layer)`` runs one
    layer's eager work."""
    layers = model.attn
    _sync(device)
    t0 = time.perf_counter()
    for md in mds:
        with ira.set_forward_context(md):
            for layer in layers:
                call(layer)
        _sync(device)
    return (time.perf_counter() - t0) / (len(mds) * len(layers))


def _micro(fn, n: int, repeat: int = 5) -> float:
    """Microseconds per call: the best of ``repeat`` runs of ``n // repeat`` calls (the least
    disturbed by other work on the host)."""
    fn()
    n = max(1, n // repeat)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--steps", type=int, default=None, help="default: 1000 on a GPU, 20 on CPU")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=None, help="decode sequences (default: 64 GPU, 2 CPU)")
    p.add_argument("--ctx", type=int, default=None, help="cached tokens per sequence (default: 512 GPU, 16 CPU)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kernels", choices=["real", "noop"], default=None,
                   help="noop: time the host path only (default on CPU); real: default on a GPU")
    p.add_argument("--out", default=f"benchmarks/results/layer_overhead_{stamp()}")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    kernels = args.kernels or ("real" if gpu else "noop")
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    steps = args.steps or (1000 if gpu or kernels == "noop" else 20)
    b = args.batch or (64 if gpu else 8)
    ctx = args.ctx or (512 if gpu else 64)
    torch.manual_seed(0)

    model = Model(args.layers, args.heads, args.kv_heads, args.head_size, args.block_size).to(device)
    per_seq = -(-(ctx + 1) // args.block_size)
    num_blocks = b * per_seq + 1
    ira.bind_kv_caches(model, num_blocks, dtype, device)
    for layer in model.attn:
        layer.kv_cache.normal_()
    alloc = ira.BlockAllocator(num_blocks, args.block_size, shuffle_seed=0)
    for s in range(b):
        alloc.allocate(s, ctx + 1)
    md = ira.build_attention_metadata([1] * b, [ctx] * b, [alloc.block_table(s) for s in range(b)],
                                      args.block_size, device)
    q = torch.randn(b, args.heads * args.head_size, device=device, dtype=dtype)
    k = torch.randn(b, args.kv_heads * args.head_size, device=device, dtype=dtype)
    v = torch.randn_like(k)

    variants = {"checks_on": contextlib.nullcontext, "checks_bypassed": bypassed_checks}
    if gpu:
        variants["index_checks"] = index_checks
    else:  # on CPU the index tensors are always read; this variant times the GPU path's host work
        variants["checks_on_gpu_path"] = no_index_reads
    q3, k3, v3 = q.view(b, args.heads, -1), k.view(b, args.kv_heads, -1), v.view(b, args.kv_heads, -1)
    out = torch.empty_like(q3)
    paths = {
        # Attention.forward: the cache update, then the attention
        "layer_forward": lambda layer: layer(q, k, v),
        # the attention op alone: what runs eagerly between captured graphs (the cache update
        # is inside the piece before it)
        "attention_op": lambda layer: torch.ops.rocm_attn.unified_attention_with_output(
            q3, k3, v3, out, layer.layer_name, None),
    }
    per_round = max(1, steps // args.rounds)
    times = {path: {name: [] for name in variants} for path in paths}
    with torch.no_grad(), (noop_kernels() if kernels == "noop" else contextlib.nullcontext()):
        for path, call in paths.items():
            for name, ctx_mgr in variants.items():  # warm-up: kernels resolved, Triton compiled
                with ctx_mgr():
                    _run_steps(model, [dataclasses.replace(md) for _ in range(2)], call, device)
        for _ in range(args.rounds):
            for path, call in paths.items():
                for name, ctx_mgr in variants.items():
                    mds = [dataclasses.replace(md) for _ in range(per_round)]  # a fresh memo per step
                    with ctx_mgr():
                        times[path][name].append(_run_steps(model, mds, call, device) * 1e6)

    # Each check alone, on this step's tensors (the memo hit is what layers 2..N pay).
    layer = model.attn[0]
    cache, shape = layer.kv_cache, layer.kv_cache.shape
    op = "bench"
    n = 20000 if gpu else 5000
    micro = {
        "check_qkv (Attention.forward)": _micro(lambda: step_checks.check_qkv(layer, q, k, v), n),
        "check_cache_update (memo hit)": _micro(lambda: step_checks.check_cache_update(
            op, layer, k3, v3, cache, md, args.kv_heads, args.head_size), n),
        "cache_shape": _micro(lambda: step_checks.cache_shape(op, layer, cache), n),
        "check_layer_kv": _micro(lambda: step_checks.check_layer_kv(
            op, k3, v3, cache.device, b, args.kv_heads, args.head_size), n),
        "check_layer_query": _micro(lambda: step_checks.check_layer_query(
            op, q3, out, cache.device, args.heads, args.head_size), n),
        "check_attention_call (attention alone, decode step, memo hit)": _micro(
            lambda: step_checks.check_attention_call(op, layer, q3, k3, v3, out, cache, md, args.heads,
                                                     args.kv_heads, args.head_size), n),
        "check_step_metadata (memo hit)": _micro(lambda: step_checks.check_step_metadata(
            op, md, b, cache.device, shape[0], shape[2]), n),
        "check_step_metadata (first layer of a step)": _micro(lambda: step_checks.check_step_metadata(
            op, dataclasses.replace(md), b, cache.device, shape[0], shape[2]), n // 10)
        - _micro(lambda: dataclasses.replace(md), n // 10),
    }
    # What a GPU step pays on its first layer: the builder's bounds, no tensor read (on CPU
    # the tensors are always read; here that is switched off to time the GPU path's host work).
    with no_index_reads():
        micro["check_step_metadata (first layer, from the plan)"] = _micro(lambda: step_checks.check_step_metadata(
            op, dataclasses.replace(md), b, cache.device, shape[0], shape[2]), n // 10) \
            - _micro(lambda: dataclasses.replace(md), n // 10)
    if gpu:
        with index_checks():
            micro["check_step_metadata (first layer, ROCM_ATTN_CHECK_INDICES=1)"] = _micro(
                lambda: step_checks.check_step_metadata(op, dataclasses.replace(md), b, cache.device, shape[0],
                                                        shape[2]), 200)
    # Per layer, the eager path runs check_qkv (Attention.forward), then the cache update's
    # check_cache_update; the attention skips what the cache update and forward of the same
    # call checked (forward's own query stride check is not timed alone).
    per_layer_sum = micro["check_qkv (Attention.forward)"] + micro["check_cache_update (memo hit)"]

    med = {p: {name: statistics.median(ts) for name, ts in v.items()} for p, v in times.items()}
    best = {p: {name: min(ts) for name, ts in v.items()} for p, v in times.items()}
    result = {
        "config": dict(device=str(device), dtype=str(dtype), kernels=kernels, layers=args.layers,
                       steps=per_round * args.rounds, rounds=args.rounds, batch=b, ctx=ctx, heads=args.heads,
                       kv_heads=args.kv_heads, head_size=args.head_size, block_size=args.block_size),
        "us_per_layer": med,
        "us_per_layer_best_round": best,
        "us_per_layer_rounds": times,
        "overhead_vs_bypassed_us_per_layer": {
            p: {name: t - v["checks_bypassed"] for name, t in v.items()} for p, v in med.items()},
        "micro_us": micro,
        "micro_sum_us_per_layer_forward": per_layer_sum,
    }
    print(f"decode B={b} ctx={ctx}, {args.layers} layers x {per_round * args.rounds} steps on {device} "
          f"({dtype}, {kernels} kernels), eager us per layer (median of {args.rounds} rounds):")
    for p, v in med.items():
        for name, t in v.items():
            print(f"  {p:<14} {name:<18} {t:9.2f}  ({t - v['checks_bypassed']:+.2f} vs bypassed; rounds: "
                  f"{', '.join(f'{x:.2f}' for x in times[p][name])})")
    print(f"  the checks of one Attention.forward timed alone: {per_layer_sum:.2f} us (plus the first layer's "
          f"step check, spread over {args.layers} layers)")
    for name, t in micro.items():
        print(f"    {name:<58} {t:8.3f} us")
    write_json(os.path.join(args.out, "layer_overhead.json"), result)
    return result


if __name__ == "__main__":
    main()
