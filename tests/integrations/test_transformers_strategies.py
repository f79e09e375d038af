"""transformers' other generate strategies on PagedCache: beam search (``reorder_cache``),
prompt lookup and assisted decoding (``crop`` after a multi-token verify step), several
return sequences, and the cache's re-batching methods, against eager transformers with its
own DynamicCache (CPU, fp32, random weights; tolerance as in test_transformers.py), on Llama
and Qwen3 and on models with sliding windows and mixed layer types."""

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from inductor_rocm_attn.integrations.transformers import PagedCache  # noqa: E402
from inductor_rocm_attn.layout import dense_kv  # noqa: E402

from test_transformers import (_SMALL, CONFIGS, MORE_CONFIGS, TOL, build, ragged_prompts, rel,  # noqa: E402
                              twin)


class RecordingCache(PagedCache):
    """A PagedCache that logs what generate() asks of it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def crop(self, tokens_to_remove):
        self.calls.append(("crop", int(tokens_to_remove)))
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx):
        self.calls.append(("reorder", beam_idx.tolist()))
        super().reorder_cache(beam_idx)


def blocks_in_use(cache):
    return cache.num_blocks - cache._allocator.num_free_blocks


def blocks_held(cache):
    """The blocks the rows' lengths need: what is in use when no block leaks."""
    return sum(cache._allocator.blocks_needed(n) for n in cache.row_lengths())


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request):
    ours = build(request.param, "rocm_attn")
    return request.param, ours, twin(ours, "eager")


# --- beam search --------------------------------------------------------------------------------


def _beam_search_matches_eager(ours, eager, ids, mask, **beams):
    """Greedy beam search through a recording PagedCache and through eager's own cache: the
    same sequences, scores within 1e-5. Returns the cache and the beam indices it was given."""
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, output_scores=True,
              return_dict_in_generate=True, **beams)
    cache = RecordingCache(ours, num_blocks=48, poison=True)
    got = ours.generate(ids, past_key_values=cache, **kw)
    want = eager.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.allclose(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=0)
    return cache, [idx for what, idx in cache.calls if what == "reorder"]


@pytest.mark.parametrize("num_beams, num_return", [(2, 1), (4, 3)])
def test_beam_search_matches_eager(models, num_beams, num_return):
    """Ragged left-padded prompts: rows of one prompt share its padding, beams move between
    rows each step (reorder_cache copies a row taken twice, frees one taken by none)."""
    _, ours, eager = models
    ids, mask = ragged_prompts()
    cache, reorders = _beam_search_matches_eager(ours, eager, ids, mask, max_new_tokens=7, num_beams=num_beams,
                                                 num_return_sequences=num_return)
    rows = len(ids) * num_beams
    assert len(reorders) == 7 and all(len(idx) == rows for idx in reorders)
    # beams did move: some row continued another row, and some row was taken twice
    assert any(idx != list(range(rows)) for idx in reorders)
    assert any(len(set(idx)) < rows for idx in reorders)
    assert blocks_in_use(cache) == blocks_held(cache)


# --- assisted decoding / prompt lookup ----------------------------------------------------------

NEW = 16


def _repetitive_prompt():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (1, 5), generator=g)
    return torch.cat([ids, ids, ids[:, :3]], 1)  # prompt lookup finds its drafts in the prompt


def _greedy(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, output_logits=True, return_dict_in_generate=True, **kw)


def _check_matches_greedy(got, want, cache):
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == NEW
    errs = [rel(a, b) for a, b in zip(got.logits, want.logits)]
    assert max(errs) < TOL, errs
    crops = [n for what, n in cache.calls if what == "crop"]
    # drafts were rejected (a crop removed tokens) and accepted (fewer verify steps than tokens)
    assert any(n < 0 for n in crops) and len(crops) < NEW, crops
    assert cache.row_lengths() == [got.sequences.shape[1] - 1]  # the last token is never fed back
    assert blocks_in_use(cache) == blocks_held(cache)


def test_prompt_lookup_decoding_matches_greedy(models):
    _, ours, eager = models
    ids = _repetitive_prompt()
    cache = RecordingCache(ours, num_blocks=8, poison=True)
    got = _greedy(ours, ids, past_key_values=cache, prompt_lookup_num_tokens=3)
    _check_matches_greedy(got, _greedy(eager, ids), cache)


def _noisy_assistant(model, **overrides):
    """``model``'s weights with a little noise, on eager attention, drafting 4 tokens a step."""
    assistant = twin(model, "eager", **overrides)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in assistant.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.005)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


def test_assisted_decoding_matches_greedy(models):
    """The assistant: the main model's weights with a little noise, on eager attention with its
    own DynamicCache: its drafts of up to 4 tokens are partly accepted, each verified by one
    multi-token step over the cached context."""
    _, ours, eager = models
    assistant = _noisy_assistant(ours)
    ids = _repetitive_prompt()
    cache = RecordingCache(ours, num_blocks=8, poison=True)
    got = _greedy(ours, ids, past_key_values=cache, assistant_model=assistant)
    _check_matches_greedy(got, _greedy(eager, ids), cache)


# --- sampling with several return sequences -----------------------------------------------------


def test_sampling_several_return_sequences_matches_dynamic_cache(models):
    """generate() repeats the prompts before the first forward: rows 3i..3i+2 are prompt i."""
    _, ours, eager = models
    ids, mask = ragged_prompts()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, num_return_sequences=3,
              eos_token_id=None)
    torch.manual_seed(7)
    got = ours.generate(ids, past_key_values=PagedCache(ours, num_blocks=24, poison=True), **kw)
    torch.manual_seed(7)
    want = eager.generate(ids, **kw)
    assert torch.equal(got, want)
    assert len({tuple(s) for s in got[:3, ids.shape[1]:].tolist()}) > 1  # the copies did sample apart


# --- the cache methods, step by step ------------------------------------------------------------


def _positions(mask, t):
    return (mask.cumsum(-1) - 1).clamp(min=0)[:, -t:]


def test_cache_methods_match_dynamic_cache_step_by_step():
    """Forward steps (prefill, decode, multi-token verify) between crop / reorder / repeat /
    select, on ragged left-padded rows; each step's logits against eager on a DynamicCache
    given the same calls."""
    ours = build("llama", "rocm_attn")
    eager = twin(ours, "eager")
    _cache_methods_step_by_step(ours, eager, transformers.DynamicCache(config=eager.config))


def _cache_methods_step_by_step(ours, eager, ref):
    ids, mask = ragged_prompts([5, 11, 8])
    cache = PagedCache(ours, num_blocks=32, block_size=16, poison=True)
    g = torch.Generator().manual_seed(5)
    state = {"mask": mask}

    def step(t):
        b = state["mask"].shape[0]
        new = torch.randint(3, 256, (b, t), generator=g)
        state["mask"] = torch.cat([state["mask"], torch.ones(b, t, dtype=torch.long)], 1)
        pos = _positions(state["mask"], t)
        a = ours(new, attention_mask=state["mask"], position_ids=pos, past_key_values=cache).logits
        w = eager(new, attention_mask=state["mask"], position_ids=pos, past_key_values=ref).logits
        assert rel(a, w) < TOL
        assert cache.get_seq_length() == ref.get_seq_length() == state["mask"].shape[1]
        assert blocks_in_use(cache) == blocks_held(cache)

    a = ours(ids, attention_mask=mask, position_ids=_positions(mask, 11), past_key_values=cache).logits
    w = eager(ids, attention_mask=mask, position_ids=_positions(mask, 11), past_key_values=ref).logits
    assert rel(a[mask.bool()], w[mask.bool()]) < TOL  # padding positions' logits mean nothing

    def both(method, arg, rows=None, columns=None):
        getattr(cache, method)(arg)
        getattr(ref, method)(arg)
        state["mask"] = state["mask"] if rows is None else state["mask"][rows]
        state["mask"] = state["mask"] if columns is None else state["mask"][:, :columns]

    step(1), step(6)  # the rows cross into their second block
    seen = cache.get_seq_length()
    before = cache.row_lengths()
    both("crop", -6, columns=seen - 6)  # back into the first block of rows 0 and 2
    assert cache.row_lengths() == [n - 6 for n in before]
    step(4)  # a verify step of 4 tokens over the cropped context
    both("crop", cache.get_seq_length() - 1, columns=cache.get_seq_length() - 1)  # keep n columns (older form)
    step(1)
    both("reorder_cache", torch.tensor([2, 0, 0]), rows=[2, 0, 0])
    step(3)
    both("batch_repeat_interleave", 2, rows=[0, 0, 1, 1, 2, 2])
    step(1)
    both("batch_select_indices", torch.tensor([5, 0, 3, 3]), rows=[5, 0, 3, 3])
    step(2)
    both("crop", 0)
    step(1)


# --- sliding windows and mixed layer types -----------------------------------------------------

# Windows of 4-5 tokens, crossed by every prompt plus its generated tokens; per model, each
# layer's window in the paged layers (-1: full attention).
SLIDING = {
    "mistral": (CONFIGS["mistral"], 6, [6, 6]),  # config.sliding_window on every layer
    "gemma2": (CONFIGS["gemma2"], 4, [4, -1]),  # sliding, full (soft cap on both)
    "gemma3": (MORE_CONFIGS["gemma3"], 4, [4, -1]),
    "gpt_oss": (MORE_CONFIGS["gpt_oss"], 4, [4, -1]),  # sinks with a window, sinks on full attention
    "qwen2": (lambda: transformers.Qwen2Config(**_SMALL, num_key_value_heads=2, use_sliding_window=True,
                                               max_window_layers=1), 4, [-1, 4]),  # full, then sliding
}


@functools.lru_cache(maxsize=None)
def sliding_models(name):
    """(ours, its eager twin) of ``SLIDING[name]``, built once for the module's tests."""
    factory, window, windows = SLIDING[name]
    config = factory()
    config.sliding_window = window
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                         dtype=torch.float32).eval()
    layers = PagedCache(ours, num_blocks=1).layers_by_name.values()
    assert [layer.impl.sliding_window for layer in layers] == windows
    return ours, twin(ours, "eager")


@pytest.mark.parametrize("name", list(SLIDING))
def test_beam_search_on_sliding_windows_matches_eager(name):
    """Beams move between rows (copies, frees) while every row is past its window: each copy
    keeps what its layers' windows see. Eager runs on the cache transformers builds for the
    model (sliding-window layers where it has them)."""
    ours, eager = sliding_models(name)
    ids, mask = ragged_prompts([5, 11])
    cache, reorders = _beam_search_matches_eager(ours, eager, ids, mask, max_new_tokens=6, num_beams=3,
                                                 num_return_sequences=2)
    assert any(len(set(idx)) < len(idx) for idx in reorders)  # some row was taken twice
    assert blocks_in_use(cache) == blocks_held(cache)


@pytest.mark.parametrize("name", list(SLIDING))
def test_prompt_lookup_on_sliding_windows_matches_greedy(name):
    """Drafts verified and rejected past the window: a crop leaves each layer's window over the
    tokens that remain."""
    ours, eager = sliding_models(name)
    ids = _repetitive_prompt()
    cache = RecordingCache(ours, num_blocks=8, poison=True)
    got = _greedy(ours, ids, past_key_values=cache, prompt_lookup_num_tokens=3)
    _check_matches_greedy(got, _greedy(eager, ids), cache)


def test_assisted_decoding_on_sliding_windows_matches_greedy():
    """Gemma2 (sliding, full). The assistant's window is out of reach: on transformers 5.17's
    own sliding-window cache, which keeps the drafts it may take back, an assistant's masks are
    sized for the window and its draft steps past the window raise (an all-eager run too)."""
    ours, eager = sliding_models("gemma2")
    assistant = _noisy_assistant(ours, sliding_window=4096)
    ids = _repetitive_prompt()
    cache = RecordingCache(ours, num_blocks=8, poison=True)
    got = _greedy(ours, ids, past_key_values=cache, assistant_model=assistant)
    _check_matches_greedy(got, _greedy(eager, ids), cache)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss", "qwen2"])
def test_cache_methods_on_sliding_windows_step_by_step(name):
    """Crops back across the window, reorder / repeat / select of rows past it. The reference:
    eager on a DynamicCache of full layers (its mask applies each layer's window; the sliding
    layers of DynamicCache(config=...) cannot crop past their window)."""
    ours, eager = sliding_models(name)
    _cache_methods_step_by_step(ours, eager, transformers.DynamicCache())


def test_crop_removes_each_rows_own_tokens_of_the_columns():
    """A crop reaching into the prompt columns removes, per row, only the tokens those columns
    held: a left-padded row with fewer real tokens there loses fewer (its padding held none)."""
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts([3, 6])  # row 0: 3 padding columns then 3 tokens
    cache = PagedCache(ours, num_blocks=4, block_size=16)
    ours(ids, attention_mask=mask, past_key_values=cache)
    mask = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], 1)
    ours(torch.full((2, 2), 5), attention_mask=mask, past_key_values=cache)
    assert cache.row_lengths() == [5, 8]
    cache.reorder_cache(torch.tensor([1, 0]))  # the rows' masks move with them
    assert cache.row_lengths() == [8, 5]
    cache.crop(-5)  # the 2 decode columns and the last 3 prompt columns: all tokens of both rows
    assert cache.row_lengths() == [3, 0] and cache.get_seq_length() == 3
    assert blocks_in_use(cache) == 1  # row 1 gave its block back
    cache.crop(-3)  # row 0 loses its last 3; row 1 has nothing left there (padding)
    assert cache.row_lengths() == [0, 0] and cache.get_seq_length() == 0 and blocks_in_use(cache) == 0
    # the batch stays: the next forward continues both rows from nothing
    ours(ids[:, :2], attention_mask=torch.ones(2, 2, dtype=torch.long), past_key_values=cache)
    assert cache.row_lengths() == [2, 2]


@pytest.mark.parametrize("kv_cache_dtype, layout", [("fp8_e4m3", "LHBNC"), ("fp8_e5m2", "LBHNC")])
def test_copied_rows_hold_the_source_bits(kv_cache_dtype, layout):
    """A repeated row's blocks are copied byte for byte, in every layer (fp8 included)."""
    ours = build("qwen3", "rocm_attn")
    ids, mask = ragged_prompts([9, 20])
    cache = PagedCache(ours, num_blocks=12, block_size=16, kv_cache_dtype=kv_cache_dtype, cache_layout=layout,
                       k_scale=0.05, v_scale=0.05, poison=True)
    ours(ids, attention_mask=mask, past_key_values=cache)

    def row_kv(row):
        table = cache._allocator.block_table(cache._ids[row])
        n = cache.row_lengths()[row]
        out = []
        for layer in cache.layers_by_name.values():
            raw = layer.kv_cache.view(torch.uint8)[table]
            out.append(raw.transpose(0, 1).flatten(1, 2)[:, :n].clone())  # [2, tokens, bytes]
        return out

    before = [row_kv(r) for r in range(2)]
    used = blocks_in_use(cache)
    cache.batch_repeat_interleave(3)
    assert cache.row_lengths() == [9, 9, 9, 20, 20, 20]
    assert blocks_in_use(cache) == 3 * used
    tables = [cache._allocator.block_table(cache._ids[r]) for r in range(6)]
    assert len({b for t in tables for b in t}) == sum(map(len, tables))  # no block shared by two rows
    for r in range(6):
        for got, want in zip(row_kv(r), before[r // 3]):
            assert torch.equal(got, want)


# --- refusals ---------------------------------------------------------------------------------


def _state(cache):
    return (cache.row_lengths(), cache.get_seq_length(), cache._allocator.num_free_blocks, list(cache._ids))


def test_bad_arguments_are_refused_before_anything_changes():
    ours = build("llama", "rocm_attn")
    ids, mask = ragged_prompts([5, 11, 8])
    cache = PagedCache(ours, num_blocks=4, block_size=16)
    ours(ids, attention_mask=mask, past_key_values=cache)
    state = _state(cache)
    refusals = [
        (lambda: cache.reorder_cache(torch.tensor([0, 3, 1])), ValueError,
         r"PagedCache.reorder_cache: beam_idx\[1\] = 3; row indices must be ints in \[0, rows\) \(the cache holds 3"),
        (lambda: cache.reorder_cache(torch.tensor([0, -1, 1])), ValueError, r"beam_idx\[1\] = -1"),
        (lambda: cache.reorder_cache(torch.tensor([0.0, 1.0, 2.0])), ValueError, "1-D integer tensor"),
        (lambda: cache.reorder_cache(torch.zeros(1, 3, dtype=torch.long)), ValueError, "1-D integer tensor"),
        (lambda: cache.batch_select_indices(torch.tensor([], dtype=torch.long)), ValueError, "selects no row"),
        (lambda: cache.batch_select_indices("0"), TypeError, "batch_select_indices: indices must be"),
        (lambda: cache.batch_repeat_interleave(0), ValueError, "repeats must be a positive int, got 0"),
        (lambda: cache.crop(-12), ValueError, r"PagedCache.crop: cannot remove 12 tokens, the cache holds 11"),
        (lambda: cache.crop(1.5), TypeError, "tokens_to_remove must be an int"),
        # 3 rows of 1 block, 4 blocks: a second copy of each needs 3 blocks, 1 is free
        (lambda: cache.batch_repeat_interleave(2), MemoryError,
         r"batch_repeat_interleave: the 3 repeated rows need 3 blocks for their copies, 1 free of 4 \(with the"),
        (lambda: cache.batch_select_indices([0, 0, 0, 0, 1]), MemoryError,
         r"batch_select_indices: the 3 repeated rows need 3 blocks for their copies, 2 free of 4"),
    ]
    for call, error, match in refusals:
        with pytest.raises(error, match=match):
            call()
        assert _state(cache) == state
    cache.batch_select_indices([0, 0, 0])  # fits: the blocks of rows 1 and 2 take the copies
    assert cache.row_lengths() == [5, 5, 5] and cache._allocator.num_free_blocks == 1


def test_calls_during_a_step_are_refused_by_name():
    ours = build("llama", "rocm_attn")
    cache = PagedCache(ours, num_blocks=4)
    ours(torch.full((2, 3), 5), past_key_values=cache)
    cache.begin_step(torch.full((2, 1), 5))
    state = _state(cache)
    for call, name in ((lambda: cache.crop(-1), "crop"), (lambda: cache.reorder_cache(torch.tensor([1, 0])),
                                                          "reorder_cache"),
                       (lambda: cache.batch_select_indices([0]), "batch_select_indices"),
                       (lambda: cache.batch_repeat_interleave(2), "batch_repeat_interleave")):
        with pytest.raises(RuntimeError, match=rf"PagedCache.{name}: a step is active"):
            call()
        assert _state(cache) == state
    cache.end_step(discard=True)
    assert cache.row_lengths() == [3, 3]
    cache.crop(-2)  # no step had a mask: every column held a token of each row
    assert cache.row_lengths() == [1, 1] and cache.get_seq_length() == 1


def test_assistant_model_on_rocm_attn_is_refused_with_what_to_do():
    """The assistant runs its own generate() on a cache that transformers builds for it (it
    passes the assistant no past_key_values): loaded with attn_implementation="rocm_attn", it
    has no PagedCache step, and the error says to load it with eager or sdpa. Any other forward
    without a step is told to pass a PagedCache."""
    ours = build("llama", "rocm_attn")
    ids = _repetitive_prompt()
    assistant = build("llama", "rocm_attn")
    cache = PagedCache(ours, num_blocks=8)
    with pytest.raises(RuntimeError) as raised:
        _greedy(ours, ids, past_key_values=cache, assistant_model=assistant)
    message = str(raised.value)
    assert message.startswith("rocm_attn attention (LlamaAttention layer 0): no PagedCache step is active: this "
                              "forward drafts tokens for assisted decoding"), message
    assert 'for the assistant_model, load it with attn_implementation="eager" or "sdpa"' in message, message
    assert "the main model keeps rocm_attn with its PagedCache" in message, message
    # assistant_early_exit drafts with the main model itself, on a cache of transformers' own
    with pytest.raises(RuntimeError, match="drafts tokens for assisted decoding.*assistant_early_exit is not "
                                           "supported on rocm_attn"):
        _greedy(ours, ids, past_key_values=PagedCache(ours, num_blocks=8), assistant_early_exit=1)
    # the advice works: the same assistant on sdpa
    assistant.set_attn_implementation("sdpa")
    cache.reset()
    _greedy(ours, ids, past_key_values=cache, assistant_model=assistant)
    with pytest.raises(RuntimeError) as raised:
        ours(ids)  # a forward of its own, no cache
    message = str(raised.value)
    assert "no PagedCache step is active; pass past_key_values=" in message and "drafts tokens" not in message
    assert 'builds its own cache and cannot be handed one (an assisted-decoding assistant): load it with ' \
           'attn_implementation="eager" or "sdpa"' in message, message
