"""The ``rocm_attn`` op namespace: schemas, fake (meta) kernels and implementations.

Registered through ``torch.library.Library.define`` (the cheapest registration: these ops
sit on the per-step path) with one implementation for all devices that validates, picks a
provider (``providers.select``) and calls its kernel. Every mutated tensor is declared with
``(a!)``. Fake kernels sit beside each schema and compute metadata only.

Kernel-level ops take explicit tensors. Layer-level ops find their layer's impl, KV cache
and per-step metadata through the forward context; the cache update returns a dependency
token that the attention op takes, so a compiled graph orders write before read. Where the
fp8 quant of the attention's output is fused into it (``output_scale``), the compiled graph
gives the layer's cache update the same ``output_scale``: the update checks it before it
writes, so a scale the attention would refuse is refused before the cache changes.
"""

from __future__ import annotations

import warnings

import torch

from . import providers, validation
from .forward_context import _current, get_forward_context, get_layer

_current_context = _current.get  # the step's context (forward_context.get_forward_context, one call less)

NAMESPACE = "rocm_attn"
_lib = torch.library.Library(NAMESPACE, "DEF")

_SCHEMAS = {
    # --- kernel level ------------------------------------------------------------------
    "reshape_and_cache": (
        "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor k_scale, Tensor v_scale, bool interleaved_v=False) -> ()"
    ),
    "paged_attention": (
        "paged_attention(Tensor(a!) output, Tensor query, Tensor? key, Tensor? value, "
        "Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, Tensor block_table, "
        "int max_query_len, int max_seq_len, float scale, Tensor k_scale, Tensor v_scale, "
        "bool causal=True, int sliding_window=-1, Tensor? alibi_slopes=None, Tensor? sinks=None, "
        "float logits_soft_cap=0.0, bool interleaved_v=False, Tensor? output_scale=None) -> ()"
    ),
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()"
    ),
    "rope_and_cache": (
        "rope_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
        "Tensor(c!) kv_cache, Tensor slot_mapping, Tensor cos_sin_cache, bool is_neox, "
        "Tensor k_scale, Tensor v_scale, bool interleaved_v=False) -> ()"
    ),
    "qk_norm_rope_and_cache": (
        "qk_norm_rope_and_cache(Tensor qkv, Tensor q_weight, Tensor k_weight, float eps, "
        "Tensor positions, Tensor cos_sin_cache, bool is_neox, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, bool interleaved_v, int num_heads, "
        "int num_kv_heads, int head_size, Tensor(b!) q_out, Tensor(c!) k_out) -> ()"
    ),
    "rope_cos_sin_and_cache": (
        "rope_cos_sin_and_cache(Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor cos, Tensor sin, "
        "bool is_neox, Tensor(c!) kv_cache, Tensor slot_mapping, Tensor k_scale, Tensor v_scale, "
        "bool interleaved_v=False) -> ()"
    ),
    "qk_norm_rope_cos_sin_and_cache": (
        "qk_norm_rope_cos_sin_and_cache(Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor q_weight, "
        "Tensor k_weight, float eps, Tensor cos, Tensor sin, bool is_neox, Tensor(c!) kv_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, bool interleaved_v=False, "
        "bool gemma_norm=False, bool norm_after_rope=False, bool gemma4_norm=False) -> ()"
    ),
    "encoder_attention": (
        "encoder_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, "
        "int max_seqlen, float scale, bool causal=False, int sliding_window=-1, "
        "Tensor? alibi_slopes=None, Tensor? sinks=None, float logits_soft_cap=0.0) -> Tensor"
    ),
    "rms_norm": "rms_norm(Tensor input, Tensor weight, float eps) -> Tensor",
    "static_scaled_fp8_quant": (
        "static_scaled_fp8_quant(Tensor input, Tensor scale, ScalarType out_dtype) -> Tensor"
    ),
    # --- layer level ---------------------------------------------------------------------
    "unified_kv_cache_update": (
        "unified_kv_cache_update(Tensor key, Tensor value, str layer_name, Tensor? output_scale=None) -> Tensor"
    ),
    "unified_attention_with_output": (
        "unified_attention_with_output(Tensor query, Tensor key, Tensor value, Tensor(a!) output, "
        "str layer_name, Tensor? kv_cache_dependency=None, Tensor? output_scale=None) -> ()"
    ),
    "unified_rope_and_kv_cache_update": (
        "unified_rope_and_kv_cache_update(Tensor positions, Tensor(a!) query, Tensor(b!) key, "
        "Tensor value, Tensor cos_sin_cache, bool is_neox, str layer_name, Tensor? output_scale=None) -> Tensor"
    ),
    "unified_qk_norm_rope_and_kv_cache_update": (
        "unified_qk_norm_rope_and_kv_cache_update(Tensor qkv, Tensor q_weight, Tensor k_weight, "
        "float eps, Tensor positions, Tensor cos_sin_cache, bool is_neox, int num_heads, "
        "int num_kv_heads, int head_size, str layer_name, Tensor? output_scale=None) -> (Tensor, Tensor, Tensor)"
    ),
    "unified_rope_cos_sin_and_kv_cache_update": (
        "unified_rope_cos_sin_and_kv_cache_update(Tensor(a!) query, Tensor(b!) key, Tensor value, "
        "Tensor cos, Tensor sin, bool is_neox, str layer_name, Tensor? output_scale=None) -> Tensor"
    ),
    "unified_qk_norm_rope_cos_sin_and_kv_cache_update": (
        "unified_qk_norm_rope_cos_sin_and_kv_cache_update(Tensor(a!) query, Tensor(b!) key, Tensor value, "
        "Tensor q_weight, Tensor k_weight, float eps, Tensor cos, Tensor sin, bool is_neox, "
        "str layer_name, bool gemma_norm=False, bool norm_after_rope=False, Tensor? output_scale=None, "
        "bool gemma4_norm=False) -> Tensor"
    ),
}

for _schema in _SCHEMAS.values():
    _lib.define(_schema)


def _impl(name: str):
    def deco(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return deco


def _fake(name: str):
    return torch.library.register_fake(f"{NAMESPACE}::{name}", lib=_lib)


# === kernel level ===========================================================================


def _check_one_norm_form(op: str, gemma_norm: bool, gemma4_norm: bool) -> None:
    """One RMSNorm form per call: Gemma's ``1 + weight`` or Gemma4's ``weight`` in fp32, not both."""
    if gemma_norm and gemma4_norm:
        raise ValueError(f"{op}: gemma_norm=True and gemma4_norm=True; the QK-norm is one form "
                         "(transformers', Gemma's 1 + weight, or Gemma4's weight in fp32)")


def _rope_features(cos_sin_cache: torch.Tensor, head_size: int) -> tuple[str, ...]:
    return ("partial_rotary",) if cos_sin_cache.shape[-1] < head_size else ()


@_impl("reshape_and_cache")
def _reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v=False):
    op = "rocm_attn.reshape_and_cache"
    validation.check_cache_write(op, key, value, kv_cache, slot_mapping, k_scale, v_scale)
    validation.check_written(op, dict(kv_cache=kv_cache), dict(key=key, value=value))
    # Native reads a head's channels as one dense vector: a strided key/value goes to a
    # provider that takes any strides, whatever the size-based preference says.
    strided = any(t.numel() > 1 and t.stride(2) != 1 for t in (key, value))
    _, fn = providers.select(
        "reshape_and_cache", device=key.device, head_size=key.shape[2], dtype=key.dtype,
        kv_cache=kv_cache, interleaved_v=interleaved_v, num_tokens=key.shape[0],
        features=("strided_channels",) if strided else (),
    )
    fn(key, value, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v)


# The fake kernels refuse a mix of devices: a call with one argument on the meta device is
# dispatched to them, and they run at trace time, where a mix would otherwise surface late.


@_fake("reshape_and_cache")
def _reshape_and_cache_fake(key, value, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v=False):
    validation.check_same_device("rocm_attn.reshape_and_cache", key=key, value=value, kv_cache=kv_cache,
                                 slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)


@_impl("paged_attention")
def _paged_attention(output, query, key, value, kv_cache, query_start_loc, seq_lens, block_table,
                     max_query_len, max_seq_len, scale, k_scale, v_scale, causal=True,
                     sliding_window=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0,
                     interleaved_v=False, output_scale=None):
    validation.check_paged_attention(
        "rocm_attn.paged_attention", output, query, key, value, kv_cache, query_start_loc,
        seq_lens, block_table, alibi_slopes, sinks, output_scale, k_scale=k_scale, v_scale=v_scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len,
    )
    validation.check_attention_options("rocm_attn.paged_attention", scale, sliding_window, logits_soft_cap)
    # output may be the query (each tile reads its rows before writing them), not key/value/cache
    validation.check_written("rocm_attn.paged_attention", dict(output=output),
                             dict(key=key, value=value, kv_cache=kv_cache))
    feats = providers.attention_features(
        causal=causal, sliding_window=sliding_window, alibi_slopes=alibi_slopes, sinks=sinks,
        logits_soft_cap=logits_soft_cap, output_scale=output_scale, max_query_len=max_query_len,
    )
    _, fn = providers.select(
        "paged_attention", device=query.device, head_size=query.shape[2], dtype=query.dtype
        if query.dtype in (torch.float16, torch.bfloat16, torch.float32) else key.dtype,
        kv_cache=kv_cache, interleaved_v=interleaved_v, features=feats, num_tokens=query.shape[0],
    )
    # The host maxima are launch hints (skip the prefill launch for a decode-only batch,
    # bound the KV split count): no device sync.
    fn(output, query, key, value, kv_cache, query_start_loc, seq_lens, block_table, scale,
       k_scale, v_scale, causal, sliding_window, alibi_slopes, sinks, logits_soft_cap,
       interleaved_v, output_scale, max_query_len, max_seq_len)


@_fake("paged_attention")
def _paged_attention_fake(output, query, key, value, kv_cache, query_start_loc, seq_lens, block_table,
                          max_query_len, max_seq_len, scale, k_scale, v_scale, causal=True,
                          sliding_window=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0,
                          interleaved_v=False, output_scale=None):
    validation.check_same_device(
        "rocm_attn.paged_attention", output=output, query=query, key=key, value=value, kv_cache=kv_cache,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table, k_scale=k_scale,
        v_scale=v_scale, alibi_slopes=alibi_slopes, sinks=sinks, output_scale=output_scale)


@_impl("rotary_embedding")
def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    op = "rocm_attn.rotary_embedding"
    validation.check_rotary(op, positions, query, key, head_size, cos_sin_cache)
    validation.check_written(op, dict(query=query, key=key), dict(cos_sin_cache=cos_sin_cache))
    _, fn = providers.select("rotary_embedding", device=query.device, head_size=head_size, dtype=query.dtype,
                             num_tokens=query.shape[0])
    fn(positions, query, key, head_size, cos_sin_cache, is_neox)


@_fake("rotary_embedding")
def _rotary_embedding_fake(positions, query, key, head_size, cos_sin_cache, is_neox):
    validation.check_same_device("rocm_attn.rotary_embedding", positions=positions, query=query, key=key,
                                 cos_sin_cache=cos_sin_cache)


@_impl("rope_and_cache")
def _rope_and_cache(positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, is_neox,
                    k_scale, v_scale, interleaved_v=False):
    op = "rocm_attn.rope_and_cache"
    if value.dim() != 3:  # the head size is read from it
        raise ValueError(f"{op}: value must be [num_tokens, num_kv_heads, head_size], got {tuple(value.shape)}")
    head_size = value.shape[-1]
    validation.check_rotary(op, positions, query, key, head_size, cos_sin_cache)
    # query and key [T, H, D] or [T, H * D] (check_rotary); the cache write reads the key by heads
    key_heads = key if key.dim() == 3 else key.view(key.shape[0], key.shape[1] // head_size, head_size)
    validation.check_cache_write(op, key_heads, value, kv_cache, slot_mapping, k_scale, v_scale)
    validation.check_gqa(op, query.shape[1] if query.dim() == 3 else query.shape[1] // head_size, key_heads.shape[1])
    validation.check_written(op, dict(query=query, key=key, kv_cache=kv_cache),
                             dict(value=value, cos_sin_cache=cos_sin_cache))
    _, fn = providers.select(
        "rope_and_cache", device=query.device, head_size=head_size, dtype=query.dtype,
        kv_cache=kv_cache, interleaved_v=interleaved_v, features=_rope_features(cos_sin_cache, head_size),
        num_tokens=query.shape[0],
    )
    fn(positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, is_neox, k_scale,
       v_scale, interleaved_v)


@_fake("rope_and_cache")
def _rope_and_cache_fake(positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, is_neox,
                         k_scale, v_scale, interleaved_v=False):
    validation.check_same_device("rocm_attn.rope_and_cache", positions=positions, query=query, key=key,
                                 value=value, kv_cache=kv_cache, slot_mapping=slot_mapping,
                                 cos_sin_cache=cos_sin_cache, k_scale=k_scale, v_scale=v_scale)


def _check_qk_outputs(op, qkv, q_out, k_out, num_heads, num_kv_heads, head_size):
    t = qkv.shape[0]
    for name, out, heads in (("q_out", q_out, num_heads), ("k_out", k_out, num_kv_heads)):
        if tuple(out.shape) != (t, heads, head_size) or out.dtype != qkv.dtype or out.device != qkv.device:
            raise ValueError(
                f"{op}: {name} must be [num_tokens, {'num_heads' if name == 'q_out' else 'num_kv_heads'}, "
                f"head_size] = [{t}, {heads}, {head_size}] of qkv's dtype {qkv.dtype} on {qkv.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )


@_impl("qk_norm_rope_and_cache")
def _qk_norm_rope_and_cache(qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox,
                            kv_cache, slot_mapping, k_scale, v_scale, interleaved_v, num_heads,
                            num_kv_heads, head_size, q_out, k_out):
    op = "rocm_attn.qk_norm_rope_and_cache"
    # the cache, slots, scales and outputs with qkv: a GPU kernel cannot read a host tensor
    validation.check_same_device(op, qkv=qkv, kv_cache=kv_cache, slot_mapping=slot_mapping, k_scale=k_scale,
                                 v_scale=v_scale, q_out=q_out, k_out=k_out)
    validation.check_qk_norm_rope(op, qkv, q_weight, k_weight, positions, cos_sin_cache,
                                  num_heads, num_kv_heads, head_size)
    validation.check_eps(op, eps)
    validation.check_scales(op, k_scale=k_scale, v_scale=v_scale)
    _check_qk_outputs(op, qkv, q_out, k_out, num_heads, num_kv_heads, head_size)
    validation.check_kv_cache(op, kv_cache, num_kv_heads, head_size)
    validation.check_slot_mapping(op, slot_mapping, kv_cache, qkv.shape[0])
    # q_out / k_out may be qkv's own q / k slices (each program reads its head before writing it)
    validation.check_written(op, dict(q_out=q_out, k_out=k_out, kv_cache=kv_cache), {})
    _, fn = providers.select(
        "qk_norm_rope_and_cache", device=qkv.device, head_size=head_size, dtype=qkv.dtype,
        kv_cache=kv_cache, interleaved_v=interleaved_v, features=_rope_features(cos_sin_cache, head_size),
        num_tokens=qkv.shape[0],
    )
    fn(qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox, kv_cache, slot_mapping, k_scale,
       v_scale, interleaved_v, num_heads, num_kv_heads, head_size, q_out, k_out, False)


@_fake("qk_norm_rope_and_cache")
def _qk_norm_rope_and_cache_fake(qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox,
                                 kv_cache, slot_mapping, k_scale, v_scale, interleaved_v, num_heads,
                                 num_kv_heads, head_size, q_out, k_out):
    validation.check_same_device("rocm_attn.qk_norm_rope_and_cache", qkv=qkv, q_weight=q_weight,
                                 k_weight=k_weight, positions=positions, cos_sin_cache=cos_sin_cache,
                                 kv_cache=kv_cache, slot_mapping=slot_mapping, k_scale=k_scale,
                                 v_scale=v_scale, q_out=q_out, k_out=k_out)


def _select_cos_sin_writer(op, query, value, kv_cache, cos, interleaved_v):
    head_size = value.shape[-1]
    _, fn = providers.select(
        op, device=query.device, head_size=head_size, dtype=query.dtype, kv_cache=kv_cache,
        interleaved_v=interleaved_v, features=_rope_features(cos, head_size), num_tokens=query.shape[0],
    )
    return fn


@_impl("rope_cos_sin_and_cache")
def _rope_cos_sin_and_cache(query, key, value, cos, sin, is_neox, kv_cache, slot_mapping, k_scale, v_scale,
                            interleaved_v=False):
    op = "rocm_attn.rope_cos_sin_and_cache"
    validation.check_rope_cos_sin(op, query, key, value, cos, sin)
    validation.check_cache_write(op, key.view(value.shape), value, kv_cache, slot_mapping, k_scale, v_scale)
    validation.check_written(op, dict(query=query, key=key, kv_cache=kv_cache), dict(value=value, cos=cos, sin=sin))
    fn = _select_cos_sin_writer("rope_cos_sin_and_cache", query, value, kv_cache, cos, interleaved_v)
    fn(query, key, value, cos, sin, is_neox, kv_cache, slot_mapping, k_scale, v_scale, interleaved_v)


@_fake("rope_cos_sin_and_cache")
def _rope_cos_sin_and_cache_fake(query, key, value, cos, sin, is_neox, kv_cache, slot_mapping, k_scale,
                                 v_scale, interleaved_v=False):
    validation.check_same_device("rocm_attn.rope_cos_sin_and_cache", query=query, key=key, value=value,
                                 cos=cos, sin=sin, kv_cache=kv_cache, slot_mapping=slot_mapping,
                                 k_scale=k_scale, v_scale=v_scale)


@_impl("qk_norm_rope_cos_sin_and_cache")
def _qk_norm_rope_cos_sin_and_cache(query, key, value, q_weight, k_weight, eps, cos, sin, is_neox, kv_cache,
                                    slot_mapping, k_scale, v_scale, interleaved_v=False, gemma_norm=False,
                                    norm_after_rope=False, gemma4_norm=False):
    op = "rocm_attn.qk_norm_rope_cos_sin_and_cache"
    validation.check_rope_cos_sin(op, query, key, value, cos, sin, q_weight, k_weight)
    validation.check_eps(op, eps)
    _check_one_norm_form(op, gemma_norm, gemma4_norm)
    validation.check_cache_write(op, key.view(value.shape), value, kv_cache, slot_mapping, k_scale, v_scale)
    validation.check_written(op, dict(query=query, key=key, kv_cache=kv_cache),
                             dict(value=value, cos=cos, sin=sin, q_weight=q_weight, k_weight=k_weight))
    fn = _select_cos_sin_writer("qk_norm_rope_cos_sin_and_cache", query, value, kv_cache, cos, interleaved_v)
    fn(query, key, value, q_weight, k_weight, eps, cos, sin, is_neox, kv_cache, slot_mapping, k_scale, v_scale,
       interleaved_v, gemma_norm=gemma_norm, norm_after_rope=norm_after_rope, gemma4_norm=gemma4_norm)


@_fake("qk_norm_rope_cos_sin_and_cache")
def _qk_norm_rope_cos_sin_and_cache_fake(query, key, value, q_weight, k_weight, eps, cos, sin, is_neox,
                                         kv_cache, slot_mapping, k_scale, v_scale, interleaved_v=False,
                                         gemma_norm=False, norm_after_rope=False, gemma4_norm=False):
    validation.check_same_device("rocm_attn.qk_norm_rope_cos_sin_and_cache", query=query, key=key, value=value,
                                 q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin, kv_cache=kv_cache,
                                 slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)


@_impl("encoder_attention")
def _encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal=False,
                       sliding_window=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0):
    op = "rocm_attn.encoder_attention"
    validation.check_encoder_attention(op, query, key, value, cu_seqlens, alibi_slopes, sinks, max_seqlen)
    validation.check_attention_options(op, scale, sliding_window, logits_soft_cap)
    feats = providers.attention_features(
        causal=causal, sliding_window=sliding_window, alibi_slopes=alibi_slopes, sinks=sinks,
        logits_soft_cap=logits_soft_cap, output_scale=None,
    )
    _, fn = providers.select("encoder_attention", device=query.device, head_size=query.shape[2],
                             dtype=query.dtype, features=feats, num_tokens=query.shape[0])
    output = torch.empty_like(query)
    fn(output, query, key, value, cu_seqlens, scale, causal, sliding_window, alibi_slopes, sinks,
       logits_soft_cap, None)
    return output


@_fake("encoder_attention")
def _encoder_attention_fake(query, key, value, cu_seqlens, max_seqlen, scale, causal=False,
                            sliding_window=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0):
    validation.check_same_device("rocm_attn.encoder_attention", query=query, key=key, value=value,
                                 cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes, sinks=sinks)
    return torch.empty_like(query)


@_impl("rms_norm")
def _rms_norm(input, weight, eps):
    """RMSNorm over the last dim, computed in fp32, in ``input.dtype`` (HF semantics)."""
    validation.check_rms_norm("rocm_attn.rms_norm", input, weight, eps)
    x = input.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.float()).to(input.dtype)


@_fake("rms_norm")
def _rms_norm_fake(input, weight, eps):
    validation.check_same_device("rocm_attn.rms_norm", input=input, weight=weight)
    return torch.empty_like(input)


@_impl("static_scaled_fp8_quant")
def _static_scaled_fp8_quant(input, scale, out_dtype):
    validation.check_fp8_quant("rocm_attn.static_scaled_fp8_quant", input, scale, out_dtype)
    m = torch.finfo(out_dtype).max
    return (input.float() / scale.float()).clamp(-m, m).to(out_dtype)


@_fake("static_scaled_fp8_quant")
def _static_scaled_fp8_quant_fake(input, scale, out_dtype):
    validation.check_same_device("rocm_attn.static_scaled_fp8_quant", input=input, scale=scale)
    return torch.empty_like(input, dtype=out_dtype)


# === layer level ============================================================================

# The layer-level fake kernels refuse tensors on more than one device, as the kernel-level
# fakes do: one argument on the meta device dispatches a real call to the fake kernel, which
# would otherwise return without writing the cache or the output.


def _token(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def _step(op: str, layer_name: str):
    """(layer, the step's metadata or None in a profiling run); outside any forward context,
    a clear error instead of a silent profiling run."""
    layer = get_layer(layer_name)
    ctx = get_forward_context()
    metadata = ctx.attn_metadata
    if metadata is None and not ctx.profiling:
        raise RuntimeError(
            f"{op} (layer {layer_name!r}): called outside a forward context. Run the model inside "
            "`with inductor_rocm_attn.set_forward_context(metadata):` with the step's metadata from "
            "inductor_rocm_attn.build_attention_metadata(...), or inside "
            "`with inductor_rocm_attn.profiling_run():` for a profiling run (no cache write, zero output)"
        )
    return layer, metadata


def _write_step(op: str, layer_name: str):
    """``_step`` of an op that writes the layer's cache: (layer, metadata, context); pass the
    last two to ``_wrote`` once the write is done. A layer's second write in one forward
    context warns: right when a step is run again on the same inputs (an eager and a compiled
    run compared in one context, ``opcheck``), it is wrong when one ``Attention`` module serves
    two depths of a model: the second call overwrites the step's slots, and the first depth's
    keys and values, which its attention read, are lost to every later step, silently."""
    layer, metadata = _step(op, layer_name)
    ctx = _current_context()
    if metadata is not None and layer.impl._written_ctx is ctx:
        warnings.warn(
            f"{op} (layer {layer_name!r}): this layer writes its KV cache a second time in one forward context, "
            "so the step's slots keep this call's keys and values. Right for a step run again on the same inputs; "
            "wrong for one Attention module called at two depths of a model, which needs one layer (its own name "
            "and cache) per depth. Enter `inductor_rocm_attn.set_forward_context(metadata)` anew for each run of "
            "a step", stacklevel=2)
    return layer, metadata, ctx


def _wrote(layer, metadata, ctx) -> None:
    """After a cache-update op: the layer wrote the step ``metadata`` (its impl records the
    metadata of every write; a layer without a cache of its own, or a profiling run, wrote
    nothing) in the context ``ctx``."""
    impl = layer.impl
    if metadata is not None and impl._written_step is metadata:
        impl._written_ctx = ctx


@_impl("unified_kv_cache_update")
def _unified_kv_cache_update(key, value, layer_name, output_scale=None):
    layer, metadata, ctx = _write_step("rocm_attn.unified_kv_cache_update", layer_name)
    if metadata is not None:  # profiling run: nothing to cache
        layer.impl.update_kv_cache(layer, key, value, layer.kv_cache, metadata, output_scale)
        _wrote(layer, metadata, ctx)
    return _token(key)


@_fake("unified_kv_cache_update")
def _unified_kv_cache_update_fake(key, value, layer_name, output_scale=None):
    validation.check_same_device("rocm_attn.unified_kv_cache_update", key=key, value=value,
                                 output_scale=output_scale)
    return _token(key)


@_impl("unified_attention_with_output")
def _unified_attention_with_output(query, key, value, output, layer_name, kv_cache_dependency=None,
                                   output_scale=None):
    layer, metadata = _step("rocm_attn.unified_attention_with_output", layer_name)
    layer.impl.forward(layer, query, key, value, layer.kv_cache, metadata, output,
                       output_scale=output_scale)


@_fake("unified_attention_with_output")
def _unified_attention_with_output_fake(query, key, value, output, layer_name, kv_cache_dependency=None,
                                        output_scale=None):
    validation.check_same_device("rocm_attn.unified_attention_with_output", query=query, key=key, value=value,
                                 output=output, kv_cache_dependency=kv_cache_dependency,
                                 output_scale=output_scale)
    return None


@_impl("unified_rope_and_kv_cache_update")
def _unified_rope_and_kv_cache_update(positions, query, key, value, cos_sin_cache, is_neox, layer_name,
                                      output_scale=None):
    """Rotates ``query``/``key`` in place (declared mutated) and writes the cache."""
    op = "rocm_attn.unified_rope_and_kv_cache_update"
    layer, metadata, ctx = _write_step(op, layer_name)
    layer.impl.do_rope_and_kv_cache_update(
        layer, positions, query, key, value, cos_sin_cache, is_neox, layer.kv_cache, metadata, op, output_scale
    )
    _wrote(layer, metadata, ctx)
    return _token(key)


@_fake("unified_rope_and_kv_cache_update")
def _unified_rope_and_kv_cache_update_fake(positions, query, key, value, cos_sin_cache, is_neox, layer_name,
                                           output_scale=None):
    validation.check_same_device("rocm_attn.unified_rope_and_kv_cache_update", positions=positions, query=query,
                                 key=key, value=value, cos_sin_cache=cos_sin_cache, output_scale=output_scale)
    return _token(key)


@_impl("unified_qk_norm_rope_and_kv_cache_update")
def _unified_qk_norm_rope_and_kv_cache_update(qkv, q_weight, k_weight, eps, positions, cos_sin_cache,
                                              is_neox, num_heads, num_kv_heads, head_size, layer_name,
                                              output_scale=None):
    op = "rocm_attn.unified_qk_norm_rope_and_kv_cache_update"
    layer, metadata, ctx = _write_step(op, layer_name)
    impl = layer.impl
    if num_heads != impl.num_heads or num_kv_heads != impl.num_kv_heads or head_size != impl.head_size:
        # the fake kernel shapes q and k from these; the layer's own give the real ones
        raise ValueError(f"{op}: num_heads, num_kv_heads, head_size = {num_heads}, {num_kv_heads}, {head_size} but "
                         f"layer {layer_name!r} has {impl.num_heads}, {impl.num_kv_heads}, {impl.head_size}")
    q, k = impl.do_qk_norm_rope_kvcache_update(
        layer, qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox, layer.kv_cache, metadata, op=op,
        output_scale=output_scale,
    )
    _wrote(layer, metadata, ctx)
    return q, k, _token(k)


@_fake("unified_qk_norm_rope_and_kv_cache_update")
def _unified_qk_norm_rope_and_kv_cache_update_fake(qkv, q_weight, k_weight, eps, positions,
                                                   cos_sin_cache, is_neox, num_heads, num_kv_heads,
                                                   head_size, layer_name, output_scale=None):
    validation.check_same_device("rocm_attn.unified_qk_norm_rope_and_kv_cache_update", qkv=qkv, q_weight=q_weight,
                                 k_weight=k_weight, positions=positions, cos_sin_cache=cos_sin_cache,
                                 output_scale=output_scale)
    t = qkv.shape[0]
    k = qkv.new_empty(t, num_kv_heads, head_size)
    return qkv.new_empty(t, num_heads, head_size), k, _token(k)


@_impl("unified_rope_cos_sin_and_kv_cache_update")
def _unified_rope_cos_sin_and_kv_cache_update(query, key, value, cos, sin, is_neox, layer_name, output_scale=None):
    """Rotates ``query``/``key`` in place with the model's per-token cos/sin and writes the cache."""
    layer, metadata, ctx = _write_step("rocm_attn.unified_rope_cos_sin_and_kv_cache_update", layer_name)
    layer.impl.do_rope_cos_sin_and_kv_cache_update(layer, query, key, value, cos, sin, is_neox,
                                                   layer.kv_cache, metadata, output_scale)
    _wrote(layer, metadata, ctx)
    return _token(key)


@_fake("unified_rope_cos_sin_and_kv_cache_update")
def _unified_rope_cos_sin_and_kv_cache_update_fake(query, key, value, cos, sin, is_neox, layer_name,
                                                   output_scale=None):
    validation.check_same_device("rocm_attn.unified_rope_cos_sin_and_kv_cache_update", query=query, key=key,
                                 value=value, cos=cos, sin=sin, output_scale=output_scale)
    return _token(key)


@_impl("unified_qk_norm_rope_cos_sin_and_kv_cache_update")
def _unified_qk_norm_rope_cos_sin_and_kv_cache_update(query, key, value, q_weight, k_weight, eps, cos, sin,
                                                      is_neox, layer_name, gemma_norm=False, norm_after_rope=False,
                                                      output_scale=None, gemma4_norm=False):
    """Normalizes and rotates ``query``/``key`` in place (``norm_after_rope``: rotates, then
    normalizes) and writes the cache (interleaved V)."""
    _check_one_norm_form("rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update", gemma_norm, gemma4_norm)
    layer, metadata, ctx = _write_step("rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update", layer_name)
    layer.impl.do_qk_norm_rope_cos_sin_kv_cache_update(layer, query, key, value, q_weight, k_weight, eps, cos,
                                                       sin, is_neox, layer.kv_cache, metadata, gemma_norm,
                                                       norm_after_rope, output_scale, gemma4_norm=gemma4_norm)
    _wrote(layer, metadata, ctx)
    return _token(key)


@_fake("unified_qk_norm_rope_cos_sin_and_kv_cache_update")
def _unified_qk_norm_rope_cos_sin_and_kv_cache_update_fake(query, key, value, q_weight, k_weight, eps, cos,
                                                           sin, is_neox, layer_name, gemma_norm=False,
                                                           norm_after_rope=False, output_scale=None,
                                                           gemma4_norm=False):
    validation.check_same_device("rocm_attn.unified_qk_norm_rope_cos_sin_and_kv_cache_update", query=query,
                                 key=key, value=value, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin,
                                 output_scale=output_scale)
    return _token(key)


OP_NAMES = tuple(_SCHEMAS)
