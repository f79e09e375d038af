"""What the backend supports, and the pure predicate that checks a call against a provider.

Backend-level constants (head sizes, dtypes, block-size rule, attention types, ops and
features) and the raising checks built on them live here; validation (clear errors for bad
input) and provider dispatch both read them, so an error message and a dispatch decision
can never disagree. What each provider supports is a ``ProviderCaps`` held by that
provider's record in ``providers.REGISTRY``; ``supports`` checks one call against one.

This module imports nothing else of the package (``layout`` builds on it), so there is no
import cycle between capabilities and layout.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotation only: layout imports this module
    from .layout import CacheLayout

HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 224, 256, 512)
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZE_MULTIPLE = 16
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


class AttentionType(str, enum.Enum):
    """A layer's attention type (``Attention(attn_type=...)``, the enum or its string value):
    DECODER, ENCODER and ENCODER_ONLY are supported; ENCODER_DECODER is refused with the
    reason (``_UNSUPPORTED_ATTENTION_TYPES``)."""

    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


SUPPORTED_ATTENTION_TYPES = (AttentionType.DECODER, AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
_UNSUPPORTED_ATTENTION_TYPES = {
    # The seed's reason, which holds for our paged_attention as well.
    AttentionType.ENCODER_DECODER: (
        "the prefill path assumes self-attention: it mixes the K/V passed in (taken as the "
        "step's new tokens) with the cached K/V, and a cross-attention layer's encoder K/V are "
        "already cached, so mixing them again gives wrong results when max_query_len > 1 "
        "(e.g. beam search)"
    ),
}
ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
# The seed's reason for rejecting a quantized (fp8) KV-cache dtype on an encoder layer.
ENCODER_FP8_KV_CACHE_REASON = "quantization is not supported for encoder attention"


@dataclasses.dataclass(frozen=True)
class MultipleOf:
    """A block-size rule: every positive multiple of ``base`` (the seed's ``MultipleOf(16)``)."""

    base: int

    def __contains__(self, block_size: object) -> bool:
        return isinstance(block_size, int) and block_size > 0 and block_size % self.base == 0


@dataclasses.dataclass(frozen=True)
class QuantKey:
    """How an attention output is quantized: what ``fused_output_quant_supported`` is asked about.

    ``static``: the scale is a fixed tensor (not computed from the data); ``per_tensor``: one
    scale for the whole tensor; ``symmetric``: no zero point.
    """

    dtype: torch.dtype
    static: bool = True
    per_tensor: bool = True
    symmetric: bool = True


# The one output quantization the attention fuses (the seed's ``kFp8StaticTensorSym``).
FP8_STATIC_TENSOR_SYM = QuantKey(torch.float8_e4m3fn)


def fused_output_quant_supported(quant_key: QuantKey) -> bool:
    """True for a static, per-tensor, symmetric quantization to an fp8 dtype (the attention
    writes ``clamp(out / output_scale, +-fp8_max)``); block-scaled or dynamic quant is not fused."""
    dtype = getattr(quant_key, "dtype", None)
    fp8 = isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1
    return bool(fp8 and quant_key.static and quant_key.per_tensor and quant_key.symmetric)

OPS = (
    "paged_attention",
    "reshape_and_cache",
    "rotary_embedding",
    "rope_and_cache",
    "qk_norm_rope_and_cache",
    "rope_cos_sin_and_cache",  # RoPE with the model's per-token cos/sin (transformers)
    "qk_norm_rope_cos_sin_and_cache",  # the same after a per-head RMSNorm, q/k/v apart
    "encoder_attention",
)
FEATURES = (
    "sliding_window", "alibi", "sinks", "logits_soft_cap", "output_scale", "non_causal",
    "partial_rotary",  # RoPE over fewer channels than the head
    "prefill",  # a paged_attention call that may hold sequences with query_len > 1
    "strided_channels",  # a cache write whose key/value head channels are not contiguous
)


@dataclasses.dataclass(frozen=True)
class ProviderCaps:
    """What one provider's kernels support (checked by ``supports``)."""

    devices: tuple[str, ...]
    ops: tuple[str, ...]
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...] | None  # None: any multiple of 16
    layouts: tuple[CacheLayout, ...]
    model_dtypes: tuple[torch.dtype, ...]
    kv_cache_dtypes: tuple[str, ...]
    interleaved_v: tuple[bool, ...]
    features: tuple[str, ...]


# --- backend-level checks (raise) -------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_head_size(head_size: int, op: str = "rocm_attn") -> None:
    if not _is_int(head_size) or head_size not in HEAD_SIZES:
        raise ValueError(f"{op}: head_size {head_size!r} is not supported; supported: {HEAD_SIZES}")


def check_block_size(block_size: int, op: str = "rocm_attn") -> None:
    if not _is_int(block_size) or block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"{op}: block_size {block_size!r} is not supported; it must be a positive multiple "
            f"of {BLOCK_SIZE_MULTIPLE} (e.g. 16, 32, 544)"
        )


def check_cache_geometry(block_size: int, head_size: int, op: str = "rocm_attn") -> None:
    check_block_size(block_size, op)
    check_head_size(head_size, op)


def check_model_dtype(dtype: torch.dtype, op: str = "rocm_attn") -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"{op}: dtype {dtype!r} is not supported; supported: {MODEL_DTYPES}")


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


# --- one call against one provider's caps (returns a reason) -----------------------------


def supports(
    caps: ProviderCaps,
    op: str,
    *,
    name: str,
    device: str,
    head_size: int,
    dtype: torch.dtype,
    block_size: int | None = None,
    layout: CacheLayout | None = None,
    kv_cache_dtype: str = "auto",
    interleaved_v: bool = False,
    features: tuple[str, ...] = (),
) -> str | None:
    """Why the provider ``name`` with ``caps`` does not support this call, or None if it does.

    Pure: reads the table only (whether the provider can run on this machine at all is its
    record's ``unavailable_reason``).
    """
    if device not in caps.devices:
        return f"{name} runs on {caps.devices}, not {device}"
    if op not in caps.ops:
        return f"{name} has no {op} kernel"
    if head_size not in caps.head_sizes:
        return f"{name} supports head sizes {caps.head_sizes}, not {head_size}"
    if dtype not in caps.model_dtypes:
        return f"{name} supports dtypes {caps.model_dtypes}, not {dtype}"
    if block_size is not None and caps.block_sizes is not None and block_size not in caps.block_sizes:
        return f"{name} supports block sizes {caps.block_sizes}, not {block_size}"
    if layout is not None and layout not in caps.layouts:
        return f"{name} supports layouts {[l.value for l in caps.layouts]}, not {layout.value}"
    if kv_cache_dtype not in caps.kv_cache_dtypes:
        return f"{name} supports kv cache dtypes {caps.kv_cache_dtypes}, not {kv_cache_dtype}"
    if interleaved_v not in caps.interleaved_v:
        return f"{name} does not support {'interleaved' if interleaved_v else 'standard'} V"
    missing = [f for f in features if f not in caps.features]
    if missing:
        return f"{name} does not support {', '.join(missing)}"
    return None
