"""Piecewise graph capture of a transformers model on the paged backend.

>>> model = AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn")
>>> runner = compile_transformers(model, num_blocks=256, capture_sizes=[1, 2, 4, 8])
>>> md = runner.prepare(query_lens, context_lens, block_tables)   # plan -> persistent buffers
>>> logits = runner(input_ids, md)                                # [num_tokens, vocab]
>>> result = generate(runner, prompts, max_new_tokens=16)         # integrations.batching

``compile_transformers`` gives a ``PiecewiseRunner`` (``compilation.piecewise``), the same
object our own models get from ``compile_piecewise``, so the same steps, graphs and checks
apply:

- **Layers.** One ``Attention`` (impl + paged KV cache) per attention module of the model,
  built from the module as ``PagedCache`` builds them (``paged_layers``), owned by the
  runner: its layer table, which every step enters as the forward context's, resolves the
  layer names the ops carry and the slot aliases of the shared pieces.
- **Trace.** Dynamo traces ``model(input_ids=ids[None], position_ids=positions[None],
  use_cache=False).logits[0]`` once, the token dimension dynamic: all of a step's tokens
  are one row, the flattened layout the metadata describes. No cache object and no mask go
  in (``rocm_attn`` registers no mask function, so transformers builds none); the rotary
  embedding, norms, MLPs and lm head run inside the compiled pieces, attention between them.
  A RoPE whose frequencies transformers recomputes from the forward's longest position
  (``longrope``, ``dynamic`` NTK: a data-dependent branch) is traced without that update, on
  its original frequencies (``original_rope_frequencies``): ``max_model_len`` stays within
  its original length.
- **Plan.** ``runner.prepare(query_lens, context_lens, block_tables)`` writes the step's
  metadata (positions included: they feed the rotary embedding) into the runner's
  persistent buffers outside any graph; every step up to the largest captured size then
  replays one whole-step graph (attention inside): a decode-only step its size's decode
  graph, any other step (prefill chunks, verify batches, decodes mixed) its size's mixed
  graph. Above the captured sizes the compiled pieces run without graphs.

``EagerRunner`` has the same ``prepare`` / call API and runs the same forward without
compiling (the eager paged path: a reference, and the demo's ``--eager``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ..cache_holds import check_free
from ..capabilities import check_block_size
from ..compilation.step_graphs import MIXED
from ..config_checks import check_runner_config
from ..forward_context import set_forward_context
from ..metadata import AttentionMetadata, build_attention_metadata
from ..validation import check_positive_int, check_token_ids, vocab_size_of
from .batching import num_cache_blocks
from .transformers import (check_dynamic_rope, check_every_layer_attends, check_model, check_placement,
                           dynamic_rope_limit, learned_position_limit, model_placement, original_rope_frequencies,
                           paged_layers)

__all__ = ["EagerRunner", "compile_transformers", "eager_runner", "step_forward"]


def step_forward(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The forward a runner traces: ``(input_ids [T] int64, positions [T] int64) -> logits
    [T, vocab]``, all tokens of a step as one row of the transformers model."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out.logits[0]

    return forward


def _default_max_model_len(model, num_blocks: int, block_size: int,
                           progress: Callable[[str], None] | None = None) -> int:
    """The smallest of the model's ``max_position_embeddings``, what the cache holds and the
    original length of a RoPE transformers recomputes past it (``dynamic_rope_limit``; said
    through ``progress`` where that one decides)."""
    limit = min(getattr(model.config, "max_position_embeddings", None) or num_blocks * block_size,
                num_blocks * block_size)
    rope = dynamic_rope_limit(model)
    if rope is None or rope[0] >= limit:
        return limit
    if progress is not None:
        progress(f"max_model_len defaults to {rope[0]}, the original length of {rope[1]}'s {rope[2]!r} RoPE "
                 "(compiled on its original frequencies)")
    return rope[0]


def compile_transformers(
    model: torch.nn.Module,
    *,
    num_blocks: int,
    block_size: int = 16,
    capture_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    max_num_seqs: int | None = None,
    max_num_tokens: int | None = None,
    max_model_len: int | None = None,
    cache_layout: str = "LHBNC",
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    poison: bool = False,
    plugin: bool | None = None,
    use_cuda_graphs: bool | None = None,
    capture: bool = True,
    graph_backend: Any = None,
    decode_graphs: bool = True,
    mixed_graphs: bool = True,
    piecewise_graphs: bool | None = None,
    trace_cache: bool | str | None = None,
    progress: Callable[[str], None] | None = None,
    compile_threads: int | None = None,
):
    """Compile a transformers causal LM piecewise around our attention, on its own paged cache.

    Args:
        model: a transformers ``...ForCausalLM`` loaded with ``attn_implementation="rocm_attn"``,
            in eval mode, on its device and dtype.
        num_blocks, block_size, cache_layout, kv_cache_dtype: the paged KV cache (every layer
            gets ``num_blocks`` blocks of ``block_size`` tokens). ``poison``: NaN-filled (tests).
        max_model_len: longest sequence (block-table width; whole-step decode graphs are
            captured for it); default the smaller of the model's ``max_position_embeddings``
            and what the cache holds, and, for a RoPE whose frequencies transformers
            recomputes from a forward's longest position (``longrope``, ``dynamic`` NTK), at
            most its original length (``original_max_position_embeddings``; for dynamic
            NTK, ``max_position_embeddings``). Such a RoPE is compiled on its original
            frequencies, so a larger ``max_model_len`` is refused; so is one past what the
            cache holds (``num_blocks * block_size``).
        k_scale, v_scale: per-tensor cache scales of every layer, for an fp8 ``kv_cache_dtype``
            (as for ``PagedCache``); ``runner.layers``' ``_k_scale`` / ``_v_scale`` buffers hold
            them.
        capture_sizes, max_num_seqs, max_num_tokens, plugin, use_cuda_graphs, capture,
        graph_backend, decode_graphs, mixed_graphs, piecewise_graphs, trace_cache, progress,
        compile_threads: as for ``compile_piecewise``.

    Returns the ``PiecewiseRunner``; ``runner.layers`` are the attention layers (their
    ``kv_cache`` tensors are the cache).
    """
    from ..compilation.piecewise import compile_piecewise

    check_model(model, "compile_transformers")
    check_every_layer_attends(model, "compile_transformers")
    if model.training:
        raise ValueError("compile_transformers: the model is in training mode; call model.eval() first")
    check_positive_int("compile_transformers", "num_blocks", num_blocks)
    # Before paged_layers allocates every layer's cache (compile_piecewise checks them again).
    check_runner_config(
        "compile_transformers", capture_sizes=capture_sizes, max_num_seqs=max_num_seqs,
        max_num_tokens=max_num_tokens, max_model_len=max_model_len,
        flags=dict(capture=capture, decode_graphs=decode_graphs, mixed_graphs=mixed_graphs, poison=poison),
        optional_flags=dict(use_cuda_graphs=use_cuda_graphs, plugin=plugin, piecewise_graphs=piecewise_graphs),
        trace_cache=trace_cache, compile_threads=compile_threads, graph_backend=graph_backend,
        progress=progress)
    check_block_size(block_size, "compile_transformers")
    if max_model_len is None:
        max_model_len = _default_max_model_len(model, num_blocks, block_size, progress)
    # Before anything is allocated: the trace runs such a RoPE on its original frequencies.
    check_dynamic_rope(model, "compile_transformers", max_model_len, traced=True)
    positions = learned_position_limit(model)
    if positions is not None and max_model_len > positions:  # the embedding's index would run past it
        raise ValueError(f"compile_transformers: max_model_len {max_model_len} is above the {positions} positions of "
                         f"{type(model).__name__}'s learned position embedding (max_position_embeddings)")
    if max_model_len > num_blocks * block_size:  # the buffers are sized for it: no sequence can outgrow the cache
        raise ValueError(f"compile_transformers: max_model_len {max_model_len} is more than the paged KV cache holds "
                         f"(num_blocks {num_blocks} x block_size {block_size} = {num_blocks * block_size} tokens); "
                         "pass max_model_len <= that (the default) or more num_blocks")
    layers = paged_layers(model, num_blocks, block_size=block_size, cache_layout=cache_layout,
                          kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, poison=poison,
                          max_seq_len=max_model_len, who="compile_transformers")
    with original_rope_frequencies(model):
        return compile_piecewise(
            model, capture_sizes, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
            max_model_len=max_model_len,
            use_cuda_graphs=use_cuda_graphs, plugin=plugin, capture=capture, graph_backend=graph_backend,
            decode_graphs=decode_graphs, mixed_graphs=mixed_graphs, piecewise_graphs=piecewise_graphs,
            forward=step_forward(model), layers=layers, progress=progress, trace_cache=trace_cache,
            compile_threads=compile_threads,
        )


def _check_step_limits(who: str, max_num_seqs, max_num_tokens) -> None:
    # generate() plans steps within them: 0 admitted no sequence and ran empty steps
    check_positive_int(who, "max_num_seqs", max_num_seqs)
    check_positive_int(who, "max_num_tokens", max_num_tokens)


class EagerRunner:
    """The paged path without compiling: ``prepare`` / ``runner(input_ids, md)`` as for a
    ``PiecewiseRunner``, the same forward run eagerly under the runner's layer table."""

    def __init__(self, model: torch.nn.Module, layers: dict, *, max_num_seqs: int, max_num_tokens: int):
        _check_step_limits("EagerRunner", max_num_seqs, max_num_tokens)
        self.model, self.layers = model, layers
        self.forward = step_forward(model)
        self.vocab_size = vocab_size_of(model)
        self.block_size = next(iter(layers.values())).block_size
        self._built_for = model_placement(model)
        self.device = self._built_for[1]
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        # generate() refuses longer sequences: positions a learned position embedding lacks
        self.max_model_len = learned_position_limit(model)
        self.step_s = 0.0  # wall time of the last step
        self._prepared: AttentionMetadata | None = None  # the latest prepare()'s metadata

    def prepare(self, query_lens: Sequence[int], context_lens: Sequence[int],
                block_tables: Sequence[Sequence[int]], *, whole_step: bool | str = True) -> AttentionMetadata:
        """The step's metadata (``whole_step``: taken for a ``PiecewiseRunner``'s API; no graphs
        here), within the runner's step limits, its block ids inside the caches, and, for a
        model with learned positions, within its ``max_model_len`` (an index past the embedding
        is a device-side assert on a GPU)."""
        check_free("EagerRunner.prepare", self.layers.values())
        if whole_step is not True and whole_step is not False and whole_step != MIXED:  # as PiecewiseRunner's
            raise ValueError(f"EagerRunner.prepare: whole_step={whole_step!r:.60}; expected True, False or {MIXED!r}")
        md = build_attention_metadata(query_lens, context_lens, block_tables, self.block_size, self.device,
                                      num_blocks=num_cache_blocks(self))
        for got, what, limit_name in ((len(query_lens), "sequences", "max_num_seqs"),
                                      (md.num_actual_tokens, "tokens", "max_num_tokens"),
                                      (md.max_seq_len, "tokens in its longest sequence", "max_model_len")):
            limit = getattr(self, limit_name)
            if limit is not None and got > limit:
                raise ValueError(f"EagerRunner.prepare: the step has {got} {what}, more than {limit_name}={limit}")
        self._prepared = md
        return md

    def replays_whole_step(self, metadata: AttentionMetadata) -> bool:
        return False

    def check_parameters(self) -> None:
        """The model is in eval mode (a ``model.train()`` after ``eager_runner`` ran its
        dropouts: other logits on every run) and its dtype and device are still the ones its
        caches were made for (a ``model.to(...)`` would run on caches of the old ones)."""
        if self.model.training:
            raise ValueError("EagerRunner: the model is in training mode (its dropouts would run); call model.eval()")
        check_placement("EagerRunner", self.model, self._built_for, "its caches were made",
                        "build a new runner for the moved model")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        t0 = time.perf_counter()
        if not isinstance(metadata, AttentionMetadata):  # None failed as an AttributeError on .positions
            raise TypeError(f"EagerRunner: metadata must be runner.prepare(...)'s AttentionMetadata, got "
                            f"{type(metadata).__name__}")
        check_free("EagerRunner", self.layers.values())  # metadata built before a generate began
        if metadata is not self._prepared:
            # as PiecewiseRunner: an older step's (or a hand-built) metadata would write its
            # slots again, over the keys and values cached there since
            raise ValueError("EagerRunner: the metadata is not the latest runner.prepare(...)'s; prepare each step "
                             "right before running it")
        n = metadata.positions.shape[0]
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"EagerRunner: input_ids must be a 1-D tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dim() != 1 or input_ids.shape[0] != n:  # the model's own error names neither
            raise ValueError(f"EagerRunner: input_ids {tuple(input_ids.shape)} for a step of {n} tokens: "
                             f"expected [{n}]")
        check_token_ids("EagerRunner", input_ids, self.vocab_size)
        self.check_parameters()
        with set_forward_context(metadata, layers=self.layers):
            out = self.forward(input_ids.to(self.device), metadata.positions)
        self.step_s = time.perf_counter() - t0
        return out


def eager_runner(model: torch.nn.Module, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_tokens: int = 2048, cache_layout: str = "LHBNC", kv_cache_dtype: str = "auto",
                 k_scale: float = 1.0, v_scale: float = 1.0, poison: bool = False) -> EagerRunner:
    """An ``EagerRunner`` of ``model`` on its own paged cache (arguments as for
    ``compile_transformers``; ``max_num_seqs`` / ``max_num_tokens`` bound a step)."""
    check_model(model, "eager_runner")
    check_every_layer_attends(model, "eager_runner")
    if model.training:  # its dropouts would run: other logits on every run
        raise ValueError("eager_runner: the model is in training mode; call model.eval() first")
    check_positive_int("eager_runner", "num_blocks", num_blocks)
    _check_step_limits("eager_runner", max_num_seqs, max_num_tokens)  # before the caches are allocated
    check_dynamic_rope(model, "eager_runner", num_blocks * block_size)  # the longest sequence the cache holds
    layers = paged_layers(model, num_blocks, block_size=block_size, cache_layout=cache_layout,
                          kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, poison=poison,
                          who="eager_runner")
    return EagerRunner(model, layers, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens)
