"""KV-cache writers: the layer-level cache update, the fused RoPE / QK-norm writers (the
RoPE ones rotate q/k in place and reach Inductor functionalized, the qkv QK-norm one returns
fresh q/k) and the kernel-level writers; each returns a dependency token or nothing. Explicit
fallbacks, so each runs in place on the caches it mutates."""

from ._fallback import ops_of, register_fallbacks

OPS = (
    "unified_kv_cache_update",
    "unified_rope_and_kv_cache_update",
    "unified_rope_cos_sin_and_kv_cache_update",
    "unified_qk_norm_rope_and_kv_cache_update",
    "unified_qk_norm_rope_cos_sin_and_kv_cache_update",
    "reshape_and_cache",
    "rope_and_cache",
    "rope_cos_sin_and_cache",
    "qk_norm_rope_and_cache",
    "qk_norm_rope_cos_sin_and_cache",
    "rotary_embedding",
)


def register() -> None:
    register_fallbacks(ops_of(*OPS))
