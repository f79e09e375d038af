"""Elementwise helpers: ``rms_norm`` and ``static_scaled_fp8_quant`` (functional)."""

from ._fallback import ops_of, register_fallbacks

OPS = ("rms_norm", "static_scaled_fp8_quant")


def register() -> None:
    register_fallbacks(ops_of(*OPS))
