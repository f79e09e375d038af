"""Checks of the attention kernels (paged_attention, encoder_attention) of any provider.

Every check draws fresh random inputs, poisons the output with NaN first and compares with
``cases.dense_oracle`` / ``cases.oracle_attention`` (independent float64 attention) by
relative norm. Tolerances: fp32 1e-5, fp16 3e-3, bf16 1e-2 (the output rounding alone is
~2.5e-4 / 2e-3 of the norm); fp8 caches compare with the oracle over the rounded cache
values, same tolerances (bf16 2e-2); fused fp8 output quant (GPU only: the interpreter's
fp32->fp8 cast is wrong when rounding carries into the exponent): every element within one
e4m3 step (+3% of its row's rms) of exact / output_scale.

``provider`` is a registered provider's name: the check resolves its kernel through
``providers_under_test.kernel`` (skipping where it is not testable). The Triton launch
knobs (``num_splits``, ``decode_cfg``/``prefill_cfg`` and their ``*_changes``) apply to
the ``triton`` provider only; other providers run the same case without them.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import cases
import providers_under_test as put
from inductor_rocm_attn.layout import fp8_max

if put.INTERPRETER:
    # Triton 3.6's interpreter turns scalars into 1-element numpy arrays, and NumPy >= 2.3
    # refuses int() of those: a loop with a loaded bound (range(lo, hi)) then fails. Make
    # __index__ read the element (interpreter only; compiled kernels are unaffected).
    import triton.runtime.interpreter as _interp

    if not getattr(_interp, "_rocm_attn_index_fix", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._rocm_attn_index_fix = True

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
GPU = "cuda"


def seed() -> int:
    return random.randrange(1 << 30)


def _features(num_heads, *, alibi=False, sinks=False, device="cpu", g=None):
    slopes = (torch.rand(num_heads, generator=g) * 0.5).to(device) if alibi else None
    sink = (torch.randn(num_heads, generator=g) * 2).to(device) if sinks else None
    return slopes, sink


def feature_names(*, causal=True, sliding_window=-1, alibi=False, sinks=False, softcap=0.0,
                  out_fp8=False) -> tuple[str, ...]:
    """The capability-table features a case uses (``capabilities.FEATURES``)."""
    return tuple(name for name, used in (
        ("sliding_window", sliding_window is not None and sliding_window > 0), ("alibi", alibi),
        ("sinks", sinks), ("logits_soft_cap", softcap > 0), ("output_scale", out_fp8),
        ("non_causal", not causal)) if used)


def check_fp8_steps(got, ref, fp8_dtype, seed_):
    """Each fp8 output is within one fp8 step of the exact value / output_scale (clamped),
    plus 3% of its row's rms for the kernel's own bf16-level error before the cast (P is
    rounded to bf16 for the PV product: the bf16 output's worst element measured 1.6% of its
    row's rms over 36 runs on the H200, benchmarks/diag_decode_accuracy.py; a bound of 1% of
    the whole output's rms failed ~1 run in 4 for every decode config)."""
    m = fp8_max(fp8_dtype)
    ref = ref.clamp(-m, m)
    mant = torch.finfo(fp8_dtype).nmant if hasattr(torch.finfo(fp8_dtype), "nmant") else 3
    tiny = torch.finfo(fp8_dtype).smallest_normal
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(tiny))) - mant)
    bad = (got - ref).abs() > step + 0.03 * ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert not bad.any(), (f"{int(bad.sum())} fp8 outputs off by more than one step (seed {seed_}); "
                           f"e.g. got {got[bad][:4].tolist()} want {ref[bad][:4].tolist()}")


def _triton_configs(c, *, num_heads, num_kv_heads, head_size, block_size, dtype, interleaved_v,
                    decode_cfg, prefill_cfg, decode_changes, prefill_changes):
    """The decode/prefill configs a Triton run passes: given ones, or the tuned defaults the
    launcher would pick, with ``*_changes`` applied (None: let the launcher pick)."""
    from inductor_rocm_attn.kernels.triton import configs

    gqa = num_heads // num_kv_heads
    if decode_changes:
        decode_cfg = dataclasses.replace(decode_cfg or configs.decode_config(
            head_size, gqa, block_size, c.kv_cache.dtype, configs.interpreting(), interleaved_v),
            **decode_changes)
    if prefill_changes:
        prefill_cfg = dataclasses.replace(prefill_cfg or configs.prefill_config(
            head_size, gqa, block_size, dtype, configs.interpreting()), **prefill_changes)
    return decode_cfg, prefill_cfg


def check_paged(provider, query_lens, context_lens, *, num_heads=4, num_kv_heads=2, head_size=64,
                block_size=16, dtype=torch.float16, cache_dtype=None, layout="LHBNC",
                interleaved_v=False, causal=True, sliding_window=-1, alibi=False, sinks=False,
                softcap=0.0, out_fp8=False, num_splits=None, device="cpu", key_from_cache=False,
                pad_rows=0, tol=None, decode_cfg=None, prefill_cfg=None, decode_changes=None,
                prefill_changes=None, expect_dense_tma=None, hints=False,
                index_dtype=torch.int32, scale_mult=1.0, kv_pad_nan=0):
    """Run ``provider``'s paged_attention on a fresh random case and compare with the oracle.
    ``expect_dense_tma`` (Triton): whether the new tokens' K/V go through TMA descriptors."""
    from inductor_rocm_attn.layout import CacheLayout

    fn = put.kernel(provider, "paged_attention", device=device, dtype=dtype, head_size=head_size,
                    block_size=block_size, layout=CacheLayout(layout),
                    kv_cache_dtype=put.cache_dtype_name(cache_dtype or dtype, dtype),
                    interleaved_v=interleaved_v,
                    features=feature_names(causal=causal, sliding_window=sliding_window,
                                           alibi=alibi, sinks=sinks, softcap=softcap,
                                           out_fp8=out_fp8))
    seed_ = seed()
    fp8 = cache_dtype is not None and cache_dtype != dtype
    c = cases.make_paged_case(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
        layout=layout, interleaved_v=interleaved_v, k_scale=0.07 if fp8 else 1.0,
        v_scale=0.05 if fp8 else 1.0, device=device, seed=seed_,
    )
    g = torch.Generator().manual_seed(seed_ + 1)
    slopes, sink = _features(num_heads, alibi=alibi, sinks=sinks, device=device, g=g)
    scale = head_size ** -0.5 * scale_mult
    key, value = c.key, c.value
    if key_from_cache:  # prefill reads its new tokens from the cache as well
        from inductor_rocm_attn.kernels import reference as ref

        ref.reshape_and_cache(key, value, c.kv_cache, c.slot_mapping, c.k_scale, c.v_scale,
                              interleaved_v)
        if fp8:  # what is read back is the rounded value
            pytest.skip("key=None with an fp8 cache: oracle would need requantised new tokens")
        key = value = None
    if kv_pad_nan:  # key/value rows past the batch (graph padding) may hold anything
        nan = torch.full((kv_pad_nan, *key.shape[1:]), float("nan"), dtype=key.dtype, device=device)
        key, value = torch.cat([key, nan]), torch.cat([value, nan])
    if index_dtype != torch.int32:
        c.query_start_loc, c.seq_lens, c.block_table = (
            x.to(index_dtype) for x in (c.query_start_loc, c.seq_lens, c.block_table))
    t = c.query.shape[0]
    query = c.query
    if pad_rows:  # rows past query_start_loc[-1] (graph padding) must stay untouched
        query = torch.cat([query, torch.randn(pad_rows, *query.shape[1:], device=device).to(dtype)])
        if key is not None and not kv_pad_nan:
            pad = torch.randn(pad_rows, *key.shape[1:], device=device).to(dtype)
            key, value = torch.cat([key, pad]), torch.cat([value, pad])
    out_dtype = torch.float8_e4m3fn if out_fp8 else dtype
    # The output sits between guard rows: a write outside its rows (e.g. a negative row
    # index of a stray program) is caught even where it lands in no other tensor.
    guarded = cases.Guarded(query.shape, out_dtype, device)
    out = guarded.t
    out_scale = torch.tensor([0.02], device=device) if out_fp8 else None
    knobs = {}
    if provider == "triton":
        decode_cfg, prefill_cfg = _triton_configs(
            c, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            block_size=block_size, dtype=dtype, interleaved_v=interleaved_v, decode_cfg=decode_cfg,
            prefill_cfg=prefill_cfg, decode_changes=decode_changes, prefill_changes=prefill_changes)
        knobs = dict(num_splits=num_splits, decode_cfg=decode_cfg, prefill_cfg=prefill_cfg)
    if hints:
        knobs.update(max_query_len=c.max_query_len, max_seq_len=c.max_seq_len)
    fn(out, query, key, value, c.kv_cache, c.query_start_loc, c.seq_lens, c.block_table, scale,
       c.k_scale, c.v_scale, causal, sliding_window, slopes, sink, softcap, interleaved_v,
       out_scale, **knobs)
    if expect_dense_tma is not None:
        _assert_dense_path(key, value, query, head_size, num_heads // num_kv_heads, block_size,
                           dtype, prefill_cfg, expect_dense_tma)
    guarded.assert_intact()
    if pad_rows:
        assert torch.isnan(out[t:].to(torch.float32)).all(), "padding rows were written"
    ref_out = cases.dense_oracle(c, scale=scale, causal=causal, sliding_window=sliding_window,
                                 alibi_slopes=slopes, sinks=sink, logits_soft_cap=softcap)
    got = out[:t].to(torch.float64).cpu()
    assert not torch.isnan(got).any(), f"unwritten or NaN output rows (seed {seed_})"
    if out_fp8:
        check_fp8_steps(got, ref_out / 0.02, out_dtype, seed_)
        return 0.0
    err = cases.rel_err(got, ref_out)
    assert err < (tol or TOL[dtype]), f"rel err {err:.3e} (seed {seed_})"
    return err


def _assert_dense_path(key, value, query, head_size, gqa, block_size, dtype, prefill_cfg, tma):
    """The Triton launcher's choice for the new tokens' K/V on these tensors: TMA descriptors
    (``tma``) or pointers. The same function and inputs the launcher uses."""
    from inductor_rocm_attn.kernels.triton import configs
    from inductor_rocm_attn.kernels.triton.paged_attention import dense_kv_descriptors, launch_target

    cfg = prefill_cfg or configs.prefill_config(head_size, gqa, block_size, dtype,
                                                configs.interpreting())
    descs = dense_kv_descriptors(key, value, head_size, cfg.block_n,
                                 cfg.dense_tma and launch_target(query.device).tma)
    assert (descs is not None) == tma, "the wrong K/V path was taken"


def check_encoder(provider, seq_lens, *, num_heads=4, num_kv_heads=2, head_size=80,
                  dtype=torch.float16, causal=False, sliding_window=-1, alibi=False, sinks=False,
                  softcap=0.0, out_fp8=False, device="cpu", pad_rows=0):
    """Run ``provider``'s encoder_attention on fresh random varlen sequences; compare.
    ``pad_rows`` rows past ``cu_seqlens[-1]`` (graph padding) must stay untouched."""
    fn = put.kernel(provider, "encoder_attention", device=device, dtype=dtype, head_size=head_size,
                    features=feature_names(causal=causal, sliding_window=sliding_window,
                                           alibi=alibi, sinks=sinks, softcap=softcap,
                                           out_fp8=out_fp8))
    seed_ = seed()
    g = torch.Generator().manual_seed(seed_)
    cu = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0).tolist()), dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t + pad_rows, num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(t + pad_rows, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(t + pad_rows, num_kv_heads, head_size, generator=g).to(dtype)
    slopes, sink = _features(num_heads, alibi=alibi, sinks=sinks, g=g)
    scale = 0.9 * head_size ** -0.5
    ref = torch.zeros(t, num_heads, head_size, dtype=torch.float64)
    for s in range(len(seq_lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            ref[a:b] = cases.oracle_attention(
                q[a:b], k[a:b], v[a:b], q_start_pos=0, scale=scale, causal=causal,
                sliding_window=sliding_window, alibi_slopes=slopes, sinks=sink,
                logits_soft_cap=softcap, encoder=True)
    out_dtype = torch.float8_e4m3fn if out_fp8 else dtype
    guarded = cases.Guarded(q.shape, out_dtype, device)  # a stray write lands in a guard
    out = guarded.t
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    out_scale = torch.tensor([0.02], device=device) if out_fp8 else None
    fn(out, dev(q), dev(k), dev(v), dev(cu), scale, causal, sliding_window, dev(slopes), dev(sink),
       softcap, out_scale)
    guarded.assert_intact()
    assert torch.isnan(out[t:].to(torch.float32)).all(), "padding rows were written"
    got = out[:t].to(torch.float64).cpu()
    assert not torch.isnan(got).any(), f"unwritten output (seed {seed_})"
    if out_fp8:
        check_fp8_steps(got, ref / 0.02, out_dtype, seed_)
        return
    err = cases.rel_err(got, ref)
    assert err < TOL[dtype], f"rel err {err:.3e} (seed {seed_})"
