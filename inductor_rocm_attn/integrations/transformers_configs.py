"""transformers configs built here, no downloads: tiny ones per architecture (demo, tests) and
the shapes of two released models (benchmarks; their vocabularies, random weights).

>>> config = tiny_config("gemma2")                # 4 layers, alternating sliding window
>>> config = model_shape_config("qwen3-0.6b")     # Qwen3-0.6B's shape
"""

from __future__ import annotations

import transformers

__all__ = ["ARCHITECTURES", "MODEL_SHAPES", "model_shape_config", "tiny_config"]

_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, **_SPECIAL)

#: architecture -> (config class, what it exercises beyond Llama's attention)
ARCHITECTURES = {
    "qwen3": (transformers.Qwen3Config, "per-head q_norm/k_norm before RoPE"),
    "llama": (transformers.LlamaConfig, "RoPE, GQA"),
    "mistral": (transformers.MistralConfig, "sliding window on every layer"),
    "gemma2": (transformers.Gemma2Config, "logit soft cap, sliding window on alternate layers"),
}


def tiny_config(arch: str, num_layers: int = 4, **overrides):
    """A small config of ``arch`` (one of ``ARCHITECTURES``) with its distinguishing features
    switched on: sliding window 16 for Mistral and Gemma2's sliding layers, soft cap 30 for
    Gemma2 (both reached by prompts of a few dozen tokens)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"tiny_config: unknown architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    kw = dict(_TINY, num_hidden_layers=num_layers)
    if arch == "mistral":
        kw.update(sliding_window=16)
    if arch == "gemma2":
        kw.update(sliding_window=16, attn_logit_softcapping=30.0, query_pre_attn_scalar=32,
                  layer_types=(["sliding_attention", "full_attention"] * num_layers)[:num_layers])
    kw.update(overrides)
    return ARCHITECTURES[arch][0](**kw)


#: name -> (config class, fields): the released models' shapes
MODEL_SHAPES = {
    "qwen3-0.6b": (transformers.Qwen3Config, dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama-3.2-1b": (transformers.LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192))),
}


def model_shape_config(name: str, **overrides):
    """The config of a released model's shape (``MODEL_SHAPES``), ``overrides`` applied
    (e.g. ``num_hidden_layers=2`` for a quick check)."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"model_shape_config: unknown model {name!r}; choose from {sorted(MODEL_SHAPES)}")
    cls, fields = MODEL_SHAPES[name]
    return cls(**{**fields, **_SPECIAL, **overrides})
