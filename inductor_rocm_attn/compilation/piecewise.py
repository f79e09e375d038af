"""The piecewise runner: trace once, split at attention, compile the pieces (deduped), capture
graphs per size: of whole steps (pieces and attention), or of each piece with attention
eagerly between them.

Steps (the vLLM "piecewise" scheme, then whole-step graphs):

1. **Trace.** Dynamo traces ``forward(input_ids, positions)`` once (default
   ``model(input_ids, positions)``; ``fullgraph``, the token dimension marked dynamic) into
   one FX graph; our backend receives it. A model's layer regions (``layer_regions``:
   the layer's code around attention) are traced once and reused for identical layers,
   then expanded into the graph (``regions``).
2. **Split** at every attention (``split.split_at_attention``); with the plugin on, each
   piece gets stand-in attentions so the fusions fire inside it (``split.add_stand_ins``;
   the ``remove_stand_ins`` pass deletes them after the fusions).
3. **Dedup** identical layers (``dedup``) and compile each distinct piece once with
   Inductor's ``compile_fx``, the plugin's pass manager in piece mode
   (``PassManager.for_pieces()``) as its post-grad custom pass.
4. **Capture.** On a GPU the runner captures, per size in ``capture_sizes`` (token
   counts), one graph of the whole step: of decode-only steps (``decode_graphs``) and of
   steps of any mix (``mixed_graphs``), each planned in fixed shapes (``step_graphs``:
   sequences padded with empty ones, a fixed ``max_query_len``), so attention runs inside
   the graph. Optionally (``piecewise_graphs``) it also captures one graph per compiled
   piece per size, all from one memory pool, in model order (``graph_backends``); a step
   planned for those replays them with attention eagerly between them, reading the step's
   metadata through the forward context. Inputs need no copies: parameters are static,
   ``input_ids`` and the metadata live in persistent buffers (``MetadataBuffers``), and
   every other input is the output of the previous piece. A step pads its token count up
   to the next captured size (padding slots are -1: skipped by writers) and replays.
   Bigger steps run the compiled pieces without graphs.
5. **Without a GPU** the same runner runs the compiled pieces without graphs
   (``RerunGraphBackend`` emulates graphs in tests).

At run time the runner calls the split graph directly with a fixed argument list (the
persistent buffers and the parameters), bypassing Dynamo's guards: the per-step host work
is the metadata plan, one copy of ``input_ids``, and the split graph's Python.

Layer names resolve through the runner's own layer table (``runner.layer_table``), which
every step, trace and capture enters as the forward context's table: the model's layers
(its ``Attention`` modules, or the ``layers`` it was given, e.g. those a transformers
integration owns) and the slot aliases of the shared pieces, rebound in that table before a
shared piece runs or is captured. Nothing is bound in the global registry, so two runners
never see each other's bindings.

Example::

    runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8], max_num_seqs=8,
                               max_model_len=4096)   # at most what the bound caches hold
    md = runner.prepare(query_lens, context_lens, block_tables)   # plan -> buffers
    logits = runner(input_ids, md)                                # [num_tokens, vocab]
"""

from __future__ import annotations

import functools
import inspect
import operator
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from inductor_rocm_attn.backend import cache_epoch
from inductor_rocm_attn.cache_holds import check_free
from inductor_rocm_attn.config_checks import check_runner_config
from inductor_rocm_attn.forward_context import set_forward_context
from inductor_rocm_attn.layer import attention_layers
from inductor_rocm_attn.metadata import AttentionMetadata, MetadataBuffers, build_attention_metadata
from inductor_rocm_attn.validation import check_positive_int, check_token_ids, is_int, vocab_size_of

from . import precompile
from .build import compile_model
from .graph_backends import CudaGraphBackend
from .pieces import CompiledPiece, CompileStats, Mode, plugin_context
from .step_graphs import DECODE, MIXED, StepShape, dummy_step, plan_step, step_shapes

__all__ = ["compile_piecewise", "PiecewiseRunner", "CompileStats", "plugin_context"]

# compile_piecewise's max_model_len when none is given (capped at what the bound caches hold)
DEFAULT_MAX_MODEL_LEN = 4096

# === the runner ==============================================================================


class PiecewiseRunner:
    """Owns the split, compiled pieces, persistent buffers and captured graphs of one model.

    Build it with :func:`compile_piecewise`. Per step: ``md = runner.prepare(...)`` plans
    the metadata into the persistent buffers (padded to the captured size), then
    ``runner(input_ids, md)`` returns logits ``[num_actual_tokens, vocab]`` (a view into
    graph memory: valid until the next step; clone to keep).
    """

    def __init__(self, model: nn.Module, *, capture_sizes: Sequence[int], max_num_seqs: int,
                 max_num_tokens: int, max_model_len: int | None, use_cuda_graphs: bool,
                 plugin: bool | None, device: torch.device, decode_graphs: bool = False,
                 mixed_graphs: bool = False, piecewise_graphs: bool | None = None,
                 forward: Callable | None = None, layers: Mapping[str, Any] | None = None,
                 progress: Callable[[str], None] | None = None, trace_cache: Any = None):
        self.model = model
        self._compiled_training = bool(getattr(model, "training", False))
        self.vocab_size = vocab_size_of(model)  # token ids are checked against it
        self._prepared: AttentionMetadata | None = None  # the latest prepare()'s metadata
        self.forward = forward
        self.progress = progress
        self.device = device
        self.decode_graphs = decode_graphs
        self.mixed_graphs = mixed_graphs
        # Piecewise graphs: by default only where whole-step graphs leave steps uncovered.
        self.piecewise_graphs = (not mixed_graphs) if piecewise_graphs is None else piecewise_graphs
        # Steps are padded to these sizes also without graphs (so CPU runs cover padding).
        self.capture_sizes = sorted(set(int(s) for s in capture_sizes))
        self.use_cuda_graphs = use_cuda_graphs
        self.max_num_tokens = max(max_num_tokens, max(self.capture_sizes, default=1))
        layers = list(layers.values()) if layers is not None else attention_layers(model)
        if not layers:
            raise ValueError("compile_piecewise: the model has no Attention layer (and no layers were given)")
        self.block_size = layers[0].block_size
        if any(layer.block_size != self.block_size for layer in layers):
            raise ValueError("compile_piecewise: all attention layers must share one block size")
        self._layers = {layer.layer_name: layer for layer in layers}
        self.max_model_len = self._checked_max_model_len(max_model_len)
        # Block-table width: max_model_len's blocks (within the bound caches' count, checked above)
        self.buffers = MetadataBuffers(max_num_seqs, self.max_num_tokens,
                                       -(-self.max_model_len // self.block_size), device)
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.long, device=device)
        self.stats = CompileStats()
        # What layer names resolve through during this runner's steps: its layers, and the
        # slot aliases of shared pieces (bound as those run).
        self.layer_table: dict[str, Any] = dict(self._layers)
        self._plugin = plugin
        self._trace_cache = trace_cache
        self._trace_files: dict[str, str | None] = {}
        self._mode = Mode.EAGER
        self._size = 0
        self._graph_backend = None
        self.split_gm: torch.fx.GraphModule | None = None
        self.pieces: list[CompiledPiece] = []
        self.attention_pieces: list[str] = []
        self._arg_plan: list[Any] = []  # per placeholder: ("param", tensor) | ("ids",) | ("pos",) | ("sym",)
        self._args_by_size: dict[int, list[Any]] = {}
        self._slot_layers: dict[str, list] = {}
        self._captured: frozenset[int] = frozenset()  # sizes whose steps replay graphs
        self._piece_sizes: frozenset[int] = frozenset()  # sizes with piecewise graphs
        # Whole-step graphs (``step_graphs``) per padded size: of decode-only steps and of
        # mixed steps; their shapes; the metadata of the step prepared for one (its tensors
        # are the views those graphs were captured on) and that graph's shape.
        self._step_graphs: dict[int, tuple[Any, Any]] = {}
        self._mixed_graphs: dict[int, tuple[Any, Any]] = {}
        self._shapes: dict[tuple[str, int], StepShape] = {}
        self._step_md: AttentionMetadata | None = None
        self._step_shape: StepShape | None = None
        self._captured_caches: dict[str, tuple] | None = None  # _cache_states() at the capture
        self._captured_epoch = -1
        compile_model(self)
        # The pieces (and graphs) read the parameters and buffers of the compile, at their
        # addresses: a step checks the first and last of them (two pointer reads: the model
        # moved or reloaded as a whole), check_parameters() every one.
        self._tensor_refs = _tensor_refs(model, self._arg_plan)
        self._sentinels = self._tensor_refs[:1] + self._tensor_refs[1:][-1:]

    @property
    def layers(self) -> dict[str, Any]:
        """The attention layers of the model (``layer_name -> Attention``; no slot aliases)."""
        return dict(self._layers)

    @property
    def max_num_seqs(self) -> int:
        return self.buffers.max_num_seqs

    def check_parameters(self) -> None:
        """Raise if a parameter or buffer the compiled pieces take was replaced or moved since
        the compile (``model.to(...)``, ``load_state_dict(..., assign=True)``, a new
        ``Parameter``): the pieces and graphs would read the old tensors, or the new memory as
        the old dtype. Each step checks the first and last of them; ``capture()`` and
        ``generate`` all of them. Also the model's training mode, as at the compile."""
        self._check_mode()
        _check_tensors(self._tensor_refs)

    def _check_mode(self) -> None:
        # The pieces were traced in one mode: a model.train() after an eval-mode compile would
        # be served without its dropouts (and the other way round), silently.
        if getattr(self.model, "training", self._compiled_training) is not self._compiled_training:
            now = "training" if self.model.training else "eval"
            raise ValueError(f"PiecewiseRunner: the model is in {now} mode now, but it was compiled in "
                             f"{'training' if self._compiled_training else 'eval'} mode (the compiled pieces run it "
                             f"as traced); call model.{'train' if self._compiled_training else 'eval'}()")

    # --- compile --------------------------------------------------------------------------

    def _dummy_metadata(self, num_tokens: int) -> AttentionMetadata:
        """Metadata of ``num_tokens`` tokens that write nothing (slots -1): one-token
        sequences, or, past ``max_num_seqs`` of them, the tokens spread evenly over that many
        sequences (so no dummy sequence is longer than the step needs: a capture size may be
        larger than ``max_model_len``). For tracing, warm-up and capture."""
        n = min(num_tokens, self.buffers.max_num_seqs)
        per, extra = divmod(num_tokens, n)
        qlens = [per + (i < extra) for i in range(n)]
        host = dict(
            query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32),
            seq_lens=torch.tensor(qlens, dtype=torch.int32),
            block_table=torch.zeros(n, 1 + max(qlens) // self.block_size, dtype=torch.int32),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
            positions=torch.arange(num_tokens, dtype=torch.int64) % 4,
        )
        t = self.buffers.fill(**host)
        return AttentionMetadata(num_actual_tokens=num_tokens, max_query_len=max(qlens),
                                 max_seq_len=max(qlens), num_decodes=sum(q == 1 for q in qlens),
                                 num_prefills=sum(q > 1 for q in qlens), block_size=self.block_size, **t)

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    # --- per step -------------------------------------------------------------------------

    def padded_size(self, num_tokens: int) -> int:
        """The captured size a step of ``num_tokens`` runs at (itself if above all sizes)."""
        for s in self.capture_sizes:
            if s >= num_tokens:
                return s
        return num_tokens

    def prepare(self, query_lens: Sequence[int], context_lens: Sequence[int],
                block_tables: Sequence[Sequence[int]], *, whole_step: bool | str = True) -> AttentionMetadata:
        """Plan a step into the persistent buffers, padded to the captured size.

        A step of a size with a whole-step graph is planned for that graph, in its fixed
        shapes (``step_graphs``: sequences padded with empty ones, the block table at full
        width, ``max_seq_len = max_model_len``): a decode-only step (every query_len 1) for
        the decode graph (``decode_graphs=True``), any other step, or a decode step without
        a decode graph, for the mixed graph (``mixed_graphs=True``). ``whole_step``: False
        plans for the piecewise graphs instead; ``"mixed"`` takes the mixed graph also for a
        decode-only step (a check, and a benchmark of what the decode graph saves). A step that
        no whole-step graph fits (its size has none, or more sequences than the graph holds) is
        planned for the piecewise graphs, with True and with ``"mixed"`` alike: same results,
        attention eager between the pieces; ``replays_whole_step(metadata)`` tells which."""
        check_free("PiecewiseRunner.prepare", self._layers.values())
        if not hasattr(query_lens, "__len__"):  # sum() below would consume a generator
            raise TypeError(f"PiecewiseRunner.prepare: query_lens must be a sequence of ints (one per sequence), "
                            f"got {type(query_lens).__name__}")
        try:
            n = sum(query_lens)
            longest = max(map(operator.add, query_lens, context_lens), default=0)
        except TypeError:  # an entry that is not an int: the builder's error names it
            build_attention_metadata(query_lens, context_lens, block_tables, self.block_size)
            raise
        if n > self.max_num_tokens:  # else the buffers' own error, naming them rather than this call
            raise ValueError(f"PiecewiseRunner.prepare: the step has {n} tokens, more than "
                             f"max_num_tokens={self.max_num_tokens}")
        if longest > self.max_model_len:  # learned positions past it index outside the embedding
            raise ValueError(f"PiecewiseRunner.prepare: the step has a sequence of {longest} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        size = self.padded_size(n)
        shape = self._whole_step_shape(query_lens, n, size, whole_step) if whole_step is not False else None
        # The runner's state changes only once the step is planned: a rejected step leaves the
        # previous one (its metadata, and the graph it replays) as it was.
        if shape is not None:
            md = plan_step(shape, query_lens, context_lens, block_tables, buffers=self.buffers,
                           block_size=self.block_size, max_model_len=self.max_model_len, device=self.device,
                           num_blocks=self._num_cache_blocks())
        else:
            md = build_attention_metadata(query_lens, context_lens, block_tables, self.block_size, self.device,
                                          num_padded_tokens=size, buffers=self.buffers,
                                          num_blocks=self._num_cache_blocks())
        self._step_shape, self._step_md = shape, (md if shape is not None else None)
        self._prepared = md
        return md

    def _checked_max_model_len(self, max_model_len: int | None) -> int:
        """``max_model_len``, or its default (``DEFAULT_MAX_MODEL_LEN`` tokens, at most what the
        bound caches hold and the model's ``max_positions``); one given that is more than the
        caches hold is refused: no sequence could reach it, and the whole-step decode graphs would
        plan their KV splits for it; one past the model's ``max_positions`` too."""
        blocks = self._num_cache_blocks()
        capacity = None if blocks is None else blocks * self.block_size
        # A model that says how many positions it embeds (``max_positions``: a RoPE table's rows):
        # a step past them reads outside the table, and a graph replay runs no check that could see it.
        positions = getattr(self.model, "max_positions", None)
        positions = positions if is_int(positions) and positions > 0 else None
        if max_model_len is None:
            return min(x for x in (DEFAULT_MAX_MODEL_LEN, capacity, positions) if x is not None)
        if capacity is not None and max_model_len > capacity:
            raise ValueError(f"compile_piecewise: max_model_len {max_model_len} is more than the bound KV caches hold "
                             f"({blocks} blocks x block_size {self.block_size} = {capacity} tokens, the smallest "
                             f"layer cache); pass max_model_len <= {capacity} (or leave it out: "
                             f"min({DEFAULT_MAX_MODEL_LEN}, {capacity})) or bind larger caches")
        if positions is not None and max_model_len > positions:
            raise ValueError(f"compile_piecewise: max_model_len {max_model_len} is more than the {positions} positions "
                             f"{type(self.model).__name__} embeds (its max_positions: a RoPE table's rows); pass "
                             f"max_model_len <= {positions}")
        return max_model_len

    def _num_cache_blocks(self) -> int | None:
        """The fewest blocks of the bound caches: the builder rejects a block id at or past it
        (a whole-step graph replay runs no layer code that could)."""
        counts = [layer.kv_cache.shape[0] for layer in self._layers.values() if layer.kv_cache.dim() == 4]
        return min(counts) if counts else None

    def _whole_step_shape(self, query_lens: Sequence[int], n: int, size: int,
                          whole_step: bool | str) -> StepShape | None:
        if whole_step is not True and whole_step != MIXED:
            raise ValueError(f"PiecewiseRunner.prepare: whole_step={whole_step!r:.60}; expected True, "
                             f"False or {MIXED!r}")
        b = len(query_lens)
        if whole_step is True and n == b and b and max(query_lens) == 1:  # all 1: decode-only
            shape = self._shapes.get((DECODE, size))
            if shape is not None:
                return shape
        shape = self._shapes.get((MIXED, size))
        return shape if shape is not None and shape.fits(b) else None

    def _args(self, size: int) -> list:
        args = self._args_by_size.get(size)
        if args is None:
            ids, pos = self.input_ids[:size], self.buffers.positions[:size]
            args = [p[1] if p[0] == "param" else ids if p[0] == "ids" else pos if p[0] == "pos" else size
                    for p in self._arg_plan]
            self._args_by_size[size] = args
        return args

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, metadata: AttentionMetadata,
                 use_graphs: bool = True) -> torch.Tensor:
        """Logits ``[num_actual_tokens, vocab]`` of one step. ``input_ids``: ``[num_actual_tokens]``
        (or already padded) int64. ``use_graphs=False`` runs the compiled pieces without
        graphs at the same padded size (a check of the graphs: results are bitwise equal)."""
        if use_graphs is not True and use_graphs is not False:  # a truthy string ("no") replayed the graphs
            raise TypeError(f"PiecewiseRunner: use_graphs must be True or False, got {use_graphs!r}")
        if not isinstance(input_ids, torch.Tensor):  # a list failed deep inside as an AttributeError
            raise TypeError(f"PiecewiseRunner: input_ids must be a 1-D tensor of token ids, got "
                            f"{type(input_ids).__name__}")
        if metadata is not self._prepared:
            # The buffers hold the latest prepare()'s step: an older metadata would run on it.
            ours = isinstance(metadata, AttentionMetadata) and (
                metadata.slot_mapping.data_ptr() == self.buffers.slot_mapping.data_ptr())
            raise ValueError("PiecewiseRunner: the metadata is not the latest runner.prepare(...)'s; prepare "
                             "each step right before running it" if ours else
                             f"PiecewiseRunner: build the step's metadata with runner.prepare(...), got "
                             f"{type(metadata).__name__}")
        n = metadata.num_actual_tokens
        size = metadata.slot_mapping.shape[0]
        if input_ids.dim() != 1 or input_ids.shape[0] not in (n, size):
            raise ValueError(f"PiecewiseRunner: input_ids {tuple(input_ids.shape)} for a step of {n} tokens: "
                             f"expected [{n}]" + (f" (or [{size}], padded)" if size != n else ""))
        if input_ids.device.type != "cpu" and input_ids.device != self.input_ids.device:  # copied into its buffer
            where = "" if self.input_ids.device.type == "cpu" else f" or on {self.input_ids.device}, the model's device"
            raise ValueError(f"PiecewiseRunner: input_ids are on {input_ids.device}; pass them on the CPU{where}")
        check_token_ids("PiecewiseRunner", input_ids, self.vocab_size)
        self._check_mode()
        _check_tensors(self._sentinels)
        if use_graphs and self._captured_caches is not None and cache_epoch() != self._captured_epoch:
            self._check_cache_states()
        self.input_ids[: input_ids.shape[0]].copy_(input_ids, non_blocking=True)
        if use_graphs and metadata is self._step_md:  # a step planned for a whole-step graph
            shape = self._step_shape
            graph, out = (self._step_graphs if shape.kind == DECODE else self._mixed_graphs)[size]
            graph.replay()
            out = out[0] if isinstance(out, (tuple, list)) else out
            return out[:n]
        graphs = use_graphs and size in self._piece_sizes
        self._mode, self._size = (Mode.REPLAY if graphs else Mode.EAGER), size
        try:
            with set_forward_context(metadata, layers=self.layer_table):
                out = self.split_gm(*self._args(size))
        finally:
            self._mode = Mode.EAGER
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out[:n]

    # --- capture --------------------------------------------------------------------------

    @torch.no_grad()
    def capture(self, num_warmup: int = 1, compile_threads: int | None = None) -> None:
        """Capture the graphs, largest size first: with ``piecewise_graphs`` one graph per
        compiled piece per size; with ``decode_graphs`` / ``mixed_graphs`` one whole-step
        graph per size of decode-only / of any steps (``step_graphs``).

        ``compile_threads``: first compile the Triton kernels every capture launches on that
        many threads (``precompile``; default one a core, at most 16; 1: each compiles at its
        first launch, one after another). A capture that raises leaves no graphs; a runner
        built without graphs (``use_cuda_graphs`` False) refuses."""
        if not is_int(num_warmup) or num_warmup < 0:
            raise ValueError(f"PiecewiseRunner.capture: num_warmup must be an int >= 0, got {num_warmup!r}")
        if compile_threads is not None:
            check_positive_int("PiecewiseRunner.capture", "compile_threads", compile_threads)
        self.check_parameters()
        if not self.use_cuda_graphs:  # returned having captured nothing: every step ran without graphs
            raise RuntimeError(f"PiecewiseRunner.capture: this runner runs without graphs (use_cuda_graphs=False: "
                               f"the model is on {self.device} and no graph_backend was given); compile it with "
                               "the model on a GPU (or use_cuda_graphs=True there), or with graph_backend=...")
        t0 = time.perf_counter()
        if self._graph_backend is None:
            self._graph_backend = CudaGraphBackend()
        # A capture that fails part-way leaves no graphs: not some of this capture's, unchecked
        # against the caches, beside the previous one's.
        self._drop_graphs()
        # the capture's dummy steps overwrite the metadata buffers: a step prepared before it
        # would run on them (no cache write, attention over the dummy sequences)
        self._step_md = self._step_shape = self._prepared = None
        try:
            self._capture(num_warmup, compile_threads, t0)
        except BaseException:
            self._drop_graphs()
            raise

    def _drop_graphs(self) -> None:
        """Every step runs the compiled pieces without graphs until a capture completes."""
        self._step_graphs.clear()
        self._mixed_graphs.clear()
        self._shapes.clear()
        for piece in self.pieces:
            piece.graphs.clear()
        self._piece_sizes = self._captured = frozenset()
        self._captured_caches = None

    def _capture(self, num_warmup: int, compile_threads: int | None, t0: float) -> None:
        backend = self._graph_backend
        threads = precompile.default_compile_threads() if compile_threads is None else compile_threads
        if threads > 1 and isinstance(backend, CudaGraphBackend):
            self._precompile(threads)
        pieces = set()
        if self.piecewise_graphs:
            self._say(f"capturing {len(self.pieces)} piece graphs per size for sizes {self.capture_sizes}")
        for size in sorted(self.capture_sizes, reverse=True) if self.piecewise_graphs else ():
            t1 = time.perf_counter()
            md = self._dummy_metadata(size)
            args = self._args(size)
            # a context per run: a layer writes its cache once per forward context
            with backend.warmup():
                for _ in range(num_warmup):
                    self._mode = Mode.EAGER
                    with set_forward_context(md, layers=self.layer_table):
                        self.split_gm(*args)
            self._mode, self._size = Mode.CAPTURE, size
            try:
                with set_forward_context(md, layers=self.layer_table):
                    self.split_gm(*args)
            finally:
                self._mode = Mode.EAGER
            pieces.add(size)
            self._say(f"captured size {size} in {time.perf_counter() - t1:.1f} s")
        self._capture_whole_steps(num_warmup)
        backend.synchronize()
        self._piece_sizes = frozenset(pieces)
        self._captured = frozenset(pieces | {size for _, size in self._shapes})
        self._captured_caches, self._captured_epoch = self._cache_states(), cache_epoch()
        self.stats.capture_s = time.perf_counter() - t0
        self._say(f"captured {self.stats.num_captures} graphs in {self.stats.capture_s:.1f} s")

    def _cache_states(self) -> dict[str, tuple]:
        """Per layer: its V layout and its bound cache's address and geometry (another cache
        may take a freed one's address)."""
        return {name: (layer.impl.interleaved_v, _cache_geometry(layer.kv_cache))
                for name, layer in self._layers.items()}

    def _check_cache_states(self) -> None:
        """A layer's V layout or bound cache changed since the capture (another compile of the
        same layers switched the layout; bind_kv_caches or an assignment rebound the cache):
        the captured launches would keep the old layout or the old cache, silently (a new
        cache's block ids could reach past the old one)."""
        now = self._cache_states()
        changed = [name for name, state in now.items() if self._captured_caches[name] != state]
        if changed:
            name = changed[0]
            was_v, now_v = self._captured_caches[name][0], now[name][0]
            what = (f"the V cache layout of layer {name!r} changed after this runner captured its graphs "
                    f"(interleaved_v {was_v} -> {now_v}, e.g. another compile of the same layers fused it)"
                    if was_v != now_v else
                    f"layer {name!r} is bound to another KV cache than when this runner captured its graphs")
            raise RuntimeError(f"PiecewiseRunner: {what}; the graphs would keep the old one: call runner.capture() "
                               "again")
        self._captured_epoch = cache_epoch()  # other models' layers changed: nothing to do

    def _precompile(self, threads: int) -> None:
        """Run every step the captures below will run once, with Triton launches that only
        compile, on ``threads`` threads (``precompile.parallel_compiles``)."""
        why = precompile.available()
        if why is not None:
            self._say(f"Triton kernels compile at their first launch: {why}")
            return
        t0 = time.perf_counter()
        self._mode = Mode.EAGER
        # (size, metadata maker): the makers fill the shared buffers, so one step at a time
        steps = [(size, functools.partial(self._dummy_metadata, size))
                 for size in self.capture_sizes] if self.piecewise_graphs else []
        steps += [(shape.num_tokens, functools.partial(dummy_step, shape, buffers=self.buffers,
                                                        max_model_len=self.max_model_len,
                                                        block_size=self.block_size))
                  for shape in self._whole_step_shapes()]
        with self._graph_backend.warmup(), precompile.parallel_compiles(threads) as done:
            for size, metadata in steps:
                with set_forward_context(metadata(), layers=self.layer_table):
                    self.split_gm(*self._args(size))
        self.stats.precompile_s = time.perf_counter() - t0
        self.stats.precompiled_kernels = done["kernels"]
        self.stats.precompile_times = sorted(done["compiles"], key=lambda c: -c[2])
        longest = (f" (longest {self.stats.precompile_times[0][0]} {self.stats.precompile_times[0][2]:.1f} s)"
                   if self.stats.precompile_times else "")
        self._say(f"compiled {done['kernels']} Triton kernels on {threads} threads in "
                  f"{self.stats.precompile_s:.1f} s{longest}")

    def _whole_step_shapes(self) -> list[StepShape]:
        return step_shapes(self.capture_sizes, self.buffers.max_num_seqs,
                           decode=self.decode_graphs, mixed=self.mixed_graphs)

    def _capture_whole_steps(self, num_warmup: int) -> None:
        """Whole steps in one graph each: the pieces and the attention between them.
        Attention's launches depend on host values only through the metadata's shapes and
        its ``max_query_len`` / ``max_seq_len`` hints, all fixed by the step's shape
        (``step_graphs``), so one capture serves every step planned in that shape; lengths,
        block tables and slots change in the buffers."""
        shapes = self._whole_step_shapes()
        if not shapes:
            return
        backend = self._graph_backend
        self._mode = Mode.EAGER  # pieces run their compiled code inside the step's graph
        for kind in (DECODE, MIXED):
            sizes = sorted(s.num_tokens for s in shapes if s.kind == kind)
            if sizes:
                self._say(f"capturing whole {kind} steps for sizes {sizes}")
        for shape in shapes:
            md = dummy_step(shape, buffers=self.buffers, max_model_len=self.max_model_len,
                            block_size=self.block_size)
            args = self._args(shape.num_tokens)
            with backend.warmup():  # a context per run: a layer writes its cache once per forward context
                for _ in range(num_warmup):
                    with set_forward_context(md, layers=self.layer_table):
                        self.split_gm(*args)
            with set_forward_context(md, layers=self.layer_table):
                graph = backend.capture_step(self.split_gm, args)
            (self._step_graphs if shape.kind == DECODE else self._mixed_graphs)[shape.num_tokens] = graph
            self._shapes[(shape.kind, shape.num_tokens)] = shape
            self.stats.num_captures += 1

    def replays_whole_step(self, metadata: AttentionMetadata) -> bool:
        """Whether ``runner(ids, metadata)`` replays one whole-step graph (a step prepared
        for a decode or mixed whole-step graph) rather than the piecewise graphs."""
        return metadata is self._step_md and self._step_md is not None

    def whole_step_shape(self, metadata: AttentionMetadata) -> StepShape | None:
        """The shape (kind ``"decode"`` / ``"mixed"``, sizes) of the whole-step graph
        ``metadata`` was prepared for, or None."""
        return self._step_shape if self.replays_whole_step(metadata) else None

    def whole_step_graph(self, metadata: AttentionMetadata) -> Any:
        """The captured graph ``runner(ids, metadata)`` replays (``graph.replay()``: e.g. to
        time it alone), or None when ``metadata`` was not prepared for a whole-step graph."""
        shape = self.whole_step_shape(metadata)
        if shape is None:
            return None
        return (self._step_graphs if shape.kind == DECODE else self._mixed_graphs)[shape.num_tokens][0]


def _cache_geometry(kv_cache: torch.Tensor) -> tuple:
    """What a captured launch keeps of a cache: its address, dtype, shape and strides."""
    return kv_cache.data_ptr(), kv_cache.dtype, tuple(kv_cache.shape), kv_cache.stride()


def _tensor_refs(model: nn.Module, plan: list) -> list[tuple]:
    """Per parameter/buffer the split graph takes: (the dict of the module holding it, its key
    there, its qualified name, the tensor, its data pointer, dtype and device)."""
    owners: dict[int, tuple] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for held in (module._parameters, module._buffers):
            for key, t in held.items():
                if t is not None:
                    owners.setdefault(id(t), (held, key, f"{prefix}.{key}" if prefix else key))
    return [(*owners[id(p[1])], p[1], p[1].data_ptr(), p[1].dtype, p[1].device)
            for p in plan if p[0] == "param"]


def _check_tensors(refs: list[tuple]) -> None:
    for held, key, name, t, ptr, dtype, device in refs:
        if held.get(key) is not t:
            rope = (" or a buffer registered anew, as transformers' longrope / dynamic RoPE does on an eager "
                    "forward past its original length: a shorter one registers the compile's frequencies again"
                    ) if not isinstance(t, nn.Parameter) else ""
            raise ValueError(
                f"PiecewiseRunner: the model's {name} is not the tensor the runner was compiled with (replaced: "
                f"load_state_dict(..., assign=True), a new Parameter{rope}); the compiled pieces and graphs read "
                "the compile's tensors: load new weights in place (load_state_dict without assign, or .copy_()) "
                "or compile the model again")
        if t.data_ptr() != ptr:
            raise ValueError(
                f"PiecewiseRunner: the model's {name} moved to new memory since the compile (now {t.dtype} on "
                f"{t.device}, compiled for {dtype} on {device}: model.to(...), .half() or .data set); the compiled "
                "pieces and graphs read the old address as the compile's dtype: compile the model again after "
                "moving it")


def _check_traced_signature(model: torch.nn.Module, forward: Callable | None) -> None:
    """What is traced is called as ``f(input_ids, positions)``: one that cannot take two
    positional arguments (a module whose forward takes hidden states) failed deep in Dynamo."""
    fn, what = (forward, "forward=") if forward is not None else (model.forward, f"{type(model).__name__}.forward")
    if not callable(fn):
        raise TypeError(f"compile_piecewise: forward must be callable, got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise TypeError(
            f"compile_piecewise: {what} is called as (input_ids [T], positions [T]) -> logits, but its signature "
            f"{inspect.signature(fn)} does not take those two arguments ({e}); pass forward=lambda input_ids, "
            "positions: ... to call the model another way") from None
    except ValueError:  # no signature to read (a builtin): left to the trace
        pass


def compile_piecewise(
    model: nn.Module,
    capture_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    max_num_seqs: int | None = None,
    max_num_tokens: int | None = None,
    max_model_len: int | None = None,
    use_cuda_graphs: bool | None = None,
    plugin: bool | None = None,
    capture: bool = True,
    graph_backend: Any = None,
    decode_graphs: bool = True,
    mixed_graphs: bool = True,
    piecewise_graphs: bool | None = None,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    layers: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    trace_cache: bool | str | None = None,
    compile_threads: int | None = None,
) -> PiecewiseRunner:
    """Split ``model`` at its attention ops, compile the pieces with Inductor and (on a GPU)
    capture graphs per size in ``capture_sizes``: by default one graph of each whole step
    (pieces and attention) per size, so no step up to ``max(capture_sizes)`` tokens runs
    attention between graphs.

    Args:
        model: ``forward(input_ids [T] int64, positions [T] int64) -> logits [T, V]`` over
            ``Attention`` layers, KV caches already bound (``bind_kv_caches``); or any
            module with ``forward=`` and ``layers=`` below.
        capture_sizes: token counts to capture; a step is padded up to the next one.
        max_num_seqs: sequences per step (metadata buffer size; default ``max(capture_sizes)``).
        max_num_tokens: tokens per step, also for steps above the captured sizes that run
            without graphs (default ``max(capture_sizes)``).
        max_model_len: longest sequence (block-table width; whole-step decode graphs plan
            their KV splits for it); at most what the bound caches hold (blocks x block size:
            more is refused) and, for a model with ``max_positions`` (``TinyDecoder``: its RoPE
            table's rows), at most that; default: 4096, or the least of those bounds.
        use_cuda_graphs: default: when the model's parameters are on a CUDA/HIP device.
        plugin: run the plugin's passes in the piece compiles (default: on; False: off; a
            post pass the user installed runs either way).
        capture: capture now (else call ``runner.capture()`` later).
        graph_backend: what captures and replays (default ``CudaGraphBackend``);
            ``RerunGraphBackend()`` emulates graphs without a GPU (tests).
        decode_graphs: capture each size's whole decode step (pieces and attention) as one
            graph, replayed for steps whose every sequence decodes one token (sizes up to
            ``max_num_seqs``): only the decode kernel launches. H200, 28-layer model, B=64:
            4.66 ms a step, piecewise graphs 5.6 ms; B=1: 1.35 vs 4.3.
        mixed_graphs: capture each size's whole step of any mix (sizes >= 2): prefill
            chunks, verify batches (2..8 query tokens) and decodes of up to that many tokens
            and ``min(size, max_num_seqs)`` sequences, planned in fixed shapes
            (``step_graphs``) so every attention path launches with a fixed grid. H200,
            28-layer model, 8 prefills of 512 + 56 decodes: 13.3 ms a step, piecewise
            graphs 16.1 ms. False: mixed steps replay the piecewise graphs.
        piecewise_graphs: also capture one graph per compiled piece per size, replayed for
            steps prepared with ``whole_step=False`` (attention eager between them);
            default: only without ``mixed_graphs`` (else every step has a whole-step graph).
        forward: what is traced, ``(input_ids [T] int64, positions [T] int64) -> logits [T, V]``
            (default ``model(input_ids, positions)``); it may call the model any way it needs
            (``integrations.transformers_runner`` adds the batch dimension transformers wants).
            Every tensor it reads besides its two inputs must be a parameter or buffer of
            ``model``.
        layers: the attention layers the traced ops name (``layer_name -> Attention``);
            default: the model's ``Attention`` modules. Give them when the model does not
            hold them itself (a cache object owns them).
        progress: called with one line per stage (tracing, compiling piece i of n with
            timings, capturing), e.g. ``print``; default: silent.
        trace_cache: store the traced graph and, in a later process with the same model,
            code and settings, load it instead of tracing (``trace_cache``: what the key
            covers). True: in Inductor's cache directory; a path: there; None (default): the
            ``ROCM_ATTN_TRACE_CACHE`` environment variable ("1" or a path; unset: off).
        compile_threads: threads that compile, before the capture, the Triton kernels every
            captured step launches (``precompile``); default one a core, at most 16; 1: each
            kernel compiles at its first launch, one after another.
    """
    sizes = check_runner_config(
        "compile_piecewise", capture_sizes=capture_sizes, max_num_seqs=max_num_seqs,
        max_num_tokens=max_num_tokens, max_model_len=max_model_len,
        flags=dict(capture=capture, decode_graphs=decode_graphs, mixed_graphs=mixed_graphs),
        optional_flags=dict(use_cuda_graphs=use_cuda_graphs, plugin=plugin, piecewise_graphs=piecewise_graphs),
        trace_cache=trace_cache, compile_threads=compile_threads, graph_backend=graph_backend,
        progress=progress, layers=layers)
    _check_traced_signature(model, forward)
    p = next(model.parameters(), None)
    if p is None:  # a bare StopIteration
        raise ValueError(f"compile_piecewise: {type(model).__name__} has no parameters; the runner takes its device "
                         "from them (pass the module that holds the weights forward= calls)")
    device = p.device
    if use_cuda_graphs is None:
        use_cuda_graphs = device.type == "cuda"
    if graph_backend is not None:
        use_cuda_graphs = True
    elif use_cuda_graphs and device.type != "cuda":
        raise ValueError(f"compile_piecewise: CUDA/HIP graphs need the model on a GPU, it is on {device}")
    top = max(sizes)
    runner = PiecewiseRunner(
        model, capture_sizes=sizes, max_num_seqs=max_num_seqs or top,
        max_num_tokens=max_num_tokens or top, max_model_len=max_model_len,
        use_cuda_graphs=use_cuda_graphs, plugin=plugin, device=device,
        decode_graphs=decode_graphs, mixed_graphs=mixed_graphs, piecewise_graphs=piecewise_graphs,
        forward=forward, layers=layers, progress=progress, trace_cache=trace_cache,
    )
    runner._graph_backend = graph_backend
    if capture and use_cuda_graphs:
        runner.capture(compile_threads=compile_threads)
    return runner
