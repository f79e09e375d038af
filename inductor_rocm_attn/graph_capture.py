"""Piecewise compilation and HIP/CUDA-graph capture around the attention op.

Decode steps are launch-bound, so they are replayed from graphs; attention metadata changes
every step, so the model graph is split at the layer-level attention op and only the pieces
between attention calls are captured (the vLLM "piecewise" scheme):

1. **Trace.** Dynamo traces ``model(input_ids, positions)`` once (``fullgraph``, the token
   dimension marked dynamic) into one FX graph; our backend receives it.
2. **Split.** ``torch.fx.passes.split_module`` cuts the graph at every
   ``rocm_attn.unified_attention_with_output``: ``L`` attention layers give ``L + 1``
   compiled pieces and ``L`` attention pieces. The cache update
   (``unified_kv_cache_update``) stays inside the piece before its attention, so the
   plugin's RoPE / QK-norm + cache-write fusions can fire inside the pieces.
3. **Dedup.** A piece's layer names are replaced by slot aliases (``__rocm_attn_slot0__``)
   that resolve to the piece's own layer at run time, so the pieces of layers 1..L-1 are
   the same graph over the same input metadata: they are compiled once (Inductor's
   ``compile_fx``, with the plugin's post-grad pass when it is importable) and share the
   artifact. Compile time does not grow with depth.
4. **Capture.** On a GPU the runner captures one ``torch.cuda.CUDAGraph`` per compiled piece
   per size in ``capture_sizes`` (token counts), all from one memory pool, in model order.
   Inputs need no copies: parameters are static, ``input_ids`` and the metadata live in
   persistent buffers (``MetadataBuffers``), and every other input is the output of the
   previous piece's graph. A step pads its token count up to the next captured size
   (padding slots are -1: skipped by writers) and replays; attention runs eagerly between
   the graphs, reading the step's metadata through the forward context. Bigger steps run
   the compiled pieces without graphs.
5. **Without a GPU** the same runner runs the compiled pieces without graphs.

At run time the runner calls the split graph directly with a fixed argument list (the
persistent buffers and the parameters), bypassing Dynamo's guards: the per-step host work
is the metadata plan, one copy of ``input_ids``, and the split graph's Python.

Example::

    runner = compile_piecewise(model, capture_sizes=[1, 2, 4, 8], max_num_seqs=8,
                               max_model_len=4096)
    md = runner.prepare(query_lens, context_lens, block_tables)   # plan -> buffers
    logits = runner(input_ids, md)                                # [num_tokens, vocab]
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import itertools
import logging
import operator
import time
import types
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import forward_context
from .forward_context import set_forward_context
from .layer import attention_layers
from .metadata import AttentionMetadata, MetadataBuffers, build_attention_metadata

__all__ = ["compile_piecewise", "PiecewiseRunner", "CompileStats", "SPLITTING_OPS",
           "split_at_attention", "plugin_context", "CudaGraphBackend", "RerunGraphBackend"]

log = logging.getLogger(__name__)

#: The op the graph is split at (attention runs eagerly between compiled pieces).
SPLITTING_OPS = ("rocm_attn.unified_attention_with_output",)

_SLOT_PREFIX = "__rocm_attn_slot"
_RUNNER_IDS = itertools.count()


def _slot_alias(j: int) -> str:
    return f"{_SLOT_PREFIX}{j}__"


def _bind_alias(alias: str, layer) -> None:
    # A slot alias is one more name for the piece's own layer, rebound before the piece
    # runs or is captured.
    forward_context.bind_layer_alias(alias, layer)


def _op_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"{t._qualified_op_name.replace('::', '.')}"
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}"
    return None


def _is_split_node(node: torch.fx.Node) -> bool:
    return _op_name(node) in SPLITTING_OPS


# === plugin ==================================================================================


def plugin_context(enabled: bool | None):
    """Context that turns the plugin's passes on for compiles inside it.

    ``enabled=None``: on when ``inductor_rocm_attn.compile_plugin`` is importable. Returns
    ``(context manager, plugin_active: bool)``.
    """
    if enabled is False:
        return contextlib.nullcontext(), False
    try:  # issue #4: the pass manager as post_grad_custom_post_pass (the package re-exports
        # a function named ``plugin``, so import the module by its full name)
        _plugin = importlib.import_module("inductor_rocm_attn.compile_plugin")
    except ImportError:
        if enabled:
            raise RuntimeError("compile_piecewise(plugin=True): inductor_rocm_attn.compile_plugin is not importable")
        return contextlib.nullcontext(), False
    return _plugin.plugin(), True


# === stand-in attention: the plugin's passes see whole layer sites inside a piece ==========
#
# The fusion passes match a layer site: the cache update, its token consumed by exactly one
# attention, and the query/key/value that attention reads. Split at the attention, a piece
# holds the cache update but not the attention. So, with the plugin on, each piece gets a
# stand-in: a call of the real attention op on exactly the values the (eager) attention
# reads from the piece, consuming the token, while the piece returns a placeholder in the
# token's slot. After the plugin's passes ran (inside the same post-grad custom pass), the
# stand-in is deleted and the placeholder replaced by the (possibly fused) token, so the
# compiled piece writes the cache, returns the token, and attends to nothing.

_capture_lib = torch.library.Library("rocm_attn_capture", "DEF")
_capture_lib.define("token_placeholder(Tensor like, str layer_name) -> Tensor")


def _token_placeholder(like, layer_name):
    return like.new_empty(0)


_capture_lib.impl("token_placeholder", _token_placeholder, "CompositeExplicitAutograd")
torch.library.register_fake("rocm_attn_capture::token_placeholder", _token_placeholder, lib=_capture_lib)

_ATTN_ARGS = ("query", "key", "value", "output", "layer_name", "kv_cache_dependency", "output_scale")


def _attn_call_args(node: torch.fx.Node) -> dict[str, Any]:
    args = dict(zip(_ATTN_ARGS, node.args))
    args.update(node.kwargs)
    return args


def _add_stand_ins(split: torch.fx.GraphModule, compiled_names: list[str]) -> int:
    """Give each piece that produces an attention's inputs a stand-in of that attention."""
    pieces = set(compiled_names)
    calls = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
    added = 0
    for attn_call in calls.values():
        sub = split._modules[attn_call.target]
        attn = next((n for n in sub.graph.nodes if _is_split_node(n)), None)
        if attn is None:
            continue
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        outer = dict(zip(phs, attn_call.args))  # attention piece placeholder -> split-graph value

        def source(a):  # the (piece, output index) a split-graph value comes from
            v = outer.get(a) if isinstance(a, torch.fx.Node) else None
            if (isinstance(v, torch.fx.Node) and v.target is operator.getitem
                    and v.args[0].op == "call_module" and v.args[0].target in pieces):
                return v.args[0].target, v.args[1]
            return None

        a = _attn_call_args(attn)
        srcs = {k: source(a.get(k)) for k in ("query", "key", "value", "output", "kv_cache_dependency")}
        if any(v is None for v in srcs.values()) or a.get("output_scale") is not None:
            continue
        names = {v[0] for v in srcs.values()}
        if len(names) != 1:
            continue
        piece = split._modules[names.pop()]
        out_node = next(n for n in piece.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        if not isinstance(outs, (tuple, list)):
            continue
        val = {k: outs[i] for k, (_, i) in srcs.items()}
        token = val["kv_cache_dependency"]
        if not isinstance(token, torch.fx.Node) or len(token.users) != 1:
            continue
        with piece.graph.inserting_before(out_node):
            # It "writes" the real output buffer, which the piece returns: so functionalization
            # keeps it (a stand-in writing a dead scratch buffer is dropped with the cache update).
            piece.graph.call_function(torch.ops.rocm_attn.unified_attention_with_output.default, (
                val["query"], val["key"], val["value"], val["output"], a["layer_name"], token))
            ph = piece.graph.call_function(torch.ops.rocm_attn_capture.token_placeholder.default,
                                           (val["key"], a["layer_name"]))
        tok_idx = srcs["kv_cache_dependency"][1]
        out_node.args = (tuple(ph if i == tok_idx else o for i, o in enumerate(outs)),)
        piece.recompile()
        added += 1
    return added


def _remove_stand_ins(graph: torch.fx.Graph) -> int:
    """Post-grad: drop each stand-in attention, put its token where the placeholder was."""
    hops = [getattr(torch.ops.higher_order, n, None) for n in ("auto_functionalized_v2", "auto_functionalized")]
    attn_op = torch.ops.rocm_attn.unified_attention_with_output.default
    tokens = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in hops or node.args[0] is not attn_op:
            continue
        kw = node.kwargs
        name = kw["layer_name"]
        if not name.startswith(_SLOT_PREFIX):
            continue  # a real attention (not ours): leave it
        tokens[name] = kw["kv_cache_dependency"]
        if "_all_bases" in kw:  # v2: getitem(af, 1 + i) is the updated base i
            bases = kw["_all_bases"]
            for u in list(node.users):
                u.replace_all_uses_with(bases[u.args[1] - 1])
                graph.erase_node(u)
        else:  # v1: getitem(af, 1) is the updated ``output``
            for u in list(node.users):
                u.replace_all_uses_with(kw["output"])
                graph.erase_node(u)
        graph.erase_node(node)
        removed += 1
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.rocm_attn_capture.token_placeholder.default:
            node.replace_all_uses_with(tokens[node.args[1]])
            graph.erase_node(node)
    return removed


class _PiecePostPass(CustomGraphPass):
    """Inductor's post-grad custom pass for pieces: the installed pass (the plugin's pass
    manager), then stand-in removal."""

    def __init__(self, inner):
        self.inner = inner

    #: passes that would rewrite the stand-in attention itself (attention + output quant):
    #: the real attention runs outside the piece, so they must not fire here.
    _OFF_IN_PIECES = ("attn_quant_fusion",)

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            flags = getattr(self.inner, "flags", None)
            saved = {}
            if isinstance(flags, dict):
                saved = {k: flags[k] for k in self._OFF_IN_PIECES if k in flags}
                flags.update({k: False for k in saved})
            try:
                self.inner(graph)
            finally:
                if saved:
                    flags.update(saved)
        _remove_stand_ins(graph)

    def uuid(self):
        inner = None
        if self.inner is not None:
            inner = getattr(self.inner, "uuid", lambda: None)()
            if inner is None:
                return None
        src = inspect.getsource(_remove_stand_ins) + inspect.getsource(_PiecePostPass)
        return hashlib.sha256(f"{inner}|{src}".encode()).hexdigest()


# === split ==================================================================================


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """Split ``gm`` at every attention op. Returns (split module, compiled piece names,
    attention piece names), each list in execution order."""
    part = 0
    ids: dict[torch.fx.Node, int] = {}
    attn_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_split_node(node):
            part += 1
            ids[node] = part
            attn_parts.add(part)
            part += 1
        else:
            ids[node] = part
    split = torch.fx.passes.split_module.split_module(
        gm, None, lambda n: ids[n], keep_original_order=True
    )
    compiled, attn = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            idx = int(node.target.rsplit("_", 1)[-1])
            (attn if idx in attn_parts else compiled).append(node.target)
    return split, compiled, attn


def _fake_prop(split: torch.fx.GraphModule, fake_args: Sequence[Any]) -> dict[str, list[Any]]:
    """Fake inputs of every submodule, in its placeholder order."""
    seen: dict[str, list[Any]] = {}

    class _Interp(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            assert not kwargs
            seen[target] = list(args)
            return super().call_module(target, args, kwargs)

    _Interp(split).run(*fake_args)
    return seen


def _meta_key(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({tuple(map(str, x.shape))},{tuple(map(str, x.stride()))},{x.dtype},{x.device},{x.requires_grad})"
    if isinstance(x, torch.SymInt):
        return f"S({x.node.expr})"
    return f"C({type(x).__name__}:{x!r})"


def _normalize_layer_names(gm: torch.fx.GraphModule, layer_names: set[str]) -> list[str]:
    """Replace layer-name constants in ``gm`` by slot aliases, in place; returns the names
    in slot order."""
    order: list[str] = []

    def sub(a):
        if isinstance(a, str) and a in layer_names:
            if a not in order:
                order.append(a)
            return _slot_alias(order.index(a))
        return a

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = torch.fx.node.map_aggregate(node.args, sub)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, sub)
    gm.recompile()
    return order


def _canonicalize_names(gm: torch.fx.GraphModule) -> None:
    """Rename every node of a piece ``n0, n1, ...`` (placeholders ``arg0, ...``), in place:
    the pieces of different layers then have the same code, and so the same key in
    Inductor's FX graph cache (warm compiles hit across layers, depths and processes)."""
    i = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            node.target = f"arg{i}"
            node._rename(f"arg{i}")
        else:
            node._rename(f"n{i}")
        i += 1
    gm.recompile()


def _structure_key(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> str | None:
    """Hash of a piece's graph up to node names, plus its inputs' metadata; None when the
    piece holds module state (get_attr) and so cannot be shared."""
    index: dict[torch.fx.Node, int] = {}
    parts = []

    def ref(a):
        return f"%{index[a]}" if isinstance(a, torch.fx.Node) else repr(a)

    for i, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr" or node.op == "call_module":
            return None
        index[node] = i
        target = node.target if isinstance(node.target, str) else torch.fx.node._get_qualified_name(node.target) \
            if callable(node.target) and not isinstance(node.target, torch._ops.OpOverload) else str(node.target)
        args = torch.fx.node.map_aggregate(node.args, ref)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
        parts.append(f"{node.op}|{target if node.op != 'placeholder' else ''}|{args}|{kwargs}")
    parts.append("inputs:" + ";".join(_meta_key(x) for x in inputs))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# === runtime pieces =========================================================================


@dataclasses.dataclass
class CompileStats:
    num_attention_pieces: int = 0
    num_compiled_pieces: int = 0
    num_unique_compiles: int = 0
    num_captures: int = 0
    trace_s: float = 0.0
    compile_s: float = 0.0
    capture_s: float = 0.0
    plugin_active: bool = False
    num_stand_ins: int = 0
    piece_groups: list[list[str]] = dataclasses.field(default_factory=list)


class _Mode:
    EAGER, CAPTURE, REPLAY = 0, 1, 2


class _CompiledPiece:
    """A compiled piece: runs its (shared) compiled code, or captures / replays a graph."""

    __slots__ = ("name", "fn", "slots", "runner", "graphs", "_bind")

    def __init__(self, name: str, fn: Callable, slots: list, runner: "PiecewiseRunner"):
        self.name, self.fn, self.slots, self.runner = name, fn, slots, runner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._bind = [(_slot_alias(j), layer) for j, layer in enumerate(slots)]

    def __call__(self, *args):
        r = self.runner
        mode = r._mode
        if mode == _Mode.REPLAY:
            graph, out = self.graphs[r._size]
            graph.replay()
            return out
        for alias, layer in self._bind:
            _bind_alias(alias, layer)
        if mode == _Mode.CAPTURE:
            graph, out = r._graph_backend.capture(self, args)
            self.graphs[r._size] = (graph, out)
            r.stats.num_captures += 1
            return out
        return self.fn(*args)


# === graph backends ==========================================================================


class CudaGraphBackend:
    """Captures with ``torch.cuda.CUDAGraph`` (HIP graphs on ROCm), all graphs from one pool,
    on one side stream."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.step_pool = None
        self.stream = torch.cuda.Stream()

    @contextlib.contextmanager
    def warmup(self):
        # Warm up on the capture stream (cuBLAS workspaces, Triton autotuning), then sync.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.synchronize()

    def capture(self, piece: "_CompiledPiece", args) -> tuple[Any, Any]:
        return self.capture_call(piece.fn, args, self.pool)

    def capture_step(self, fn: Callable, args) -> tuple[Any, Any]:
        """A whole step (pieces and attention) in one graph, from its own pool: the piecewise
        graphs' outputs stay untouched by it."""
        if self.step_pool is None:
            self.step_pool = torch.cuda.graph_pool_handle()
        return self.capture_call(fn, args, self.step_pool)

    def capture_call(self, fn: Callable, args, pool) -> tuple[Any, Any]:
        # capture_begin/end rather than torch.cuda.graph(): that one synchronizes and
        # empties the allocator cache on every entry (hundreds of captures here).
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class RerunGraphBackend:
    """A stand-in for graphs on machines without a GPU (tests): "capture" runs the piece and
    keeps its inputs, outputs, layer bindings and forward context; "replay" runs it again on
    exactly those input tensors, under that context, and copies the results into the kept
    outputs. Like a real graph, a replay sees new data only through the same tensors
    (persistent buffers, earlier pieces' outputs), so it checks the runner's buffer
    discipline on CPU."""

    class _Graph:
        __slots__ = ("fn", "bind", "args", "out", "ctx")

        def replay(self):
            for alias, layer in self.bind:
                _bind_alias(alias, layer)
            with set_forward_context(self.ctx.attn_metadata):
                new = self.fn(*self.args)
            for o, n in zip(_flat(self.out), _flat(new)):
                o.copy_(n)

    @contextlib.contextmanager
    def warmup(self):
        yield

    def capture(self, piece, args):
        return self._capture(piece.fn, piece._bind, args)

    def capture_step(self, fn, args):
        return self._capture(fn, (), args)

    def _capture(self, fn, bind, args):
        g = self._Graph()
        g.fn, g.bind, g.args = fn, bind, args
        g.ctx = forward_context.get_forward_context()
        g.out = fn(*args)
        return g, g.out

    def synchronize(self) -> None:
        pass


def _flat(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


# === the runner ==============================================================================


class PiecewiseRunner:
    """Owns the split, compiled pieces, persistent buffers and captured graphs of one model.

    Build it with :func:`compile_piecewise`. Per step: ``md = runner.prepare(...)`` plans
    the metadata into the persistent buffers (padded to the captured size), then
    ``runner(input_ids, md)`` returns logits ``[num_actual_tokens, vocab]`` (a view into
    graph memory: valid until the next step; clone to keep).
    """

    def __init__(self, model: nn.Module, *, capture_sizes: Sequence[int], max_num_seqs: int,
                 max_num_tokens: int, max_model_len: int, use_cuda_graphs: bool,
                 plugin: bool | None, device: torch.device, decode_graphs: bool = False):
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.decode_graphs = decode_graphs
        # Steps are padded to these sizes also without graphs (so CPU runs cover padding).
        self.capture_sizes = sorted(set(int(s) for s in capture_sizes))
        self.use_cuda_graphs = use_cuda_graphs
        self.max_num_tokens = max(max_num_tokens, max(self.capture_sizes, default=1))
        layers = attention_layers(model)
        if not layers:
            raise ValueError("compile_piecewise: the model has no Attention layer")
        self.block_size = layers[0].block_size
        if any(layer.block_size != self.block_size for layer in layers):
            raise ValueError("compile_piecewise: all attention layers must share one block size")
        self.buffers = MetadataBuffers(max_num_seqs, self.max_num_tokens,
                                       -(-max_model_len // self.block_size), device)
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.long, device=device)
        self.stats = CompileStats()
        self._layers = {layer.layer_name: layer for layer in layers}
        self._plugin = plugin
        self._mode = _Mode.EAGER
        self._size = 0
        self._graph_backend = None
        self.split_gm: torch.fx.GraphModule | None = None
        self.pieces: list[_CompiledPiece] = []
        self.attention_pieces: list[str] = []
        self._arg_plan: list[Any] = []  # per placeholder: ("param", tensor) | ("ids",) | ("pos",) | ("sym",)
        self._args_by_size: dict[int, list[Any]] = {}
        self._slot_layers: dict[str, list] = {}
        self._captured: frozenset[int] = frozenset()
        # Whole-step graphs of decode-only steps, per padded size, and the metadata of the
        # step prepared for one (its tensors are the views those graphs were captured on).
        self._step_graphs: dict[int, tuple[Any, Any]] = {}
        self._step_md: AttentionMetadata | None = None
        self._compile()

    # --- compile --------------------------------------------------------------------------

    def _dummy_metadata(self, num_tokens: int) -> AttentionMetadata:
        """Metadata of ``num_tokens`` one-token sequences that write nothing (slots -1) and
        read one block: for tracing, warm-up and capture."""
        n = min(num_tokens, self.buffers.max_num_seqs)
        qlens = [1] * (n - 1) + [num_tokens - (n - 1)]
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
                                 num_prefills=sum(q > 1 for q in qlens), **t)

    def _compile(self) -> None:
        model = self.model

        def backend(gm: torch.fx.GraphModule, example_inputs):
            t0 = time.perf_counter()
            self._build(gm, list(example_inputs))
            self.stats.compile_s = time.perf_counter() - t0
            return self.split_gm

        def fwd(input_ids, positions):
            return model(input_ids, positions)

        # A fresh code object per runner: Dynamo caches by code object, and this one is traced
        # exactly once (the runner then calls the split graph itself).
        fwd = types.FunctionType(fwd.__code__.replace(co_name=f"rocm_attn_piecewise_{next(_RUNNER_IDS)}"),
                                 fwd.__globals__, None, None, fwd.__closure__)

        # Trace at a size > 1 (Dynamo specializes sizes 0 and 1) with the token dim dynamic.
        t = min(8, self.max_num_tokens) if self.max_num_tokens >= 2 else 2
        t = max(t, 2)
        ids = self.input_ids[:t]
        md = self._dummy_metadata(t)
        pos = md.positions
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        self._trace_ids, self._trace_pos = ids, pos
        compiled = torch.compile(fwd, backend=backend, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.no_grad(), set_forward_context(md):
            compiled(ids, pos)
        self.stats.trace_s = time.perf_counter() - t0 - self.stats.compile_s

    def _build(self, gm: torch.fx.GraphModule, example_inputs: list) -> None:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx

        # Placeholder -> run-time value.
        params = {id(p): p for p in list(self.model.parameters()) + list(self.model.buffers())}
        plan = []
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                if x is self._trace_ids:
                    plan.append(("ids",))
                elif x is self._trace_pos:
                    plan.append(("pos",))
                elif id(x) in params:
                    plan.append(("param", x))
                else:
                    raise RuntimeError(
                        "compile_piecewise: the traced graph takes a tensor that is neither an "
                        f"input nor a parameter/buffer of the model (shape {tuple(x.shape)})"
                    )
            elif isinstance(x, (int, torch.SymInt)):
                hint = x.node.hint if isinstance(x, torch.SymInt) else x
                if hint != self._trace_ids.shape[0]:
                    raise RuntimeError(f"compile_piecewise: unexpected symbolic input {x}")
                plan.append(("sym",))
            else:
                raise RuntimeError(f"compile_piecewise: unexpected graph input {type(x)}")
        self._arg_plan = plan

        split, compiled_names, attn_names = split_at_attention(gm)
        self.split_gm, self.attention_pieces = split, attn_names
        for name in attn_names:  # eager attention: call forward directly (no Module.__call__)
            split.__dict__[name] = getattr(split, name).forward
        self.stats.num_attention_pieces = len(attn_names)
        self.stats.num_compiled_pieces = len(compiled_names)

        fake_mode = detect_fake_mode(example_inputs)
        fake_args = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        with fake_mode:
            sub_inputs = _fake_prop(split, fake_args)

        ctx, self.stats.plugin_active = plugin_context(self._plugin)
        if self.stats.plugin_active:
            self.stats.num_stand_ins = _add_stand_ins(split, compiled_names)
        cache: dict[str, Callable] = {}
        groups: dict[str, list[str]] = {}
        names = set(self._layers)
        with ctx:
            inner = torch._inductor.config.post_grad_custom_post_pass
            if not self.stats.plugin_active and type(inner).__module__.startswith("inductor_rocm_attn"):
                inner = None  # plugin=False while the plugin is enabled globally: leave it out
            post_pass = _PiecePostPass(inner)
            for name in compiled_names:
                sub = split._modules[name]
                slot_names = _normalize_layer_names(sub, names)
                _canonicalize_names(sub)
                slots = [self._layers[n] for n in slot_names]
                inputs = sub_inputs.get(name, [])
                key = _structure_key(sub, inputs) or f"unique:{name}"
                fn = cache.get(key)
                if fn is None:
                    for j, layer in enumerate(slots):
                        _bind_alias(_slot_alias(j), layer)
                    fn = compile_fx(sub, inputs, config_patches={"post_grad_custom_post_pass": post_pass})
                    cache[key] = fn
                    self.stats.num_unique_compiles += 1
                    groups[key] = [name]
                else:
                    groups[key].append(name)
                    rep = self._slot_layers.get(groups[key][0], [])
                    # A pass may have switched the representative's layer to interleaved V at
                    # compile time: the layers sharing its code follow.
                    for a, b in zip(rep, slots):
                        if a.interleaved_v != b.interleaved_v:
                            b.set_interleaved_v_cache(a.interleaved_v)
                self._slot_layers[name] = slots
                piece = _CompiledPiece(name, fn, slots, self)
                split.__dict__[name] = piece  # the split graph calls it in place of the submodule
                self.pieces.append(piece)
        self.stats.piece_groups = list(groups.values())

    # --- per step -------------------------------------------------------------------------

    def padded_size(self, num_tokens: int) -> int:
        """The captured size a step of ``num_tokens`` runs at (itself if above all sizes)."""
        for s in self.capture_sizes:
            if s >= num_tokens:
                return s
        return num_tokens

    def prepare(self, query_lens: Sequence[int], context_lens: Sequence[int],
                block_tables: Sequence[Sequence[int]], *, whole_step: bool = True) -> AttentionMetadata:
        """Plan a step into the persistent buffers, padded to the captured size.

        A decode-only step (every query_len 1) of a size with a whole-step graph
        (``decode_graphs=True``) is planned for that graph: its sequences are padded too (empty
        ones), the block table keeps its full width and ``max_seq_len`` is ``max_model_len``,
        the shapes the graph was captured with. ``whole_step=False`` plans it for the
        piecewise graphs instead."""
        n = sum(query_lens)
        size = self.padded_size(n)
        if (whole_step and size in self._step_graphs and n == len(query_lens)
                and all(q == 1 for q in query_lens)):
            self._step_md = self._plan_decode_step(context_lens, block_tables, size)
            return self._step_md
        self._step_md = None
        return build_attention_metadata(query_lens, context_lens, block_tables, self.block_size,
                                        self.device, num_padded_tokens=size,
                                        buffers=self.buffers)

    def _plan_decode_step(self, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                          size: int, dummy: bool = False) -> AttentionMetadata:
        """Metadata of ``len(context_lens)`` one-token sequences padded with empty ones to
        ``size``, in the fixed shapes of a whole-step graph. ``dummy``: for capture (every
        sequence one token, nothing written to the caches)."""
        b = len(context_lens)
        pad = size - b
        md = build_attention_metadata(
            [1] * b + [0] * pad, list(context_lens) + [0] * pad, list(block_tables) + [[]] * pad,
            self.block_size, self.device, num_padded_tokens=size, buffers=self.buffers)
        if dummy:
            self.buffers.slot_mapping[:size].fill_(-1)
        return dataclasses.replace(
            md, block_table=self.buffers.block_table[:size], max_query_len=1,
            max_seq_len=self.max_model_len, num_actual_tokens=size if dummy else b)

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
        n = metadata.num_actual_tokens
        size = metadata.slot_mapping.shape[0]
        if metadata.slot_mapping.data_ptr() != self.buffers.slot_mapping.data_ptr():
            raise ValueError("PiecewiseRunner: build the step's metadata with runner.prepare(...)")
        if input_ids.shape[0] not in (n, size):
            raise ValueError(f"PiecewiseRunner: {input_ids.shape[0]} input ids for {n} tokens")
        self.input_ids[: input_ids.shape[0]].copy_(input_ids, non_blocking=True)
        if use_graphs and metadata is self._step_md:  # a decode step with a whole-step graph
            graph, out = self._step_graphs[size]
            graph.replay()
            out = out[0] if isinstance(out, (tuple, list)) else out
            return out[:n]
        graphs = use_graphs and size in self._captured
        self._mode, self._size = (_Mode.REPLAY if graphs else _Mode.EAGER), size
        try:
            with set_forward_context(metadata):
                out = self.split_gm(*self._args(size))
        finally:
            self._mode = _Mode.EAGER
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out[:n]

    # --- capture --------------------------------------------------------------------------

    @torch.no_grad()
    def capture(self, num_warmup: int = 1) -> None:
        """Capture one graph per compiled piece per size, largest size first; with
        ``decode_graphs``, also one whole-step graph per size for decode-only steps."""
        if not self.use_cuda_graphs or not self.capture_sizes:
            return
        t0 = time.perf_counter()
        if self._graph_backend is None:
            self._graph_backend = CudaGraphBackend()
        backend = self._graph_backend
        captured = set()
        for size in sorted(self.capture_sizes, reverse=True):
            md = self._dummy_metadata(size)
            args = self._args(size)
            with set_forward_context(md):
                with backend.warmup():
                    for _ in range(num_warmup):
                        self._mode = _Mode.EAGER
                        self.split_gm(*args)
                self._mode, self._size = _Mode.CAPTURE, size
                try:
                    self.split_gm(*args)
                finally:
                    self._mode = _Mode.EAGER
            captured.add(size)
        if self.decode_graphs:
            self._capture_decode_steps(num_warmup)
        backend.synchronize()
        self._captured = frozenset(captured)
        self.stats.capture_s = time.perf_counter() - t0

    def _capture_decode_steps(self, num_warmup: int) -> None:
        """Whole decode steps in one graph each: the pieces and the attention between them.
        Attention's launches depend on host values only through the metadata's shapes and
        ``max_seq_len``, all fixed here (``_plan_decode_step``), so one capture per size serves
        every decode step of that size; lengths and block tables change in the buffers."""
        backend = self._graph_backend
        self._mode = _Mode.EAGER  # pieces run their compiled code inside the step's graph
        for size in sorted((s for s in self.capture_sizes if s <= self.buffers.max_num_seqs),
                           reverse=True):
            md = self._plan_decode_step([0] * size, [[0]] * size, size, dummy=True)
            args = self._args(size)
            with set_forward_context(md):
                with backend.warmup():
                    for _ in range(num_warmup):
                        self.split_gm(*args)
                self._step_graphs[size] = backend.capture_step(self.split_gm, args)
            self.stats.num_captures += 1

    def replays_whole_step(self, metadata: AttentionMetadata) -> bool:
        """Whether ``runner(ids, metadata)`` replays one whole-step graph (a decode step
        prepared for ``decode_graphs``) rather than the piecewise graphs."""
        return metadata is self._step_md and self._step_md is not None


def compile_piecewise(
    model: nn.Module,
    capture_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    max_num_seqs: int | None = None,
    max_num_tokens: int | None = None,
    max_model_len: int = 4096,
    use_cuda_graphs: bool | None = None,
    plugin: bool | None = None,
    capture: bool = True,
    graph_backend: Any = None,
    decode_graphs: bool = True,
) -> PiecewiseRunner:
    """Split ``model`` at its attention ops, compile the pieces with Inductor and (on a GPU)
    capture one graph per piece per size in ``capture_sizes``.

    Args:
        model: ``forward(input_ids [T] int64, positions [T] int64) -> logits [T, V]`` over
            ``Attention`` layers, KV caches already bound (``bind_kv_caches``).
        capture_sizes: token counts to capture; a step is padded up to the next one.
        max_num_seqs: sequences per step (metadata buffer size; default ``max(capture_sizes)``).
        max_num_tokens: tokens per step, also for steps above the captured sizes that run
            without graphs (default ``max(capture_sizes)``).
        max_model_len: longest sequence (block-table width).
        use_cuda_graphs: default: when the model's parameters are on a CUDA/HIP device.
        plugin: run the plugin's passes in the piece compiles (default: when importable).
        capture: capture now (else call ``runner.capture()`` later).
        graph_backend: what captures and replays (default ``CudaGraphBackend``);
            ``RerunGraphBackend()`` emulates graphs without a GPU (tests).
        decode_graphs: also capture each size's whole decode step (pieces and attention) as
            one graph, replayed for steps whose every sequence decodes one token (sizes up
            to ``max_num_seqs``); other steps use the piecewise graphs. H200, 28-layer
            model, B=64: 5.56 ms a step, piecewise graphs 5.9-6.5 ms; B=1: 1.32 vs 4.4-7.3.
    """
    p = next(model.parameters())
    device = p.device
    if use_cuda_graphs is None:
        use_cuda_graphs = device.type == "cuda"
    if graph_backend is not None:
        use_cuda_graphs = True
    elif use_cuda_graphs and device.type != "cuda":
        raise ValueError(f"compile_piecewise: CUDA/HIP graphs need the model on a GPU, it is on {device}")
    sizes = list(capture_sizes)
    top = max(sizes, default=1)
    runner = PiecewiseRunner(
        model, capture_sizes=sizes, max_num_seqs=max_num_seqs or top,
        max_num_tokens=max_num_tokens or top, max_model_len=max_model_len,
        use_cuda_graphs=use_cuda_graphs, plugin=plugin, device=device,
        decode_graphs=decode_graphs,
    )
    runner._graph_backend = graph_backend
    if capture and use_cuda_graphs:
        runner.capture()
    return runner
