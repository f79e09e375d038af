"""Every architecture README's transformers table lists as matching, on both paths, against
the same weights under ``attn_implementation="eager"`` (CPU, fp32, tiny random configs, no
downloads; compiled only where said):

- ``PagedCache`` + ``generate()`` on ragged left-padded prompts (one prefill, 8 decode steps)
  against eager with its own cache, for the architectures ``test_transformers.py`` does not
  already run that way;
- ``eager_runner`` + ``batching.generate()``: the same prompts served by continuous batching
  in steps of at most 16 tokens (chunked prefills mixed with decodes, all of a step's tokens
  one row of the model), each against eager generating that prompt alone;
- two compiled checks (Cohere2, EXAONE 4, NoPE layers beside RoPE layers): every RoPE layer
  fuses, the NoPE layers stay unfused.

Each config switches on what sets its architecture apart (sliding windows the prompts pass,
NoPE layers, partial rotary, QK-norms, biases, clamped projections, multipliers, soft caps,
KV-shared layers, heads set per layer, MoE routing); what it exercises is in its comment. The
attention honours some of these itself (a window, a scaling, a soft cap):
``test_features_change_eager_logits`` shows that each moves eager's logits by far more than the
tolerance when switched off, so a match is evidence they are honoured. The attention modules
one paged layer cannot serve are refused by every entry point before any cache is built
(``REFUSED``).

Tolerance: greedy tokens identical and every step's logits within 4e-6 of its largest
|logit|, the bound README's table states (measured 1e-7 to 1.8e-6: our CPU kernels accumulate
in float64 and round once, eager in fp32); Gemma3n and Gemma4 within 1e-5, Gemma4 with its
real head sizes 2e-5 (``TOL_OF``).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from inductor_rocm_attn.integrations.batching import generate  # noqa: E402
from inductor_rocm_attn.integrations.transformers import PagedCache  # noqa: E402
from inductor_rocm_attn.integrations.transformers_runner import eager_runner  # noqa: E402
from test_transformers import (_SMALL, MORE_CONFIGS, NEW_TOKENS, greedy, ragged_prompts, rel,  # noqa: E402
                               twin)
from test_transformers_fusion import CONFIGS as FUSION_CONFIGS  # noqa: E402

TOL = 4e-6
# Gemma3n, Gemma4 (scaling 1.0 over normalized q/k: sharper softmaxes): eager fp32 itself is up
# to 6.5e-6 from the same model run in float64, ours up to 4.6e-6, so up to 8.8e-6 from eager.
# Gemma4 with its real head sizes (dots over 512 channels of normalized q/k): eager fp32 is up
# to 1.6e-5 from the same model in float64, ours up to 1.2e-5, 8.6e-6 from eager.
TOL_OF = {"gemma3n": 1e-5, "gemma4": 1e-5, "gemma4_real_heads": 2e-5}
STEP_TOKENS = 16  # the runner's step budget: the longer prompts prefill in two chunks beside decodes

_KV2 = dict(_SMALL, num_key_value_heads=2)  # 2 layers, hidden 128, 4 query heads, 2 KV heads
_LAYER_NORM = {k: v for k, v in _KV2.items() if k != "rms_norm_eps"}  # configs with layer_norm_eps instead
_ALTERNATING = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
_GPT2 = dict(vocab_size=256, n_layer=2, n_embd=128, n_head=4, n_positions=128, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)

# Architectures whose PagedCache path is run here (test_transformers.py runs the others).
PAGED_CONFIGS = {
    # per-head QK-norm, MoE (top-2 of 4), a sliding window on every layer
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_KV2, head_dim=32, moe_intermediate_size=64, num_experts=4,
                                                     num_experts_per_tok=2, use_sliding_window=True, sliding_window=6),
    # MoE, a sliding window on every layer (from the config, no per-layer attribute)
    "mixtral": lambda: transformers.MixtralConfig(**_KV2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                                  sliding_window=6),
    # layer 1 a NoPE layer with a sliding window, layer 0 RoPE and full
    "smollm3": lambda: transformers.SmolLM3Config(**_KV2, no_rope_layer_interval=2, use_sliding_window=True,
                                                  sliding_window=6),
    # interleaved (GPT-J) RoPE on the sliding layer only: the full layer is NoPE
    "cohere2": lambda: transformers.Cohere2Config(**_LAYER_NORM, **_ALTERNATING),
    "ministral": lambda: transformers.MinistralConfig(**_KV2, head_dim=32, **_ALTERNATING),
    # QK-norm over the whole projection, sliding + full layers
    "olmo3": lambda: transformers.Olmo3Config(**_KV2, **_ALTERNATING),
    # QK-norm over the projection, q/k/v clamped, MoE
    "olmoe": lambda: transformers.OlmoeConfig(**_KV2, num_experts=4, num_experts_per_tok=2, clip_qkv=0.5),
    # partial rotary (half of each head), LayerNorm QK-norm, biases
    "phi": lambda: transformers.PhiConfig(**_LAYER_NORM, qk_layernorm=True),
    # (1 + weight) norms, scaled embeddings, head_dim set apart from hidden / heads
    "gemma": lambda: transformers.GemmaConfig(**_KV2, head_dim=32),
    "arcee": lambda: transformers.ArceeConfig(**_KV2),  # ReLU^2 MLP
    # q/k/v and output-projection biases
    "seed_oss": lambda: transformers.SeedOssConfig(**_KV2, head_dim=32, attention_bias=True, attention_out_bias=True),
    "bitnet": lambda: transformers.BitNetConfig(**_KV2),  # sub-norm before the output projection
    "nemotron": lambda: transformers.NemotronConfig(**_LAYER_NORM),  # partial rotary 0.5, (1 + weight) LayerNorm
    # fused qkv, partial rotary, LayerNorm QK-norm, no GQA
    "persimmon": lambda: transformers.PersimmonConfig(**{k: v for k, v in _LAYER_NORM.items()
                                                         if k != "num_key_value_heads"}),
    # attention_multiplier as the scaling, MoE
    "granitemoe": lambda: transformers.GraniteMoeConfig(**_KV2, num_local_experts=4, num_experts_per_tok=2,
                                                        attention_multiplier=0.3),
    # per-head QK-norm, MoE with a shared expert after a dense layer, sliding + full layers
    "dots1": lambda: transformers.Dots1Config(**_KV2, head_dim=32, moe_intermediate_size=64, n_routed_experts=4,
                                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                              **_ALTERNATING),
    "apertus": lambda: transformers.ApertusConfig(**_KV2),  # per-head QK-norm, xIELU, llama3 RoPE scaling
    # learned positions, the scaling divided by layer_idx + 1
    "gpt2": lambda: transformers.GPT2Config(**_GPT2, scale_attn_by_inverse_layer_idx=True),
    # learned positions, multi-query attention (one KV head) from a fused projection
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(**_GPT2, multi_query=True),
    # a sliding layer (0) beside a full one, its window set on the module and applied by the mask
    # only (the module never passes it to the attention function)
    "qwen2_moe_window": lambda: transformers.Qwen2MoeConfig(**_KV2, moe_intermediate_size=64, num_experts=4,
                                                            shared_expert_intermediate_size=64,
                                                            use_sliding_window=True, sliding_window=6,
                                                            max_window_layers=1),
    # per-head QK-norm after RoPE (heads-first q/k), MoE
    "hunyuan_moe": lambda: transformers.HunYuanMoEV1Config(**_KV2, head_dim=32, num_experts=4, moe_topk=2),
    # query heads set per layer (4, then 8): the layer's count is the module's, not the config's
    "laguna": lambda: transformers.LagunaConfig(**_KV2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=64, num_attention_heads_per_layer=[4, 8]),
    # mixture of attention heads: K/V repeated top_k times before the call (num_key_value_groups 1)
    "jetmoe": lambda: transformers.JetMoeConfig(**_KV2, kv_channels=32, num_local_experts=4, num_experts_per_tok=2),
    # sliding layers with twice the KV heads and sinks, full layers without (value heads of head_dim)
    "mimo_v2_flash": lambda: transformers.MiMoV2FlashConfig(**_KV2, head_dim=32, v_head_dim=32, num_experts=4,
                                                            num_experts_per_tok=2, moe_intermediate_size=64,
                                                            **_ALTERNATING),
    # KV-shared layers (the last attends to the K/V of the last full layer before it), per-layer
    # inputs, AltUp
    "gemma3n": lambda: transformers.Gemma3nTextConfig(
        **dict(_KV2, intermediate_size=[256] * 3, num_hidden_layers=3), num_kv_shared_layers=1,
        layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=6,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, altup_num_inputs=2, laurel_rank=8,
        activation_sparsity_pattern=[0.0] * 3),
    # KV-shared layer, head sizes per layer type (32 sliding, 64 full), scaling 1.0, V-norm
    "gemma4": lambda: transformers.Gemma4TextConfig(
        **dict(_KV2, num_hidden_layers=3), head_dim=32, global_head_dim=64, num_kv_shared_layers=1,
        layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=6,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
    # the released checkpoints' head sizes (256 sliding, 512 full), K used as V on the full layers
    # (attention_k_eq_v: V is the V-norm of the key projection, K its K-norm + RoPE) with fewer KV
    # heads there (num_global_key_value_heads), proportional RoPE over a quarter of the 512,
    # a KV-shared full layer
    "gemma4_real_heads": lambda: transformers.Gemma4TextConfig(
        **dict(_KV2, num_hidden_layers=3), head_dim=256, global_head_dim=512, attention_k_eq_v=True,
        num_global_key_value_heads=1, num_kv_shared_layers=1,
        layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=6,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
    # soft-capped attention logits (a cap the random init's small scores reach), sliding + full layers
    "vaultgemma": lambda: transformers.VaultGemmaConfig(**_KV2, head_dim=32, attn_logit_softcapping=0.05,
                                                        query_pre_attn_scalar=24, **_ALTERNATING),
    "granite_swa": lambda: transformers.GraniteSWAConfig(**_KV2, attention_multiplier=0.3, **_ALTERNATING),
    # NoPE full layers beside sliding RoPE layers, MoE
    "exaone_moe": lambda: transformers.ExaoneMoeConfig(**_KV2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=64, **_ALTERNATING),
    "cohere2_moe": lambda: transformers.Cohere2MoeConfig(**_LAYER_NORM, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=64, **_ALTERNATING),
    # gated attention output, QK-norm, sliding + full layers, MoE
    "afmoe": lambda: transformers.AfmoeConfig(**_KV2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=64, **_ALTERNATING),
    # partial rotary with QK-norm, MoE
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**_KV2, head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=64, n_group=1, topk_group=1,
                                                   use_qk_norm=True),
    # a window applied by the mask, never passed to the attention function (as for qwen2_moe_window)
    "phimoe": lambda: transformers.PhimoeConfig(**_KV2, num_local_experts=4, num_experts_per_tok=2,
                                                sliding_window=6),
    # position-dependent query scaling (llama_4_scaling) in the model, a sliding window on every layer
    "ministral3": lambda: transformers.Ministral3Config(**_KV2, head_dim=32, sliding_window=6),
    "nanochat": lambda: transformers.NanoChatConfig(**_KV2),  # QK-norm without weights, ReLU^2
    "granitemoe_swa": lambda: transformers.GraniteMoeSWAConfig(**_KV2, num_local_experts=4, num_experts_per_tok=2,
                                                               attention_multiplier=0.3, **_ALTERNATING),
    "granitemoe_shared": lambda: transformers.GraniteMoeSharedConfig(**_KV2, num_local_experts=4,
                                                                     num_experts_per_tok=2, attention_multiplier=0.3),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(**_KV2, moe_num_experts=4, moe_k=2,
                                                            moe_intermediate_size=64),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(**_KV2, head_dim=32, num_local_experts=4,
                                                       num_experts_per_tok=2),
    "flex_olmo": lambda: transformers.FlexOlmoConfig(**_KV2, num_experts=4, num_experts_per_tok=2),
    "cwm": lambda: transformers.CwmConfig(**_KV2, head_dim=32, **_ALTERNATING),
    "mellum": lambda: transformers.MellumConfig(**_KV2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=64, **_ALTERNATING),
    "hy_v3": lambda: transformers.HYV3Config(**_KV2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=64),
    "jais2": lambda: transformers.Jais2Config(**_KV2),  # biases
    "hyperclovax": lambda: transformers.HyperCLOVAXConfig(**_KV2, attention_multiplier=0.3),
    "solar_open": lambda: transformers.SolarOpenConfig(**_KV2, head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=64, n_group=1, topk_group=1),
    "aria_text": lambda: transformers.AriaTextConfig(**_KV2, moe_num_experts=4, moe_topk=2),
    # get_decoder() is its output projection (named ``decoder``): the stack is the base model;
    # sliding layers of local_attention // 2 beside full ones
    "modernbert_decoder": lambda: transformers.ModernBertDecoderConfig(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=3,
        sep_token_id=4, local_attention=12, global_attn_every_n_layers=2),
    # fused qkv projection, q/k/v clamped (transformers 5.17 fails without clip_qkv), MoE
    "dbrx": lambda: transformers.DbrxConfig(
        d_model=128, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 0.5},
        ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 64}),
}
# eager_runner: the architectures above and those test_transformers*.py run through PagedCache
# (their configs, reused); Hunyuan dense's runner check is test_transformers_graphs.py's.
RUNNER_CONFIGS = {**PAGED_CONFIGS, **MORE_CONFIGS,
                  **{name: FUSION_CONFIGS[name] for name in ("glm", "glm4", "helium", "ernie4_5", "olmo")}}

# What the attention computes from each config, and the config change that removes it.
FEATURE_OFF = {
    "qwen3_moe": {"sliding_window": None}, "mixtral": {"sliding_window": None},
    "smollm3": {"sliding_window": 4096}, "cohere2": {"sliding_window": 4096}, "ministral": {"sliding_window": 4096},
    "olmo3": {"sliding_window": 4096}, "dots1": {"sliding_window": 4096}, "granitemoe": {"attention_multiplier": 1.0},
    "gpt2": {"scale_attn_by_inverse_layer_idx": False},
    "starcoder2": {"sliding_window": None}, "gemma3": {"sliding_window": 4096}, "gpt_oss": {"sliding_window": 4096},
    "exaone4": {"sliding_window": 4096}, "granite": {"attention_multiplier": 1.0},
    "mimo_v2_flash": {"sliding_window": 4096}, "gemma3n": {"sliding_window": 4096}, "gemma4": {"sliding_window": 4096},
    "vaultgemma": {"attn_logit_softcapping": None}, "granite_swa": {"sliding_window": 4096},
    "exaone_moe": {"sliding_window": 4096}, "cohere2_moe": {"sliding_window": 4096},
    "afmoe": {"sliding_window": 4096}, "ministral3": {"sliding_window": None},
    "granitemoe_swa": {"sliding_window": 4096}, "cwm": {"sliding_window": 4096}, "mellum": {"sliding_window": 4096},
    "hyperclovax": {"attention_multiplier": 1.0}, "phimoe": {"sliding_window": None},
    "qwen2_moe_window": {"use_sliding_window": False, "layer_types": ["full_attention", "full_attention"]},
    "modernbert_decoder": {"layer_types": ["full_attention", "full_attention"]},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: a second intra-op thread only waits (on a loaded 2-core machine this file
    took 5x longer with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(configs, name):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[name](), attn_implementation="rocm_attn",
                                                         dtype=torch.float32).eval()


def _errors(got_logits, want_logits):
    return [rel(a, b) for a, b in zip(got_logits, want_logits)]


@pytest.mark.parametrize("name", list(PAGED_CONFIGS))
def test_paged_cache_generate_matches_eager(name):
    ours = _build(PAGED_CONFIGS, name)
    ids, mask = ragged_prompts()
    got = greedy(ours, ids, mask, past_key_values=PagedCache(ours, num_blocks=32, poison=True))
    want = greedy(twin(ours, "eager"), ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    errs = _errors(got.logits, want.logits)
    assert len(errs) == NEW_TOKENS and max(errs) < TOL_OF.get(name, TOL), errs


@pytest.mark.parametrize("name", list(RUNNER_CONFIGS))
def test_eager_runner_generate_matches_eager(name):
    ours = _build(RUNNER_CONFIGS, name)
    eager = twin(ours, "eager")
    prompts = [p[m.bool()].tolist() for p, m in zip(*ragged_prompts())]
    runner = eager_runner(ours, num_blocks=32, max_num_seqs=8, max_num_tokens=STEP_TOKENS, poison=True)
    got = generate(runner, prompts, NEW_TOKENS, return_logits=True)
    assert "mixed" in [s.kind for s in got.steps]  # prefill chunks beside decodes
    for p, tokens, logits in zip(prompts, got.tokens, got.logits):
        want = greedy(eager, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
        assert tokens == want.sequences[0, len(p):].tolist()
        errs = _errors(logits, [x[0] for x in want.logits])
        assert len(errs) == NEW_TOKENS and max(errs) < TOL_OF.get(name, TOL), errs


@pytest.mark.parametrize("name", list(FEATURE_OFF))
def test_features_change_eager_logits(name):
    """The window, scaling or soft cap each config sets is reached by the prompts: eager
    without it differs by far more than the tolerance, so the matches above depend on it."""
    eager = twin(_build(RUNNER_CONFIGS, name), "eager")
    ids, mask = ragged_prompts()
    want = greedy(eager, ids, mask)
    off = greedy(twin(eager, "eager", **FEATURE_OFF[name]), ids, mask)
    assert max(_errors(off.logits, want.logits)) > 100 * TOL


# Attention modules one paged layer cannot serve, refused by every entry point before any cache
# is allocated: (config, what the refusal says).
REFUSED = {
    # two attention calls per layer over the halves of V: served, the second call's cache write
    # replaced the first's V and the logits were 1.2 off eager, tokens different
    "diffllama": (lambda: transformers.DiffLlamaConfig(**_KV2, head_dim=32),
                  r"DiffLlamaAttention \(layer 0\) is differential attention"),
    # a mask computed from the values inside the module (refused at the first forward before)
    "doge": (lambda: transformers.DogeConfig(**_KV2, head_dim=32),
             r"DogeAttention \(layer 0\) is dynamic mask attention"),
    # the op refused its first call, naming only a shape
    "mimo_v2_flash": (lambda: transformers.MiMoV2FlashConfig(**_KV2, head_dim=32, v_head_dim=64, num_experts=4,
                                                             num_experts_per_tok=2, moe_intermediate_size=64),
                      r"MiMoV2FlashAttention \(layer 0\) has value heads of 64 and query/key heads of 32"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_one_paged_layer_cannot_serve_is_refused(name):
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers

    config, why = REFUSED[name]
    model = _build({name: config}, name)
    for make in (PagedCache, eager_runner, compile_transformers):
        with pytest.raises(NotImplementedError, match=rf"^{make.__name__}: {why}"):
            make(model, num_blocks=4)


# Compiled with the plugin, through PagedCache, as test_transformers_fusion.py runs its
# architectures (its ``Run``): every RoPE layer fuses in every graph, the NoPE layers (Cohere2's
# full layer, EXAONE 4's) have no rotation to fuse and stay unfused, and generate still matches.
NOPE_LAYERS = {"cohere2": {"transformers.layers.1"}, "exaone4": {"transformers.layers.1"}}


@pytest.mark.compile
@pytest.mark.parametrize("name", list(NOPE_LAYERS))
def test_compiled_rope_layers_fuse_and_nope_layers_do_not(name, monkeypatch):
    import test_transformers_fusion as fusion

    monkeypatch.setitem(fusion.CONFIGS, name, RUNNER_CONFIGS[name])
    run = fusion.Run(name, torch.float32)
    assert torch.equal(run.got.sequences, run.want.sequences)
    assert max(_errors(run.got.logits, run.want.logits)) < TOL
    fused = [r for r in run.records if r.fused]
    rope_layers = [layer for layer in run.layers if layer not in NOPE_LAYERS[name]]
    graphs = len(fused) // len(rope_layers)
    assert rope_layers and graphs >= 2, run.report  # the prefill graph and the decode graph
    for layer in run.layers:
        assert sum(r.layer_name == layer for r in fused) == (graphs if layer in rope_layers else 0), run.report
