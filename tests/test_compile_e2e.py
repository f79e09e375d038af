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
Tolerance: fp32 max |diff| <= 1e-4 on logits and caches (measured ~4e-6); bf16 (CPU
reference kernels, or the Triton kernels on a GPU) relative error <= 2e-2 on logits and on
each layer's cached K/V (and max |diff| < 0.5): compiled bf16 matmuls round differently
from eager, and the fused writer rounds once after norm and RoPE in fp32 where the HF form
rounds to bf16 after each step, so cached values differ by an ulp or two (max |diff| 0.047
measured on the H200).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn import compilation
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
    report = compilation.fusion_report()
    report.clear()
    compilation.enable()
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
        mgr = compilation.enable()
        pass_s = sum(p.last_time_s for p in mgr.passes)
        step("compiled decode 1", {"a": 1, "b": 1, "c": 1}, compiled)
        step("compiled decode 2", {"a": 1, "b": 1, "c": 1}, compiled)
        step("eager decode after the switch", {"a": 1, "b": 1, "c": 1}, model)
    finally:
        compilation.disable()
    records = [r for r in report.records if r.layer_name.startswith(tag + ".")]
    return Scenario(tag, ref, model, alloc, diffs, records, interleaved_before, compile_s, pass_s)


def _cache_diff(sc: Scenario) -> tuple[float, float]:
    """``(max |diff|, worst per-layer relative error)`` over every written K/V slot.

    Each layer's cache is read through its own layout (the compiled model's Qwen3 layers
    are interleaved, the reference's are not); NaN (an unwritten slot read back) fails.
    """
    worst_abs, worst_rel = 0.0, 0.0
    for lr, lm in zip(ira.attention_layers(sc.ref), ira.attention_layers(sc.model)):
        kr, vr = dense_kv(lr.kv_cache, lr.num_kv_heads, lr.interleaved_v)
        km, vm = dense_kv(lm.kv_cache, lm.num_kv_heads, lm.interleaved_v)
        idx = [(t[p // BLOCK], p % BLOCK) for s in "abc" for t in [sc.alloc.block_table(s)]
               for p in range(sc.alloc.num_tokens(s))]
        b = torch.tensor([i for i, _ in idx])
        o = torch.tensor([j for _, j in idx])
        for x, y in ((kr, km), (vr, vm)):
            x, y = x[b, o].double(), y[b, o].double()
            d = (x - y).abs()
            worst_abs = max(worst_abs, float(d.max()) if not d.isnan().any() else float("inf"))
            worst_rel = max(worst_rel, float((x - y).norm() / x.norm()))
    return worst_abs, worst_rel


PARAMS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cpu", torch.bfloat16), id="cpu-bf16"),
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
    err, rel = _cache_diff(sc)
    if dtype == torch.float32:
        assert err <= 1e-4, err
    else:
        assert rel <= 2e-2 and err < 0.5, (err, rel)
    sc.diffs.append(("caches", err, rel))


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
