"""The ROCM_ATTN backend and its per-layer impl.

``RocmAttentionBackend`` answers capability queries (from ``capabilities``) and describes
the cache. ``RocmAttentionImpl`` holds a layer's fixed configuration, validated once at
construction, and runs the per-step paths: cache update, fused RoPE/QK-norm cache updates,
attention (paged or encoder) and the profiling run. Its per-call work is a provider lookup
and a kernel call; everything that can be decided once is decided in ``__init__``.
"""

from __future__ import annotations

import math

import torch

from . import capabilities, providers, validation
from .capabilities import AttentionType
from .layout import (
    CacheLayout,
    KVCacheSpec,
    SUPPORTED_KV_CACHE_DTYPES,
    cache_torch_dtype,
    convert_v_layout_,
    customize_spec,
)

__all__ = ["RocmAttentionBackend", "RocmAttentionImpl"]

_SIZED_OPS = providers.SIZED_OPS


class RocmAttentionBackend:
    name = "ROCM_ATTN"
    accept_output_buffer = True
    supported_dtypes = capabilities.MODEL_DTYPES
    supported_kv_cache_dtypes = SUPPORTED_KV_CACHE_DTYPES
    supported_head_sizes = capabilities.HEAD_SIZES
    supported_attention_types = capabilities.SUPPORTED_ATTENTION_TYPES
    cache_layouts = (CacheLayout.LHBNC, CacheLayout.LBHNC)

    @staticmethod
    def get_impl_cls():
        return RocmAttentionImpl

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

    customize_spec = staticmethod(customize_spec)


class RocmAttentionImpl:
    """One attention layer's configuration and per-step paths.

    ``sliding_window``: keys with ``q_pos - k_pos < sliding_window`` are kept (None: all).
    ``logits_soft_cap``: logits become ``cap * tanh(logits / cap)`` (None/0: off).
    ``sinks``: ``[num_heads]`` per-head logit of a virtual zero-value token.
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
    ):
        op = "RocmAttentionImpl"
        self.attn_type = capabilities.check_attention_type(attn_type, op)
        capabilities.check_head_size(head_size, op)
        capabilities.check_kv_cache_dtype(kv_cache_dtype, op)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"{op}: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        if kv_cache_dtype.startswith("fp8") and q_scale != 1.0:
            raise NotImplementedError(
                f"{op}: fp8 query quantization (q_scale={q_scale}) is not supported; q_scale must be 1.0"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"{op}: sliding_window must be positive or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"{op}: logits_soft_cap must be >= 0, got {logits_soft_cap}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"{op}: sinks must be [num_heads] = [{num_heads}], got {tuple(sinks.shape)}")
        if alibi_slopes is not None:
            alibi_slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
            if tuple(alibi_slopes.shape) != (num_heads,):
                raise ValueError(f"{op}: alibi_slopes must be [num_heads] = [{num_heads}]")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.alibi_slopes = alibi_slopes
        self.sliding_window = int(sliding_window) if sliding_window else -1
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.sinks = sinks
        self.q_scale = q_scale
        if causal is None:
            causal = self.attn_type == AttentionType.DECODER
        self.causal = bool(causal)
        self.interleaved_v = False
        # (op, call signature) -> kernel: the first call of a signature is validated in full
        # and resolved through the provider registry; later steps go straight to the kernel.
        self._kernels: dict[tuple, object] = {}
        self._features = providers.attention_features(
            causal=self.causal, sliding_window=self.sliding_window, alibi_slopes=alibi_slopes,
            sinks=sinks, logits_soft_cap=self.logits_soft_cap, output_scale=None,
        )

    # --- cache ----------------------------------------------------------------------------

    @property
    def uses_kv_cache(self) -> bool:
        return self.attn_type == AttentionType.DECODER

    def kv_cache_spec(self, block_size: int, model_dtype: torch.dtype,
                      layout: CacheLayout | str = CacheLayout.LHBNC,
                      device: torch.device | None = None) -> KVCacheSpec:
        dtype = cache_torch_dtype(self.kv_cache_dtype, model_dtype, device)
        return customize_spec(block_size, self.num_kv_heads, self.head_size, dtype, layout)

    def set_interleaved_v_cache(self, enabled: bool = True, kv_cache: torch.Tensor | None = None) -> bool:
        """Switch this layer's V interior; converts ``kv_cache`` in place if given.

        Returns True when the layout changed. Every reader and writer of the layer reads
        ``self.interleaved_v`` at run time, so they all follow the switch.
        """
        enabled = bool(enabled)
        if enabled == self.interleaved_v:
            return False
        if kv_cache is not None and kv_cache.numel():
            convert_v_layout_(kv_cache, self.num_kv_heads, to_interleaved=enabled)
        self.interleaved_v = enabled
        return True

    def _signature(self, op: str, x: torch.Tensor, kv_cache: torch.Tensor, num_tokens: int, *extra) -> tuple:
        device = x.device
        # The token range picks among providers where a measured preference says so.
        bucket = providers.token_bucket(op, device, num_tokens) if op in _SIZED_OPS else 0
        return (op, device, x.dtype, kv_cache.data_ptr(), kv_cache.dtype, self.interleaved_v, bucket, *extra)

    def _resolve(self, sig: tuple, op: str, x: torch.Tensor, kv_cache: torch.Tensor | None,
                 num_tokens: int, features=()):
        """Select the kernel of a new call signature (already validated) and cache it."""
        _, fn = providers.select(op, device=x.device, head_size=self.head_size, dtype=x.dtype,
                                 kv_cache=kv_cache, features=features, num_tokens=num_tokens,
                                 interleaved_v=self.interleaved_v and kv_cache is not None)
        self._kernels[sig] = fn
        return fn

    def _rope_features(self, cos_sin_cache: torch.Tensor) -> tuple[str, ...]:
        return ("partial_rotary",) if cos_sin_cache.shape[-1] < self.head_size else ()

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self.uses_kv_cache:
            return
        if key.dim() != 3:
            key = key.view(-1, self.num_kv_heads, self.head_size)
            value = value.view(-1, self.num_kv_heads, self.head_size)
        buffers = layer._buffers  # skips nn.Module.__getattr__
        k_scale, v_scale = buffers["_k_scale"], buffers["_v_scale"]
        t = key.shape[0]
        sig = self._signature("reshape_and_cache", key, kv_cache, t)
        fn = self._kernels.get(sig)
        if fn is None:
            validation.check_cache_write("rocm_attn.unified_kv_cache_update", key, value, kv_cache,
                                         slot_mapping, k_scale, v_scale)
            fn = self._resolve(sig, "reshape_and_cache", key, kv_cache, t)
        fn(key, value, kv_cache, slot_mapping, k_scale, v_scale, self.interleaved_v)

    def do_rope_and_kv_cache_update(self, layer, positions, query, key, value, cos_sin_cache,
                                    is_neox, kv_cache, attn_metadata) -> None:
        """Rotate ``query``/``key`` in place and write the rotated key and value to the cache."""
        t = query.shape[0]
        rot_dim = cos_sin_cache.shape[-1]  # partial rotary changes which providers apply
        if attn_metadata is None or not self.uses_kv_cache:  # profiling run / no cache
            op = "rotary_embedding"
            sig = (op, query.device, query.dtype, rot_dim, providers.token_bucket(op, query.device, t))
            fn = self._kernels.get(sig)
            if fn is None:
                validation.check_rotary("rocm_attn.rotary_embedding", positions, query, key,
                                        self.head_size, cos_sin_cache)
                fn = self._resolve(sig, op, query, None, t, self._rope_features(cos_sin_cache))
            fn(positions, query, key, self.head_size, cos_sin_cache, is_neox)
            return
        key = key.view(t, self.num_kv_heads, self.head_size)
        value = value.view(t, self.num_kv_heads, self.head_size)
        buffers = layer._buffers  # skips nn.Module.__getattr__
        k_scale, v_scale = buffers["_k_scale"], buffers["_v_scale"]
        slot_mapping = attn_metadata.slot_mapping
        sig = self._signature("rope_and_cache", query, kv_cache, t, rot_dim)
        fn = self._kernels.get(sig)
        if fn is None:
            op = "rocm_attn.rope_and_cache"
            validation.check_rotary(op, positions, query, key, self.head_size, cos_sin_cache)
            validation.check_cache_write(op, key, value, kv_cache, slot_mapping, k_scale, v_scale)
            fn = self._resolve(sig, "rope_and_cache", query, kv_cache, t, self._rope_features(cos_sin_cache))
        fn(positions, query, key, value, kv_cache, slot_mapping, cos_sin_cache, is_neox, k_scale,
           v_scale, self.interleaved_v)

    def do_qk_norm_rope_kvcache_update(self, layer, qkv, q_weight, k_weight, eps, positions,
                                       cos_sin_cache, is_neox, kv_cache, attn_metadata):
        """Split qkv, per-head RMSNorm q/k, RoPE, cache k/v. Returns fresh (q, k, v).

        The fused writer emits interleaved V: a layer fused into it is switched (normally
        by the pass at compile time; this guard covers a cache bound after compilation).
        """
        if not self.interleaved_v:
            self.set_interleaved_v_cache(True, kv_cache)
        t = qkv.shape[0]
        if attn_metadata is None:
            slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=qkv.device)
        else:
            slot_mapping = attn_metadata.slot_mapping
        buffers = layer._buffers  # skips nn.Module.__getattr__
        sig = self._signature("qk_norm_rope_and_cache", qkv, kv_cache, t, cos_sin_cache.shape[-1])
        fn = self._kernels.get(sig)
        if fn is None:
            op = "rocm_attn.qk_norm_rope_and_cache"
            validation.check_qk_norm_rope(op, qkv, q_weight, k_weight, positions, cos_sin_cache,
                                          self.num_heads, self.num_kv_heads, self.head_size)
            validation.check_kv_cache(op, kv_cache, self.num_kv_heads, self.head_size)
            validation.check_slot_mapping(op, slot_mapping, kv_cache, t)
            fn = self._resolve(sig, "qk_norm_rope_and_cache", qkv, kv_cache, t,
                               self._rope_features(cos_sin_cache))
        return fn(qkv, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox, kv_cache,
                  slot_mapping, buffers["_k_scale"], buffers["_v_scale"], True, self.num_heads,
                  self.num_kv_heads, self.head_size)

    # --- attention -------------------------------------------------------------------------

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """Attention of one step into ``output`` ``[num_tokens, num_heads, head_size]``."""
        if output_block_scale is not None:
            raise NotImplementedError(
                "RocmAttentionImpl: output_block_scale (block-scaled output quant) is not supported; "
                "only per-tensor static fp8 output quant (output_scale) is"
            )
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        # The layer passes [T, H, D] tensors; views and slices only when needed (each costs
        # about a microsecond on this per-layer, per-step path).
        if query.dim() != 3:
            query = query.view(-1, h, d)
        if output.dim() != 3:
            output = output.view(-1, h, d)
        if key.dim() != 3:
            key, value = key.view(-1, hkv, d), value.view(-1, hkv, d)
        if self.attn_type is not AttentionType.DECODER:
            return self._encoder_forward(query[:n], key[:n], value[:n], attn_metadata, output, output_scale)
        if n != query.shape[0]:  # padded step: rows past n are not ours to touch
            out_n, query, key, value = output[:n], query[:n], key[:n], value[:n]
        else:
            out_n = output
        md = attn_metadata
        buffers = layer._buffers  # skips nn.Module.__getattr__
        args = (out_n, query, key, value, kv_cache, md.query_start_loc, md.seq_lens,
                md.block_table, self.scale, buffers["_k_scale"], buffers["_v_scale"], self.causal,
                self.sliding_window, self.alibi_slopes, self.sinks, self.logits_soft_cap,
                self.interleaved_v, output_scale, md.max_query_len, md.max_seq_len)
        sig = self._signature("paged_attention", query, kv_cache, n, output.dtype, output_scale is None)
        fn = self._kernels.get(sig)
        if fn is None:
            # Per-head tensors follow the query's device, checked once per signature.
            args = args[:13] + (self._alibi(query), self._sinks(query)) + args[15:]
            validation.check_paged_attention(
                "rocm_attn.unified_attention_with_output", out_n, query, key, value,
                kv_cache, md.query_start_loc, md.seq_lens, md.block_table, args[13], args[14],
                output_scale,
            )
            feats = self._features + (("output_scale",) if output_scale is not None else ())
            fn = self._resolve(sig, "paged_attention", query, kv_cache, n, feats)
        fn(*args)
        return output

    def _encoder_forward(self, query, key, value, attn_metadata, output, output_scale):
        out = torch.ops.rocm_attn.encoder_attention(
            query, key, value, attn_metadata.query_start_loc, attn_metadata.max_query_len,
            self.scale, self.causal, self.sliding_window, self._alibi(query), self._sinks(query),
            self.logits_soft_cap,
        )
        if output_scale is not None:
            out = torch.ops.rocm_attn.static_scaled_fp8_quant(out, output_scale, output.dtype)
        output[: out.shape[0]].copy_(out)
        return output

    def _alibi(self, like: torch.Tensor):
        if self.alibi_slopes is not None and self.alibi_slopes.device != like.device:
            self.alibi_slopes = self.alibi_slopes.to(like.device)
        return self.alibi_slopes

    def _sinks(self, like: torch.Tensor):
        if self.sinks is not None and self.sinks.device != like.device:
            self.sinks = self.sinks.to(like.device)
        return self.sinks

    def __repr__(self) -> str:
        return (f"RocmAttentionImpl(heads={self.num_heads}/{self.num_kv_heads}, d={self.head_size}, "
                f"{self.attn_type.value}, kv={self.kv_cache_dtype}, interleaved_v={self.interleaved_v})")
