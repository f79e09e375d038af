"""Attention ops: the layer-level ``unified_attention_with_output`` (mutates ``output``,
written in place after Inductor's reinplacing) and the kernel-level attention ops."""

from ._fallback import ops_of, register_fallbacks

OPS = ("unified_attention_with_output", "paged_attention", "encoder_attention")


def register() -> None:
    register_fallbacks(ops_of(*OPS))
