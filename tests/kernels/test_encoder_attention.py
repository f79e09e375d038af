"""``encoder_attention`` (no cache, varlen) of every provider against the float64 oracle.

CPU: the reference, and Triton in its interpreter (fp16/fp32); ``gpu``: the GPU providers
in bf16/fp16 with longer sequences and fused fp8 output quant. Checks and tolerances:
``attention_checks.py``.
"""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from attention_checks import GPU, check_encoder, check_encoder_nonfinite

PROVIDERS = put.providers_for("encoder_attention")

ENC_CASES = [
    ("plain", dict()),
    ("causal_window_alibi_sinks_softcap", dict(causal=True, sliding_window=5, alibi=True,
                                                sinks=True, softcap=3.0)),
    ("noncausal_window_gqa", dict(sliding_window=4, num_kv_heads=1)),
    ("fp32_d256", dict(dtype=torch.float32, head_size=256)),
]
# The interpreter's fp32 -> fp8 cast is wrong where rounding carries into the exponent
# (1.98 -> 1.0, 31.9 -> 16 with triton 3.6): fused fp8 output quant is tested on the GPU only.
ENC_GPU_ONLY = [("fp8_out", dict(out_fp8=True))]
GPU_CASES = [c for c in ENC_CASES + ENC_GPU_ONLY if c[0] != "fp32_d256"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU matrix; the gpu tests cover CUDA")
@pytest.mark.parametrize("kw", [c[1] for c in ENC_CASES], ids=[c[0] for c in ENC_CASES])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention(provider, kw):
    check_encoder(provider, [7, 0, 23, 3], **kw)


# Padding rows past cu_seqlens[-1] crossing the interpreter's 16-row blocks, empty sequences
# in the middle and at the end, token counts that are multiples of no tile.
PAD_CASES = [
    ("seq2_pad14", [2], 14, dict()),
    ("empty_middle_and_end", [7, 0, 23, 3, 0], 20, dict(causal=True, sliding_window=4)),
    ("empty_first", [0, 5, 0, 17], 27, dict(sinks=True)),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU matrix; the gpu tests cover CUDA")
@pytest.mark.parametrize("seq_lens,pad_rows,kw", [c[1:] for c in PAD_CASES], ids=[c[0] for c in PAD_CASES])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_padding_rows(provider, seq_lens, pad_rows, kw):
    check_encoder(provider, seq_lens, pad_rows=pad_rows, **kw)


NAN, INF = float("nan"), float("inf")
# (tensor, row of the batch, head, channel, value); sequences [5, 20] (rows 5..24)
NONFINITE_CASES = [
    ("q_nan", [("q", 9, 1, 3, NAN)], dict()),
    ("v_inf_window_both_sides", [("v", 13, 0, 2, INF)], dict(sliding_window=3)),
    ("k_nan_causal", [("k", 20, 1, 0, NAN)], dict(causal=True)),
    ("v_nan_causal_window", [("v", 12, 1, 7, NAN)], dict(causal=True, sliding_window=4)),
    ("k_neg_inf_v_neg_inf", [("k", 2, 0, 1, -INF), ("v", 16, 1, 4, -INF)], dict()),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU matrix; the gpu tests cover CUDA")
@pytest.mark.parametrize("inject,kw", [c[1:] for c in NONFINITE_CASES], ids=[c[0] for c in NONFINITE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_nonfinite(provider, dtype, inject, kw):
    """NaN / inf propagate as float64 SDPA over each row's visible keys; rows that mask the
    key (the two-sided window, causal) are not affected."""
    check_encoder_nonfinite(provider, [5, 20], inject, dtype=dtype, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("inject,kw", [
    ([("q", 400, 1, 3, NAN), ("v", 900, 0, 2, INF)], dict(sliding_window=100)),
    ([("k", 500, 1, 0, NAN), ("v", 777, 1, 7, -INF)], dict(causal=True, sliding_window=200)),
], ids=["q_nan_v_inf_window", "k_nan_v_neg_inf_causal_window"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_nonfinite_gpu(provider, inject, kw):
    check_encoder_nonfinite(provider, [300, 700], inject, dtype=torch.bfloat16, device=GPU,
                            head_size=128, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens,pad_rows", [([2], 254), ([700, 0, 333, 1, 0], 300)],
                         ids=["seq2_pad254", "empty_middle_and_end_pad300"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_padding_rows_gpu(provider, seq_lens, pad_rows, causal):
    """GPU row blocks (64-128 rows): the padding crosses several of them."""
    check_encoder(provider, seq_lens, dtype=torch.bfloat16, device=GPU, head_size=128,
                  pad_rows=pad_rows, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kw", [c[1] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_gpu(provider, kw, dtype):
    check_encoder(provider, [700, 1, 0, 333, 1030], dtype=dtype, device=GPU, head_size=128, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_gpu_head_size_512(provider, causal):
    """Head size 512 takes prefill's head-512 tile (configs.prefill_config: 32 x 16 over 4
    warps, a bounded spill on sm_90): ragged sequences, an empty one, GQA 8."""
    check_encoder(provider, [700, 1, 0, 333], dtype=torch.bfloat16, device=GPU, head_size=512,
                  num_heads=16, num_kv_heads=2, causal=causal)
