"""The providers the kernel tests run, read from the provider registry.

Every test in tests/kernels/ is parametrized over the registered providers that implement
its op (``providers_for(op)``), so a new provider is tested by registering it. A provider
runs where it is testable here (``kernel(...)`` skips with the reason otherwise):
- ``reference``: with CPU tensors (it is the CPU implementation of every op);
- ``triton``: on a GPU, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set by
  conftest.py without a GPU) in fp16/fp32: the interpreter computes bf16 wrongly;
- any other: when it is available here and its capabilities cover the case.

Reads ``inductor_rocm_attn.providers.REGISTRY`` (``Provider.caps``, ``.load(op)``,
``.unavailable_reason()``, ``.supports(op, ...)``).
"""

from __future__ import annotations

import os

import pytest
import torch

from inductor_rocm_attn.providers import REGISTRY as _REGISTRY

ON_GPU = torch.cuda.is_available()
INTERPRETER = not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRETER_DTYPES = (torch.float16, torch.float32)


def load(name: str, op: str):
    """The provider's kernel function for ``op`` (the signature of ``kernels.reference``)."""
    return _REGISTRY[name].load(op)


def unavailable_reason(name: str) -> str | None:
    return _REGISTRY[name].unavailable_reason()


def supports(name: str, op: str, **query) -> str | None:
    return _REGISTRY[name].supports(op, **query)


def providers_for(op: str) -> list[str]:
    """Registered providers that implement ``op``, in registry order (test parameters)."""
    return [n for n, p in _REGISTRY.items() if op in p.caps.ops]


def cache_dtype_name(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` string of a cache of ``cache_dtype`` for a ``model_dtype`` model."""
    if cache_dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    if cache_dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    return "auto" if cache_dtype == model_dtype else {
        torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[cache_dtype]


def why_not_testable(name: str, op: str, *, device: str, dtype: torch.dtype, head_size: int,
                     **query) -> str | None:
    """Why provider ``name`` cannot be tested on this case here, or None."""
    if name == "reference" and device != "cpu":
        return "the reference is tested with CPU tensors"
    if name == "triton" and device == "cpu":
        if not INTERPRETER:
            return "Triton on CPU tensors needs its interpreter (TRITON_INTERPRET=1, no GPU)"
        if dtype not in _INTERPRETER_DTYPES:
            return f"Triton's interpreter computes {dtype} wrongly (fp16/fp32 only on CPU)"
        # the rest of the capability table as on a GPU
        return supports(name, op, device="cuda", dtype=dtype, head_size=head_size, **query)
    why = supports(name, op, device=device, dtype=dtype, head_size=head_size, **query)
    return why or unavailable_reason(name)


def kernel(name: str, op: str, *, device: str, dtype: torch.dtype, head_size: int, **query):
    """Provider ``name``'s kernel for ``op``; skips the test when it is not testable here.
    ``query``: the remaining keywords of ``supports`` (block_size, layout, kv_cache_dtype,
    interleaved_v, features)."""
    why = why_not_testable(name, op, device=device, dtype=dtype, head_size=head_size, **query)
    if why is not None:
        pytest.skip(f"{name}: {why}")
    return load(name, op)
