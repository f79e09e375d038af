"""KV-cache writers: the layer-level cache update and the fused RoPE / QK-norm writers (the
RoPE one rotates q/k in place, reinplaced by Inductor; the QK-norm one returns fresh q/k and
a dependency token), and the kernel-level writers: explicit fallbacks so each runs in place
on the caches it mutates."""

from ._fallback import ops_of, register_fallbacks

OPS = (
    "unified_kv_cache_update",
    "unified_rope_and_kv_cache_update",
    "unified_qk_norm_rope_and_kv_cache_update",
    "reshape_and_cache",
    "rope_and_cache",
    "qk_norm_rope_and_cache",
    "rotary_embedding",
)


def register() -> None:
    register_fallbacks(ops_of(*OPS))
