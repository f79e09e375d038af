"""transformers models with attn_implementation="rocm_attn" on PagedCache, against the same
models with attn_implementation="eager" and their own cache (CPU, random weights, no downloads).

Tolerance: fp32 logits agree within 1e-5 of the step's largest |logit|. Our CPU kernels
accumulate in float64 and round once, eager accumulates in fp32: the measured gap is
2-5e-7 after two layers, so 1e-5 leaves room without hiding a wrong mask (a missing
window, soft cap or padding moves logits by > 1e-2 here, which each test checks).
"""

import copy
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import inductor_rocm_attn as ira  # noqa: E402
from inductor_rocm_attn.integrations import transformers as hf  # noqa: E402
from inductor_rocm_attn.integrations.transformers import PagedCache, attention_forward  # noqa: E402
from inductor_rocm_attn.layout import dense_kv  # noqa: E402

TOL = 1e-5
# Ragged: generate() left-pads them to 11, so rows have 6, 0, 3 and 1 padding tokens (a
# one-token padding sequence is decode-shaped and reads the cache's zero block).
PROMPT_LENS = [5, 11, 8, 10]
NEW_TOKENS = 9  # one prefill step + 8 decode steps

_COMMON = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=128, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, hidden_size=128, intermediate_size=256,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, hidden_size=128, intermediate_size=256,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, hidden_size=64, intermediate_size=128,
                                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                                  sliding_window=6),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, hidden_size=128, intermediate_size=256,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                sliding_window=6, attn_logit_softcapping=2.0,
                                                query_pre_attn_scalar=24,
                                                layer_types=["sliding_attention", "full_attention"]),
}
# More architectures through the same attention interface, generate against eager only:
# fused qkv projections, partial rotary, sinks, QK-norm over the whole projection, (1 + w)
# norms, attention multipliers. Small shapes; what each adds is in its comment.
_SMALL = dict(_COMMON, hidden_size=128, intermediate_size=256, num_attention_heads=4)
MORE_CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, num_key_value_heads=2),  # q/k/v biases
    "phi3": lambda: transformers.Phi3Config(**_SMALL, num_key_value_heads=2,
                                            partial_rotary_factor=0.5),  # fused qkv, partial rotary
    "olmo2": lambda: transformers.Olmo2Config(**_SMALL, num_key_value_heads=2),  # QK-norm over the projection
    "gemma3": lambda: transformers.Gemma3TextConfig(**_SMALL, num_key_value_heads=2, head_dim=32, sliding_window=6,
                                                    query_pre_attn_scalar=24,
                                                    layer_types=["sliding_attention", "full_attention"]),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_SMALL),  # head_size attribute, rotary_pct 0.25
    "granite": lambda: transformers.GraniteConfig(**_SMALL, num_key_value_heads=2, attention_multiplier=0.3),
    "cohere": lambda: transformers.CohereConfig(**_SMALL, num_key_value_heads=2),  # interleaved (GPT-J) RoPE
    "starcoder2": lambda: transformers.Starcoder2Config(**_SMALL, num_key_value_heads=2, sliding_window=6),
    # default config: sliding_window 0 (off) and no per-layer window on the modules
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_SMALL, num_key_value_heads=2, moe_intermediate_size=64,
                                                     shared_expert_intermediate_size=64, num_experts=4),
    "gpt_oss": lambda: transformers.GptOssConfig(**dict(_SMALL, intermediate_size=128), num_key_value_heads=2,
                                                 head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=6,
                                                 layer_types=["sliding_attention", "full_attention"]),  # sinks
    # sliding_window on every module, passed only on its sliding layers; NoPE full layers
    "exaone4": lambda: transformers.Exaone4Config(**_SMALL, num_key_value_heads=2, head_dim=32, sliding_window=6,
                                                  sliding_window_pattern=2),
    # Gemma 3 as released (AutoModelForCausalLM builds Gemma3ForConditionalGeneration): its base
    # model gets generate's 2-D mask and hands the language model a dict of per-layer-type masks
    "gemma3_multimodal": lambda: transformers.Gemma3Config(
        text_config=dict(_SMALL, num_key_value_heads=2, head_dim=32, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14)),
    # q multiplied by module.scaling in the module, scaling=1.0 passed; learned positions
    "opt": lambda: transformers.OPTConfig(vocab_size=256, hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=128,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
# What each config exercises, and the config change that removes it (must change the logits).
FEATURE_OFF = {"mistral": {"sliding_window": None},
               "gemma2": {"attn_logit_softcapping": None, "sliding_window": 4096}}


def build(name, impl, seed=0, **overrides):
    config = CONFIGS[name]()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                         dtype=torch.float32).eval()


def twin(model, impl, **overrides):
    """The same weights under another attention implementation (its own config object)."""
    config = copy.deepcopy(model.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    other = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                          dtype=torch.float32).eval()
    other.load_state_dict(model.state_dict())
    return other


def ragged_prompts(lens=PROMPT_LENS, seed=1, left=True):
    """Token ids everywhere (padding too: a zero-embedding pad id would hide a padding token
    written to the cache or attended to), the mask says which are prompt tokens."""
    t = max(lens)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (len(lens), t), generator=g)
    mask = torch.zeros(len(lens), t, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, slice(t - n, t) if left else slice(0, n)] = 1
    return ids, mask


def greedy(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, output_logits=True, return_dict_in_generate=True, **kw)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def written_slots(cache: PagedCache) -> list[int]:
    """Per layer, cache slots holding a finite key (the cache is poisoned with NaN)."""
    counts = []
    for layer in cache.layers_by_name.values():
        k, _ = dense_kv(layer.kv_cache[: cache.num_blocks], layer.num_kv_heads, layer.interleaved_v)
        counts.append(int(k.isfinite().all(-1).all(-1).sum()))
    return counts


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request):
    ours = build(request.param, "rocm_attn")
    return request.param, ours, twin(ours, "eager")


def test_generate_matches_eager(models):
    name, ours, eager = models
    ids, mask = ragged_prompts()
    copies = hf.stats.qkv_copies
    cache = PagedCache(ours, num_blocks=8, poison=True)
    got = greedy(ours, ids, mask, past_key_values=cache)
    want = greedy(eager, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == NEW_TOKENS
    errs = [rel(a, b) for a, b in zip(got.logits, want.logits)]
    assert max(errs) < TOL, errs
    assert hf.stats.qkv_copies == copies  # q/k/v reached the ops as views
    # Every real token is cached once per layer and no padding token is: the last generated
    # token is never fed back, so each row holds its prompt + NEW_TOKENS - 1 tokens.
    real = sum(PROMPT_LENS) + len(PROMPT_LENS) * (NEW_TOKENS - 1)
    assert cache.row_lengths() == [n + NEW_TOKENS - 1 for n in PROMPT_LENS]
    assert written_slots(cache) == [real] * len(cache.layers_by_name)
    for layer in cache.layers_by_name.values():  # the zero block padding rows read stays zero
        assert not layer.kv_cache[cache.num_blocks].any()
    # The features this model exercises change the result when switched off, so the match
    # above is evidence that they are honoured.
    if name in FEATURE_OFF:
        off = greedy(twin(ours, "eager", **FEATURE_OFF[name]), ids, mask)
        assert max(rel(a, b) for a, b in zip(off.logits, want.logits)) > 100 * TOL


@pytest.mark.parametrize("left", [True, False], ids=["left_padded", "right_padded"])
def test_forward_without_position_ids(left):
    """Prefill + decode steps without position_ids: positions come from the cache's metadata
    (padding-aware), and position_ids that disagree with it raise."""
    ours = build("llama", "rocm_attn")
    eager = twin(ours, "eager")
    ids, mask = ragged_prompts(left=left)
    cache = PagedCache(ours, num_blocks=8, poison=True)
    ref_cache = transformers.DynamicCache(config=eager.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, past_key_values=cache).logits
        want = eager(ids, attention_mask=mask, position_ids=positions, past_key_values=ref_cache).logits
        real = mask.bool()
        assert rel(got[real], want[real]) < TOL
        assert got.isfinite().all()  # padding rows too: they read no poisoned slot
        nxt = want[:, -1].argmax(-1, keepdim=True) if left else ids[:, :1]
        pos = positions.max(-1, keepdim=True).values
        for step in range(3):
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
            if step == 0:  # transformers' default for omitted ids (past length) is wrong here
                naive = eager(nxt, attention_mask=mask, position_ids=torch.full_like(nxt, mask.shape[1] - 1),
                              past_key_values=copy.deepcopy(ref_cache)).logits
            pos = pos + 1
            got = ours(nxt, attention_mask=mask, past_key_values=cache).logits
            want = eager(nxt, attention_mask=mask, position_ids=pos, past_key_values=ref_cache).logits
            assert rel(got, want) < TOL
            if step == 0:
                assert rel(naive, want) > 100 * TOL
            nxt = want[:, -1].argmax(-1, keepdim=True)
        # The eager default (past length + arange) is wrong for the shorter rows: refused.
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        wrong = torch.full_like(nxt, cache.get_seq_length())
        with pytest.raises(ValueError, match=r"position_ids\[0, 0\] = 14 but that token is at position 8 of its row \(8 cached\)"):
            ours(nxt, attention_mask=mask, position_ids=wrong, past_key_values=cache)


def test_deepcopy_writes_its_own_cache():
    ours = build("qwen3", "rocm_attn")
    ids, mask = ragged_prompts()
    cache = PagedCache(ours, num_blocks=8, poison=True)
    first = greedy(ours, ids, mask, past_key_values=cache)
    before = [layer.kv_cache.clone() for layer in cache.layers_by_name.values()]
    clone = copy.deepcopy(ours)
    second = greedy(clone, ids, mask, past_key_values=PagedCache(clone, num_blocks=8, poison=True))
    assert torch.equal(first.sequences, second.sequences)
    for b, layer in zip(before, cache.layers_by_name.values()):
        a = layer.kv_cache
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    with pytest.raises(ValueError, match="built for another model instance"):
        greedy(clone, ids, mask, past_key_values=PagedCache(ours, num_blocks=8))


def test_cache_of_another_model_is_named():
    """A model that never had a PagedCache of its own has no planning hook: given another
    model's cache, its attention said "no PagedCache step is active; pass past_key_values=
    PagedCache(...)", although one was passed."""
    ours, other = build("llama", "rocm_attn"), build("llama", "rocm_attn")
    ids, mask = ragged_prompts()
    cache = PagedCache(ours, num_blocks=8, poison=True)
    with pytest.raises(ValueError, match=r"PagedCache: layer 0 got this cache outside one of its steps: the cache "
                                         r"was built for another model instance"):
        greedy(other, ids, mask, past_key_values=cache)
    assert written_slots(cache) == [0, 0] and cache.batch_size == -1


def test_from_pretrained(tmp_path):
    ours = build("gemma2", "rocm_attn")
    ours.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="rocm_attn")
    ids, mask = ragged_prompts()
    want = greedy(ours, ids, mask, past_key_values=PagedCache(ours, num_blocks=8))
    got = greedy(loaded, ids, mask, past_key_values=PagedCache(loaded, num_blocks=8))
    assert loaded.config._attn_implementation == "rocm_attn" and torch.equal(got.sequences, want.sequences)


def _step_inputs(module, b=2, t=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = module.config.num_attention_heads, module.config.num_key_value_heads, module.head_dim
    q = torch.randn(b, t, hq, d, generator=g).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    v = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("kwargs, match", [
    (dict(scaling=0.5), r"scaling=0\.5 differs from the value the layer was built with \(0\.176"),
    (dict(dropout=0.1), r"dropout=0\.1 is not supported"),
    (dict(sliding_window=4), r"sliding_window=4 differs .*\(None"),
    (dict(softcap=30.0), r"softcap=30\.0 differs"),
    (dict(is_causal=False), r"is_causal=False differs"),
    (dict(s_aux=torch.zeros(4)), r"s_aux \(attention sinks\) must be the module's `sinks`"),
    (dict(attention_mask=torch.zeros(2, 1, 3, 3)), r"prepared attention mask of shape \(2, 1, 3, 3\)"),
    (dict(cu_seq_lens_q=torch.zeros(3, dtype=torch.int32)), r"cu_seq_lens_q is an argument of packed"),
    # the attention weights were silently absent (outputs.attentions == ())
    (dict(output_attentions=True), r"output_attentions=True is not supported: the paged kernels do not form the "
                                   r"attention weights"),
], ids=["scaling", "dropout", "sliding_window", "softcap", "is_causal", "s_aux", "mask", "packed", "attentions"])
def test_bad_call_arguments_raise_before_writing(kwargs, match):
    ours = build("llama", "rocm_attn")
    module = ours.model.layers[0].self_attn
    cache = PagedCache(ours, num_blocks=4, poison=True)
    q, k, v = _step_inputs(module)
    call = dict(scaling=module.scaling, attention_mask=None)
    call.update(kwargs)
    cache.begin_step(torch.zeros(2, 3, dtype=torch.long))
    try:
        with pytest.raises(ValueError, match=match):
            attention_forward(module, q, k, v, **call)
    finally:
        cache.end_step()
    assert written_slots(cache) == [0, 0]


def test_refusals_name_the_fix():
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts()
    with pytest.raises(RuntimeError, match="no PagedCache step is active; pass past_key_values="):
        greedy(ours, ids, mask)  # generate() would build a DynamicCache
    with pytest.raises(ValueError, match='load it with attn_implementation="rocm_attn"'):
        PagedCache(twin(ours, "eager"), num_blocks=4)
    cache = PagedCache(ours, num_blocks=4)
    gap = torch.tensor([[1, 0, 1, 1]])
    with pytest.raises(ValueError, match="row 0 has padding between its new tokens"):
        ours(torch.ones(1, 4, dtype=torch.long), attention_mask=gap, past_key_values=cache)
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D \[batch, seen \+ new\] = \[1, 4\]"):
        ours(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5), past_key_values=cache)
    with pytest.raises(MemoryError, match="needs 5 more blocks, 4 free of 4"):
        ours(torch.ones(1, 65, dtype=torch.long), past_key_values=cache)



def test_rejected_first_step_leaves_the_cache_without_a_batch():
    """The first step fixed the cache's batch size before its checks: after a refused first
    step (a wrong mask, too few blocks) a batch of another size was refused too."""
    ours = build("llama", "rocm_attn")
    cache = PagedCache(ours, num_blocks=1, poison=True)
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D \[batch, seen \+ new\] = \[2, 4\]"):
        ours(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 5), past_key_values=cache)
    with pytest.raises(MemoryError, match=r"this step needs 4 more blocks, 1 free of 1"):
        ours(torch.ones(2, 17, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match=r"PagedCache\.begin_step: input_ids must be a 2-D tensor, \[batch, new tokens\]"):
        cache.begin_step(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"PagedCache\.begin_step: inputs_embeds must be a 3-D tensor, "
                                         r"\[batch, new tokens, hidden\], got \(4, 64\)"):
        cache.begin_step(inputs_embeds=torch.ones(4, 64))  # planned as 4 rows of 64 tokens before
    with pytest.raises(ValueError, match=r"PagedCache\.begin_step: attention_mask must be a 2-D tensor "
                                         r"\[batch, seen \+ new\] \(1: token, 0: padding\), got dict"):
        cache.begin_step(torch.ones(1, 4, dtype=torch.long), attention_mask={"full_attention": None})
    assert cache.batch_size == -1 and cache.row_lengths() == [] and cache.get_seq_length() == 0
    assert written_slots(cache) == [0, 0]
    ours(torch.ones(1, 4, dtype=torch.long), past_key_values=cache)  # a batch of one is the first batch
    assert cache.row_lengths() == [4] and written_slots(cache) == [4, 4]



@pytest.mark.parametrize("shape", [(1, 0), (0, 3)], ids=["no_new_tokens", "no_rows"])
def test_a_step_without_tokens_is_refused_by_name(shape):
    """A forward of no new tokens (or no rows) failed inside the cache's planning with
    "amin(): Expected reduction dim 1 to have non-zero size" (or "max() arg is an empty
    sequence"), naming neither the cache nor the input."""
    ours = build("llama", "rocm_attn")
    cache = PagedCache(ours, num_blocks=4, poison=True)
    with pytest.raises(ValueError, match=rf"PagedCache\.begin_step: a step needs at least one row and one new "
                                         rf"token, got input_ids of shape \({shape[0]}, {shape[1]}\)"):
        ours(torch.ones(*shape, dtype=torch.long), past_key_values=cache)
    assert cache.batch_size == -1 and cache.get_seq_length() == 0 and written_slots(cache) == [0, 0]



@pytest.mark.parametrize("bad", [256, -1])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_step(bad):
    """An id outside the vocabulary reached the embedding: "index out of range in self" on CPU,
    a device-side assert on a GPU (which ends the process's CUDA context), naming neither the
    id nor the vocabulary. Read where index tensors are (CPU; a GPU with
    ROCM_ATTN_CHECK_INDICES=1), as the runners do."""
    ours = build("llama", "rocm_attn")
    cache = PagedCache(ours, num_blocks=4, poison=True)
    with pytest.raises(ValueError, match=rf"PagedCache: input_ids\[1, 2\] = {bad} is outside the vocabulary "
                                         r"\[0, 256\)"):
        ours(torch.tensor([[3, 4, 5], [6, 7, bad]]), past_key_values=cache)
    assert cache.batch_size == -1 and written_slots(cache) == [0, 0]



def test_use_cache_false_with_a_paged_cache_is_refused():
    """use_cache=False with a PagedCache was ignored (the step's keys were written all the same);
    generate(use_cache=False) feeds the whole sequence every step and failed at the second one
    with an attention_mask error that told to reset() the cache."""
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts([3, 5])
    shown = r"PagedCache: use_cache=False with a PagedCache: the paged path writes every step's keys into the cache"
    cache = PagedCache(ours, num_blocks=4, poison=True)
    with pytest.raises(ValueError, match=shown):
        ours(ids, attention_mask=mask, past_key_values=cache, use_cache=False)
    with pytest.raises(ValueError, match=shown):
        ours.generate(ids, attention_mask=mask, past_key_values=cache, use_cache=False, max_new_tokens=2,
                      do_sample=False)
    assert cache.batch_size == -1 and written_slots(cache) == [0, 0]


def test_forward_that_raises_leaves_the_rows_as_they_were():
    """A forward that raised after its step was planned (here: dropout in training mode, whose
    message says to call model.eval()) kept the step's tokens in the row lengths without
    writing them: the retry attended to unwritten slots at shifted positions, silently."""
    ours = build("llama", "rocm_attn", attention_dropout=0.1)
    eager = twin(ours, "eager")
    ids, mask = ragged_prompts([3, 5])
    cache = PagedCache(ours, num_blocks=8, poison=True)

    def fails(*args, **kwargs):
        ours.train()
        with pytest.raises(ValueError, match=r"dropout=0\.1 is not supported .*call model\.eval\(\)"):
            ours(*args, past_key_values=cache, **kwargs)
        ours.eval()

    with torch.no_grad():
        fails(ids[:, :4], attention_mask=mask[:, :4])  # a first step: the cache holds no batch after it
        assert cache.batch_size == -1 and cache.get_seq_length() == 0
        assert cache._allocator.num_free_blocks == 8 and written_slots(cache) == [0, 0]
        ours(ids[:, :4], attention_mask=mask[:, :4], past_key_values=cache)
        fails(ids[:, 4:], attention_mask=mask)  # a later step
        assert cache.row_lengths() == [2, 4] and cache.get_seq_length() == 4
        assert cache._allocator.num_free_blocks == 6
        got = ours(ids[:, 4:], attention_mask=mask, past_key_values=cache).logits[:, 0]
        want = eager(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 4]
    assert cache.row_lengths() == [3, 5] and rel(got, want) < TOL


def test_attention_mask_masking_out_cached_tokens_is_refused():
    """The mask's earlier columns were not read: a later step whose mask zeroed a cached token
    (or marked a cached padding column as a token) attended to every cached token anyway."""
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts([3, 5])
    cache = PagedCache(ours, num_blocks=8, poison=True)
    with torch.no_grad():
        ours(ids[:, :4], attention_mask=mask[:, :4], past_key_values=cache)
        slots = written_slots(cache)
        for row, col, value in ((1, 2, 0), (0, 0, 1)):
            bad = mask.clone()
            bad[row, col] = value
            with pytest.raises(ValueError, match=rf"PagedCache: attention_mask\[{row}, :4\] marks "
                                                 rf"{int(mask[row, :4].sum()) + (1 if value else -1)} earlier tokens "
                                                 rf"but the cache holds {int(mask[row, :4].sum())} of row {row}"):
                ours(ids[:, 4:], attention_mask=bad, past_key_values=cache)
            assert cache.row_lengths() == [2, 4] and written_slots(cache) == slots
        ours(ids[:, 4:], attention_mask=mask, past_key_values=cache)  # the right mask still runs
    assert cache.row_lengths() == [3, 5]


@pytest.mark.parametrize("scale, shown", [(2, r"\[2\]"), (0.5, r"\[0\.5\]")], ids=["twos", "halves"])
def test_attention_mask_of_other_values_is_refused(scale, shown):
    """A mask of 2s or 0.5s was read as "nonzero = token"; generate() derived positions from its
    cumulative sum, and the step failed on positions the caller never passed. The mask is
    named now."""
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts([3, 4])
    cache = PagedCache(ours, num_blocks=4, poison=True)
    with pytest.raises(ValueError, match=rf"PagedCache: attention_mask must hold 1 \(a token\) and 0 \(padding\), "
                                         rf"got {shown}"):
        ours.generate(ids, attention_mask=mask * scale, max_new_tokens=2, do_sample=False, past_key_values=cache)
    assert written_slots(cache) == [0, 0] and cache.batch_size == -1

@pytest.mark.parametrize("name", list(MORE_CONFIGS))
def test_generate_matches_eager_more_architectures(name):
    """Ragged left-padded prompts through PagedCache: the same greedy tokens as eager
    transformers, logits within TOL of each step's largest."""
    config = MORE_CONFIGS[name]()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                         dtype=torch.float32).eval()
    eager = twin(ours, "eager")
    ids, mask = ragged_prompts()
    got = greedy(ours, ids, mask, past_key_values=PagedCache(ours, num_blocks=32, poison=True))
    want = greedy(eager, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    errs = [rel(a, b) for a, b in zip(got.logits, want.logits)]
    assert len(errs) == NEW_TOKENS and max(errs) < TOL, errs


def test_chunked_attention_layers_run_only_within_one_chunk():
    """Llama 4's chunked_attention layers (a token attends only inside its chunk of
    attention_chunk_size positions) ran as full attention: logits 0.9 off eager past the
    first chunk, without an error. A sequence inside one chunk is exact; a longer one is
    refused (PagedCache: at the step that would grow it; runners: by their longest sequence)."""
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    config = transformers.Llama4TextConfig(**_SMALL, num_key_value_heads=2, head_dim=32, num_local_experts=2,
                                           attention_chunk_size=16, no_rope_layers=[1, 1])
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                         dtype=torch.float32).eval()
    ids, mask = ragged_prompts([5, 11])  # 11 + 5 new tokens: the first chunk
    cache = PagedCache(ours, num_blocks=8, poison=True)
    got = ours.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False,
                        eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    want = twin(ours, "eager").generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                        eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert max(rel(a, b) for a, b in zip(got.logits, want.logits)) < TOL
    with pytest.raises(NotImplementedError, match=r"PagedCache: row 1 would hold 17 tokens, past the "
                                                  r"attention_chunk_size 16 of the model's chunked_attention"):
        ours(got.sequences[:, -2:], attention_mask=torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1),
             past_key_values=cache)
    assert cache.row_lengths() == [9, 15]
    match = (r"Llama4TextAttention layer 0\): a chunked_attention layer \(attention_chunk_size=16\) with "
             r"sequences of up to {} tokens")
    with pytest.raises(NotImplementedError, match=match.format(32)):
        eager_runner(ours, num_blocks=2)
    with pytest.raises(NotImplementedError, match=match.format(20)):
        compile_transformers(ours, num_blocks=2, max_model_len=20)
    config.layer_types = ["window_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match=r"layer 0\): config.layer_types has 'window_attention' for this "
                                                  r"layer; supported layer types: full_attention, sliding_attention"):
        PagedCache(ours, num_blocks=1)


_HYBRIDS = {  # decoder layers without an attention module: their state is no paged cache's
    "lfm2": lambda: transformers.Lfm2Config(**_SMALL, num_key_value_heads=2, layer_types=["conv", "full_attention"]),
    "minimax": lambda: transformers.MiniMaxConfig(**_SMALL, num_key_value_heads=2, head_dim=32, num_local_experts=2,
                                                  layer_types=["linear_attention", "full_attention"]),
    "recurrent_gemma": lambda: transformers.RecurrentGemmaConfig(**_SMALL, num_key_value_heads=2,
                                                                 block_types=["recurrent", "attention"]),
}


@pytest.mark.parametrize("name", list(_HYBRIDS))
def test_hybrid_models_are_refused(name):
    """Layers that are not attention (LFM2's conv, MiniMax's linear attention, RecurrentGemma's
    recurrent blocks) were served as if absent: the runners' steps ran them on the step's tokens
    only (MiniMax's logits 2.2 off eager, silently), PagedCache crashed in LFM2's own cache code.
    A config.layer_types entry that is not attention is refused by both; a decoder layer without
    an attention module by the runners (RecurrentGemma keeps its state in its modules, which
    serves one PagedCache batch: generate matches eager there)."""
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_HYBRIDS[name](), attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    cls = type(model).__name__
    for make in (eager_runner, compile_transformers):
        with pytest.raises(NotImplementedError, match=rf"{make.__name__}: decoder layers \[0\] of {cls} have no "
                                                      r"attention module"):
            make(model, num_blocks=4)
    if name == "recurrent_gemma":
        ids, mask = ragged_prompts([5, 11])
        got = greedy(model, ids, mask, past_key_values=PagedCache(model, num_blocks=8, poison=True))
        want = greedy(twin(model, "eager"), ids, mask)
        assert torch.equal(got.sequences, want.sequences)
        assert max(rel(a, b) for a, b in zip(got.logits, want.logits)) < TOL
    else:
        kind = model.config.layer_types[0]
        with pytest.raises(NotImplementedError, match=rf"\({cls} layer 0\): config.layer_types has '{kind}'"):
            PagedCache(model, num_blocks=4)


_DYNAMIC_ROPES = {  # transformers recomputes the frequencies from a forward's longest position
    "longrope": lambda: transformers.Phi3Config(
        **_SMALL, num_key_value_heads=2, original_max_position_embeddings=32,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 16,
                             long_factor=[1.0 + i for i in range(16)], original_max_position_embeddings=32)),
    "dynamic": lambda: transformers.LlamaConfig(**dict(_SMALL, max_position_embeddings=32), num_key_value_heads=2,
                                                rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                     factor=4.0)),
}


@pytest.mark.parametrize("kind", list(_DYNAMIC_ROPES))
def test_dynamic_rope_served_only_below_its_switch(kind):
    """Longrope (Phi-3.5) and dynamic NTK RoPE switch frequencies once a forward's longest
    position passes original_max_position_embeddings / max_position_embeddings: in a
    runner's step that is the longest of every sequence in it, so a short prompt sharing a
    step with a long one (or a long prompt's first chunk) was rotated with the wrong
    frequencies, silently (longrope: logits 2.2 off eager, tokens differ). eager_runner serves
    sequences up to the switch (exact) and refuses a cache that holds longer ones;
    compile_transformers (which traces the original frequencies: the switch is a
    data-dependent branch Dynamo cannot trace) refuses a max_model_len past it."""
    from inductor_rocm_attn.integrations.batching import generate
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_DYNAMIC_ROPES[kind](), attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    cls = type(model.model.rotary_emb).__name__
    with pytest.raises(NotImplementedError, match=rf"eager_runner: {cls} uses transformers' '{kind}' RoPE, .* "
                                                  r"sequences of up to 64 tokens here, at most 32 supported"):
        eager_runner(model, num_blocks=4)
    with pytest.raises(NotImplementedError, match=rf"compile_transformers: {cls} uses transformers' '{kind}' RoPE, "
                                                  r".* max_model_len=33 here, pass max_model_len <= 32"):
        compile_transformers(model, num_blocks=4, max_model_len=33)
    eager = twin(model, "eager")
    runner = eager_runner(model, num_blocks=2, max_num_seqs=4, max_num_tokens=8, poison=True)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(*ragged_prompts([5, 24]))]
    got = generate(runner, prompts, 8, return_logits=True)
    for p, toks, logits in zip(prompts, got.tokens, got.logits):
        ids = torch.tensor([p])
        want = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        assert toks == want.sequences[0, len(p):].tolist()
        assert max(rel(a, b[0]) for a, b in zip(logits, want.logits)) < TOL


def test_multi_head_latent_attention_is_refused_by_name():
    """DeepSeek V3's MLA modules carry no head_dim: the refusal said only that no attention
    modules were found. Each entry point refuses it in its own name."""
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1,
        topk_group=1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn").eval()
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    # each entry point names itself (the runners' refusal was worded as PagedCache's)
    for who, make in (("PagedCache", PagedCache), ("eager_runner", eager_runner),
                      ("compile_transformers", compile_transformers)):
        with pytest.raises(NotImplementedError, match=rf"^{who}: DeepseekV3Attention is multi-head latent attention "
                                                      r"\(MLA"):
            make(model, num_blocks=4)


_OWN_ATTENTION = {  # attention computed inside the module, never through ALL_ATTENTION_FUNCTIONS
    # picked from a per-model table keyed eager / sdpa / flash_attention_2: "rocm_attn" is a KeyError there
    "falcon": lambda: transformers.FalconConfig(vocab_size=256, hidden_size=64, num_attention_heads=4,
                                                num_hidden_layers=2),
    "gptj": lambda: transformers.GPTJConfig(vocab_size=256, n_embd=64, n_head=4, n_layer=2, rotary_dim=8,
                                            bos_token_id=1, eos_token_id=2),
    "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=256, hidden_size=64, num_heads=4, num_layers=2,
                                                 attention_types=[[["global", "local"], 1]], bos_token_id=1,
                                                 eos_token_id=2),
    # built under any name, the name ignored
    "stablelm": lambda: transformers.StableLmConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                    num_attention_heads=4, num_hidden_layers=2),
}
_TABLES = {"falcon": "FALCON_ATTENTION_CLASSES", "gptj": "GPTJ_ATTENTION_CLASSES",
           "gpt_neo": "GPT_NEO_ATTENTION_CLASSES"}


@pytest.mark.parametrize("name", list(_OWN_ATTENTION))
def test_models_computing_their_own_attention_are_refused_by_name(name):
    """Falcon, GPT-J and GPT-Neo pick their attention module from a per-model table (eager,
    sdpa, flash_attention_2), so transformers raises KeyError('rocm_attn') building them with
    our name; loaded otherwise, our entry points told the user to load them with
    attn_implementation="rocm_attn", which cannot work. Each entry point refuses them by their
    class before building anything, saying why and what is supported."""
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    if name in _TABLES:
        with pytest.raises(KeyError, match="rocm_attn"):
            transformers.AutoModelForCausalLM.from_config(_OWN_ATTENTION[name](), attn_implementation="rocm_attn")
    model = transformers.AutoModelForCausalLM.from_config(_OWN_ATTENTION[name](), attn_implementation="eager").eval()
    why = (rf"transformers marks {type(model).__name__} as not supporting attention backends "
           r"\(_supports_attention_backend is False.*"
           + (rf"{_TABLES[name]} .*raises KeyError in transformers.*" if name in _TABLES else "")
           + r"supported: models transformers marks as supporting them, whose attention modules call "
             r"ALL_ATTENTION_FUNCTIONS")
    with pytest.raises(ValueError, match=rf"PagedCache: {why}"):
        PagedCache(model, num_blocks=4)
    for make in (eager_runner, compile_transformers):
        with pytest.raises(ValueError, match=rf"{make.__name__}: {why}"):
            make(model, num_blocks=4)


def test_generate_on_right_padded_or_empty_prompts_says_why():
    """generate() continues a right-padded row (or a row whose prompt was all padding) at
    positions that disagree with its cache: refused at the first decode step, saying which."""
    ours = build("llama", "rocm_attn")
    for ids, mask, why in (
            ([[11, 12, 0, 0], [21, 22, 23, 24]], [[1, 1, 0, 0], [1, 1, 1, 1]], "row 0 was right-padded: generate"),
            ([[0, 0], [21, 22]], [[0, 0], [1, 1]], "row 0 has no token before this step: its prompt was all padding")):
        with pytest.raises(ValueError, match=why):
            ours.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=2, do_sample=False,
                          past_key_values=PagedCache(ours, num_blocks=8))


class _OpInputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records which op produced each storage, and the q/k/v of every rocm_attn attention call."""

    def __init__(self):
        super().__init__()
        self.producer, self.calls = {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.rocm_attn.unified_attention_with_output.default:
            self.calls.append(args[:3])
        aliasing = func.is_view or func is torch.ops.aten._unsafe_view.default  # no new storage
        for t in () if aliasing else out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel():
                self.producer[t.untyped_storage().data_ptr()] = func.name()
        return out


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_qkv_reach_the_ops_without_copies(name):
    ours = build(name, "rocm_attn")
    ids, mask = ragged_prompts()
    cache = PagedCache(ours, num_blocks=8)
    copies = hf.stats.qkv_copies
    with torch.no_grad(), _OpInputs() as rec:
        ours(ids, attention_mask=mask, past_key_values=cache)
    assert len(rec.calls) == 2 and hf.stats.qkv_copies == copies
    for q, k, v in rec.calls:
        for t in (q, k, v):
            # [B*T, H, D] views of the model's own tensors: RoPE's add for q/k, the v projection
            producer = rec.producer[t.untyped_storage().data_ptr()]
            assert producer.split("::")[1].split(".")[0] in ("add", "mm", "addmm"), producer
            assert t.shape[0] == ids.numel() and t.stride(-1) == 1


def test_layout_without_a_view_is_copied_and_counted():
    """q [B, H, T, D] contiguous cannot be viewed as [B*T, H, D]: copied (counted), same result."""
    ours = build("llama", "rocm_attn")
    module = ours.model.layers[0].self_attn
    q, k, v = _step_inputs(module)
    outs = []
    for layout in ("view", "copy"):
        cache = PagedCache(ours, num_blocks=4, poison=True)
        cache.begin_step(torch.zeros(2, 3, dtype=torch.long))
        before = hf.stats.qkv_copies
        args = (q, k, v) if layout == "view" else (q.contiguous(), k.contiguous(), v.contiguous())
        out, weights = attention_forward(module, *args, None, scaling=module.scaling)
        cache.end_step()
        assert weights is None and hf.stats.qkv_copies - before == (0 if layout == "view" else 3)
        outs.append(out)
    assert out.shape == (2, 3, 4, 32) and torch.equal(outs[0], outs[1])


def test_caches_of_one_model_are_independent():
    """Two PagedCaches of one model: layer names resolve through the step's own table."""
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts()
    a, b = PagedCache(ours, num_blocks=8, poison=True), PagedCache(ours, num_blocks=8, poison=True)
    first = greedy(ours, ids, mask, past_key_values=a)
    assert written_slots(b) == [0, 0]
    second = greedy(ours, ids[:2], mask[:2], past_key_values=b)
    assert torch.equal(first.sequences[:2], second.sequences)
    assert ira.get_forward_context().layers is None  # every step left its context


_OURS_FIRST = """
import sys, inductor_rocm_attn
assert "transformers" not in sys.modules
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32)
model = AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn")
assert model.config._attn_implementation == "rocm_attn"
assert not any(type(f).__name__ == "_PostImportHook" for f in sys.meta_path)
"""


def test_name_is_accepted_after_import_without_importing_transformers():
    """import inductor_rocm_attn first (a fresh interpreter): transformers is not imported; the
    name is registered once transformers loads its attention registry, and the hook is gone."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OURS_FIRST], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_install_registers_at_once_when_transformers_is_loaded():
    from inductor_rocm_attn.integrations import install
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    AttentionInterface._global_mapping.pop(hf.ATTN_IMPLEMENTATION)
    try:
        assert hf.ATTN_IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS.valid_keys()
        install()
        assert ALL_ATTENTION_FUNCTIONS[hf.ATTN_IMPLEMENTATION] is attention_forward
    finally:
        hf.register()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 1e-2), (torch.bfloat16, 4e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_on_gpu_matches_eager(name, dtype, tol):
    """The Triton kernels under generate(): every step's logits against eager attention run on
    the tokens we generated (teacher forcing, so a near-tie cannot fork the comparison)."""
    ours = build(name, "rocm_attn").to("cuda", dtype)
    eager = twin(ours, "eager").to("cuda", dtype)
    ids, mask = (t.cuda() for t in ragged_prompts())
    got = greedy(ours, ids, mask, past_key_values=PagedCache(ours, num_blocks=8, poison=True))
    full = torch.cat([mask, torch.ones(mask.shape[0], NEW_TOKENS - 1, dtype=mask.dtype, device="cuda")], 1)
    with torch.no_grad():
        want = eager(got.sequences[:, :-1], attention_mask=full,
                     position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits.float()
    t = ids.shape[1]
    errs = [rel(step.float(), want[:, t - 1 + i]) for i, step in enumerate(got.logits)]
    assert max(errs) < tol, errs


def test_eager_runner_checks_its_step_inputs():
    """input_ids of another length than the step failed inside the model's RoPE (a broadcast
    error naming neither), and a misspelt prepare() keyword was swallowed."""
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    runner = eager_runner(build("llama", "rocm_attn"), num_blocks=4, poison=True)
    md = runner.prepare([3], [0], [[1]])
    for ids in (torch.tensor([3, 4, 5, 6]), torch.tensor([[3, 4, 5]])):
        with pytest.raises(ValueError, match=re.escape(f"EagerRunner: input_ids {tuple(ids.shape)} for a step of 3 "
                                                       "tokens: expected [3]")):
            runner(ids, md)
    with pytest.raises(TypeError, match="whole_stp"):
        runner.prepare([3], [0], [[1]], whole_stp=False)
    # Step limits: 0 made generate() run empty steps that failed inside the model (a reshape
    # of 0 elements), a string failed in a comparison there.
    for kw, shown in ((dict(max_num_seqs=0), "max_num_seqs must be a positive int, got 0"),
                      (dict(max_num_tokens="64"), "max_num_tokens must be a positive int, got '64'"),
                      (dict(max_num_seqs=2.5), "max_num_seqs must be a positive int, got 2.5")):
        with pytest.raises(ValueError, match=re.escape(f"eager_runner: {shown}")):
            eager_runner(runner.model, num_blocks=4, **kw)
    assert runner.prepare([3], [0], [[1]], whole_step=False).num_actual_tokens == 3
    assert all(written == 0 for written in
               (int(layer.kv_cache.isfinite().sum()) for layer in runner.layers.values()))



def test_eager_runner_refuses_a_model_moved_after_it_was_built():
    """model.to(bfloat16) after eager_runner(model) ran the bf16 model on the fp32 caches the
    runner made for it (generate() too: it asks a runner's check_parameters() first)."""
    from inductor_rocm_attn.integrations.batching import generate
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    runner = eager_runner(build("llama", "rocm_attn"), num_blocks=4, poison=True)
    runner.model.to(torch.bfloat16)
    md = runner.prepare([3], [0], [[1]])
    shown = r"EagerRunner: the model is now torch\.bfloat16 on cpu but its caches were made for torch\.float32 on cpu"
    with pytest.raises(ValueError, match=shown):
        runner(torch.tensor([3, 4, 5]), md)
    with pytest.raises(ValueError, match=shown):
        generate(runner, [[3, 4, 5]], max_new_tokens=2)
    assert all(int(layer.kv_cache.isfinite().sum()) == 0 for layer in runner.layers.values())


# --- cache dtypes, layouts and block sizes ------------------------------------------------------
#
# The reference for a rounding cache is eager transformers with its cached keys/values rounded
# as ours are stored (fp8: value / scale, saturated, cast, times scale). As the kernels do, a
# prefill reads its own new keys/values unrounded and the cached ones rounded; a decode reads
# every one from the cache. Then the logits agree within TOL for fp8 (measured 4e-7 to 1e-5)
# and ROUNDING_TOL for 16-bit caches (measured up to 3e-5: the finer the rounding, the more
# values sit near a boundary where ours and eager's fp32 value round apart), while the
# unrounded eager model differs by 2e-4 (fp16), 2e-3 (bf16) and 1e-2 to 1e-1 (fp8).
ROUNDING_TOL = 1e-4
_ROUNDED = {"dtype": None, "k_scale": 1.0, "v_scale": 1.0}
_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}


def _round_like_cache(x, dtype, scale):
    if dtype.itemsize == 1:
        m = torch.finfo(dtype).max
        return ((x.double() / scale).clamp(-m, m).to(dtype).double() * scale).to(x.dtype)
    return x.to(dtype).to(x.dtype)


def _cache_rounded_attention(module, query, key, value, attention_mask, **kwargs):
    dtype = _ROUNDED["dtype"]
    if dtype is not None:
        cached = key.shape[2] - (query.shape[2] if query.shape[2] > 1 else 0)
        key, value = key.clone(), value.clone()
        key[:, :, :cached] = _round_like_cache(key[:, :, :cached], dtype, _ROUNDED["k_scale"])
        value[:, :, :cached] = _round_like_cache(value[:, :, :cached], dtype, _ROUNDED["v_scale"])
    eager = sys.modules[type(module).__module__].eager_attention_forward  # the model's own (soft cap, sinks)
    return eager(module, query, key, value, attention_mask, **kwargs)


def rounded_eager(model, kv_cache_dtype, k_scale=1.0, v_scale=1.0):
    """``model``'s weights under eager attention whose cache rounds as ``kv_cache_dtype``."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("eager_cache_rounded", _cache_rounded_attention)
    AttentionMaskInterface.register("eager_cache_rounded", eager_mask)
    _ROUNDED.update(dtype=_CACHE_DTYPES[kv_cache_dtype], k_scale=k_scale, v_scale=v_scale)
    return twin(model, "eager_cache_rounded")


# (model, kv_cache_dtype, cache_layout, block_size, (k_scale, v_scale)): each model's window
# (6) is crossed by the prompts; 48 is a block size that is not a power of two.
CACHE_VARIANTS = [("gemma2", "fp8_e4m3", "LBHNC", 48, (0.05, 0.03)), ("mistral", "fp8_e5m2", "LHBNC", 32, (0.5, 0.25)),
                  ("llama", "bfloat16", "LBHNC", 16, (1.0, 1.0)), ("qwen3", "float16", "LHBNC", 48, (1.0, 1.0))]


@pytest.mark.parametrize("name, kv_cache_dtype, layout, block_size, scales", CACHE_VARIANTS,
                         ids=[f"{v[0]}-{v[1]}-{v[2]}-{v[3]}" for v in CACHE_VARIANTS])
def test_cache_variants_match_eager_with_the_cache_rounding(name, kv_cache_dtype, layout, block_size, scales):
    ours = build(name, "rocm_attn")
    k_scale, v_scale = scales
    ids, mask = ragged_prompts()
    cache = PagedCache(ours, num_blocks=8, block_size=block_size, cache_layout=layout,
                       kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, poison=True)
    got = greedy(ours, ids, mask, past_key_values=cache)
    want = greedy(rounded_eager(ours, kv_cache_dtype, k_scale, v_scale), ids, mask)
    tol = TOL if kv_cache_dtype.startswith("fp8") else ROUNDING_TOL
    assert torch.equal(got.sequences, want.sequences)
    assert max(rel(a, b) for a, b in zip(got.logits, want.logits)) < tol
    if kv_cache_dtype != "float16":  # fp16 rounds k/v by 2^-11: too close to its tolerance to tell apart
        unrounded = greedy(twin(ours, "eager"), ids, mask)
        assert max(rel(a, b) for a, b in zip(got.logits, unrounded.logits)) > 10 * tol
    for layer in cache.layers_by_name.values():
        assert layer.kv_cache.shape[2] == block_size
        assert (float(layer._k_scale), float(layer._v_scale)) == pytest.approx(scales)


def test_eager_runner_cache_variants_match_eager_with_the_cache_rounding():
    """The runner path: fp8 with scales, the blocks-contiguous layout, 48-token blocks."""
    from inductor_rocm_attn.integrations.batching import generate
    from inductor_rocm_attn.integrations.transformers_runner import eager_runner

    ours = build("gemma2", "rocm_attn")
    prompts = [p[m.bool()].tolist() for p, m in zip(*ragged_prompts())]
    runner = eager_runner(ours, num_blocks=8, block_size=48, cache_layout="LBHNC", kv_cache_dtype="fp8_e4m3",
                          k_scale=0.05, v_scale=0.03, poison=True)
    got = generate(runner, prompts, NEW_TOKENS, return_logits=True)
    eager = rounded_eager(ours, "fp8_e4m3", 0.05, 0.03)
    for p, tokens, logits in zip(prompts, got.tokens, got.logits):
        want = greedy(eager, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
        assert tokens == want.sequences[0, len(p):].tolist()
        assert max(rel(a, b[0]) for a, b in zip(logits, want.logits)) < TOL


def test_fp8_scales_keep_large_values_in_range():
    """A model whose values pass e4m3's 448 (here V, 2000x larger, the output projection
    2000x smaller: the same function): with scale 1 they saturate, with a v_scale that keeps
    them in range the cache only rounds them (fp8's 2^-4 relative step)."""
    ours = build("llama", "rocm_attn")
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.v_proj.weight.mul_(2000)
            layer.self_attn.o_proj.weight.div_(2000)
    ids, mask = ragged_prompts()
    want = greedy(twin(ours, "eager"), ids, mask)
    errs = {}
    for v_scale in (1.0, 8.0):
        cache = PagedCache(ours, num_blocks=8, kv_cache_dtype="fp8_e4m3", v_scale=v_scale)
        errs[v_scale] = max(rel(a, b) for a, b in zip(greedy(ours, ids, mask, past_key_values=cache).logits,
                                                         want.logits))
    assert errs[8.0] < 5e-2 < errs[1.0], errs


def test_cache_scales_are_refused_without_an_fp8_cache():
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    ours = build("llama", "rocm_attn")
    for make, who in ((PagedCache, "PagedCache"), (eager_runner, "eager_runner"),
                      (compile_transformers, "compile_transformers")):
        with pytest.raises(ValueError, match=re.escape(f"{who}: k_scale=0.5 with kv_cache_dtype='auto'; the cache "
                                                       "scales apply only to an fp8 kv_cache_dtype")):
            make(ours, num_blocks=4, k_scale=0.5)
        with pytest.raises(ValueError, match=re.escape(f"{who}: v_scale must be a positive finite number, got 0")):
            make(ours, num_blocks=4, kv_cache_dtype="fp8_e5m2", v_scale=0)



@pytest.mark.parametrize("kw, what", [(dict(block_size=8), r"block_size 8 is not supported"),
                                      (dict(cache_layout="NHD"), r"cache_layout 'NHD' is not supported"),
                                      (dict(kv_cache_dtype="int8"), r"kv_cache_dtype 'int8' is not supported")])
def test_cache_geometry_refusals_name_the_entry_point(kw, what):
    """A bad cache geometry given to PagedCache / eager_runner was refused by the Attention
    layer each builds inside ("Attention: block_size 8 ..."), not by the function called."""
    from inductor_rocm_attn.integrations.transformers_runner import compile_transformers, eager_runner

    ours = build("llama", "rocm_attn")
    for make, who in ((PagedCache, "PagedCache"), (eager_runner, "eager_runner"),
                      (compile_transformers, "compile_transformers")):
        with pytest.raises(ValueError, match=rf"^{who}: {what}"):
            make(ours, num_blocks=4, **kw)


def test_generate_fills_the_cache_exactly_and_is_refused_one_token_past_it():
    """Rows of 20 and 5 tokens with 12 new tokens hold 31 + 16 tokens: 3 blocks of 16, the
    second row's last block full. One more new token needs a fourth block: the step that
    needs it raises (generate() does not tell the cache how far it will go) and leaves the rows
    as they were."""
    ours = build("gemma2", "rocm_attn")
    ids, mask = ragged_prompts([20, 5])
    cache = PagedCache(ours, num_blocks=3, poison=True)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                        past_key_values=cache)
    want = twin(ours, "eager").generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                        eos_token_id=None)
    assert torch.equal(got, want)
    assert cache.row_lengths() == [31, 16]
    cache = PagedCache(ours, num_blocks=3, poison=True)
    with pytest.raises(MemoryError, match="PagedCache: this step needs 1 more blocks, 0 free of 3; build the cache "
                                          "with more num_blocks"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=13, do_sample=False, eos_token_id=None,
                      past_key_values=cache)
    assert cache.row_lengths() == [31, 16]


@pytest.mark.parametrize("move", [lambda m: m.to(torch.bfloat16), lambda m: m.to("meta")], ids=["dtype", "device"])
def test_a_model_moved_after_its_cache_was_built_is_refused(move):
    """model.to(...) after PagedCache(model) kept the cache's dtype and device: a bf16 model ran
    on the fp32 cache (an 'auto' cache is the model's dtype) and a model on another device
    failed inside the first layer's cache update, naming neither the cache nor the move."""
    ours = build("llama", "rocm_attn")
    cache = PagedCache(ours, num_blocks=4, poison=True)
    ours(torch.tensor([[5, 6, 7]]), past_key_values=cache)
    move(ours)
    before = [layer.kv_cache.clone() for layer in cache.layers_by_name.values()]
    with pytest.raises(ValueError, match=r"PagedCache: the model is now torch\.\w+ on \w+ but the cache was built for "
                                         r"torch\.float32 on cpu; build a new PagedCache for the moved model"):
        ours(torch.tensor([[8]], device=next(ours.parameters()).device), past_key_values=cache)
    assert cache.row_lengths() == [3]
    assert all(torch.equal(b.view(torch.uint8), layer.kv_cache.view(torch.uint8))
               for b, layer in zip(before, cache.layers_by_name.values()))
