"""The one capability table: what the backend and each provider support.

Validation (clear errors for bad input) and provider dispatch both read this module, so an
error message and a dispatch decision can never disagree. Every predicate is pure and
returns ``None`` when supported, else a human-readable reason.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util

import torch

from .layout import SUPPORTED_KV_CACHE_DTYPES, CacheLayout

HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 224, 256)
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZE_MULTIPLE = 16


class AttentionType(str, enum.Enum):
    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


SUPPORTED_ATTENTION_TYPES = (AttentionType.DECODER, AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
_UNSUPPORTED_ATTENTION_TYPES = {
    AttentionType.ENCODER_DECODER: (
        "cross-attention reads a cache filled by the encoder with no per-step cache write, "
        "which the ROCM_ATTN paged kernels do not implement"
    ),
}

OPS = (
    "paged_attention",
    "reshape_and_cache",
    "rotary_embedding",
    "rope_and_cache",
    "qk_norm_rope_and_cache",
    "encoder_attention",
)
FEATURES = (
    "sliding_window", "alibi", "sinks", "logits_soft_cap", "output_scale", "non_causal",
    "partial_rotary",  # RoPE over fewer channels than the head
)


@dataclasses.dataclass(frozen=True)
class ProviderCaps:
    devices: tuple[str, ...]
    ops: tuple[str, ...]
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...] | None  # None: any multiple of 16
    layouts: tuple[CacheLayout, ...]
    model_dtypes: tuple[torch.dtype, ...]
    kv_cache_dtypes: tuple[str, ...]
    interleaved_v: tuple[bool, ...]
    features: tuple[str, ...]


_ALL_LAYOUTS = (CacheLayout.LHBNC, CacheLayout.LBHNC)

# provider -> what it supports. Order is dispatch preference on a GPU.
CAPS: dict[str, ProviderCaps] = {
    # AITER's fused_qk_rope_reshape_and_cache asserts a bf16 or fp8-e4m3 cache (so a bf16
    # model: "auto" would be fp16 for an fp16 model) and power-of-two head and block sizes; it
    # writes both V interiors (kernels/aiter.py). Partial rotary it cannot do: that call raises.
    "aiter": ProviderCaps(
        devices=("cuda",),
        ops=("rope_and_cache", "qk_norm_rope_and_cache"),
        head_sizes=(64, 128, 256),
        block_sizes=(16, 32, 64, 128, 256, 512, 1024),
        layouts=_ALL_LAYOUTS,
        model_dtypes=(torch.bfloat16,),
        kv_cache_dtypes=("auto", "bfloat16", "fp8", "fp8_e4m3"),
        interleaved_v=(False, True),
        features=(),
    ),
    "native": ProviderCaps(
        devices=("cuda",),
        ops=("paged_attention",),
        head_sizes=(64, 128),
        block_sizes=(16, 32),
        layouts=(CacheLayout.LHBNC,),
        model_dtypes=(torch.float16, torch.bfloat16),
        kv_cache_dtypes=("auto", "float16", "bfloat16"),
        interleaved_v=(False,),
        features=("sliding_window", "alibi"),
    ),
    "triton": ProviderCaps(
        devices=("cuda",),
        ops=OPS,
        head_sizes=HEAD_SIZES,
        block_sizes=None,
        layouts=_ALL_LAYOUTS,
        model_dtypes=MODEL_DTYPES,
        kv_cache_dtypes=SUPPORTED_KV_CACHE_DTYPES,
        interleaved_v=(False, True),
        features=FEATURES,
    ),
    "reference": ProviderCaps(
        devices=("cpu", "cuda"),
        ops=OPS,
        head_sizes=HEAD_SIZES,
        block_sizes=None,
        layouts=_ALL_LAYOUTS,
        model_dtypes=MODEL_DTYPES,
        kv_cache_dtypes=SUPPORTED_KV_CACHE_DTYPES,
        interleaved_v=(False, True),
        features=FEATURES,
    ),
}
PROVIDERS = tuple(CAPS)


# --- backend-level checks (raise) -------------------------------------------------------


def check_head_size(head_size: int, op: str = "rocm_attn") -> None:
    if head_size not in HEAD_SIZES:
        raise ValueError(f"{op}: head_size {head_size} is not supported; supported: {HEAD_SIZES}")


def check_block_size(block_size: int, op: str = "rocm_attn") -> None:
    if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"{op}: block_size {block_size} is not supported; it must be a positive multiple "
            f"of {BLOCK_SIZE_MULTIPLE} (e.g. 16, 32, 544)"
        )


def check_cache_geometry(block_size: int, head_size: int, op: str = "rocm_attn") -> None:
    check_block_size(block_size, op)
    check_head_size(head_size, op)


def check_model_dtype(dtype: torch.dtype, op: str = "rocm_attn") -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"{op}: dtype {dtype} is not supported; supported: {MODEL_DTYPES}")


def check_kv_cache_dtype(kv_cache_dtype: str, op: str = "rocm_attn") -> None:
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"{op}: kv_cache_dtype {kv_cache_dtype!r} is not supported; "
            f"supported: {SUPPORTED_KV_CACHE_DTYPES}"
        )


def check_attention_type(attn_type: AttentionType | str, op: str = "rocm_attn") -> AttentionType:
    try:
        attn_type = AttentionType(attn_type)
    except ValueError:
        raise ValueError(
            f"{op}: attention type {attn_type!r} is unknown; supported: "
            f"{[t.value for t in SUPPORTED_ATTENTION_TYPES]}"
        ) from None
    if attn_type in _UNSUPPORTED_ATTENTION_TYPES:
        raise NotImplementedError(
            f"{op}: attention type {attn_type.value} is not supported: "
            f"{_UNSUPPORTED_ATTENTION_TYPES[attn_type]}; supported: "
            f"{[t.value for t in SUPPORTED_ATTENTION_TYPES]}"
        )
    return attn_type


# --- provider availability and support (return a reason) --------------------------------


@functools.cache
def _module_present(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def provider_unavailable(provider: str) -> str | None:
    """Why ``provider`` cannot run on this machine at all, or None if it can."""
    if provider == "reference":
        return None
    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU visible to torch"
    if provider == "triton":
        return None if _module_present("triton") else "triton is not installed"
    if provider == "aiter":
        if torch.version.hip is None and not _aiter_triton_only():
            return "AMD AITER runs on ROCm (set AITER_TRITON_ONLY=1 to use its Triton kernels elsewhere)"
        return None if _module_present("aiter") else "AMD AITER (PyPI: amd-aiter) is not importable"
    if provider == "native":
        from . import native

        return native.unavailable_reason()
    return f"unknown provider {provider!r}; known: {PROVIDERS}"


def _aiter_triton_only() -> bool:
    import os

    return os.environ.get("AITER_TRITON_ONLY", "0") == "1"


def provider_supports(
    provider: str,
    op: str,
    *,
    device: str,
    head_size: int,
    dtype: torch.dtype,
    block_size: int | None = None,
    layout: CacheLayout | None = None,
    kv_cache_dtype: str = "auto",
    interleaved_v: bool = False,
    features: tuple[str, ...] = (),
) -> str | None:
    """Why ``provider`` does not support this call, or None if it does (pure: table only)."""
    caps = CAPS[provider]
    if device not in caps.devices:
        return f"{provider} runs on {caps.devices}, not {device}"
    if op not in caps.ops:
        return f"{provider} has no {op} kernel"
    if head_size not in caps.head_sizes:
        return f"{provider} supports head sizes {caps.head_sizes}, not {head_size}"
    if dtype not in caps.model_dtypes:
        return f"{provider} supports dtypes {caps.model_dtypes}, not {dtype}"
    if block_size is not None and caps.block_sizes is not None and block_size not in caps.block_sizes:
        return f"{provider} supports block sizes {caps.block_sizes}, not {block_size}"
    if layout is not None and layout not in caps.layouts:
        return f"{provider} supports layouts {[l.value for l in caps.layouts]}, not {layout.value}"
    if kv_cache_dtype not in caps.kv_cache_dtypes:
        return f"{provider} supports kv cache dtypes {caps.kv_cache_dtypes}, not {kv_cache_dtype}"
    if interleaved_v not in caps.interleaved_v:
        return f"{provider} does not support {'interleaved' if interleaved_v else 'standard'} V"
    missing = [f for f in features if f not in caps.features]
    if missing:
        return f"{provider} does not support {', '.join(missing)}"
    return None


def select_provider(op: str, *, exclude: tuple[str, ...] = (), **query) -> str:
    """First provider (in CAPS order) that is available here and supports the call.

    The reference is chosen only for CPU tensors: on a GPU a missing kernel is an error,
    never a silent slow fallback.
    """
    reasons = []
    for provider in PROVIDERS:
        if provider in exclude:
            continue
        if provider == "reference" and query.get("device") != "cpu":
            continue
        why = provider_supports(provider, op, **query) or provider_unavailable(provider)
        if why is None:
            return provider
        reasons.append(f"{provider}: {why}")
    raise NotImplementedError(f"rocm_attn.{op}: no provider supports this call ({'; '.join(reasons)})")
