"""Paged decode over an fp8 cache with a bf16 query through fp16 dots
(``DecodeConfig.fp8_fp16_dot``), against the float64 oracle.

The path converts the bf16 query to fp32 as it loads it, divides it by a power of two and
computes in fp16: nothing is computed in bf16, so Triton's CPU interpreter runs it correctly
(its bf16 arithmetic is not: the same cases through the bf16-compute config miss by ~1e8,
which ``test_interpreter_bf16_compute_is_what_fails`` keeps visible). On a GPU the same checks
run on CUDA tensors; the GPU attention matrix (test_paged_attention.py) covers the config too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cases
from attention_checks import GPU, assert_same_nonfinite, sdpa_visible, seed
from inductor_rocm_attn.kernels.triton.configs import DecodeConfig

ON_GPU = torch.cuda.is_available()
# Each test runs on CPU tensors in the interpreter (CI) and, marked gpu, on CUDA tensors.
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(ON_GPU, reason="CPU interpreter run")),
           pytest.param(GPU, marks=pytest.mark.gpu)]
TOL = 1e-2  # bf16 output (2^-9 rounding), fp16 weights; the fp8 rounding is in the oracle's K/V
ROWS3 = DecodeConfig(16, 1, 3 if ON_GPU else 1, "rows3", fp8_fp16_dot=True)
ROWS = DecodeConfig(32, 2, 3 if ON_GPU else 1, "rows", fp8_fp16_dot=True)
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _case(context_lens, *, cache_dtype, device, num_heads=8, num_kv_heads=2, head_size=64,
          layout="LHBNC", interleaved_v=False, q_mult=None):
    c = cases.make_paged_case([1] * len(context_lens), context_lens, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size,
                              dtype=torch.bfloat16, cache_dtype=cache_dtype, layout=layout,
                              interleaved_v=interleaved_v, k_scale=0.07, v_scale=0.05,
                              device=device, seed=seed())
    if q_mult is not None:  # per-head multipliers (powers of two keep the bf16 query exact)
        c.query = (c.query.float() * q_mult.to(c.query.device).view(1, -1, 1)).to(torch.bfloat16)
    return c


def _run(c, cfg, *, scale, sliding_window=-1, alibi=None, sinks=None, softcap=0.0, num_splits=None):
    from inductor_rocm_attn.kernels.triton.paged_attention import paged_attention

    out = cases.poison(torch.empty_like(c.query))
    dev = c.query.device
    paged_attention(out, c.query, c.key, c.value, c.kv_cache, c.query_start_loc, c.seq_lens,
                    c.block_table, scale, c.k_scale, c.v_scale, True, sliding_window,
                    None if alibi is None else alibi.to(dev), None if sinks is None else sinks.to(dev),
                    softcap, c.interleaved_v, None, max_query_len=1,
                    max_seq_len=int(c.seq_lens.max()), num_splits=num_splits, decode_cfg=cfg)
    return out


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("cfg", [ROWS3, ROWS], ids=["rows3", "rows"])
@pytest.mark.parametrize("feat", [
    dict(num_splits=2),
    dict(sliding_window=37, alibi=True, num_splits=3),
    dict(sinks=True, softcap=6.0, interleaved_v=True, layout="LBHNC"),
    dict(num_heads=16, num_kv_heads=1, head_size=128, interleaved_v=True),
], ids=["split", "window_alibi_split", "sinks_softcap_interleaved_lbhnc", "gqa16_d128"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_fp16_dot_matches_oracle(device, cache_dtype, cfg, feat):
    feat = dict(feat)
    geom = {k: feat.pop(k) for k in ("num_heads", "num_kv_heads", "head_size", "interleaved_v", "layout")
            if k in feat}
    c = _case([70, 5, 130, 33], cache_dtype=cache_dtype, device=device, **geom)
    hq, d = c.query.shape[1], c.query.shape[2]
    g = torch.Generator().manual_seed(seed())
    alibi = torch.rand(hq, generator=g) * 0.2 if feat.pop("alibi", False) else None
    sinks = torch.randn(hq, generator=g) if feat.pop("sinks", False) else None
    scale = d ** -0.5
    out = _run(c, cfg, scale=scale, alibi=alibi, sinks=sinks, **feat)
    want = cases.dense_oracle(c, scale=scale, causal=True, sliding_window=feat.get("sliding_window", -1),
                              alibi_slopes=alibi, sinks=sinks, logits_soft_cap=feat.get("softcap", 0.0))
    assert torch.isfinite(out.float()).all(), "unwritten or non-finite output rows"
    err = cases.rel_err(out, want)
    assert err < TOL, f"rel err {err:.3e}"


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mults", [
    [2.0 ** 20] * 4,  # |q| ~ 1e6: past fp16's 65504 without the power-of-two division
    [2.0 ** -30] * 4,  # |q| ~ 1e-9: below fp16's subnormals without it
    [2.0 ** 12, 1.0, 2.0 ** -6, 2.0 ** 3],  # heads of one program at different magnitudes
], ids=["huge", "tiny", "mixed_heads"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_fp16_dot_query_magnitudes(device, cache_dtype, mults):
    """The query keeps its bf16 value whatever its magnitude: the power of two taken from
    the program's largest element brings it into fp16's range exactly."""
    q_mult = torch.tensor(mults * 2)  # 8 heads: 2 KV heads x GQA 4, one program each
    c = _case([90, 17], cache_dtype=cache_dtype, device=device, q_mult=q_mult)
    scale = 64 ** -0.5 / float(q_mult.max())  # logits of O(1) for the largest head
    out = _run(c, ROWS3, scale=scale, num_splits=2)
    want = cases.dense_oracle(c, scale=scale, causal=True)
    assert torch.isfinite(out.float()).all()
    err = cases.rel_err(out, want)
    assert err < TOL, f"rel err {err:.3e}"


@pytest.mark.parametrize("cfg", [ROWS3, ROWS], ids=["rows3", "rows"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_fp16_dot_nonfinite_query_stays_in_its_head(device, cfg):
    """An inf or NaN query element turns its own head's output NaN (as float64 SDPA) and
    does not enter the power of two the other heads of its program are divided by."""
    c = _case([60, 25], cache_dtype=torch.float8_e4m3fn, device=device)
    c.query[0, 1, 5] = float("inf")
    c.query[1, 6, 0] = float("nan")
    scale = 64 ** -0.5
    out = _run(c, cfg, scale=scale, num_splits=2)
    qsl = c.query_start_loc.tolist()
    want = torch.cat([sdpa_visible(c.query[qsl[s]:qsl[s + 1]].cpu(), c.k_full[s], c.v_full[s],
                                   q_start_pos=int(c.seq_lens[s]) - 1, scale=scale)
                      for s in range(2)])
    assert torch.isnan(want[0, 1]).all() and torch.isnan(want[1, 6]).all()
    assert_same_nonfinite(out, want, TOL, "fp8_fp16_dot")


def test_fp8_fp16_dot_config_rejects_other_kinds():
    for kind in ("keys", "keys3", "streams", "streams3"):
        with pytest.raises(ValueError, match=f"fp8_fp16_dot with kind '{kind}'"):
            DecodeConfig(32, 2, 1, kind, fp8_fp16_dot=True)


@pytest.mark.skipif(ON_GPU, reason="about the CPU interpreter")
def test_interpreter_bf16_compute_is_what_fails():
    """Why the fp16-dot tests can run bf16 queries on CPU while the rest of the matrix cannot:
    the same case through the bf16-compute config is wrong in the interpreter. If this starts
    passing, the interpreter's bf16 got fixed and the CPU matrix can take bf16 again."""
    c = _case([45, 20], cache_dtype=torch.float8_e4m3fn, device="cpu")
    out = _run(c, dataclasses.replace(ROWS3, fp8_fp16_dot=False), scale=64 ** -0.5)
    want = cases.dense_oracle(c, scale=64 ** -0.5, causal=True)
    assert not cases.rel_err(out, want) < TOL
