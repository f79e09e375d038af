"""transformers models on the paged backend: ``attn_implementation="rocm_attn"`` + ``PagedCache``.

>>> model = AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn")
>>> cache = PagedCache(model, num_blocks=256)
>>> out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16)

How it joins transformers (tested with 5.17.0), through registration points only:

- ``AttentionInterface.register("rocm_attn", attention_forward)``: every attention module that
  dispatches through ``ALL_ATTENTION_FUNCTIONS`` calls ``attention_forward`` with its
  q/k/v ``[B, H, T, D]`` (already rotated). It views them as ``[B*T, H, D]`` without a copy
  (a transpose of a ``[B, T, H, D]`` tensor flattens as a view) and emits the layer-level
  ops ``rocm_attn.unified_kv_cache_update`` then ``rocm_attn.unified_attention_with_output``.
- No ``AttentionMaskInterface`` entry: transformers skips building masks for an
  implementation without one (``masking_utils._preprocess_mask_arguments``); padding and
  causality come from our metadata.
- ``PagedCache`` (a ``transformers.Cache``) is passed as ``past_key_values``. It owns one
  ``Attention`` layer (impl + KV cache) per attention module, the block allocator and each
  row's length; its ``update`` returns the new k/v unchanged (the attention op writes them).
- generate()'s beam search and assisted / prompt lookup decoding call ``reorder_cache`` and
  ``crop`` between forwards: rows exchange or copy blocks, a crop shortens each row by the
  cached tokens of the attention-mask columns it removes.
- Planning: a forward pre-hook on the model's decoder (installed by ``PagedCache``, a
  no-op for any other cache) reads ``input_ids``/``attention_mask``/``position_ids``,
  builds the step's metadata and enters the forward context with the cache's own layer
  table; a forward hook leaves it (and, when the forward raised, forgets the step's
  tokens). Left padding (``generate`` pads ragged prompts) becomes padding sequences that
  write nothing (slot -1) and that no real token attends to.

Positions are tied to the metadata: ``position_ids`` that disagree with a row's cached
length raise; omitted ones are filled in from the metadata. Per-call arguments that change
the attention (``scaling``, ``sliding_window``, ``softcap``, ``s_aux``, ``is_causal``,
``dropout``, a prepared mask, packed-sequence or continuous-batching kwargs) must match
what the layer was built with from its module, or raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import weakref
from typing import Callable

import torch
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.modeling_utils import AttentionInterface

from ..block_allocator import BlockAllocator
from ..capabilities import check_block_size, check_kv_cache_dtype
from ..config_checks import check_cache_scales
from ..forward_context import get_forward_context, set_forward_context
from ..layer import Attention
from ..layout import allocate_kv_cache, as_cache_layout
from ..metadata import AttentionMetadata, build_attention_metadata
from ..validation import check_bool, check_positive_int, check_token_ids, is_int, vocab_size_of

__all__ = ["ATTN_IMPLEMENTATION", "PagedCache", "attention_forward", "register", "stats"]

ATTN_IMPLEMENTATION = "rocm_attn"
_NAME_PREFIX = "transformers.layers."
# Keyword arguments of other attention paths: packed sequences (flash varlen) and
# transformers' own continuous batching (its PagedAttentionCache).
_FOREIGN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache",
                   "read_index", "write_index", "block_table")


@dataclasses.dataclass
class IntegrationStats:
    qkv_copies: int = 0  # q/k/v tensors that could not be viewed as [B*T, H, D] and were copied


stats = IntegrationStats()


def register() -> None:
    """Register ``attn_implementation="rocm_attn"`` (``import inductor_rocm_attn`` does it)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)


# --- attention modules ------------------------------------------------------------------------


def _module_window(module) -> int | None:
    types = getattr(module.config, "layer_types", None)
    if types and 0 <= module.layer_idx < len(types) and types[module.layer_idx] == "full_attention":
        return None  # EXAONE 4: sliding_window on every module, passed only on its sliding layers
    if hasattr(module, "sliding_window"):  # Gemma2, Qwen2/3: per layer (None on full layers)
        return module.sliding_window
    # Mistral passes config.sliding_window. A config's 0 means off: Qwen2-MoE stores 0 when
    # use_sliding_window is False, and its full layers have no sliding_window attribute.
    return getattr(module.config, "sliding_window", None) or None


# Attention modules that never pass their window to the attention function: their mask applies
# it (Qwen2-MoE: the module's sliding_window, set on its sliding layers; PhiMoE:
# config.sliding_window on every layer). The layer is built with that window, and a call's
# sliding_window (None from these) is not compared with it.
_WINDOW_FROM_MASK = frozenset({"Qwen2MoeAttention", "PhimoeAttention"})


def _module_softcap(module) -> float | None:
    return getattr(module, "attn_logit_softcapping", None)  # Gemma2


def _module_sinks(module) -> torch.Tensor | None:
    return getattr(module, "sinks", None)  # gpt-oss


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What a transformers attention module computes, read from the module (and its config)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    softcap: float | None
    causal: bool
    sinks: torch.Tensor | None

    @classmethod
    def of(cls, module) -> "LayerSpec":
        config = module.config
        num_heads = _module_int(module, "num_heads") or config.num_attention_heads
        return cls(
            num_heads=num_heads,
            num_kv_heads=_module_kv_heads(module, num_heads),
            head_size=_head_dim(module),
            scale=float(_call_scaling(module)),
            sliding_window=_module_window(module),
            softcap=_module_softcap(module),
            causal=bool(getattr(module, "is_causal", True)),
            sinks=_module_sinks(module),
        )


def _module_int(module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _module_kv_heads(module, num_heads: int) -> int:
    """The KV heads the module passes: ``num_heads / num_key_value_groups`` (the repeat its eager
    path applies) where the module has it, which also covers heads set per layer (Laguna's
    query heads, MiMo-V2's doubled KV heads on sliding layers) and K/V repeated before the call
    (JetMoE); else the config's ``num_key_value_heads``."""
    groups = _module_int(module, "num_key_value_groups")
    if groups is not None:
        return num_heads // groups
    return getattr(module.config, "num_key_value_heads", None) or num_heads


# Attention modules whose forward multiplies q by ``module.scaling`` itself and passes this
# scaling to the attention function (OPT keeps its reference implementation's rounding order).
_CALL_SCALING = {"OPTAttention": 1.0}


def _call_scaling(module) -> float:
    """The scaling ``module``'s forward passes to the attention function."""
    return _CALL_SCALING.get(type(module).__name__, module.scaling)


# The layer types (config.layer_types) whose attention the metadata expresses: causal (or
# the module's is_causal) and a sliding window. Others mask differently and would run as
# full attention, except a chunked layer (Llama 4: a token sees only its own chunk of
# attention_chunk_size positions) while no sequence leaves its first chunk.
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_layer_types(model: torch.nn.Module, modules: dict[int, torch.nn.Module], max_seq_len: int | None) -> None:
    """Every entry of ``config.layer_types``, also those of layers without an attention module
    (hybrid models: mamba, conv, linear-attention layers keep state no paged cache holds).
    ``max_seq_len``: the longest sequence the owner of the layers allows (None: it checks
    each step against ``chunk_limit``)."""
    config = next(iter(modules.values())).config
    types = getattr(config, "layer_types", None) or ()
    for idx, kind in enumerate(types):
        if kind in _LAYER_TYPES:
            continue
        chunk = getattr(config, "attention_chunk_size", None)
        where = f"rocm_attn ({type(modules[idx] if idx in modules else model).__name__} layer {idx})"
        if kind != "chunked_attention" or not chunk:
            raise NotImplementedError(f"{where}: config.layer_types has {kind!r} for this layer; supported layer "
                                      f"types: {', '.join(_LAYER_TYPES)}")
        if max_seq_len is not None and max_seq_len > chunk:
            raise NotImplementedError(
                f"{where}: a chunked_attention layer (attention_chunk_size={chunk}) with sequences of up to "
                f"{max_seq_len} tokens; chunked attention is supported only within one chunk: at most {chunk} "
                "tokens a sequence"
            )


def _dynamic_rope_entries(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str | None, str, int]]:
    """``(rotary module, layer type or None, rope type, limit)`` for each RoPE whose frequencies
    transformers recomputes from a batch's longest position (``dynamic_rope_update``):
    "dynamic" (NTK) rescales past ``max_position_embeddings`` (the module's
    ``original_max_seq_len``), "longrope" switches to its long factors past
    ``original_max_position_embeddings``. Up to ``limit`` positions the frequencies stay the
    module's original ones (``original_inv_freq``; a per-layer-type module's
    ``{layer_type}_original_inv_freq``)."""
    found = []
    for m in model.modules():
        types = getattr(m, "rope_type", None)
        if not isinstance(types, (str, dict)) or not hasattr(m, "config"):
            continue
        for layer_type, kind in (types.items() if isinstance(types, dict) else [(None, types)]):
            if not isinstance(kind, str) or not ("dynamic" in kind or kind == "longrope"):
                continue
            if kind == "longrope":
                params = m.config.rope_parameters
                params = params[layer_type] if layer_type is not None else params
                limit = params["original_max_position_embeddings"]
            else:
                limit = m.original_max_seq_len
            found.append((m, layer_type, kind, int(limit)))
    return found


def dynamic_rope_limit(model: torch.nn.Module) -> tuple[int, str, str] | None:
    """``(limit, rotary module class, rope type)`` of the dynamic RoPE (``_dynamic_rope_entries``)
    with the smallest limit; None without one."""
    entries = _dynamic_rope_entries(model)
    if not entries:
        return None
    m, _, kind, limit = min(entries, key=lambda e: e[3])
    return limit, type(m).__name__, kind


@functools.cache
def _rope_update_code():
    """The code object of ``dynamic_rope_update``'s wrapper: every forward it decorates shares it."""
    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _undecorated_rope_forward(module: torch.nn.Module) -> Callable | None:
    """The function ``dynamic_rope_update`` wraps in ``type(module).forward`` (found down the
    ``__wrapped__`` chain, under ``torch.no_grad`` or other ``functools.wraps`` decorators);
    None where no such wrapper is found (a rotary class of its own)."""
    fn, seen = type(module).forward, set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if getattr(fn, "__code__", None) is _rope_update_code():
            return getattr(fn, "__wrapped__", None)
        fn = getattr(fn, "__wrapped__", None)
    return None


def check_dynamic_rope(model: torch.nn.Module, who: str, max_seq_len: int, *, traced: bool = False) -> None:
    """Refuse a RoPE whose frequencies follow the batch's longest position (``_dynamic_rope_entries``)
    where it would leave its original frequencies. A runner's step holds the tokens of several
    sequences (and chunks of long prompts), so they would follow the other sequences of the
    step, not each sequence's own length as in eager transformers; a compiled trace
    (``traced``) cannot take the switch at all (a data-dependent branch): it runs on the
    original frequencies (``original_rope_frequencies``), which needs transformers'
    ``dynamic_rope_update`` wrapper to leave out. ``max_seq_len``: the longest sequence the
    runner allows."""
    for m, _, kind, limit in _dynamic_rope_entries(model):
        cls = type(m).__name__
        if max_seq_len > limit and traced:
            raise NotImplementedError(
                f"{who}: {cls} uses transformers' {kind!r} RoPE, whose frequencies change once a forward's longest "
                f"position passes {limit} (a data-dependent branch, not traceable in one graph); the compiled "
                f"model keeps its original frequencies, so no sequence may pass {limit} tokens: "
                f"max_model_len={max_seq_len} here, pass max_model_len <= {limit} (PagedCache serves longer "
                f"sequences)")
        if max_seq_len > limit:
            raise NotImplementedError(
                f"{who}: {cls} uses transformers' {kind!r} RoPE, whose frequencies change once a forward's "
                f"longest position passes {limit}; a step mixes sequences and prompt chunks, so they would follow "
                f"the step, not each sequence: sequences of up to {max_seq_len} tokens here, at most {limit} "
                f"supported (fewer cache blocks)")
        if traced and _undecorated_rope_forward(m) is None:
            raise NotImplementedError(
                f"{who}: {cls} uses transformers' {kind!r} RoPE, but its forward is not wrapped by transformers' "
                f"dynamic_rope_update, so the frequency update (a data-dependent branch, not traceable in one "
                f"graph) cannot be left out of the trace; serve it with eager_runner (sequences of at most "
                f"{limit} tokens) or PagedCache")
        if traced and "forward" in vars(m):  # a hook (accelerate's) the trace's forward would leave out
            raise NotImplementedError(
                f"{who}: {cls} uses transformers' {kind!r} RoPE and its instance has a forward of its own (a hook), "
                f"which the trace would replace to leave out the frequency update; remove it, or serve the model "
                f"with eager_runner (sequences of at most {limit} tokens) or PagedCache")


@contextlib.contextmanager
def original_rope_frequencies(model: torch.nn.Module):
    """While tracing a model that ``check_dynamic_rope(..., traced=True)`` accepted: each
    rotary module with a dynamic RoPE runs its forward without transformers'
    ``dynamic_rope_update`` (the undecorated function, set as the instance's ``forward``,
    taking ``layer_type`` as the wrapper does), on its original frequencies, which the update
    itself picks for a forward within the limit. As that update does, the ``inv_freq``
    buffer (``{layer_type}_inv_freq``) is registered as the original one (the same tensor: a
    later eager forward within the limit registers that tensor again, so the compiled
    runner's buffer checks still find the tensor it was compiled with) and a grown dynamic
    length is reset: a change that stays, as harmless as the next short eager forward's. The
    instance ``forward`` is restored on exit (also on error); ``attention_scaling`` is left
    as it is (the update does not change it within the limit)."""
    entries = _dynamic_rope_entries(model)
    modules = {id(m): m for m, *_ in entries}
    undecorated = {key: _undecorated_rope_forward(m) for key, m in modules.items()}
    for key, m in modules.items():
        if undecorated[key] is None:
            raise NotImplementedError(f"original_rope_frequencies: {type(m).__name__}'s forward is not wrapped by "
                                      "transformers' dynamic_rope_update")
    for m, layer_type, kind, limit in entries:  # for dynamic, limit is original_max_seq_len
        prefix = "" if layer_type is None else f"{layer_type}_"
        original = getattr(m, f"{prefix}original_inv_freq").to(getattr(m, f"{prefix}inv_freq").device)
        m.register_buffer(f"{prefix}inv_freq", original, persistent=False)
        setattr(m, f"{prefix}original_inv_freq", original)
        if "dynamic" in kind and getattr(m, f"{prefix}max_seq_len_cached", m.max_seq_len_cached) > limit:
            setattr(m, f"{prefix}max_seq_len_cached", limit)
    missing = object()
    saved = {key: m.__dict__.get("forward", missing) for key, m in modules.items()}
    try:
        for key, m in modules.items():
            m.__dict__["forward"] = _without_rope_update(m, undecorated[key])
        yield
    finally:
        for key, m in modules.items():
            if saved[key] is missing:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = saved[key]


def _without_rope_update(module: torch.nn.Module, fn: Callable) -> Callable:
    """``module``'s forward as ``dynamic_rope_update``'s wrapper calls it, without the update."""

    def forward(x, position_ids, layer_type=None):
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        return fn(module, x, position_ids, **kwargs)

    return forward


def learned_position_limit(model: torch.nn.Module) -> int | None:
    """The positions a learned position embedding holds (GPT-2's ``wpe``: an embedding other
    than the token embedding), ``config.max_position_embeddings``; None without one (RoPE
    computes any position)."""
    token = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not any(isinstance(m, torch.nn.Embedding) and m is not token for m in model.modules()):
        return None
    return getattr(model.config, "max_position_embeddings", None)


def chunk_limit(model: torch.nn.Module, who: str) -> int | None:
    """The longest sequence ``model``'s chunked_attention layers allow (None: no such layer)."""
    config = next(iter(_attention_modules(_decoder(model), who).values())).config
    chunked = "chunked_attention" in (getattr(config, "layer_types", None) or ())
    return getattr(config, "attention_chunk_size", None) if chunked else None


def layer_name(module) -> str:
    """The name the ops carry for a transformers attention module (unique within a model)."""
    return f"{_NAME_PREFIX}{module.layer_idx}"


def _head_dim(module) -> int | None:
    """``head_dim`` (most models) or ``head_size`` (GPT-NeoX)."""
    return getattr(module, "head_dim", None) or getattr(module, "head_size", None)


def _attention_modules(decoder: torch.nn.Module, who: str) -> dict[int, torch.nn.Module]:
    """``layer_idx`` -> attention module of ``decoder``; ``who``: the entry point refusals name."""
    found: dict[int, torch.nn.Module] = {}
    for path, m in decoder.named_modules():
        if not all(hasattr(m, a) for a in ("layer_idx", "scaling", "config")) or not isinstance(_head_dim(m), int):
            continue
        if m.layer_idx in found:
            raise NotImplementedError(
                f"{who}: two attention modules share layer_idx {m.layer_idx} ({path}); models "
                "with several attention stacks (encoder-decoder, cross-attention) are not supported"
            )
        _check_supported_attention(m, who)
        found[m.layer_idx] = m
    if not found:
        mla = next((m for m in decoder.modules() if hasattr(m, "kv_lora_rank") and hasattr(m, "layer_idx")), None)
        if mla is not None:  # DeepSeek V2/V3, Kimi: K/V come from a latent the paged cache does not hold
            raise NotImplementedError(f"{who}: {type(mla).__name__} is multi-head latent attention (MLA, "
                                      "kv_lora_rank); only standard multi-head / grouped-query attention is supported")
        raise ValueError(f"{who}: no attention modules (with layer_idx, scaling, head_dim or head_size) in "
                         f"{type(decoder).__name__}")
    return found


# Attention modules that call the attention function in a way one paged layer cannot serve,
# by class name, with why.
_UNSUPPORTED_ATTENTION = {
    "DiffLlamaAttention": "differential attention: two attention calls per layer, over the two halves of V, each "
                          "of which would write the layer's one paged cache (the second overwrites the first's V)",
    "DogeAttention": "dynamic mask attention: an additive mask computed from the values in the module, which the "
                     "paged kernels (causal, sliding window) do not take",
}


def _check_supported_attention(module, who: str) -> None:
    """Refuse, before any cache is built, an attention module one paged layer cannot serve:
    those of ``_UNSUPPORTED_ATTENTION``, and value heads of another size than query/key heads
    (the cache holds one head size for K and V)."""
    cls = type(module).__name__
    where = f"{who}: {cls} (layer {module.layer_idx})"
    if cls in _UNSUPPORTED_ATTENTION:
        raise NotImplementedError(f"{where} is {_UNSUPPORTED_ATTENTION[cls]}; not supported")
    head, value_head = _head_dim(module), getattr(module, "v_head_dim", None)
    if value_head is not None and value_head != head:
        raise NotImplementedError(f"{where} has value heads of {value_head} and query/key heads of {head}; "
                                  "only equal head sizes are supported (one head_size for the K and V cache)")


def _step_modules(model: torch.nn.Module, decoder: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The modules whose forward plans a step (the outermost one called does): the decoder,
    and the base model when it wraps the decoder. A multimodal wrapper's base model
    (Gemma3ForConditionalGeneration's) gets generate's 2-D padding mask and hands the decoder a
    dict of per-layer-type masks; OPT's head calls its decoder past the base model."""
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not decoder and any(m is decoder for m in base.modules()):
        return base, decoder
    return (decoder,)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack: ``get_decoder()``, unless that is a leaf module (ModernBERT-decoder
    names its output projection ``decoder``, which ``get_decoder()`` returns): then the base model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if next(decoder.children(), None) is None and hasattr(model, "base_model"):
        return model.base_model
    return decoder


def _attention_class_table(model: torch.nn.Module) -> tuple[str, list[str]] | None:
    """The per-model table of attention classes in ``model``'s modeling module (Falcon's
    ``FALCON_ATTENTION_CLASSES``, GPT-J's, GPT-Neo's) and its keys: such a model picks its
    attention module by implementation name and computes attention inside it."""
    for name, value in vars(sys.modules.get(type(model).__module__, object)).items():
        if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict):
            return name, list(value)
    return None


def check_model(model: torch.nn.Module, who: str) -> None:
    """Refuse a model whose attention does not dispatch to ``attention_forward``: first one
    whose architecture never does (whatever it was loaded with), then one loaded with
    another implementation."""
    if hasattr(model, "is_backend_compatible") and not model.is_backend_compatible():
        table = _attention_class_table(model)
        how = (f"; it builds its attention modules from transformers' {table[0]} (keys {', '.join(table[1])}), so "
               f'loading it with attn_implementation="{ATTN_IMPLEMENTATION}" raises KeyError in transformers'
               if table else "")
        raise ValueError(f"{who}: transformers marks {type(model).__name__} as not supporting attention backends "
                         f"(_supports_attention_backend is False: its attention is not promised to reach a backend "
                         f"registered in the AttentionInterface with what it needs){how}; supported: models "
                         "transformers marks as supporting them, whose attention modules call ALL_ATTENTION_FUNCTIONS "
                         "(README, 'With transformers')")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"{who}: the model uses attn_implementation={impl!r}; load it with "
                         f'attn_implementation="{ATTN_IMPLEMENTATION}"')


def check_every_layer_attends(model: torch.nn.Module, who: str) -> None:
    """Refuse a model with decoder layers that have no attention module (RecurrentGemma's
    recurrent blocks and other hybrids without ``config.layer_types``): a runner's step mixes
    sequences in one row, so state such a layer keeps between steps (or none, under
    ``use_cache=False``) is not per sequence. ``PagedCache`` (one batch, the model's own
    forward) does not need this."""
    found = _attention_modules(_decoder(model), who)
    total = getattr(model.config, "num_hidden_layers", None)
    missing = [i for i in range(total or 0) if i not in found]
    if missing:
        raise NotImplementedError(
            f"{who}: decoder layers {missing} of {type(model).__name__} have no attention module (recurrent, "
            "convolution or linear-attention layers); the runners serve models whose every layer is attention"
        )


def model_placement(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) of ``module``'s first parameter: what its paged caches are made for."""
    first = next(module.parameters())
    return first.dtype, first.device


def check_placement(who: str, module: torch.nn.Module, built_for: tuple, caches: str, remedy: str) -> None:
    """Refuse a model moved (``model.to(...)``) since its ``caches`` were made for ``built_for``:
    its steps would run on caches of the old dtype / device."""
    now = model_placement(module)
    if now != built_for:
        raise ValueError(f"{who}: the model is now {now[0]} on {now[1]} but {caches} for "
                         f"{built_for[0]} on {built_for[1]}; {remedy}")


def paged_layers(model: torch.nn.Module, num_blocks: int, *, block_size: int = 16,
                 cache_layout: str = "LHBNC", kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                 v_scale: float = 1.0, poison: bool = False, max_seq_len: int | None = -1,
                 who: str) -> dict[str, Attention]:
    """One ``Attention`` (impl + KV cache of ``num_blocks`` blocks) per attention module of
    ``model``, built from what the module computes (``LayerSpec``), keyed by the name the ops
    carry (``layer_name``). Not registered globally: the owner hands them to the forward
    context as its layer table. ``poison``: caches filled with NaN (tests). ``max_seq_len``:
    the longest sequence the owner allows (-1: what the caches hold; None: the owner checks
    every step against ``chunk_limit``). ``k_scale`` / ``v_scale``: every layer's per-tensor
    fp8 cache scales (stored = value / scale); only with an fp8 ``kv_cache_dtype``, which
    alone uses them. ``who``: the entry point its refusals name."""
    check_bool(who, "poison", poison)
    # the cache geometry, refused here by name rather than by each layer built below
    check_block_size(block_size, who)
    as_cache_layout(cache_layout, who)
    check_kv_cache_dtype(kv_cache_dtype, who)
    check_cache_scales(who, kv_cache_dtype, k_scale, v_scale)
    param = next(model.parameters())
    dtype, device = getattr(model, "dtype", param.dtype), getattr(model, "device", param.device)
    layers: dict[str, Attention] = {}
    modules = _attention_modules(_decoder(model), who)
    for idx, module in sorted(modules.items()):
        spec = LayerSpec.of(module)
        layer = Attention(
            spec.num_heads, spec.head_size, layer_name=layer_name(module), num_kv_heads=spec.num_kv_heads,
            scale=spec.scale, block_size=block_size, cache_layout=cache_layout,
            kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, sliding_window=spec.sliding_window,
            logits_soft_cap=spec.softcap, sinks=spec.sinks, causal=spec.causal, register=False,
        ).to(device)
        if idx == min(modules):
            _check_layer_types(model, modules, num_blocks * layer.block_size if max_seq_len == -1 else max_seq_len)
        cache = allocate_kv_cache(layer.kv_cache_spec(dtype, device), num_blocks, device)
        if poison:
            cache.view(torch.uint8).fill_(0xFF)
        layer.kv_cache = cache
        layers[layer.layer_name] = layer
    return layers


# --- the attention function -------------------------------------------------------------------


def _check_call(module, attention_mask, scaling, dropout, sliding_window, softcap, s_aux, is_causal,
                kwargs) -> None:
    """Per-call arguments must match what the layer was built with (``LayerSpec.of(module)``);
    ``scaling``/``is_causal`` None means not passed, for the window (except ``_WINDOW_FROM_MASK``)
    and the soft cap None is "off"."""
    checks = (
        ("sliding_window", sliding_window, _module_window(module), type(module).__name__ not in _WINDOW_FROM_MASK),
        ("softcap", softcap, _module_softcap(module), True),
        ("scaling", scaling, _call_scaling(module), False),
        ("is_causal", is_causal, getattr(module, "is_causal", True), False),
    )
    bad = [(n, got, built) for n, got, built, none_is_value in checks
           if (none_is_value or got is not None) and got != built]
    if not (dropout or attention_mask is not None or bad or s_aux is not None or kwargs.get("output_attentions")
            or any(kwargs.get(k) is not None for k in _FOREIGN_KWARGS)):
        return
    where = f"rocm_attn attention ({type(module).__name__} layer {module.layer_idx})"
    if kwargs.get("output_attentions"):  # transformers' own kernels warn and return no weights
        raise ValueError(f"{where}: output_attentions=True is not supported: the paged kernels do not form the "
                         "attention weights; load the model with attn_implementation=\"eager\" to get them")
    if dropout:
        raise ValueError(f"{where}: dropout={dropout} is not supported (inference only); call model.eval()")
    if attention_mask is not None:
        raise ValueError(
            f"{where}: got a prepared attention mask of shape {tuple(attention_mask.shape)}; custom masks "
            "are not supported (padding comes from the 2-D attention_mask through PagedCache)"
        )
    for name, got, built in bad:
        raise ValueError(f"{where}: {name}={got!r} differs from the value the layer was built with "
                         f"({built!r}, from the module and its config)")
    if s_aux is not None and s_aux is not _module_sinks(module):
        raise ValueError(f"{where}: s_aux (attention sinks) must be the module's `sinks` parameter")
    for key in _FOREIGN_KWARGS:
        if kwargs.get(key) is not None:
            raise ValueError(
                f"{where}: {key} is an argument of packed-sequence / continuous-batching attention, "
                "which rocm_attn does not take; run batches through PagedCache"
            )


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B*T, H, D]``: a view when the layout allows it (a transpose of a
    ``[B, T, H, D]`` tensor does), else a copy, counted in ``stats.qkv_copies``."""
    b, h, t, d = x.shape
    rows = x.transpose(1, 2)
    if x.stride(3) == 1 and (b == 1 or t == 1 or x.stride(0) == t * x.stride(2)):
        return rows.view(b * t, h, d)
    stats.qkv_copies += 1
    return rows.contiguous().view(b * t, h, d)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers attention function: q ``[B, Hq, T, D]``, k/v ``[B, Hkv, T, D]`` (new tokens
    only; ``PagedCache.update`` passes them through) -> (``[B, T, Hq, D]``, None)."""
    _check_call(module, attention_mask, scaling, dropout, sliding_window, softcap, s_aux, is_causal, kwargs)
    if not torch.compiler.is_compiling() and get_forward_context().layers is None:
        raise RuntimeError(_no_step_message(module))
    b, h, t, d = query.shape
    name = layer_name(module)
    q, k, v = _token_rows(query), _token_rows(key), _token_rows(value)
    out = query.new_empty(b, t, h, d)
    token = torch.ops.rocm_attn.unified_kv_cache_update(k, v, name)
    torch.ops.rocm_attn.unified_attention_with_output(q, k, v, out.view(b * t, h, d), name, token)
    return out, None


# The transformers module whose candidate generators run the assistant model's own generate().
_ASSISTANT_CALLER = "transformers.generation.candidate_generator"


def _no_step_message(module) -> str:
    """Why a rocm_attn forward has no PagedCache step, and what to do (error path only: it
    walks the caller's frames to tell an assisted-decoding assistant from other callers)."""
    where = f"rocm_attn attention ({type(module).__name__} layer {module.layer_idx}): no PagedCache step is active"
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") != _ASSISTANT_CALLER:
        frame = frame.f_back
    own_cache = ('load it with attn_implementation="eager" or "sdpa" (or call its set_attn_implementation("sdpa")): '
                 "only a model given a PagedCache runs on rocm_attn")
    if frame is not None:  # an assistant_model, or the model itself under assistant_early_exit
        return (f"{where}: this forward drafts tokens for assisted decoding, on a cache transformers builds itself "
                "(it passes the drafting model no past_key_values, so it cannot get a PagedCache); for the "
                f"assistant_model, {own_cache} (the main model keeps rocm_attn with its PagedCache); "
                "assistant_early_exit is not supported on rocm_attn")
    return (f"{where}; pass past_key_values=inductor_rocm_attn.integrations.transformers.PagedCache(model, "
            "num_blocks=...) to the model or to generate() (a transformers DynamicCache cannot be used). A model "
            "whose generate() builds its own cache and cannot be handed one (an assisted-decoding assistant): "
            f"{own_cache}")


# --- the cache --------------------------------------------------------------------------------

# Integer dtypes of each element size: cache blocks are copied as raw bits (fp8 included).
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PagedCache(Cache):
    """A transformers ``Cache`` backed by this package's paged KV cache, for one batch.

    Args:
        model: a transformers model loaded with ``attn_implementation="rocm_attn"``.
        num_blocks: cache blocks shared by all rows (each holds ``block_size`` tokens of every
            layer); one more, kept zero, backs padding rows.
        block_size, cache_layout, kv_cache_dtype: cache geometry, as for ``Attention``.
        k_scale, v_scale: per-tensor cache scales of every layer, for an fp8
            ``kv_cache_dtype`` (stored = value / scale, saturated at the fp8 maximum: a scale
            of at least max |key| / 448 for e4m3 keeps a model's keys in range).
        poison: fill the caches with NaN (tests: a read of an unwritten slot shows).

    Rows of the batch are sequences 0..B-1 from the first forward on; ``get_seq_length()`` is
    the padded length seen so far (as for transformers' own caches). ``reset()`` frees every
    row to reuse the memory for a new batch.

    generate()'s other strategies call, between forwards: ``reorder_cache`` (beam search),
    ``crop`` (assisted and prompt lookup decoding drop rejected draft tokens), and for other
    callers ``batch_select_indices`` / ``batch_repeat_interleave``. Each row owns its blocks
    (no sharing, no copy-on-write): a row taken by several new rows is copied block by block
    (every layer, raw bytes), a row taken by none is freed, a crop frees the blocks a row no
    longer needs. Arguments are checked before anything changes.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, *, block_size: int = 16,
                 cache_layout: str = "LHBNC", kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                 v_scale: float = 1.0, poison: bool = False):
        super().__init__(layers=[])
        check_model(model, "PagedCache")
        check_positive_int("PagedCache", "num_blocks", num_blocks)
        decoder = _decoder(model)
        param = next(model.parameters())
        self.block_size, self.num_blocks = block_size, num_blocks
        self._device = getattr(model, "device", param.device)
        self._null_block = num_blocks  # zero keys/values: what a one-token padding row reads
        self._layers = paged_layers(model, num_blocks + 1, block_size=block_size, cache_layout=cache_layout,
                                    kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, poison=poison,
                                    max_seq_len=None, who="PagedCache")
        self._chunk_limit = chunk_limit(model, "PagedCache")  # checked every step (chunked attention layers)
        for layer in self._layers.values():
            layer.kv_cache[self._null_block].zero_()
        self._allocator = BlockAllocator(num_blocks, block_size)
        self._decoder = weakref.ref(decoder)
        self._step_modules = [weakref.ref(m) for m in _step_modules(model, decoder)]  # their forward hooks plan steps
        self._built_for = model_placement(decoder)
        self._lengths: list[int] = []  # real (cached) tokens of each row
        # Each row's key in the allocator: rows exchange their blocks (reorder, select) by
        # exchanging keys, so a row's blocks change owner without a copy.
        self._ids: list[int] = []
        self._next_id = 0
        self._seen = 0  # padded tokens seen (attention-mask columns)
        # The last attention mask (CPU, [rows, columns]): which columns hold a row's cached
        # tokens, what crop() removes per row. Columns past its width (steps without a mask)
        # are all tokens; None: no step had a mask.
        self._columns: torch.Tensor | None = None
        self._step = None  # the active step's forward context
        self._step_from_hook = False
        self._hook_depth = 0  # hooked forwards inside the step a hook planned (a wrapper's, then its decoder's)
        self.last_metadata: AttentionMetadata | None = None
        # (row lengths, tokens seen, metadata, mask columns) before the step
        self._before_step = ([], 0, None, None)
        for ref in self._step_modules:
            _install_hooks(ref())

    # --- what transformers asks a cache ---

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._step is None:  # else the attention would say no PagedCache was passed
            raise ValueError(
                f"PagedCache: layer {layer_idx} got this cache outside one of its steps: the cache was built for "
                "another model instance (its forward plans no step of this cache); build one PagedCache per "
                "model, PagedCache(model, num_blocks=...)"
            )
        return key_states, value_states  # the attention op writes them into the paged cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._seen + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return len(self._lengths) or -1

    def reset(self) -> None:
        """Free every row (end of a batch); the next forward starts a new batch."""
        if self._step is not None:
            raise RuntimeError("PagedCache.reset: a step is active")
        for row, n in enumerate(self._lengths):
            if n:
                self._allocator.free(self._ids[row])
        self._lengths, self._ids, self._seen, self._columns = [], [], 0, None

    # --- generate's other strategies: rollback (crop) and re-batching (reorder, select, repeat) ---

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` attention-mask columns (assisted and prompt
        lookup decoding drop the rejected draft tokens this way); a positive value keeps that
        many columns (transformers' older form; no-op when the cache holds no more), 0 is a
        no-op. Each row loses the cached tokens those columns held, and the blocks it no
        longer needs go back to the allocator."""
        who = "PagedCache.crop"
        self._check_between_steps(who)
        if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.dim() == 0 \
                and not tokens_to_remove.dtype.is_floating_point and tokens_to_remove.dtype != torch.bool:
            tokens_to_remove = int(tokens_to_remove)  # assisted decoding passes a 0-d tensor
        if not is_int(tokens_to_remove):
            raise TypeError(f"{who}: tokens_to_remove must be an int (or a 0-d integer tensor), got "
                            f"{tokens_to_remove!r}")
        n = max(self._seen - tokens_to_remove, 0) if tokens_to_remove > 0 else -tokens_to_remove
        if n > self._seen:
            raise ValueError(f"{who}: cannot remove {n} tokens, the cache holds {self._seen} (attention-mask "
                             "columns seen so far)")
        if n == 0:
            return
        keep = self._seen - n
        removed = self._cached_in_columns(keep)
        for row, k in enumerate(removed):
            if k:
                self._allocator.truncate(self._ids[row], self._lengths[row] - k)  # to 0: frees the row
                self._lengths[row] -= k
        self._seen = keep
        if self._columns is not None and self._columns.shape[1] > keep:
            self._columns = self._columns[:, :keep]

    def _cached_in_columns(self, start: int) -> list[int]:
        """Per row, its cached tokens in attention-mask columns ``start`` .. ``seen``."""
        cols = self._columns
        width = 0 if cols is None else cols.shape[1]
        past_mask = max(self._seen - max(start, width), 0)  # columns no mask covered: all tokens
        if start >= width:
            return [past_mask] * len(self._lengths)
        return [k + past_mask for k in (cols[:, start:] != 0).sum(1).tolist()]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` continues row ``beam_idx[i]`` (beam search, after each step)."""
        self._gather_rows(beam_idx, "PagedCache.reorder_cache", "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order; a row may be taken more than once)."""
        self._gather_rows(indices, "PagedCache.batch_select_indices", "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row (as ``Tensor.repeat_interleave`` on the batch)."""
        who = "PagedCache.batch_repeat_interleave"
        check_positive_int(who, "repeats", repeats)
        self._gather_rows([r for r in range(len(self._lengths)) for _ in range(repeats)], who, "repeats")

    def _gather_rows(self, indices, who: str, name: str) -> None:
        """New row ``i`` holds a copy of old row ``indices[i]``. The first new row taking an
        old row gets its blocks (its allocator key); each further one gets fresh blocks with
        the K/V of every layer copied as stored (raw bytes: fp8 stays exact); old rows no new
        row takes are freed. Checked whole before anything changes."""
        self._check_between_steps(who)
        rows = self._row_indices(indices, who, name)
        if not self._lengths:
            return  # no batch yet: nothing cached to move (the next forward sets the batch)
        taken, ids, copies = set(), [], []
        for i, src in enumerate(rows):
            if src in taken:
                ids.append(None)
                copies.append(i)
            else:
                taken.add(src)
                ids.append(self._ids[src])
        blocks = self._allocator.blocks_needed
        need = sum(blocks(self._lengths[rows[i]]) for i in copies)
        dropped = [r for r in range(len(self._lengths)) if r not in taken]
        available = self._allocator.num_free_blocks + sum(blocks(self._lengths[r]) for r in dropped)
        if need > available:
            raise MemoryError(f"{who}: the {len(copies)} repeated rows need {need} blocks for their copies, "
                              f"{available} free of {self.num_blocks} (with the rows left out freed); build the "
                              "cache with more num_blocks")
        for r in dropped:  # their blocks may take the copies: nothing reads them any more
            if self._lengths[r]:
                self._allocator.free(self._ids[r])
        src_blocks, dst_blocks = [], []
        for i in copies:
            ids[i] = self._next_id
            self._next_id += 1
            length = self._lengths[rows[i]]
            if length:
                src_blocks += self._allocator.block_table(self._ids[rows[i]])
                dst_blocks += self._allocator.allocate(ids[i], length)
        self._copy_blocks(src_blocks, dst_blocks)
        self._lengths = [self._lengths[src] for src in rows]
        self._ids = ids
        if self._columns is not None:
            self._columns = self._columns[rows]

    def _row_indices(self, indices, who: str, name: str) -> list[int]:
        if isinstance(indices, torch.Tensor):
            if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex \
                    or indices.dtype == torch.bool:
                raise ValueError(f"{who}: {name} must be a 1-D integer tensor of row indices, got "
                                 f"{indices.dtype} of shape {tuple(indices.shape)}")
            rows = indices.tolist()
        elif isinstance(indices, (list, tuple)):
            rows = list(indices)
        else:
            raise TypeError(f"{who}: {name} must be a 1-D integer tensor or a list of row indices, got "
                            f"{type(indices).__name__}")
        if not rows:
            raise ValueError(f"{who}: {name} selects no row; a batch needs at least one")
        b = len(self._lengths)
        for i, r in enumerate(rows):
            if not is_int(r) or r < 0 or (b and r >= b):
                held = f"the cache holds {b} rows" if b else "no batch yet"
                raise ValueError(f"{who}: {name}[{i}] = {r!r}; row indices must be ints in [0, rows) ({held})")
        return rows

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Every layer's blocks ``src`` into blocks ``dst`` (disjoint), byte for byte."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.int64, device=self._device)
        d = torch.tensor(dst, dtype=torch.int64, device=self._device)
        for layer in self._layers.values():
            raw = layer.kv_cache.view(_RAW_DTYPES[layer.kv_cache.dtype.itemsize])  # a view: writes through
            raw[d] = raw[s]

    def _check_between_steps(self, who: str) -> None:
        if self._step is not None:
            raise RuntimeError(f"{who}: a step is active (inside the model's forward); call it between forwards")

    def __repr__(self) -> str:
        return (f"PagedCache(layers={len(self._layers)}, rows={len(self._lengths)}, seen={self._seen}, "
                f"blocks={self.num_blocks}x{self.block_size}, free={self._allocator.num_free_blocks})")

    # --- our side ---

    @property
    def layers_by_name(self) -> dict[str, Attention]:
        """The layer table the forward context hands the ops (name -> ``Attention``)."""
        return self._layers

    def row_lengths(self) -> list[int]:
        return list(self._lengths)

    def begin_step(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Plan one forward of ``[B, T]`` new tokens and enter its forward context.

        ``attention_mask`` ``[B, seen + T]`` (1: token, 0: padding; None: no padding): each
        row's new tokens must be one run (left or right padding). ``position_ids`` ``[B, T]``
        or ``[1, T]``, if given, must equal each real token's position (its row's cached
        length + its index in the run). Returns the ``[B, T]`` position ids to use when
        ``position_ids`` is None (padding gets 0), else None. The forward hook calls this.
        """
        if self._step is not None:
            raise RuntimeError("PagedCache: a step is already active (end_step() first)")
        decoder = self._decoder()
        if decoder is not None:
            check_placement("PagedCache", decoder, self._built_for, "the cache was built",
                            "build a new PagedCache for the moved model")
        x = input_ids if input_ids is not None else inputs_embeds
        if x is None:
            raise ValueError("PagedCache.begin_step: needs input_ids or inputs_embeds")
        name, rank = ("input_ids", 2) if input_ids is not None else ("inputs_embeds", 3)
        if not isinstance(x, torch.Tensor) or x.dim() != rank:  # else planned on the wrong dims, failing later
            raise ValueError(f"PagedCache.begin_step: {name} must be a {rank}-D tensor, [batch, new tokens"
                             f"{', hidden' if rank == 3 else ''}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"PagedCache.begin_step: attention_mask must be a 2-D tensor [batch, seen + new] "
                             f"(1: token, 0: padding), got {type(attention_mask).__name__}")
        b, t = x.shape[0], x.shape[1]
        if b == 0 or t == 0:  # nothing to plan (the planning would fail on empty reductions)
            raise ValueError(f"PagedCache.begin_step: a step needs at least one row and one new token, got "
                             f"{'input_ids' if input_ids is not None else 'inputs_embeds'} of shape {tuple(x.shape)}")
        if input_ids is not None:  # the embedding's own error names neither (a GPU: a device-side assert)
            check_token_ids("PagedCache", input_ids, vocab_size_of(decoder))
        if self._lengths and len(self._lengths) != b:
            raise ValueError(f"PagedCache: batch of {b} rows for a cache holding {len(self._lengths)} rows; "
                             "use a new PagedCache (or reset()) for a new batch")
        self._before_step = (list(self._lengths), self._seen, self.last_metadata, self._columns)
        if not self._lengths:
            self._lengths = [0] * b
            self._ids = list(range(self._next_id, self._next_id + b))
            self._next_id += b
        try:
            real, first, count, mask = self._new_tokens(b, t, attention_mask)
            ctx = torch.tensor(self._lengths, dtype=torch.int64)
            expected = ctx[:, None] + torch.arange(t)[None, :] - first[:, None]
            inject = self._check_positions(position_ids, real, expected, b, t, attention_mask)
            md = self._plan(b, t, first.tolist(), count.tolist())
        except BaseException:
            self._undo_step()  # a rejected first step leaves the cache without a batch
            raise
        self._seen += t
        if mask is not None:
            self._columns = mask
        self.last_metadata = md
        self._step = set_forward_context(md, layers=self._layers)
        self._step.__enter__()
        return inject

    def end_step(self, *, discard: bool = False) -> None:
        """Leave the step's forward context. ``discard=True`` (its forward raised): the step's
        tokens are forgotten, each row keeps the length it had before the step, so a retry
        does not attend to slots the failed forward may not have written (the forward hook
        does this when the model's forward raises)."""
        if self._step is not None:
            step, self._step = self._step, None
            step.__exit__(None, None, None)
            if discard:
                self._undo_step()

    def _undo_step(self) -> None:
        """Back to the state ``begin_step`` found: row lengths, their blocks, tokens seen."""
        lengths, seen, metadata, columns = self._before_step
        for row, n in enumerate(self._lengths):
            before = lengths[row] if row < len(lengths) else 0
            if n != before:
                self._allocator.truncate(self._ids[row], before)
        if not lengths:
            self._ids = []
        self._lengths, self._seen, self.last_metadata, self._columns = lengths, seen, metadata, columns

    def _new_tokens(self, b: int, t: int, attention_mask):
        """(real [B, T] bool host mask or None, first real index [B], real count [B], the whole
        host mask or None)."""
        if attention_mask is None:
            return None, torch.zeros(b, dtype=torch.int64), torch.full((b,), t, dtype=torch.int64), None
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, self._seen + t):
            raise ValueError(
                f"PagedCache: attention_mask must be 2-D [batch, seen + new] = [{b}, {self._seen + t}], got "
                f"{tuple(attention_mask.shape)} (prepared 4-D masks are not supported; a PagedCache holds one "
                "batch: reset() it or build a new one for the next)"
            )
        mask = attention_mask.to("cpu")
        new = mask[:, self._seen:]
        if not bool(((new == 0) | (new == 1)).all()):
            values = sorted(set(new.flatten().tolist()) - {0, 1})
            raise ValueError(f"PagedCache: attention_mask must hold 1 (a token) and 0 (padding), got "
                             f"{values[:4]} among its new columns")
        if self._seen:  # every cached token is attended to: the earlier columns must mark exactly those
            held = (mask[:, :self._seen] != 0).sum(1).tolist()
            if held != self._lengths:
                row = next(r for r in range(b) if held[r] != self._lengths[r])
                raise ValueError(
                    f"PagedCache: attention_mask[{row}, :{self._seen}] marks {held[row]} earlier tokens but the cache "
                    f"holds {self._lengths[row]} of row {row}; its earlier columns must be the masks of the earlier "
                    "steps (cached tokens cannot be masked out)")
        real = new.to(torch.bool)
        idx = torch.arange(t)
        count = real.sum(1)
        first = torch.where(real, idx, t).amin(1)
        last = torch.where(real, idx, -1).amax(1)
        gaps = (count > 0) & (last - first + 1 != count)
        if bool(gaps.any()):
            row = int(gaps.nonzero()[0])
            raise ValueError(f"PagedCache: row {row} has padding between its new tokens "
                             f"(mask {real[row].int().tolist()}); only left or right padding is supported")
        return real, first, count, mask

    def _check_positions(self, position_ids, real, expected, b, t, attention_mask=None):
        if position_ids is None:
            pos = expected if real is None else torch.where(real, expected, 0)
            return pos.to(self._device, non_blocking=True)
        got = position_ids.to("cpu")
        got = got.reshape(1, -1) if got.dim() == 1 else got
        if got.dim() != 2 or got.shape[-1] != t or got.shape[0] not in (1, b):
            raise ValueError(f"PagedCache: position_ids must be [{b}, {t}] or [1, {t}], got {tuple(position_ids.shape)}")
        wrong = got.expand(b, t) != expected
        if real is not None:
            wrong &= real
        if bool(wrong.any()):
            row, col = (int(i) for i in wrong.nonzero()[0])
            raise ValueError(
                f"PagedCache: position_ids[{row}, {col}] = {int(got.expand(b, t)[row, col])} but that token is at "
                f"position {int(expected[row, col])} of its row ({self._lengths[row]} cached); omit position_ids "
                f"to have them derived from the cache{self._padding_hint(row, attention_mask)}"
            )
        return None

    def _padding_hint(self, row: int, attention_mask) -> str:
        """Why generate()'s positions may disagree: the row's earlier columns (error path only)."""
        if attention_mask is None or self._seen == 0:
            return ""
        seen = attention_mask[row, :self._seen].to("cpu", torch.bool)
        if not bool(seen.any()):
            return f" (row {row} has no token before this step: its prompt was all padding)"
        if not bool(seen[-1]):
            return (f" (row {row} was right-padded: generate() does not continue a right-padded row at its "
                    "own positions; left-pad the prompts, e.g. tokenizer padding_side='left')")
        return ""

    def _plan(self, b: int, t: int, first: list[int], count: list[int]) -> AttentionMetadata:
        """Kernel sequences in token order: per row, padding before / the real run / padding after."""
        longest = max(self._lengths[r] + count[r] for r in range(b))
        if self._chunk_limit is not None and longest > self._chunk_limit:
            row = next(r for r in range(b) if self._lengths[r] + count[r] == longest)
            raise NotImplementedError(
                f"PagedCache: row {row} would hold {longest} tokens, past the attention_chunk_size "
                f"{self._chunk_limit} of the model's chunked_attention layers; chunked attention is supported "
                "only within one chunk"
            )
        blocks = self._allocator.blocks_needed
        need = sum(blocks(self._lengths[r] + count[r]) - blocks(self._lengths[r]) for r in range(b))
        if need > self._allocator.num_free_blocks:
            raise MemoryError(f"PagedCache: this step needs {need} more blocks, {self._allocator.num_free_blocks} "
                              f"free of {self.num_blocks}; build the cache with more num_blocks")
        qls, ctxs, tables, pads = [], [], [], []
        null = [self._null_block]
        for r in range(b):
            n, start = count[r], (first[r] if count[r] else t)
            for ql, ctx, table, pad in ((start, 0, null, True),
                                        (n, self._lengths[r], None, False),
                                        (t - start - n, 0, null, True)):
                if ql <= 0:
                    continue
                if not pad:
                    table = self._allocator.allocate(self._ids[r], n)
                    self._lengths[r] += n
                qls.append(ql), ctxs.append(ctx), tables.append(table), pads.append(pad)
        return build_attention_metadata(qls, ctxs, tables, self.block_size, self._device, padding=pads)

    def _begin_from_forward(self, module, args, kwargs):
        """``module``: the hooked one (``_step_modules``: the decoder, or the base model wrapping it)."""
        if self._step is not None:
            if self._step_from_hook:  # the decoder inside a wrapper whose forward planned the step
                self._hook_depth += 1
            return None  # else planned by the caller (begin_step): run inside it
        if not any(module is ref() for ref in self._step_modules):
            raise ValueError("PagedCache: this cache was built for another model instance (e.g. the original of "
                             "a copy.deepcopy); build one PagedCache per model")
        impl = getattr(self._decoder().config, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise ValueError(f"PagedCache: the model now uses attn_implementation={impl!r}; PagedCache only works "
                             f'with "{ATTN_IMPLEMENTATION}"')
        if len(args) > 1:  # bind positional inputs by name, pass everything on as keywords
            names = _positional_names(type(module))
            kwargs = {**dict(zip(names, args)), **kwargs}
            args = ()
        elif args:
            kwargs = {"input_ids": args[0], **kwargs}
            args = ()
        if kwargs.get("use_cache") is False:  # it would be ignored: the attention writes the cache
            raise ValueError("PagedCache: use_cache=False with a PagedCache: the paged path writes every step's keys "
                             "into the cache (and generate(use_cache=False) feeds the whole sequence again each "
                             "step); drop use_cache=False")
        inject = self.begin_step(kwargs.get("input_ids"), inputs_embeds=kwargs.get("inputs_embeds"),
                                 attention_mask=kwargs.get("attention_mask"),
                                 position_ids=kwargs.get("position_ids"))
        self._step_from_hook = True
        self._hook_depth = 1
        if inject is not None:
            kwargs["position_ids"] = inject
        return args, kwargs

    def _end_from_forward(self, failed: bool):
        if self._step_from_hook:
            self._hook_depth -= 1
            if self._hook_depth == 0:  # the forward that planned the step returns
                self._step_from_hook = False
                self.end_step(discard=failed)


def _positional_names(cls) -> list[str]:
    params = inspect.signature(cls.forward).parameters
    return [n for n, p in params.items() if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]


def _begin_step_hook(module, args, kwargs):
    # Traceable when no PagedCache is passed (Dynamo sees a no-op, no graph break): a forward
    # whose steps are planned elsewhere, e.g. the one the piecewise runner traces.
    if len(args) <= 1 and not isinstance(kwargs.get("past_key_values"), PagedCache):
        return None
    return _begin_step(module, args, kwargs)


@torch.compiler.disable
def _begin_step(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    if cache is None and len(args) > 1:
        cache = dict(zip(_positional_names(type(module)), args)).get("past_key_values")
    if not isinstance(cache, PagedCache):
        return None
    return cache._begin_from_forward(module, args, kwargs)


def _end_step_hook(module, args, kwargs, output):
    # always_call: also runs when the forward raised, with output None
    if isinstance(kwargs.get("past_key_values"), PagedCache):
        _end_step(kwargs["past_key_values"], output is None)


@torch.compiler.disable
def _end_step(cache, failed):
    cache._end_from_forward(failed)


def _install_hooks(decoder: torch.nn.Module) -> None:
    """Plan/finish a step around every forward of ``decoder`` that gets a PagedCache. The
    hooks are plain functions of the module, so a ``copy.deepcopy`` of the model keeps them."""
    if _begin_step_hook in decoder._forward_pre_hooks.values():
        return
    decoder.register_forward_pre_hook(_begin_step_hook, with_kwargs=True)
    decoder.register_forward_hook(_end_step_hook, with_kwargs=True, always_call=True)


register()  # importing this module is how ``import inductor_rocm_attn`` registers the name
