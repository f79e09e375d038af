"""End to end: small Qwen3-style and Llama-style models compiled with the plugin vs eager.

One scenario per model (module-scoped, one Inductor compile each):

1. eager prefill of sequences a (5 tokens) and b (7) on both models: these tokens are in
   the cache, in the standard V layout, before anything is compiled;
2. compiled mixed step: decode a, chunked prefill of b (+6 on its 7-token prefix), prefill c
   (9): the compile runs the passes, which switch the Qwen3 layers to interleaved V and
   convert a's and b's cached tokens in place;
3. two compiled decode steps of a, b, c;
4. one eager decode step on the compiled model's layers (the eager path follows the switch).

Every step's logits, and at the end every written cache slot (K and V, read through each
layer's own layout), are compared with an eager reference model with the same weights.
Tolerance: fp32 on CPU max |diff| <= 1e-4 (measured ~4e-6); bf16 on a GPU (Triton kernels)
relative error <= 2e-2 on logits, max |diff| <= 2e-2 on the caches.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import plugin
from inductor_rocm_attn.layout import dense_kv
from inductor_rocm_attn.models import TinyDecoder, llama_config, qwen3_config

BLOCK = 16
NUM_BLOCKS = 24


@dataclasses.dataclass
class Scenario:
    name: str
    ref: TinyDecoder
    model: TinyDecoder
    alloc: ira.BlockAllocator
    diffs: list  # (step, max |diff|, rel err)
    report_records: list
    interleaved_before: list
    compile_s: float
    pass_s: float


def _fresh_cache():
    """A private, empty Inductor cache: a hit would skip the passes (and their report)."""
    import torch._inductor.utils as u

    return getattr(u, "fresh_cache", None) and u.fresh_cache() or u.fresh_inductor_cache()


def _run(kind: str, device: str, dtype: torch.dtype) -> Scenario:
    with _fresh_cache():
        return _run_uncached(kind, device, dtype)


def _run_uncached(kind: str, device: str, dtype: torch.dtype) -> Scenario:
    torch.manual_seed(0)
    make = qwen3_config if kind == "qwen3" else llama_config
    impl = dict(rope_impl="torch", norm_impl="torch") if kind == "qwen3" else dict(rope_impl="op", norm_impl="op")
    cfg = make(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=128, block_size=BLOCK, **impl)
    tag = f"e2e_{kind}_{device}_{str(dtype)[6:]}"
    ref = TinyDecoder(cfg, name=f"{tag}_ref").to(device=device, dtype=dtype).eval()
    model = TinyDecoder(cfg, name=tag).to(device=device, dtype=dtype).eval()
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):
        ira.bind_kv_caches(m, NUM_BLOCKS, dtype, device, poison=True)
    alloc = ira.BlockAllocator(NUM_BLOCKS, BLOCK, shuffle_seed=3)
    gen = torch.Generator().manual_seed(1)
    seqs = {s: torch.randint(0, cfg.vocab_size, (40,), generator=gen) for s in "abc"}

    torch._dynamo.reset()
    report = plugin.fusion_report()
    report.clear()
    plugin.enable()
    compiled = torch.compile(model, backend="inductor")
    diffs = []

    def step(label, plan, runner):
        ids, ql, cl, tables = [], [], [], []
        for s, n in plan.items():
            start = alloc.num_tokens(s)
            alloc.allocate(s, n)
            ids.append(seqs[s][start:start + n])
            ql.append(n)
            cl.append(start)
            tables.append(alloc.block_table(s))
        md = ira.build_attention_metadata(ql, cl, tables, BLOCK, device)
        ids = torch.cat(ids).to(device)
        with torch.no_grad():
            with ira.set_forward_context(md):
                want = ref(ids, md.positions)
            pos = md.positions.clone()
            if runner is compiled:
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)
            with ira.set_forward_context(md):
                got = runner(ids, pos)
        err = float((got.float() - want.float()).abs().max())
        rel = float((got.double() - want.double()).norm() / want.double().norm())
        diffs.append((label, err, rel))

    try:
        step("eager prefill a, b", {"a": 5, "b": 7}, model)
        interleaved_before = [l.interleaved_v for l in ira.attention_layers(model)]
        t0 = time.perf_counter()
        step("compiled: decode a, chunked prefill b, prefill c", {"a": 1, "b": 6, "c": 9}, compiled)
        compile_s = time.perf_counter() - t0
        mgr = plugin.enable()
        pass_s = sum(p.last_time_s for p in mgr.passes)
        step("compiled decode 1", {"a": 1, "b": 1, "c": 1}, compiled)
        step("compiled decode 2", {"a": 1, "b": 1, "c": 1}, compiled)
        step("eager decode after the switch", {"a": 1, "b": 1, "c": 1}, model)
    finally:
        plugin.disable()
    records = [r for r in report.records if r.layer_name.startswith(tag + ".")]
    return Scenario(tag, ref, model, alloc, diffs, records, interleaved_before, compile_s, pass_s)


def _cache_diff(sc: Scenario) -> float:
    worst = 0.0
    for lr, lm in zip(ira.attention_layers(sc.ref), ira.attention_layers(sc.model)):
        kr, vr = dense_kv(lr.kv_cache, lr.num_kv_heads, lr.interleaved_v)
        km, vm = dense_kv(lm.kv_cache, lm.num_kv_heads, lm.interleaved_v)
        for s in "abc":
            table = sc.alloc.block_table(s)
            for p in range(sc.alloc.num_tokens(s)):
                b, o = table[p // BLOCK], p % BLOCK
                d = max(float((kr[b, o].float() - km[b, o].float()).abs().max()),
                        float((vr[b, o].float() - vm[b, o].float()).abs().max()))
                worst = max(worst, d if d == d else float("inf"))  # NaN: an unwritten slot
    return worst


PARAMS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=PARAMS)
def device_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def qwen3(device_dtype):
    return _run("qwen3", *device_dtype)


@pytest.fixture(scope="module")
def llama(device_dtype):
    return _run("llama", *device_dtype)


def _check_numbers(sc: Scenario, dtype):
    for label, err, rel in sc.diffs:
        if dtype == torch.float32:
            assert err <= 1e-4, (label, err)
        else:
            assert rel <= 2e-2, (label, err, rel)
    assert _cache_diff(sc) <= (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.compile
def test_qwen3_matches_eager_every_layer_fused_and_switched(qwen3, device_dtype):
    sc = qwen3
    _check_numbers(sc, device_dtype[1])
    fused = [r for r in sc.report_records if r.fused]
    assert [r.pass_name for r in fused] == ["qk_norm_rope_kv_cache_fusion"] * 2
    assert sorted(r.layer_name for r in fused) == [f"{sc.name}.layers.{i}.attn" for i in range(2)]
    assert all(r.switched_interleaved_v for r in fused)
    assert sc.interleaved_before == [False, False]  # eager prefill wrote the standard layout...
    assert all(l.interleaved_v for l in ira.attention_layers(sc.model))  # ...and the compile switched
    assert not any(l.interleaved_v for l in ira.attention_layers(sc.ref))
    print(f"\n{sc.name}: compile {sc.compile_s:.1f} s, passes {sc.pass_s * 1e3:.0f} ms; diffs {sc.diffs}")


@pytest.mark.compile
def test_llama_matches_eager_every_layer_fused(llama, device_dtype):
    sc = llama
    _check_numbers(sc, device_dtype[1])
    fused = [r for r in sc.report_records if r.fused]
    assert [r.pass_name for r in fused] == ["rope_kv_cache_fusion"] * 2
    assert not any(l.interleaved_v for l in ira.attention_layers(sc.model))  # RoPE writer keeps the layout
    print(f"\n{sc.name}: compile {sc.compile_s:.1f} s, passes {sc.pass_s * 1e3:.0f} ms; diffs {sc.diffs}")
