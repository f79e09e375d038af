"""Checks of configuration, made once at construction: an attention layer's (the arguments
of ``RocmAttentionImpl`` and ``Attention``) and a piecewise runner's (``compile_piecewise``,
``compile_transformers``). Each error names the class or function, the parameter, the bad
value and what is supported."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from . import capabilities, validation
from .capabilities import AttentionType


def check_impl_config(op: str, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                      kv_cache_dtype, logits_soft_cap, attn_type, sinks, causal, q_scale,
                      kv_sharing_target_layer_name):
    """Raise for a configuration the backend cannot run; returns ``(attention type, num_kv_heads,
    sinks, alibi_slopes)`` normalized (``num_kv_heads`` None: ``num_heads``; sinks and ALiBi
    slopes given as lists: float32 tensors)."""
    attn_type = capabilities.check_attention_type(attn_type, op)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    validation.check_positive_int(op, "num_heads", num_heads)
    validation.check_positive_int(op, "num_kv_heads", num_kv_heads)
    capabilities.check_head_size(head_size, op)
    capabilities.check_kv_cache_dtype(kv_cache_dtype, op)
    if num_heads % num_kv_heads:
        raise ValueError(f"{op}: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    validation.check_softmax_scale(op, scale)
    validation.check_positive_finite(op, "q_scale", q_scale)
    if attn_type in capabilities.ENCODER_TYPES and kv_cache_dtype.startswith("fp8"):
        raise NotImplementedError(
            f"{op}: kv_cache_dtype {kv_cache_dtype!r} on a {attn_type.value} layer is not "
            f"supported: {capabilities.ENCODER_FP8_KV_CACHE_REASON} (an encoder layer has no KV "
            "cache); use 'auto'"
        )
    if kv_sharing_target_layer_name is not None:
        if not isinstance(kv_sharing_target_layer_name, str) or not kv_sharing_target_layer_name:
            raise ValueError(f"{op}: kv_sharing_target_layer_name must be a layer name, got "
                             f"{kv_sharing_target_layer_name!r}")
        if attn_type != AttentionType.DECODER:
            raise ValueError(
                f"{op}: kv_sharing_target_layer_name={kv_sharing_target_layer_name!r} on a "
                f"{attn_type.value} layer: only decoder layers have a KV cache to share"
            )
    if sliding_window is not None and (not validation.is_int(sliding_window) or sliding_window <= 0):
        raise ValueError(f"{op}: sliding_window must be None or a positive int, got {sliding_window!r}")
    if logits_soft_cap is not None and logits_soft_cap != 0:
        try:
            validation.check_positive_finite(op, "logits_soft_cap", logits_soft_cap)
        except ValueError:
            raise ValueError(f"{op}: logits_soft_cap must be None, 0 (off) or a positive finite number, "
                             f"got {logits_soft_cap!r}") from None
    if causal is not None and not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be True, False or None, got {causal!r}")
    if sinks is not None:
        sinks = validation.per_head_tensor(op, "sinks", sinks, num_heads)
        if sinks.device.type != "meta" and bool((sinks == float("inf")).any()):  # -inf: no sink for that head
            raise ValueError(f"{op}: sinks must not be +inf (the sink would take all the weight and every row "
                             f"turn NaN); -inf means no sink for a head, got {sinks.tolist()}")
    if alibi_slopes is not None:
        alibi_slopes = validation.per_head_tensor(op, "alibi_slopes", alibi_slopes, num_heads,
                                                  finite=True).to(torch.float32)
    return attn_type, num_kv_heads, sinks, alibi_slopes


def check_cache_scales(op: str, kv_cache_dtype, k_scale, v_scale) -> None:
    """Per-tensor cache scales: positive finite numbers, other than 1.0 only for an fp8 cache (a
    16-bit cache stores values as they are and reads no scale: one given would be ignored)."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        validation.check_positive_finite(op, name, value)
        if value != 1.0 and not (isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith("fp8")):
            raise ValueError(f"{op}: {name}={value!r} with kv_cache_dtype={kv_cache_dtype!r}; the cache scales "
                             "apply only to an fp8 kv_cache_dtype (fp8, fp8_e4m3, fp8_e5m2)")


_GRAPH_BACKEND_METHODS = ("warmup", "capture", "capture_step", "synchronize")


def _check_layers(op: str, layers) -> None:
    """``layers``: None or a mapping of layer name -> ``Attention``, checked before the trace
    (the runner reads each value's ``layer_name`` and ``block_size`` as an Attention's)."""
    if layers is None:
        return
    from .layer import Attention

    bad = (f"a {type(layers).__name__}" if not isinstance(layers, Mapping) else
           next((f"{name!r}: {type(v).__name__}" for name, v in layers.items() if not isinstance(v, Attention)), None))
    if bad is not None:
        raise TypeError(f"{op}: layers must be a mapping of layer name -> Attention (e.g. runner.layers), got {bad}")
    # the traced ops name a layer by its layer_name: a key of another name would be ignored
    misnamed = next(((name, v.layer_name) for name, v in layers.items() if name != v.layer_name), None)
    if misnamed is not None:
        raise ValueError(f"{op}: layers key {misnamed[0]!r} maps to the layer named {misnamed[1]!r}; the keys are "
                         "the layers' layer_name (the name the traced ops use), e.g. runner.layers")


def check_runner_config(op: str, *, capture_sizes, max_num_seqs, max_num_tokens, max_model_len,
                        flags: dict, optional_flags: dict, trace_cache, compile_threads=None,
                        graph_backend=None, progress=None, layers=None) -> list[int]:
    """The arguments of ``compile_piecewise`` / ``compile_transformers`` that shape the
    runner's buffers and graphs, checked before anything is traced or allocated. Returns the
    capture sizes as a sorted list of distinct ints."""
    try:
        sizes = list(capture_sizes)
    except TypeError:
        raise TypeError(f"{op}: capture_sizes must be a sequence of positive ints, got {capture_sizes!r}") from None
    if not sizes:
        raise ValueError(f"{op}: capture_sizes is empty; give the token counts to capture, e.g. [1, 2, 4, 8]")
    for size in sizes:
        if not validation.is_int(size) or size <= 0:
            raise ValueError(f"{op}: capture_sizes must hold positive ints, got {size!r} in {sizes!r}")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_tokens", max_num_tokens),
                        ("max_model_len", max_model_len)):
        if value is not None:  # None: the caller's default
            validation.check_positive_int(op, name, value)
    top = max(sizes)
    if max_num_tokens is not None and max_num_tokens < top:
        raise ValueError(f"{op}: max_num_tokens {max_num_tokens} is below the largest capture size {top}; "
                         "raise it or drop the larger sizes")
    for name, value in flags.items():
        validation.check_bool(op, name, value)
    for name, value in optional_flags.items():
        validation.check_bool(op, name, value, optional=True)
    if not (trace_cache is None or isinstance(trace_cache, (bool, str, os.PathLike))):
        raise TypeError(f"{op}: trace_cache must be True, False, None or a directory path, got {trace_cache!r}")
    if compile_threads is not None:
        validation.check_positive_int(op, "compile_threads", compile_threads)
    if graph_backend is not None and optional_flags.get("use_cuda_graphs") is False:
        # a graph backend captures graphs: the explicit False would be ignored
        raise ValueError(f"{op}: graph_backend given with use_cuda_graphs=False; a graph backend captures graphs "
                         "(use_cuda_graphs None or True), or drop graph_backend to run without graphs")
    if graph_backend is not None and not all(callable(getattr(graph_backend, m, None)) for m in _GRAPH_BACKEND_METHODS):
        # graph_backend=True (meant as "use graphs") failed at the capture, after the whole compile
        raise TypeError(f"{op}: graph_backend must be a graph backend (CudaGraphBackend(), RerunGraphBackend() or an "
                        f"object with {', '.join(_GRAPH_BACKEND_METHODS)}), got {graph_backend!r:.60}; "
                        "use_cuda_graphs=True turns graphs on")
    if progress is not None and not callable(progress):  # failed at its first message, mid-compile
        raise TypeError(f"{op}: progress must be callable (e.g. print) or None, got {progress!r:.60}")
    _check_layers(op, layers)
    return sorted(set(sizes))
