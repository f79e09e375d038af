"""The attention geometry of real checkpoints (CPU, fp32, random weights, no downloads):
per-head sizes, query / KV head ratios, rotary dims, RoPE types and scaling parameters, QK-norm
kinds, biases, soft caps and sliding windows as the released ``config.json`` files set them,
against the same weights under ``attn_implementation="eager"``.

Each config keeps its checkpoint's per-head geometry (``head_dim``, rotary dim, RoPE type and
parameters, QK-norm, biases, scalings, soft caps, query / KV heads ratio) and shrinks what the
attention does not see: 2 layers (a few with the checkpoint's layer pattern over 4 or 7), 2
KV heads with the checkpoint's query heads per KV head (1 for the multi-query checkpoints; as
many as query heads where the checkpoint has no GQA), a small vocabulary and MLP. Sliding windows are shrunk
to ``WINDOW`` so the prompts (5 to 11 tokens, 9 new) cross them. Norm weights, biases and sinks
start at constants (one, zero): they are perturbed so a weight or bias applied to the wrong
head or channel shows.

- ``PagedCache`` + ``generate()`` and ``eager_runner`` + ``batching.generate()`` for every
  geometry (``test_transformers_architectures.py``'s checks and tolerance);
- ``compile_transformers`` (README's serving path) for a subset (``COMPILED``): every layer's
  RoPE (QK-norm too where the model has one) and cache write fuse in the compiled pieces, and
  the served prompts match eager;
- the RoPEs transformers recomputes from each forward's longest position (``longrope``:
  Phi-3.5-mini, Phi-4-mini; ``dynamic``: Hunyuan dense's released NTK-alpha RoPE) compile on
  their original frequencies up to their original length (``SHORT_ORIGINAL``: shrunk so the
  prompts reach it; every layer fuses, the served prompts match eager; ``max_model_len``
  defaults to it), a longer ``max_model_len`` is refused before any cache is allocated, naming
  the rotary class and the largest accepted.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import inductor_rocm_attn as ira  # noqa: E402
from inductor_rocm_attn.compilation import RerunGraphBackend  # noqa: E402
from inductor_rocm_attn.integrations.batching import generate  # noqa: E402
from inductor_rocm_attn.integrations.transformers import PagedCache  # noqa: E402
from inductor_rocm_attn.compilation import piecewise as piecewise_module  # noqa: E402
from inductor_rocm_attn.compilation.trace_cache import trace_key  # noqa: E402
from inductor_rocm_attn.integrations import transformers_runner as runner_module  # noqa: E402
from inductor_rocm_attn.integrations.transformers_runner import (compile_transformers, eager_runner,  # noqa: E402
                                                                 step_forward)
from test_transformers import NEW_TOKENS, greedy, ragged_prompts  # noqa: E402
from test_transformers_architectures import PAGED_CONFIGS, STEP_TOKENS, TOL, TOL_OF, _errors  # noqa: E402

WINDOW = 6  # every sliding window, shrunk: the prompts and their new tokens cross it
_BASE = dict(vocab_size=256, num_hidden_layers=2, intermediate_size=128, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
_ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


def _heads(num_heads, num_kv_heads, head_dim, hidden=None):
    """Query / KV heads and the checkpoint's head size; hidden = heads * head_dim unless given
    (models whose projections allow another: kept small where the heads are many). Where the
    checkpoint has several query heads per KV head, 2 KV heads in its ratio (one KV head
    would hide which query heads read which), except the multi-query checkpoints."""
    return dict(_BASE, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                hidden_size=hidden or num_heads * head_dim)


def _fused_heads(num_heads, head_size):  # models whose head size is hidden / heads (no head_dim field)
    return dict(_BASE, num_attention_heads=num_heads, hidden_size=num_heads * head_size)


def _llama3(factor):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _longrope(rotary_dim):  # Phi-3.5 / Phi-4-mini: per-frequency short and long factors
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}


_YARN_GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
_GEMMA3_4B_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}


def _pattern(n, full_every):  # the checkpoint's layer pattern over n layers: every k-th layer full
    return dict(num_hidden_layers=n, sliding_window=WINDOW,
                layer_types=["full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
                             for i in range(n)])


# checkpoint: its attention, shrunk (comment: the checkpoint's query / KV heads and what is kept)
GEOMETRIES = {
    # 16 / 8 heads of 128 (hidden 1024), per-head q/k RMSNorm, theta 1e6
    "Qwen3-0.6B": lambda: transformers.Qwen3Config(**_heads(4, 2, 128, hidden=256), rope_theta=1e6),
    # 32 / 8 heads of 128
    "Qwen3-8B": lambda: transformers.Qwen3Config(**_heads(8, 2, 128, hidden=256), rope_theta=1e6),
    # 32 / 4 heads of 128, MoE
    "Qwen3-30B-A3B": lambda: transformers.Qwen3MoeConfig(**_heads(16, 2, 128, hidden=256), moe_intermediate_size=64,
                                                         num_experts=4, num_experts_per_tok=2, rope_theta=1e6),
    # 32 / 8 heads of 64, llama3 RoPE scaling (factor 32), theta 5e5, tied embeddings
    "Llama-3.2-1B": lambda: transformers.LlamaConfig(**_heads(8, 2, 64, hidden=256), rope_theta=5e5, rope_scaling=_llama3(32.0),
                                                     max_position_embeddings=131072, tie_word_embeddings=True),
    # 32 / 8 heads of 128, llama3 RoPE scaling (factor 8)
    "Llama-3.1-8B": lambda: transformers.LlamaConfig(**_heads(8, 2, 128, hidden=256), rope_theta=5e5, rope_scaling=_llama3(8.0),
                                                     max_position_embeddings=131072),
    # 32 / 8 heads of 128, a window on every layer (4096)
    "Mistral-7B-v0.1": lambda: transformers.MistralConfig(**_heads(8, 2, 128, hidden=256), sliding_window=WINDOW),
    # 32 / 8 heads of 128, sliding + full layers (window 32768)
    "Ministral-8B": lambda: transformers.MinistralConfig(**_heads(8, 2, 128, hidden=256), **_ALTERNATING),
    # 32 / 8 heads of 128, MoE, theta 1e6
    "Mixtral-8x7B": lambda: transformers.MixtralConfig(**_heads(8, 2, 128, hidden=256), num_local_experts=4,
                                                       num_experts_per_tok=2, rope_theta=1e6),
    # 8 / 4 heads of 256, query_pre_attn_scalar 256, attention soft cap 50 (final 30), window 4096
    "gemma-2-2b": lambda: transformers.Gemma2Config(**_heads(4, 2, 256, hidden=256), query_pre_attn_scalar=256,
                                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                    **_ALTERNATING),
    # 32 / 16 heads of 128, query_pre_attn_scalar 144 (hidden / heads, not head_dim)
    "gemma-2-27b": lambda: transformers.Gemma2Config(**_heads(4, 2, 128, hidden=256), query_pre_attn_scalar=144,
                                                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                     **_ALTERNATING),
    # 4 / 1 heads of 256 (multi-query), (1 + weight) QK-norm, window 512, local theta 1e4, global 1e6;
    # 7 layers: five sliding, one full, one sliding (its pattern)
    "gemma-3-1b": lambda: transformers.Gemma3TextConfig(**dict(_heads(4, 1, 256, hidden=256), **_pattern(7, 6)),
                                                        query_pre_attn_scalar=256, rope_parameters=_GEMMA3_ROPE),
    # 8 / 4 heads of 256, the global RoPE linearly scaled (factor 8)
    "gemma-3-4b": lambda: transformers.Gemma3TextConfig(**_heads(4, 2, 256, hidden=256), query_pre_attn_scalar=256,
                                                        **_ALTERNATING, rope_parameters=_GEMMA3_4B_ROPE),
    # 8 / 1 heads of 256 (multi-query)
    "gemma-2b": lambda: transformers.GemmaConfig(**_heads(8, 1, 256, hidden=256)),
    # 32 / 32 heads of 96, fused qkv, window 2047
    "Phi-3-mini-4k": lambda: transformers.Phi3Config(**_heads(2, 2, 96), sliding_window=WINDOW,
                                                     max_position_embeddings=4096),
    # 32 / 32 heads of 96, longrope (original 4096 of 131072 positions)
    "Phi-3.5-mini": lambda: transformers.Phi3Config(**_heads(2, 2, 96), max_position_embeddings=131072,
                                                    original_max_position_embeddings=4096, rope_scaling=_longrope(96)),
    # 24 / 8 heads of 128, partial rotary 0.75 (96 of 128 channels), longrope
    "Phi-4-mini": lambda: transformers.Phi3Config(**_heads(6, 2, 128), partial_rotary_factor=0.75,
                                                  max_position_embeddings=131072,
                                                  original_max_position_embeddings=4096, rope_scaling=_longrope(96)),
    # Phi-4-mini's heads with a plain RoPE: partial rotary 96 of 128 under compile_transformers
    "Phi-4-mini (plain RoPE)": lambda: transformers.Phi3Config(**_heads(6, 2, 128), partial_rotary_factor=0.75,
                                                               max_position_embeddings=4096),
    # 32 heads of 80, partial rotary 0.4 (32 of 80), q/k/v and dense biases, LayerNorm
    "phi-2": lambda: transformers.PhiConfig(**_fused_heads(4, 80), partial_rotary_factor=0.4),
    # 32 heads of 64, partial rotary 0.5
    "phi-1_5": lambda: transformers.PhiConfig(**_fused_heads(4, 64), partial_rotary_factor=0.5),
    # 32 heads of 80, rotary_pct 0.25: 20 channels rotated (10 frequencies), heads-first qkv
    "pythia-2.8b": lambda: transformers.GPTNeoXConfig(**_fused_heads(4, 80), rotary_pct=0.25),
    # 12 heads of 64, 16 channels rotated
    "pythia-160m": lambda: transformers.GPTNeoXConfig(**_fused_heads(4, 64), rotary_pct=0.25),
    # 64 heads of 96, 24 channels rotated
    "gpt-neox-20b": lambda: transformers.GPTNeoXConfig(**_fused_heads(4, 96), rotary_pct=0.25),
    # 64 heads of 64, partial rotary 0.5, q/k LayerNorm
    "persimmon-8b": lambda: transformers.PersimmonConfig(**_fused_heads(4, 64), partial_rotary_factor=0.5,
                                                         qk_layernorm=True),
    # 24 / 8 heads of 128, partial rotary 0.5, (1 + weight) LayerNorm
    "Minitron-4B": lambda: transformers.NemotronConfig(**_heads(6, 2, 128, hidden=256), partial_rotary_factor=0.5),
    # 16 / 16 heads of 128, q/k/v clamped at 8
    "OLMo-7B-0424": lambda: transformers.OlmoConfig(**_heads(2, 2, 128), clip_qkv=8.0),
    # 16 / 16 heads of 128, q/k RMSNorm over the whole projection, theta 5e5
    "OLMo-2-1B": lambda: transformers.Olmo2Config(**_heads(2, 2, 128), rope_theta=5e5),
    # 32 / 32 heads of 128, sliding + full layers (window 4096, three sliding to one full)
    "Olmo-3-7B": lambda: transformers.Olmo3Config(**dict(_heads(2, 2, 128), **_pattern(4, 4))),
    # 16 / 16 heads of 128, projection QK-norm, MoE
    "OLMoE-1B-7B": lambda: transformers.OlmoeConfig(**_heads(2, 2, 128), num_experts=4, num_experts_per_tok=2),
    # 64 / 64 heads of 128, interleaved (GPT-J) RoPE, theta 8e6, logit_scale
    "c4ai-command-r-v01": lambda: transformers.CohereConfig(**_heads(2, 2, 128), logit_scale=0.0625, rope_theta=8e6),
    # 96 / 8 heads of 128, per-head q/k LayerNorm (weights per head)
    "c4ai-command-r-plus": lambda: transformers.CohereConfig(**_heads(24, 2, 128, hidden=256), logit_scale=0.833,
                                                             use_qk_norm=True, rope_theta=7.5e7),
    # 32 / 8 heads of 128, sliding RoPE layers, full NoPE layers (window 4096, three to one)
    "c4ai-command-r7b": lambda: transformers.Cohere2Config(**dict(_heads(8, 2, 128, hidden=256), **_pattern(4, 4)),
                                                           logit_scale=0.25),
    # 64 / 8 heads of 64, yarn (factor 32, original 4096), theta 1.5e5, window 128, sinks, biases
    "gpt-oss-20b": lambda: transformers.GptOssConfig(**_heads(16, 2, 64, hidden=256), num_local_experts=4, num_experts_per_tok=2,
                                                     **_ALTERNATING, rope_scaling=_YARN_GPT_OSS, rope_theta=150000.0,
                                                     max_position_embeddings=131072),
    # 32 / 8 heads of 64, attention multiplier 1/64 as the scaling, theta 5e6
    "granite-3.1-2b": lambda: transformers.GraniteConfig(**_heads(8, 2, 64, hidden=256), attention_multiplier=0.015625,
                                                         embedding_multiplier=12.0, residual_multiplier=0.22,
                                                         logits_scaling=8.0, rope_theta=5e6),
    # 16 / 8 heads of 64, MoE
    "granite-3.0-1b-a400m": lambda: transformers.GraniteMoeConfig(**_heads(4, 2, 64, hidden=256), num_local_experts=4,
                                                                  num_experts_per_tok=2,
                                                                  attention_multiplier=0.015625),
    # 16 / 4 heads of 128, every 4th layer NoPE, theta 5e6 (4 layers: the last NoPE)
    "SmolLM3-3B": lambda: transformers.SmolLM3Config(**dict(_heads(8, 2, 128, hidden=256), num_hidden_layers=4),
                                                     no_rope_layer_interval=4, rope_theta=5e6),
    # 14 / 2 heads of 64 (seven query heads per KV head), q/k/v biases
    "Qwen2.5-0.5B": lambda: transformers.Qwen2Config(**_heads(14, 2, 64, hidden=256), rope_theta=1e6),
    # 28 / 4 heads of 128, yarn (factor 4, original 32768) as its card configures for long inputs
    "Qwen2.5-7B (yarn)": lambda: transformers.Qwen2Config(**_heads(14, 2, 128, hidden=256), rope_theta=1e6,
                                                          max_position_embeddings=131072,
                                                          rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                        "original_max_position_embeddings": 32768}),
    # 16 / 16 heads of 128, q/k/v biases, MoE
    "Qwen1.5-MoE-A2.7B": lambda: transformers.Qwen2MoeConfig(**_heads(2, 2, 128), moe_intermediate_size=64,
                                                             num_experts=4, shared_expert_intermediate_size=64),
    # 24 / 2 heads of 128, biases, window 4096
    "starcoder2-3b": lambda: transformers.Starcoder2Config(**_heads(24, 2, 128, hidden=256), sliding_window=WINDOW,
                                                           rope_theta=999999.4),
    # 32 / 2 heads of 128, GPT-J pairs over half of each head, q/k/v biases
    "GLM-4-9B-0414": lambda: transformers.Glm4Config(**_heads(32, 2, 128, hidden=256), partial_rotary_factor=0.5,
                                                     attention_bias=True),
    "glm-4-9b-chat-hf": lambda: transformers.GlmConfig(**_heads(32, 2, 128, hidden=256), partial_rotary_factor=0.5,
                                                       attention_bias=True),
    # 16 / 8 heads of 128, GPT-J pairs over the whole head
    "helium-1-2b": lambda: transformers.HeliumConfig(**_heads(4, 2, 128), rope_theta=1e5),
    # 16 / 2 heads of 128, GPT-J pairs rotated in fp32, theta 5e5
    "ERNIE-4.5-0.3B": lambda: transformers.Ernie4_5Config(**_heads(16, 2, 128, hidden=256), rope_theta=5e5),
    # 32 / 8 heads of 64, per-head QK-norm, llama3 RoPE scaling (factor 16), all layers full
    "EXAONE-4.0-1.2B": lambda: transformers.Exaone4Config(**_heads(8, 2, 64, hidden=256), rope_scaling=_llama3(16.0),
                                                          max_position_embeddings=65536, sliding_window=None,
                                                          layer_types=["full_attention"] * 2),
    # 40 / 8 heads of 128, sliding RoPE layers and full NoPE layers (window 4096, three to one)
    "EXAONE-4.0-32B": lambda: transformers.Exaone4Config(**dict(_heads(10, 2, 128, hidden=256), **_pattern(4, 4))),
    # 32 / 8 heads of 128, RoPE then per-head QK-norm; a plain RoPE (the released one: below)
    "Hunyuan-7B (plain RoPE)": lambda: transformers.HunYuanDenseV1Config(**_heads(8, 2, 128, hidden=256)),
    # the released RoPE: "dynamic" with NTK alpha 1000 (a fixed rescaled base up to 32768 positions)
    "Hunyuan-7B": lambda: transformers.HunYuanDenseV1Config(**_heads(8, 2, 128, hidden=256), max_position_embeddings=32768,
                                                            rope_scaling={"rope_type": "dynamic", "alpha": 1000.0,
                                                                          "factor": 1.0}),
    # 20 / 5 heads of 128, theta 5e5
    "bitnet-b1.58-2B-4T": lambda: transformers.BitNetConfig(**_heads(8, 2, 128), rope_theta=5e5),
    # 80 / 8 heads of 128, q/k/v biases, theta 1e7
    "Seed-OSS-36B": lambda: transformers.SeedOssConfig(**_heads(20, 2, 128, hidden=256), attention_bias=True, rope_theta=1e7),
    # 32 / 8 heads of 128, per-head QK-norm, llama3 RoPE scaling
    "Apertus-8B": lambda: transformers.ApertusConfig(**_heads(8, 2, 128, hidden=256), rope_scaling=_llama3(8.0),
                                                     max_position_embeddings=65536, rope_theta=12e6),
    # 32 / 32 heads of 128, per-head QK-norm, MoE after a dense layer
    "dots.llm1": lambda: transformers.Dots1Config(**_heads(2, 2, 128), moe_intermediate_size=64, n_routed_experts=4,
                                                  num_experts_per_tok=2, n_shared_experts=1,
                                                  first_k_dense_replace=1),
    # 20 / 4 heads of 128, yarn (factor 20, original 4096)
    "AFM-4.5B": lambda: transformers.ArceeConfig(**_heads(10, 2, 128), max_position_embeddings=65536,
                                                 rope_scaling={"rope_type": "yarn", "factor": 20.0,
                                                               "original_max_position_embeddings": 4096}),
}

# served through compile_transformers in CI (the audit behind README's table ran every config
# here): what the other files' tiny configs do not compile: heads of 256 with the (1 + weight)
# QK-norm and a linearly scaled global RoPE beside the local one; 20 of 80 channels rotated in
# heads-first q/k; yarn with sinks and eight query heads per KV head
COMPILED = ["gemma-3-4b", "pythia-2.8b", "gpt-oss-20b"]
# RoPEs whose frequencies follow each forward's longest position (rotary class, RoPE, its
# original length): compiled on their original frequencies, up to that length
RECOMPUTED_ROPE = {"Phi-3.5-mini": ("Phi3RotaryEmbedding", "longrope", 4096),
                   "Phi-4-mini": ("Phi3RotaryEmbedding", "longrope", 4096),
                   "Hunyuan-7B": ("HunYuanDenseV1RotaryEmbedding", "dynamic", 32768)}
ORIGINAL_LEN = 19  # the longest prompt (11 tokens) and its new tokens but the last: the cache holds 19
# Phi-3.5-mini's, Phi-4-mini's (partial rotary) and Hunyuan-7B's RoPEs with their original
# length shrunk to ORIGINAL_LEN
SHORT_ORIGINAL = {
    "Phi-3.5-mini": lambda: transformers.Phi3Config(**_heads(2, 2, 96), max_position_embeddings=131072,
                                                    original_max_position_embeddings=ORIGINAL_LEN,
                                                    rope_scaling=_longrope(96)),
    "Phi-4-mini": lambda: transformers.Phi3Config(**_heads(6, 2, 128), partial_rotary_factor=0.75,
                                                  max_position_embeddings=131072,
                                                  original_max_position_embeddings=ORIGINAL_LEN,
                                                  rope_scaling=_longrope(96)),
    "Hunyuan-7B": lambda: transformers.HunYuanDenseV1Config(**_heads(8, 2, 128, hidden=256),
                                                            max_position_embeddings=ORIGINAL_LEN,
                                                            rope_scaling={"rope_type": "dynamic", "alpha": 1000.0,
                                                                          "factor": 1.0}),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: a second intra-op thread only waits on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(name, geometries=GEOMETRIES):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(geometries[name](), attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    with torch.no_grad():  # constants at init (norm weights one, biases zero) would hide a misplaced one
        for param_name, p in model.named_parameters():
            if "norm" in param_name or param_name.endswith(".bias") or param_name.endswith("sinks"):
                g = torch.Generator().manual_seed(len(param_name))
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _eager(model):
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    other.load_state_dict(model.state_dict())
    return other


def _prompts():
    return [p[m.bool()].tolist() for p, m in zip(*ragged_prompts())]


def _eager_reference(eager, prompts):
    """Eager transformers generating each prompt alone: (tokens, logits) per prompt."""
    out = []
    for p in prompts:
        want = greedy(eager, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
        out.append((want.sequences[0, len(p):].tolist(), [x[0] for x in want.logits]))
    return out


def _check_served(got, want, tol=TOL):
    assert "mixed" in [s.kind for s in got.steps]  # prefill chunks beside decodes
    for tokens, logits, (want_tokens, want_logits) in zip(got.tokens, got.logits, want):
        assert tokens == want_tokens
        errs = _errors(logits, want_logits)
        assert len(errs) == NEW_TOKENS and max(errs) < tol, errs


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_paged_cache_and_eager_runner_match_eager(name):
    ours = _build(name)
    eager = _eager(ours)
    ids, mask = ragged_prompts()
    got = greedy(ours, ids, mask, past_key_values=PagedCache(ours, num_blocks=32, poison=True))
    want = greedy(eager, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    errs = _errors(got.logits, want.logits)
    assert len(errs) == NEW_TOKENS and max(errs) < TOL, errs
    runner = eager_runner(ours, num_blocks=32, max_num_seqs=8, max_num_tokens=STEP_TOKENS, poison=True)
    _check_served(generate(runner, _prompts(), NEW_TOKENS, return_logits=True), _eager_reference(eager, _prompts()))


@pytest.mark.compile
@pytest.mark.parametrize("name", COMPILED)
def test_compile_transformers_fuses_every_rope_layer_and_matches_eager(name):
    ours = _build(name)
    ira.fusion_report().clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # cold: the passes run
        runner = compile_transformers(ours, num_blocks=32, capture_sizes=[1, 2, 4, 8, 16], max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, poison=True, graph_backend=RerunGraphBackend())
    records = [r for r in ira.fusion_report().records
               if r.pass_name in ("rope_kv_cache_fusion", "qk_norm_rope_kv_cache_fusion")]
    fused = {layer for r in records if r.fused for layer in (r.serves or (r.layer_name,))}
    assert fused == set(runner.layers), ira.fusion_report()  # every layer, in the piece that serves it
    _check_served(generate(runner, _prompts(), NEW_TOKENS, return_logits=True),
                  _eager_reference(_eager(ours), _prompts()))


@pytest.mark.compile
def test_compile_transformers_fuses_gemma4_with_its_released_head_sizes():
    """Gemma4 (heads of 256 sliding / 512 full, K used as V on the full layers, a KV-shared last
    layer; ``test_transformers_architectures.py``'s config): under compile_transformers every
    layer with a key of its own fuses QK-norm + RoPE + cache write (``gemma4_norm``), the
    KV-shared layer fuses none (it has no key of its own), and the served prompts match eager."""
    torch.manual_seed(0)
    config = PAGED_CONFIGS["gemma4_real_heads"]()
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                         dtype=torch.float32).eval()
    ira.fusion_report().clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # cold: the passes run
        runner = compile_transformers(ours, num_blocks=32, capture_sizes=[1, 2, 4, 8, 16], max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, poison=True, graph_backend=RerunGraphBackend())
    records = [r for r in ira.fusion_report().records if r.pass_name == "qk_norm_rope_kv_cache_fusion"]
    fused = {layer for r in records if r.fused for layer in (r.serves or (r.layer_name,))}
    shared = config.num_hidden_layers - config.num_kv_shared_layers
    own_key = {name for name in runner.layers if int(name.split(".layers.")[1].split(".")[0]) < shared}
    assert own_key and fused == own_key, ira.fusion_report()
    # the KV-shared layer's miss says why: its key is the piece's input, computed by its target
    shared_misses = [r.detail for r in records if not r.fused
                     and not own_key & set(r.serves or (r.layer_name,))]
    assert shared_misses and all("the cached key is an input of this graph" in why for why in shared_misses), \
        ira.fusion_report()
    _check_served(generate(runner, _prompts(), NEW_TOKENS, return_logits=True),
                  _eager_reference(_eager(ours), _prompts()), tol=TOL_OF["gemma4_real_heads"])


def _rotary(model):
    return model.model.rotary_emb


def _fail(why):
    def fail(*args, **kwargs):
        raise AssertionError(why)
    return fail


@pytest.mark.parametrize("name", list(RECOMPUTED_ROPE))
def test_recomputed_ropes_past_their_original_length_are_refused_before_allocating(name, monkeypatch):
    """compile_transformers traces such a RoPE on its original frequencies: a max_model_len
    past its original length is refused, naming the rotary class, the RoPE, the value and
    the largest accepted, before any cache is allocated."""
    cls, kind, limit = RECOMPUTED_ROPE[name]
    monkeypatch.setattr(runner_module, "paged_layers", _fail("a cache was allocated"))
    with pytest.raises(NotImplementedError, match=rf"^compile_transformers: {cls} uses transformers' '{kind}' RoPE, "
                                                  rf"whose frequencies change once a forward's longest position "
                                                  rf"passes {limit} .* max_model_len={limit + 1} here, pass "
                                                  rf"max_model_len <= {limit} \(PagedCache serves longer"):
        compile_transformers(_build(name), num_blocks=4, max_model_len=limit + 1)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("name", list(SHORT_ORIGINAL))
def test_recomputed_rope_compile_defaults_to_its_original_length_and_restores_its_forward(name, monkeypatch):
    """Without max_model_len the default is capped at the RoPE's original length (longrope:
    below max_position_embeddings, said through progress; dynamic NTK: that length is
    max_position_embeddings). While compile_piecewise runs, the rotary module's forward is the
    function transformers' dynamic_rope_update wraps, on the original frequencies: past the
    limit it switches nothing. The class's forward is back after a compile that raises."""
    kind = _rotary(_build(name, SHORT_ORIGINAL)).rope_type
    model = _build(name, SHORT_ORIGINAL)
    rotary = _rotary(model)
    x, positions = torch.zeros(1, 3, 8), torch.tensor([[0, 1, 2 * ORIGINAL_LEN]])
    freqs = positions[0, :, None].float() * rotary.original_inv_freq
    want_cos = torch.cat((freqs, freqs), dim=-1).cos() * rotary.attention_scaling  # original frequencies
    seen = {}

    def compile_piecewise(model, capture_sizes, **kwargs):
        seen["max_model_len"] = kwargs["max_model_len"]
        seen["instance forward"] = "forward" in vars(rotary)
        seen["cos"] = rotary(x, positions)[0][0]
        seen["no update"] = rotary.inv_freq is rotary.original_inv_freq
        raise _Stop

    monkeypatch.setattr(piecewise_module, "compile_piecewise", compile_piecewise)
    said = []
    with pytest.raises(_Stop):
        compile_transformers(model, num_blocks=4, progress=said.append)  # the cache holds 64 tokens
    assert seen["max_model_len"] == ORIGINAL_LEN
    capped = [m for m in said if m.startswith("max_model_len defaults to")]
    assert capped == ([f"max_model_len defaults to {ORIGINAL_LEN}, the original length of {type(rotary).__name__}'s "
                       f"'longrope' RoPE (compiled on its original frequencies)"] if kind == "longrope" else [])
    assert seen["instance forward"] and seen["no update"]
    torch.testing.assert_close(seen["cos"], want_cos, rtol=0, atol=1e-6)
    assert "forward" not in vars(rotary)
    # the class's forward again: past the limit, transformers' update switches the frequencies
    assert not torch.allclose(rotary(x, positions)[0][0], want_cos, atol=1e-3)
    assert rotary.inv_freq is not rotary.original_inv_freq


@pytest.mark.parametrize("name", list(RECOMPUTED_ROPE))
def test_recomputed_rope_without_transformers_update_wrapper_is_refused(name):
    """A rotary class whose forward is not transformers' dynamic_rope_update wrapper (a class
    of its own), or an instance with a forward of its own (a hook), cannot have the update
    left out of the trace: refused, naming the class."""
    cls, kind, limit = RECOMPUTED_ROPE[name]
    model = _build(name)
    rotary = _rotary(model)
    rotary.forward = lambda x, position_ids: type(rotary).forward(rotary, x, position_ids)
    with pytest.raises(NotImplementedError, match=rf"^compile_transformers: {cls} uses transformers' '{kind}' RoPE "
                                                  r"and its instance has a forward of its own \(a hook\)"):
        compile_transformers(model, num_blocks=4)
    del rotary.forward
    rotary.__class__ = type(cls, (type(rotary),), {"forward": lambda self, x, position_ids: None})
    with pytest.raises(NotImplementedError, match=rf"^compile_transformers: {cls} uses transformers' '{kind}' RoPE, "
                                                  r"but its forward is not wrapped by transformers' "
                                                  r"dynamic_rope_update"):
        compile_transformers(model, num_blocks=4)


def test_recomputed_rope_trace_key_tells_the_trace_without_the_update_apart():
    """The trace cache's key covers each module's instance attributes: the trace
    compile_transformers makes without the frequency update (an instance forward) is never
    the one of the model with its update (compile_piecewise called directly)."""
    from inductor_rocm_attn.integrations.transformers import original_rope_frequencies

    model = _build("Phi-3.5-mini", SHORT_ORIGINAL)

    def key():
        return trace_key(model, [], step_forward(model), {})[0]

    with_update = key()
    with original_rope_frequencies(model):
        without_update = key()
        assert key() == without_update
    assert without_update != with_update
    assert key() == with_update


@pytest.mark.compile
@pytest.mark.parametrize("name", list(SHORT_ORIGINAL))
def test_compile_transformers_serves_recomputed_ropes_within_their_original_length(name):
    """Longrope (short and long factors far apart) and dynamic NTK-alpha RoPEs compile on their
    original frequencies: max_model_len defaults to the original length, which the longest
    prompt and its new tokens reach; every layer fuses and the served prompts match eager.
    An eager forward of the model past that length registers other frequencies: the compiled
    pieces keep reading the compile's (a step serves as before), the runner's full buffer
    check (generate) refuses naming the buffer, and a shorter eager forward registers the
    compile's frequencies again."""
    ours = _build(name, SHORT_ORIGINAL)
    rotary = _rotary(ours)
    ira.fusion_report().clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # cold: the passes run
        runner = compile_transformers(ours, num_blocks=32, capture_sizes=[1, 2, 4, 8, 16], max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, poison=True, graph_backend=RerunGraphBackend())
    assert runner.max_model_len == ORIGINAL_LEN and "forward" not in vars(rotary)
    records = [r for r in ira.fusion_report().records
               if r.pass_name in ("rope_kv_cache_fusion", "qk_norm_rope_kv_cache_fusion")]
    fused = {layer for r in records if r.fused for layer in (r.serves or (r.layer_name,))}
    assert fused == set(runner.layers), ira.fusion_report()
    prompts = _prompts()
    assert max(map(len, prompts)) + NEW_TOKENS - 1 == ORIGINAL_LEN
    served = generate(runner, prompts, NEW_TOKENS, return_logits=True)
    _check_served(served, _eager_reference(_eager(ours), prompts))

    step = [5, 6, 7, 8]
    before = runner(torch.tensor(step), runner.prepare([4], [0], [[0]])).clone()
    long_ids = torch.randint(3, 256, (1, 2 * ORIGINAL_LEN))
    greedy(ours, long_ids, torch.ones_like(long_ids), past_key_values=PagedCache(ours, num_blocks=8))
    assert rotary.inv_freq is not rotary.original_inv_freq  # transformers' update: other frequencies
    assert torch.equal(runner(torch.tensor(step), runner.prepare([4], [0], [[0]])), before)
    with pytest.raises(ValueError, match=r"model's model.rotary_emb.inv_freq is not the tensor the runner was "
                                         r"compiled with .* a buffer registered anew, as transformers' longrope / "
                                         r"dynamic RoPE does"):
        generate(runner, prompts, NEW_TOKENS)
    short_ids = long_ids[:, :5]
    greedy(ours, short_ids, torch.ones_like(short_ids), past_key_values=PagedCache(ours, num_blocks=8))
    again = generate(runner, prompts, NEW_TOKENS, return_logits=True)
    assert again.tokens == served.tokens
    assert all(torch.equal(a, b) for x, y in zip(again.logits, served.logits) for a, b in zip(x, y))
