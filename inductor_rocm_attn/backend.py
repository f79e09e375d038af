"""The ROCM_ATTN backend and its per-layer impl.

``RocmAttentionBackend`` answers capability queries (from ``capabilities``) and describes
the cache. ``RocmAttentionImpl`` holds a layer's fixed configuration, validated once at
construction, and runs the per-step paths: cache update, fused RoPE/QK-norm cache updates,
attention (paged or encoder) and the profiling run. Its per-call work is the host-side checks
of ``step_checks`` (every call, before anything is written), a provider lookup and a kernel
call; everything that can be decided once is decided in ``__init__``.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

from . import capabilities, config_checks, providers, step_checks, validation
from .capabilities import AttentionType
from .forward_context import get_forward_context, get_layer
from .layout import (
    CacheLayout,
    KVCacheSpec,
    SUPPORTED_KV_CACHE_DTYPES,
    cache_torch_dtype,
    check_spec,
    convert_v_layout_,
    customize_spec,
    is_fp8_dtype,
)

__all__ = ["RocmAttentionBackend", "RocmAttentionImpl", "cache_epoch", "note_cache_bound"]

# Counts the V-layout switches and KV-cache (re)bindings of every layer in the process. A
# captured graph keeps the layout and the cache its launches were captured with, so a graph
# runner compares this once per replay and looks at its own layers only when it moved
# (``PiecewiseRunner``).
_cache_epoch = 0


def cache_epoch() -> int:
    return _cache_epoch


def note_cache_change() -> None:
    """A layer's V layout or bound KV cache changed."""
    global _cache_epoch
    _cache_epoch += 1


# Every live impl, so that a rebound cache reaches the kernels each one resolved.
_LIVE_IMPLS: "weakref.WeakSet[RocmAttentionImpl]" = weakref.WeakSet()


def note_cache_bound() -> None:
    """A layer was bound to a KV cache (``Attention.kv_cache`` assigned). Every impl forgets
    the kernels it resolved: their signatures hold a cache's address, dtype and V layout, not
    the geometry its first call checked, and a new cache may sit at a freed one's address
    with another geometry. Every impl, not only the layer's: layers that share its cache read
    it too. The next call of each signature is checked in full again."""
    for impl in list(_LIVE_IMPLS):
        impl._kernels.clear()
    note_cache_change()


_SIZED_OPS = providers.SIZED_OPS
_NO_SLOTS: dict = {}  # device -> an empty slot_mapping: a writer call that caches nothing
_KV_UPDATE_OP = "rocm_attn.unified_kv_cache_update"
_ATTN_OP = "rocm_attn.unified_attention_with_output"


class RocmAttentionBackend:
    """What the backend supports, under the seed backend's query names.

    Engine code written against the seed's ``RocmAttentionBackend`` asks these questions and
    gets the seed's answers, except where we go beyond it (each such answer says so): sinks
    work on every path, and the logits soft cap is applied (the seed stores it and ignores
    it). The answers read ``capabilities``, the table the providers' records build on.
    """

    name = "ROCM_ATTN"
    accept_output_buffer = True
    # The cache write is a separate op (``unified_kv_cache_update`` or a fused writer), not
    # part of the attention's forward.
    forward_includes_kv_cache_update = False
    supported_dtypes = list(capabilities.MODEL_DTYPES)
    supported_kv_cache_dtypes = list(SUPPORTED_KV_CACHE_DTYPES)
    supported_head_sizes = capabilities.HEAD_SIZES
    supported_attention_types = capabilities.SUPPORTED_ATTENTION_TYPES
    cache_layouts = (CacheLayout.LHBNC, CacheLayout.LBHNC)

    @staticmethod
    def get_name() -> str:
        return "ROCM_ATTN"

    @staticmethod
    def get_impl_cls():
        return RocmAttentionImpl

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        """``[MultipleOf(16)]``: any positive multiple of 16 (16, 32, 544, 784, 1056 ...).

        The native kernels serve 16 and 32; the Triton and reference paths every multiple.
        """
        return [capabilities.MultipleOf(capabilities.BLOCK_SIZE_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """The head sizes a GPU call of this build is served at: the Triton provider's, which
        stop at 256 on ROCm (head size 512's configs do not fit AMD's LDS; dispatch refuses
        it there), every ``capabilities.HEAD_SIZES`` entry elsewhere."""
        return list(providers.triton_head_sizes(bool(torch.version.hip)))

    @classmethod
    def supports_sink(cls) -> bool:
        """True; beyond the seed, which answers False (its native decode has no sinks): here
        every attention path applies sinks (the dispatch picks a provider that has them)."""
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type) -> bool:
        """DECODER, ENCODER and ENCODER_ONLY. Not ENCODER_DECODER, for the seed's reason: the
        prefill mixes the K/V passed in with the cached K/V, which is wrong for
        cross-attention once ``max_query_len > 1``."""
        try:
            return capabilities.AttentionType(attn_type) in capabilities.SUPPORTED_ATTENTION_TYPES
        except ValueError:
            return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        """False, as the seed: no bidirectional attention over a multimodal prefix."""
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        """False, as the seed: no KV-connector (KV transfer) integration."""
        return False

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[CacheLayout, ...]:
        """LHBNC (the native kernels need it) and LBHNC (Triton, the reference and AITER)."""
        return (CacheLayout.LHBNC, CacheLayout.LBHNC)

    @classmethod
    def customize_spec(cls, spec: KVCacheSpec) -> KVCacheSpec:
        """The spec with K and V as two head slots (``num_head_slots = 2``), so a block is a
        K page and a V page; its ``state_content_bytes`` is the seed's: the bytes one token
        takes in one head slot. Raises for a block or head size the backend does not support."""
        op = "RocmAttentionBackend.customize_spec"
        capabilities.check_cache_geometry(spec.block_size, spec.head_size, op)
        if spec.num_head_slots != 2:
            spec = dataclasses.replace(spec, num_head_slots=2)
        if isinstance(spec, KVCacheSpec):  # its head count, dtype and layout too (an engine's own spec: duck-typed)
            check_spec(spec, op)
        return spec

    @classmethod
    def fused_output_quant_supported(cls, quant_key) -> bool:
        """Static per-tensor symmetric fp8 quant of the output (``capabilities.FP8_STATIC_TENSOR_SYM``)."""
        return capabilities.fused_output_quant_supported(quant_key)

    @classmethod
    def fused_rope_kvcache_supported(cls) -> bool:
        """True: RoPE + cache write fuse for every configuration (the seed needs AITER)."""
        return True

    @classmethod
    def fused_qk_norm_rope_kvcache_supported(cls) -> bool:
        """True: QK-norm + RoPE + cache write fuse for every configuration (the seed needs AITER)."""
        return True

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return block_size > 0 and block_size % capabilities.BLOCK_SIZE_MULTIPLE == 0

    @staticmethod
    def supports_head_size(head_size: int) -> bool:
        return head_size in capabilities.HEAD_SIZES

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int):
        """Logical shape ``[num_blocks, 2, block_size, num_kv_heads * head_size]``."""
        capabilities.check_cache_geometry(block_size, head_size)
        return (num_blocks, 2, block_size, num_kv_heads * head_size)


# The cache dtypes each named kv_cache_dtype allows (fp8: either encoding of its format, FN or
# the FNUZ of some ROCm GPUs).
_CACHE_DTYPES_OF = {
    "float16": (torch.float16,),
    "bfloat16": (torch.bfloat16,),
    "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fnuz),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fnuz),
    "fp8_e5m2": (torch.float8_e5m2, torch.float8_e5m2fnuz),
}


def _select(caller: str, op: str, **call):
    """The kernel ``providers.select`` picks for ``op``; its refusal names ``caller``, the op the
    user called, before the kernel op (rewritten on the error path only)."""
    return _select_named(caller, op, **call)[1]


def _select_named(caller: str, op: str, **call) -> tuple[str, object]:
    try:
        return providers.select(op, **call)
    except NotImplementedError as e:
        raise NotImplementedError(f"{caller}: {e}") from None


def _warn_no_gradient(caller: str, provider: str, x: torch.Tensor) -> None:
    """The ops have no backward: only the PyTorch reference, built of differentiable torch ops,
    passes a gradient through. Another provider's output carries none, which in a model with
    a residual path would train on silently without the attention's gradient. Checked when a
    call signature's kernel is chosen (not every call): a warning, since inference without
    ``torch.no_grad()`` is a common and harmless use."""
    if provider != "reference" and x.requires_grad and torch.is_grad_enabled():
        warnings.warn(f"{caller}: the {provider!r} kernels have no backward; no gradient flows through this "
                      "attention to the query, key or value (inference only: run under torch.no_grad() or "
                      "torch.inference_mode())", stacklevel=3)


def _check_output_scale(op: str, output_scale: torch.Tensor, x: torch.Tensor, x_name: str = "query") -> None:
    """A per-call tensor: its shape, dtype and device (``x``'s) every call, its value where
    readable. The attention checks it, and so does its layer's cache update in a compiled
    graph that fused the fp8 output quant (the pass gives the update the same scale): there
    a scale the attention would refuse is refused before the cache is written."""
    if output_scale.device != x.device:
        raise ValueError(f"{op}: output_scale is on {output_scale.device} but the {x_name} is on {x.device}")
    validation.check_scales(op, output_scale=output_scale)


def _check_output(op: str, output: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                  reads_kv: bool, kv_cache: torch.Tensor | None = None, cache_ptr: int = 0) -> None:
    """The attention's output: not an expanded view (its rows would share memory), not the memory
    of the KV cache it reads (``kv_cache`` at ``cache_ptr``; None: a layer without one) nor, when
    the kernels read them (``reads_kv``: a query longer than one token), of the key/value; the
    common case (a contiguous output of a decode step) in a flag read and a pointer compare."""
    ptr = output.data_ptr()
    if output.is_contiguous() and (kv_cache is None or ptr != cache_ptr) and not (
            reads_kv and key is not None and ptr in (key.data_ptr(), value.data_ptr())):
        return  # a contiguous tensor has no expanded (stride-0) dim of size > 1
    read = dict(key=key, value=value) if reads_kv else {}
    if kv_cache is not None:
        read["kv_cache"] = kv_cache
    validation.check_written(op, dict(output=output), read)


class RocmAttentionImpl:
    """One attention layer's configuration and per-step paths.

    ``sliding_window``: keys with ``q_pos - k_pos < sliding_window`` are kept (None: all).
    ``logits_soft_cap``: logits become ``cap * tanh(logits / cap)`` (None/0: off); applied,
    where the seed stores the cap and ignores it.
    ``sinks``: ``[num_heads]`` per-head logit of a virtual zero-value token (every path).
    ``causal``: the layer's value (None: True for DECODER, False otherwise); a step's
    ``AttentionMetadata.causal`` overrides it for DECODER layers, as in the seed.
    ``q_scale``: must be 1.0 for an fp8 query (checked when such a query arrives); with any
    other query it is ignored, as in the seed, and the first such call warns.
    ``kv_sharing_target_layer_name``: this layer owns no cache and writes nothing; it reads
    the named layer's cache, V interior and scales at run time.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: torch.Tensor | list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType | str = AttentionType.DECODER,
        sinks: torch.Tensor | None = None,
        causal: bool | None = None,
        q_scale: float = 1.0,
        kv_sharing_target_layer_name: str | None = None,
    ):
        self.attn_type, num_kv_heads, sinks, alibi_slopes = config_checks.check_impl_config(
            "RocmAttentionImpl", num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, attn_type, sinks, causal, q_scale, kv_sharing_target_layer_name)
        self.num_heads, self.head_size, self.num_kv_heads = int(num_heads), int(head_size), int(num_kv_heads)
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.alibi_slopes = alibi_slopes
        self.sliding_window = int(sliding_window) if sliding_window else -1
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.sinks = sinks
        self.q_scale = float(q_scale)
        self._q_scale_warned = False
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if causal is None:
            causal = self.attn_type == AttentionType.DECODER
        self.causal = bool(causal)
        self.interleaved_v = False
        # An fp8 cache's scales are tensors a caller may change in place (no recompile): the
        # version of the layer's scale buffers when last checked; a write checks them again
        # when it moved (a 16-bit cache reads no scale).
        self._reads_scales = kv_cache_dtype.startswith("fp8")
        self._scales_checked = -1
        # The sinks / ALiBi slopes are the caller's tensors (a model's parameter, loaded later):
        # their version when their values were last checked (here, by the config check).
        self._per_head_checked = self._per_head_version()
        # The metadata of the last step this layer wrote its cache for: a layer sharing the cache
        # reads it only after this layer wrote the same step.
        self._written_step = None
        # The forward context this layer last wrote its cache in (ops._write_step): a second
        # write in the same context is refused.
        self._written_ctx = None
        # (metadata, key, value, cache, tokens) the cache update of this layer's current call
        # checked and wrote; the attention of the same call (same objects) skips those checks.
        self._just_written: tuple | None = None
        # (query, output) of ``Attention.forward``'s current call, set after its cache update:
        # it made output and checked query against key, so the attention skips those checks.
        self._forward_made: tuple | None = None
        # (op, call signature) -> kernel: the first call of a signature is validated in full
        # and resolved through the provider registry; later steps go straight to the kernel.
        self._kernels: dict[tuple, object] = {}
        _LIVE_IMPLS.add(self)
        # The attention's features for a causal and a non-causal step (the step may override),
        # decode-only (max_query_len 1: no "prefill") or not.
        self._features_of_step = {
            (c, prefill): providers.attention_features(
                causal=c, sliding_window=self.sliding_window, alibi_slopes=alibi_slopes,
                sinks=sinks, logits_soft_cap=self.logits_soft_cap, output_scale=None,
                max_query_len=2 if prefill else 1,
            )
            for c in (True, False) for prefill in (True, False)
        }

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_written_step"] = state["_written_ctx"] = None  # records of the last step, not configuration
        return state

    def __setstate__(self, state):  # a copy (deepcopy, unpickling) is live too
        self.__dict__.update(state)
        _LIVE_IMPLS.add(self)

    # --- cache ----------------------------------------------------------------------------

    @property
    def uses_kv_cache(self) -> bool:
        """Owns a KV cache: allocates it and writes it. A decoder layer that shares another
        layer's cache reads that cache but owns none (and writes nothing)."""
        return self.attn_type == AttentionType.DECODER and self.kv_sharing_target_layer_name is None

    def fused_rope_kvcache_supported(self) -> bool:
        """Whether this layer's RoPE and cache write may fuse (seed's name): it must write a cache."""
        return self.uses_kv_cache

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        """Whether this layer's QK-norm, RoPE and cache write may fuse (seed's name)."""
        return self.uses_kv_cache

    def fused_output_quant_supported(self, quant_key) -> bool:
        """Static per-tensor symmetric fp8 output quant fuses into the attention (seed's name)."""
        return capabilities.fused_output_quant_supported(quant_key)

    def kv_cache_spec(self, block_size: int, model_dtype: torch.dtype,
                      layout: CacheLayout | str = CacheLayout.LHBNC,
                      device: torch.device | None = None) -> KVCacheSpec:
        dtype = cache_torch_dtype(self.kv_cache_dtype, model_dtype, device)
        return customize_spec(block_size, self.num_kv_heads, self.head_size, dtype, layout)

    def set_interleaved_v_cache(self, enabled: bool = True, kv_cache: torch.Tensor | None = None) -> bool:
        """Switch this layer's V interior; converts ``kv_cache`` in place if given.

        Returns True when the layout changed. Every reader and writer of the layer reads
        ``self.interleaved_v`` at run time, so they all follow the switch (layers that share
        this layer's cache too).
        """
        validation.check_bool("set_interleaved_v_cache", "enabled", enabled)
        if enabled == self.interleaved_v:
            return False
        if kv_cache is not None and kv_cache.numel():
            convert_v_layout_(kv_cache, self.num_kv_heads, to_interleaved=enabled)
        self.interleaved_v = enabled
        note_cache_change()
        return True

    def _signature(self, op: str, x: torch.Tensor, kv_cache: torch.Tensor, num_tokens: int, *extra,
                   interleaved_v: bool | None = None, cache_ptr: int | None = None) -> tuple:
        """``interleaved_v``: the V interior the call will have (None: the layer's now);
        ``cache_ptr``: ``kv_cache.data_ptr()`` where the caller has it."""
        device = x.device
        # The token range picks among providers where a measured preference says so.
        bucket = providers.token_bucket(op, device, num_tokens) if op in _SIZED_OPS else 0
        if interleaved_v is None:
            interleaved_v = self.interleaved_v
        if cache_ptr is None:
            cache_ptr = kv_cache.data_ptr()
        return (op, device, x.dtype, cache_ptr, kv_cache.dtype, interleaved_v, bucket, *extra)

    def _resolve(self, sig: tuple, op: str, x: torch.Tensor, kv_cache: torch.Tensor | None,
                 num_tokens: int, features=(), interleaved_v: bool | None = None, *, caller: str):
        """Select the kernel ``op`` of a new call signature (already validated) and cache it;
        errors name ``caller``, the op the user called."""
        if kv_cache is not None and is_fp8_dtype(kv_cache.dtype) != self.kv_cache_dtype.startswith("fp8"):
            # an fp8 layer's scales would be ignored on a 16-bit cache, and an fp8 cache read
            # with the scale of 1 an "auto" layer carries
            raise ValueError(f"{caller}: the layer is configured with kv_cache_dtype={self.kv_cache_dtype!r} but "
                             f"its KV cache is {kv_cache.dtype}; an fp8 cache needs an fp8 kv_cache_dtype (with its "
                             "k/v scales) and any other cache a non-fp8 one ('auto', 'float16', 'bfloat16')")
        if kv_cache is not None and kv_cache.dtype not in _CACHE_DTYPES_OF.get(self.kv_cache_dtype, (kv_cache.dtype,)):
            # a named cache dtype is what the layer was configured for ("auto": the model's, or
            # another float dtype a caller allocated, e.g. under autocast)
            raise ValueError(f"{caller}: the layer is configured with kv_cache_dtype={self.kv_cache_dtype!r} but "
                             f"its KV cache is {kv_cache.dtype}; allocate the cache with the layer's kv_cache_spec() "
                             "(bind_kv_caches does) or configure the layer with the cache's dtype")
        if interleaved_v is None:
            interleaved_v = self.interleaved_v
        provider, fn = _select_named(caller, op, device=x.device, head_size=self.head_size, dtype=x.dtype,
                                     kv_cache=kv_cache, features=features, num_tokens=num_tokens,
                                     interleaved_v=interleaved_v and kv_cache is not None)
        _warn_no_gradient(caller, provider, x)
        self._kernels[sig] = fn
        return fn

    def _rope_features(self, cos_sin_cache: torch.Tensor) -> tuple[str, ...]:
        return ("partial_rotary",) if cos_sin_cache.shape[-1] < self.head_size else ()

    def _check_query_scale(self, query: torch.Tensor, op: str) -> None:
        if self.q_scale == 1.0:
            return
        if is_fp8_dtype(query.dtype):
            raise NotImplementedError(
                f"{op}: a q_scale of {self.q_scale} with an fp8 query ({query.dtype}) is not "
                "supported (as in the seed); an fp8 query needs q_scale 1.0"
            )
        if not self._q_scale_warned:  # the seed ignores it for such a query: say so, once a layer
            self._q_scale_warned = True
            warnings.warn(f"{op}: q_scale {self.q_scale} is ignored for a {query.dtype} query (it would scale an "
                          "fp8 query, which needs q_scale 1.0 here, as in the seed); build the layer with "
                          "q_scale=1.0", stacklevel=3)

    def check_fp8_query(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """What this layer's attention refuses of an fp8 ``query`` whatever the step (its
        ``q_scale``, a provider for the query's dtype), refused by ``Attention.forward`` before
        the cache update writes."""
        self._check_query_scale(query, _ATTN_OP)
        if self.uses_kv_cache and kv_cache.dim() == 4:  # unbound: the cache update says so
            _select(_ATTN_OP, "paged_attention", device=query.device, head_size=self.head_size, dtype=query.dtype,
                    kv_cache=kv_cache, interleaved_v=self.interleaved_v, num_tokens=query.shape[0])

    # --- per-call checks (every call, before anything is written) ---------------------------

    def check_scales_changed(self, op: str, buffers) -> None:
        """An fp8 layer's ``k_scale`` / ``v_scale`` buffers, checked again when they changed in
        place since their last check (an assigned tensor is checked by ``Attention``): a zero,
        NaN or infinite scale would be written with the keys, silently. Two version reads."""
        k, v = buffers["_k_scale"], buffers["_v_scale"]
        version = k._version + v._version
        if version != self._scales_checked:
            validation.check_scales(op, k_scale=k, v_scale=v)
            self._scales_checked = version

    def _kv_rows(self, op: str, key, value):
        rows = step_checks.token_rows
        return (rows(op, "key", key, self.num_kv_heads, self.head_size),
                rows(op, "value", value, self.num_kv_heads, self.head_size))

    def _checked_step(self, op: str, layer, key, value, kv_cache, attn_metadata):
        """(key, value as ``[T, Hkv, D]``, T) after the per-call checks of a write into
        ``kv_cache`` and of the step's metadata against it (the metadata the attention reads too)."""
        if key.dim() != 3 or value.dim() != 3:
            key, value = self._kv_rows(op, key, value)
        t = step_checks.check_cache_update(op, layer, key, value, kv_cache, attn_metadata, self.num_kv_heads,
                                           self.head_size)
        return key, value, t

    # --- cache writes ----------------------------------------------------------------------

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Write key/value ``[T, Hkv, D]`` (or ``[T, Hkv * D]``) at ``slot_mapping`` (the seed's
        entry point; the layer-level op calls ``update_kv_cache`` with the step's metadata)."""
        if not self.uses_kv_cache:
            return
        op = "RocmAttentionImpl.do_kv_cache_update"
        key, value = self._kv_rows(op, key, value)
        step_checks.cache_shape(op, layer, kv_cache)
        step_checks.check_layer_kv(op, key, value, kv_cache.device, key.shape[0], self.num_kv_heads,
                                   self.head_size)
        validation.check_slot_mapping(op, slot_mapping, kv_cache, key.shape[0])
        self._write(layer, key, value, kv_cache, slot_mapping, key.shape[0])

    def update_kv_cache(self, layer, key, value, kv_cache, attn_metadata, output_scale=None) -> None:
        """The step's cache write (``rocm_attn.unified_kv_cache_update``): checks the step's
        metadata against the cache, as the attention will read it, before writing.
        ``output_scale``: the scale of the fp8 quant fused into this layer's attention (None:
        not fused), checked before the write. A layer without a cache of its own (KV-sharing,
        encoder) writes nothing, but its key and value are still checked: the layer's heads."""
        if not self.uses_kv_cache:
            if key.dim() != 3 or value.dim() != 3:
                key, value = self._kv_rows(_KV_UPDATE_OP, key, value)
            step_checks.check_layer_kv(_KV_UPDATE_OP, key, value, key.device, key.shape[0], self.num_kv_heads,
                                       self.head_size)
            return
        key, value, t = self._checked_step(_KV_UPDATE_OP, layer, key, value, kv_cache, attn_metadata)
        if output_scale is not None:
            _check_output_scale(_KV_UPDATE_OP, output_scale, key, "key")
        self._write(layer, key, value, kv_cache, attn_metadata.slot_mapping, t)
        self._just_written = (attn_metadata, key, value, kv_cache, t)
        self._written_step = attn_metadata

    def _write(self, layer, key, value, kv_cache, slot_mapping, t: int) -> None:
        buffers = layer._buffers  # skips nn.Module.__getattr__
        if self._reads_scales:
            self.check_scales_changed(_KV_UPDATE_OP, buffers)
        if self.sinks is not None or self.alibi_slopes is not None:  # the attention's, before the write
            self.check_per_head_changed(_KV_UPDATE_OP)
        k_scale, v_scale = buffers["_k_scale"], buffers["_v_scale"]
        sig = self._signature("reshape_and_cache", key, kv_cache, t)
        fn = self._kernels.get(sig)
        if fn is None:
            validation.check_cache_write(_KV_UPDATE_OP, key, value, kv_cache, slot_mapping, k_scale, v_scale)
            fn = self._resolve(sig, "reshape_and_cache", key, kv_cache, t, caller=_KV_UPDATE_OP)
        fn(key, value, kv_cache, slot_mapping, k_scale, v_scale, self.interleaved_v)

    def do_rope_and_kv_cache_update(self, layer, positions, query, key, value, cos_sin_cache,
                                    is_neox, kv_cache, attn_metadata, op: str | None = None,
                                    output_scale=None) -> None:
        """Rotate ``query``/``key`` in place and write the rotated key and value to the cache.
        ``op``: the name errors give (the layer-level op's; None: the kernel op's, as the seed).
        ``output_scale``: as ``update_kv_cache``'s, checked before anything is written."""
        t = query.shape[0]
        rot_dim = cos_sin_cache.shape[-1]  # partial rotary changes which providers apply
        if attn_metadata is None or not self.uses_kv_cache:  # profiling run / no cache
            name = op or "rocm_attn.rotary_embedding"
            step_checks.check_rope_inputs(name, positions, cos_sin_cache, t, query.device, attn_metadata)
            step_checks.check_heads(name, "query", query, self.num_heads, self.head_size, t)
            if key is not None:
                step_checks.check_heads(name, "key", key, self.num_kv_heads, self.head_size, t)
            step_checks.check_rotated(name, query, key, None)
            sig = ("rotary_embedding", query.device, query.dtype, rot_dim,
                   providers.token_bucket("rotary_embedding", query.device, t))
            fn = self._kernels.get(sig)
            if fn is None:
                validation.check_rotary(name, positions, query, key, self.head_size, cos_sin_cache)
                fn = self._resolve(sig, "rotary_embedding", query, None, t,
                                   self._rope_features(cos_sin_cache), caller=name)
            fn(positions, query, key, self.head_size, cos_sin_cache, is_neox)
            return
        op = op or "rocm_attn.rope_and_cache"
        key, value, kv_t = self._checked_step(op, layer, key, value, kv_cache, attn_metadata)
        if t != kv_t or query.dtype is not key.dtype or query.device != kv_cache.device:
            raise ValueError(f"{op}: query ({tuple(query.shape)}, {query.dtype}, {query.device}) must match key "
                             f"({tuple(key.shape)}, {key.dtype}) on the KV cache's device {kv_cache.device}")
        step_checks.check_heads(op, "query", query, self.num_heads, self.head_size, t)
        step_checks.check_rope_inputs(op, positions, cos_sin_cache, t, kv_cache.device, attn_metadata)
        step_checks.check_rotated(op, query, key, value)
        if output_scale is not None:
            _check_output_scale(op, output_scale, key, "key")
        buffers = layer._buffers  # skips nn.Module.__getattr__
        if self._reads_scales:
            self.check_scales_changed(op, buffers)
        if self.sinks is not None or self.alibi_slopes is not None:
            self.check_per_head_changed(op)
        k_scale, v_scale = buffers["_k_scale"], buffers["_v_scale"]
        slot_mapping = attn_metadata.slot_mapping
        sig = self._signature("rope_and_cache", query, kv_cache, t, rot_dim)
        fn = self._kernels.get(sig)
        if fn is None:
            validation.check_rotary(op, positions, query, key, self.head_size, cos_sin_cache)
            validation.check_cache_write(op, key, value, kv_cache, slot_mapping, k_scale, v_scale)
            fn = self._resolve(sig, "rope_and_cache", query, kv_cache, t, self._rope_features(cos_sin_cache),
                               caller=op)
        fn(positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, is_neox, k_scale,
           v_scale, self.interleaved_v)
        self._written_step = attn_metadata

    def do_qk_norm_rope_kvcache_update(self, layer, qkv, q_weight, k_weight, eps, positions,
                                       cos_sin_cache, is_neox, kv_cache, attn_metadata,
                                       q_out=None, k_out=None, op: str = "rocm_attn.qk_norm_rope_and_cache",
                                       output_scale=None):
        """Split qkv, per-head RMSNorm q/k, RoPE, cache k/v. Returns ``(q, k)``.

        q and k are written into ``q_out [T, Hq, D]`` / ``k_out [T, Hkv, D]`` when given (the
        caller's buffers, as in the seed), else into buffers the kernel allocates. v is not
        copied out: the caller's v is the V slice of ``qkv``.

        The fused writer emits interleaved V: a layer fused into it is switched (normally
        by the pass at compile time; this guard covers a cache bound after compilation).
        ``op``: the name errors give (the layer-level op's; the default: the kernel op's, as the seed).
        ``output_scale``: as ``update_kv_cache``'s, checked before anything is written or converted.
        """
        if not self.uses_kv_cache:
            raise NotImplementedError(f"{op}: {self!r} writes no KV cache (an encoder layer or a "
                                      "layer sharing another layer's cache); nothing to fuse")
        t = qkv.shape[0]
        shape = step_checks.cache_shape(op, layer, kv_cache)
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_size
        if qkv.dim() != 2 or qkv.shape[1] != width or qkv.device != kv_cache.device:
            raise ValueError(f"{op}: qkv must be [num_tokens, {width}] on the KV cache's device {kv_cache.device}, "
                             f"got {tuple(qkv.shape)} on {qkv.device}")
        step_checks.check_rope_inputs(op, positions, cos_sin_cache, t, kv_cache.device, attn_metadata)
        if attn_metadata is None:
            slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=qkv.device)
        else:
            step_checks.check_step_metadata(op, attn_metadata, t, kv_cache.device, shape[0], shape[2])
            slot_mapping = attn_metadata.slot_mapping
            if output_scale is not None:
                _check_output_scale(op, output_scale, qkv, "qkv")
            if self._reads_scales:
                self.check_scales_changed(op, layer._buffers)
            if self.sinks is not None or self.alibi_slopes is not None:
                self.check_per_head_changed(op)

        def check_all():
            validation.check_qk_norm_rope(op, qkv, q_weight, k_weight, positions, cos_sin_cache,
                                          self.num_heads, self.num_kv_heads, self.head_size)
            validation.check_eps(op, eps)
            validation.check_kv_cache(op, kv_cache, self.num_kv_heads, self.head_size)
            validation.check_slot_mapping(op, slot_mapping, kv_cache, t)

        if not step_checks.norm_weights_ok(q_weight, k_weight, eps, self.head_size, kv_cache.device):
            check_all()
        if not self.interleaved_v:  # converts the cached data: every check, and the kernel's choice, first
            check_all()
            self._resolve(self._signature("qk_norm_rope_and_cache", qkv, kv_cache, t, cos_sin_cache.shape[-1],
                                          interleaved_v=True),
                          "qk_norm_rope_and_cache", qkv, kv_cache, t, self._rope_features(cos_sin_cache), True,
                          caller=op)
            self.set_interleaved_v_cache(True, kv_cache)
        buffers = layer._buffers  # skips nn.Module.__getattr__
        sig = self._signature("qk_norm_rope_and_cache", qkv, kv_cache, t, cos_sin_cache.shape[-1])
        fn = self._kernels.get(sig)
        if fn is None:
            check_all()
            fn = self._resolve(sig, "qk_norm_rope_and_cache", qkv, kv_cache, t,
                               self._rope_features(cos_sin_cache), caller=op)
        q, k, _ = fn(qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox, kv_cache,
                     slot_mapping, buffers["_k_scale"], buffers["_v_scale"], True, self.num_heads,
                     self.num_kv_heads, self.head_size, q_out, k_out, False)
        if attn_metadata is not None:
            self._written_step = attn_metadata
        return q, k

    def do_rope_cos_sin_and_kv_cache_update(self, layer, query, key, value, cos, sin, is_neox, kv_cache,
                                            attn_metadata, output_scale=None) -> None:
        """Rotate ``query [T, Hq, D]``/``key [T, Hkv, D]`` in place with the model's per-token
        ``cos``/``sin`` ``[T, rot_dim]`` and write the rotated key and value to the cache (a
        profiling run or a layer without a cache of its own: rotate only). ``output_scale``: as
        ``update_kv_cache``'s, checked before anything is written."""
        self._cos_sin_writer("rope_cos_sin_and_cache", layer, query, key, value, cos, sin, is_neox,
                             kv_cache, attn_metadata, (), output_scale=output_scale)

    def do_qk_norm_rope_cos_sin_kv_cache_update(self, layer, query, key, value, q_weight, k_weight, eps, cos,
                                                sin, is_neox, kv_cache, attn_metadata, gemma_norm=False,
                                                norm_after_rope=False, output_scale=None, gemma4_norm=False) -> None:
        """Per-head RMSNorm (transformers' rounding; ``gemma_norm``: Gemma's ``1 + weight``;
        ``gemma4_norm``: Gemma4's ``weight`` in fp32, rounded once),
        RoPE with per-token cos/sin (``norm_after_rope``: RoPE first, then the norm, as
        Hunyuan), both on ``query``/``key`` in place, and the cache write of key and value.

        The fused writer stands for a layer fused at compile time into interleaved V: a layer
        not switched yet (a graph from Inductor's cache, a cache bound after compilation) is
        switched here, its cached data converted, before the first write. ``output_scale``: as
        ``update_kv_cache``'s, checked before anything is written or converted.
        """
        self._cos_sin_writer("qk_norm_rope_cos_sin_and_cache", layer, query, key, value, cos, sin, is_neox,
                             kv_cache, attn_metadata, (q_weight, k_weight, eps), (gemma_norm, norm_after_rope, gemma4_norm),
                             output_scale)

    def _cos_sin_writer(self, op, layer, query, key, value, cos, sin, is_neox, kv_cache, attn_metadata,
                        norm: tuple, tail: tuple = (), output_scale=None) -> None:
        """``norm``: the QK-norm writer's weights and eps (empty for the plain writer), ``tail``:
        its arguments after ``interleaved_v``."""
        t = query.shape[0]
        write = attn_metadata is not None and self.uses_kv_cache
        name = f"rocm_attn.unified_{op.replace('_and_cache', '_and_kv_cache_update')}"
        if write:  # every call, before anything is written or converted
            rows = step_checks.token_rows(name, "key", key, self.num_kv_heads, self.head_size)
            step_checks.check_cache_update(name, layer, rows, value, kv_cache, attn_metadata, self.num_kv_heads,
                                           self.head_size)
            if output_scale is not None:
                _check_output_scale(name, output_scale, key, "key")
            if self._reads_scales:
                self.check_scales_changed(name, layer._buffers)
            if self.sinks is not None or self.alibi_slopes is not None:
                self.check_per_head_changed(name)
        device = kv_cache.device if write else value.device
        step_checks.check_cos_sin_call(name, query, key, value, cos, sin, device)
        step_checks.check_heads(name, "query", query, self.num_heads, self.head_size, t)
        if not write:  # else the cache update's check took key's rows
            step_checks.check_heads(name, "key", key, self.num_kv_heads, self.head_size, t)
        step_checks.check_rotated(name, query, key, value if write else None)
        slot_mapping = attn_metadata.slot_mapping if write else _NO_SLOTS.get(query.device)
        if slot_mapping is None:
            slot_mapping = _NO_SLOTS[query.device] = torch.empty(0, dtype=torch.int64, device=query.device)

        def check_all():
            validation.check_rope_cos_sin(name, query, key, value, cos, sin, *norm[:2])
            if norm:
                validation.check_eps(name, norm[2])
            if write:
                validation.check_cache_write(name, key.view(value.shape), value, kv_cache, slot_mapping,
                                             layer._buffers["_k_scale"], layer._buffers["_v_scale"])

        if norm and not step_checks.norm_weights_ok(*norm, self.head_size, device):
            check_all()
        cache = kv_cache if write else None
        rot_dim = cos.shape[-1]  # partial rotary changes which providers apply
        features = ("partial_rotary",) if rot_dim < self.head_size else ()
        if norm and write and not self.interleaved_v:  # the fused QK-norm writer emits interleaved V
            check_all()  # the switch converts the cached data: every check, and the kernel's choice, first
            self._resolve(self._signature(op, query, kv_cache, t, rot_dim, interleaved_v=True), op, query,
                          cache, t, features, True, caller=name)
            self.set_interleaved_v_cache(True, kv_cache)
        sig = (self._signature(op, query, kv_cache, t, rot_dim) if write
               else (op, query.device, query.dtype, rot_dim, "no cache"))
        fn = self._kernels.get(sig)
        if fn is None:
            check_all()
            fn = self._resolve(sig, op, query, cache, t, features, caller=name)
        buffers = layer._buffers  # skips nn.Module.__getattr__
        fn(query, key, value, *norm, cos, sin, is_neox, kv_cache, slot_mapping, buffers["_k_scale"],
           buffers["_v_scale"], self.interleaved_v and write, *tail)
        if write:
            self._written_step = attn_metadata

    # --- attention -------------------------------------------------------------------------

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """Attention of one step into ``output`` ``[num_tokens, num_heads, head_size]``.

        ``attn_metadata`` None: a profiling run (the seed's convention; the layer-level op
        passes None only inside ``profiling_run()``): zero-fills ``output``.
        """
        # What the cache update of this call checked; taken first, so it is never kept longer.
        written, self._just_written = self._just_written, None
        made, self._forward_made = self._forward_made, None
        if output_block_scale is not None:
            raise NotImplementedError(
                "RocmAttentionImpl: output_block_scale (block-scaled output quant) is not supported; "
                "only per-tensor static fp8 output quant (output_scale) is"
            )
        op = _ATTN_OP
        md = attn_metadata
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        if md is None:  # profiling run: zeros, into an output of the query's shape
            rows = step_checks.token_rows(op, "output", output, h, d)
            step_checks.check_layer_query(op, step_checks.token_rows(op, "query", query, h, d), rows,
                                          query.device, h, d)
            return output.fill_(0)
        # The layer passes [T, H, D] tensors; views and slices only when needed (each costs
        # about a microsecond on this per-layer, per-step path).
        query = step_checks.token_rows(op, "query", query, h, d)
        output = step_checks.token_rows(op, "output", output, h, d)
        if self.attn_type is not AttentionType.DECODER:
            key, value = self._kv_rows(op, key, value)
            step_checks.check_layer_query(op, query, output, query.device, h, d)
            step_checks.check_layer_kv(op, key, value, query.device, query.shape[0], hkv, d)
            step_checks.check_step_metadata(op, md, query.shape[0], query.device)
            step_checks.check_encoder_step(op, md)
            _check_output(op, output, key, value, True)
            if output_scale is not None:  # the quant after the encoder kernel would name its own op
                _check_output_scale(op, output_scale, query)
                if not is_fp8_dtype(output.dtype):
                    raise ValueError(f"{op}: output_scale (fused fp8 output quant) needs an fp8 output, got "
                                     f"{output.dtype}")
            n = md.num_actual_tokens
            return self._encoder_forward(query[:n], key[:n], value[:n], md, output, output_scale)
        # The cache this layer reads: its own, or (KV sharing) the target's, with the target's
        # V interior and scales read now, so a later switch of the target is followed.
        # A sharing layer's own k/v are not its keys: every key, the step's new ones too
        # (the target wrote them earlier in the step), comes from the target's cache.
        interleaved_v, buffers = self.interleaved_v, layer._buffers  # _buffers: skips nn.Module.__getattr__
        unwritten = False
        if self.kv_sharing_target_layer_name is not None:
            layer = get_layer(self.kv_sharing_target_layer_name)
            target = layer.impl
            if target.num_kv_heads != hkv or target.head_size != d:  # its cache holds other heads
                raise ValueError(
                    f"{op}: this layer ({hkv} KV heads of {d}) shares the KV cache of "
                    f"{self.kv_sharing_target_layer_name!r}, which holds {target.num_kv_heads} KV heads of "
                    f"{target.head_size}; a layer can only read a cache of its own geometry")
            unwritten = target._written_step is not md  # checked with the rest, below
            kv_cache, key, value = layer.kv_cache, None, None
            interleaved_v, buffers = target.interleaved_v, layer._buffers
        if (written is not None and written[0] is md and written[1] is key and written[2] is value
                and written[3] is kv_cache):
            # The cache update of this call checked key/value and the step against this cache.
            t = written[4]
            # Called by Attention.forward (``made``), the query's shape and channel stride, and
            # its device and dtype against the key's, are checked, and output is a [T, H, D]
            # tensor with a unit channel stride it made like the query.
            if made is None or made[0] is not query or made[1] is not output:
                step_checks.check_layer_query(op, query, output, kv_cache.device, h, d, t)
                if md.max_query_len > 1 and key.dtype is not query.dtype and not is_fp8_dtype(query.dtype):
                    raise ValueError(f"{op}: key dtype {key.dtype} != query dtype {query.dtype}")
        else:
            if key is not None and (key.dim() != 3 or value.dim() != 3):
                key, value = self._kv_rows(op, key, value)
            t = step_checks.check_attention_call(op, layer, query, key, value, output, kv_cache, md, h, hkv, d)
        cache_ptr = kv_cache.data_ptr()
        if made is None or made[1] is not output:  # an output of the caller's (Attention.forward makes its own)
            _check_output(op, output, key, value, md.max_query_len > 1, kv_cache, cache_ptr)
        n = md.num_actual_tokens
        if n != t:  # padded step: rows past n are not ours to touch
            out_n, query = output[:n], query[:n]
            if key is not None:
                key, value = key[:n], value[:n]
        else:
            out_n = output
        causal = self.causal if md.causal is None else md.causal
        args = (out_n, query, key, value, kv_cache, md.query_start_loc, md.seq_lens,
                md.block_table, self.scale, buffers["_k_scale"], buffers["_v_scale"], causal,
                self.sliding_window, self.alibi_slopes, self.sinks, self.logits_soft_cap,
                interleaved_v, output_scale, md.max_query_len, md.max_seq_len)
        if output_scale is not None:
            _check_output_scale(op, output_scale, query)
        prefill = md.max_query_len > 1  # a decode-only step may go to a provider without prefill
        sig = self._signature("paged_attention", query, kv_cache, n, output.dtype, output_scale is None,
                              causal, interleaved_v, prefill, cache_ptr=cache_ptr)
        fn = self._kernels.get(sig)
        if fn is None:
            self._check_query_scale(query, op)
            if key is None:  # the kernel reads the head count from the cache: it must be this layer's
                validation.check_kv_cache(op, kv_cache, hkv, d)
            # Per-head tensors follow the query's device, checked once per signature.
            args = args[:13] + (self._alibi(query), self._sinks(query)) + args[15:]
            validation.check_paged_attention(
                op, out_n, query, key, value, kv_cache, md.query_start_loc, md.seq_lens,
                md.block_table, args[13], args[14], output_scale, k_scale=args[9], v_scale=args[10],
                max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            )
            feats = self._features_of_step[causal, prefill] + (("output_scale",) if output_scale is not None else ())
            fn = self._resolve(sig, "paged_attention", query, kv_cache, n, feats, interleaved_v, caller=op)
        if self.sinks is not None or self.alibi_slopes is not None:
            self.check_per_head_changed(op)
        if unwritten and get_forward_context().layers is None:
            # A KV-sharing layer reads the keys its target wrote this step. Checked outside a
            # runner only: a runner's graph replays run no Python, so keep no record of the write.
            raise RuntimeError(
                f"{op}: this layer reads the KV cache of {self.kv_sharing_target_layer_name!r}, which has not "
                "written this step's tokens yet; in every step the target layer must run before the layers "
                "that share its cache")
        fn(*args)
        return output

    def _encoder_forward(self, query, key, value, attn_metadata, output, output_scale):
        self._check_query_scale(query, _ATTN_OP)
        if self.sinks is not None or self.alibi_slopes is not None:
            self.check_per_head_changed(_ATTN_OP)
        try:
            out = torch.ops.rocm_attn.encoder_attention(
                query, key, value, attn_metadata.query_start_loc, attn_metadata.max_query_len,
                self.scale, self.causal, self.sliding_window, self._alibi(query), self._sinks(query),
                self.logits_soft_cap,
            )
        except (ValueError, NotImplementedError) as e:  # the error path only: name the op the user called
            raise type(e)(f"{_ATTN_OP}: {e}") from None
        if output_scale is not None:  # checked by forward
            out = torch.ops.rocm_attn.static_scaled_fp8_quant(out, output_scale, output.dtype)
        output[: out.shape[0]].copy_(out)
        return output

    def _per_head_version(self) -> int:
        return sum(t._version for t in (self.alibi_slopes, self.sinks) if t is not None)

    def check_per_head_changed(self, op: str) -> None:
        """Sinks / ALiBi slopes changed in place since their values were checked (weights loaded
        after the layer was built): NaN / +inf sinks or non-finite slopes turn every row NaN,
        silently. Two version reads a call; the values are read as ``check_per_head_values`` reads them."""
        version = self._per_head_version()
        if version != self._per_head_checked:
            validation.check_per_head_values(op, self.alibi_slopes, self.sinks)
            self._per_head_checked = version

    def _alibi(self, like: torch.Tensor):
        if self.alibi_slopes is not None and self.alibi_slopes.device != like.device:
            self.alibi_slopes = self.alibi_slopes.to(like.device)
        return self.alibi_slopes

    def _sinks(self, like: torch.Tensor):
        if self.sinks is not None and self.sinks.device != like.device:
            self.sinks = self.sinks.to(like.device)
        return self.sinks

    def __repr__(self) -> str:
        shares = (f", shares {self.kv_sharing_target_layer_name!r}"
                  if self.kv_sharing_target_layer_name is not None else "")
        return (f"RocmAttentionImpl(heads={self.num_heads}/{self.num_kv_heads}, d={self.head_size}, "
                f"{self.attn_type.value}, kv={self.kv_cache_dtype}, interleaved_v={self.interleaved_v}"
                f"{shares})")
