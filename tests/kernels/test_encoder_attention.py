"""``encoder_attention`` (no cache, varlen) of every provider against the float64 oracle.

CPU: the reference, and Triton in its interpreter (fp16/fp32); ``gpu``: the GPU providers
in bf16/fp16 with longer sequences and fused fp8 output quant. Checks and tolerances:
``attention_checks.py``.
"""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from attention_checks import GPU, check_encoder

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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kw", [c[1] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_encoder_attention_gpu(provider, kw, dtype):
    check_encoder(provider, [700, 1, 0, 333, 1030], dtype=dtype, device=GPU, head_size=128, **kw)
