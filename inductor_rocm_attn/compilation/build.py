"""How a ``PiecewiseRunner`` gets its compiled pieces: trace the model with Dynamo (or load
the stored trace, ``trace_cache``), split it at attention, dedup identical pieces and
compile each distinct one with Inductor (steps 1-3 of ``piecewise``).

Two ways to the pieces' fake inputs: after a trace, Dynamo's fake values on the split's
placeholders; from a stored trace, the split graph run under a fake mode with identical
pieces run once (``split.submodule_inputs``). A cold start with the trace cache on builds
from the stored form too, so a warm start compiles exactly the same pieces and hits
Inductor's caches.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
import warnings
from typing import TYPE_CHECKING, Callable

import torch

from inductor_rocm_attn import layer_regions
from inductor_rocm_attn.forward_context import set_forward_context
from inductor_rocm_attn.metadata import AttentionMetadata, MetadataBuffers

from .dedup import (
    bind_alias,
    canonicalize_names,
    follow_interleaved_v,
    normalize_layer_names,
    slot_alias,
    structure_key,
)
from .pieces import CompiledPiece, piece_post_pass, plugin_context
from .regions import inline_regions, stamp_regions
from .split import add_stand_ins, split_at_attention, submodule_inputs
from .trace_cache import (
    TraceCache,
    TraceEntry,
    deserialize_graph,
    fake_inputs,
    file_digest,
    plan_by_name,
    plan_by_tensor,
    resolve_trace_cache,
    serialize_graph,
    trace_key,
    traced_files,
)

if TYPE_CHECKING:
    from .piecewise import PiecewiseRunner

__all__ = ["compile_model", "build", "plan_args"]

_RUNNER_IDS = itertools.count()


def compile_model(runner: "PiecewiseRunner") -> None:
    """Trace (or load the stored trace), split, dedup and compile ``runner``'s model."""
    if runner.device.type == "cuda":
        _start_inductor_workers()
    # Trace at a size > 1 (Dynamo specializes sizes 0 and 1) with the token dim dynamic; a
    # runner of 1-token steps (capture_sizes=[1]) traces in buffers of 2 tokens of its own.
    t = max(2, min(8, runner.max_num_tokens))
    if t <= runner.max_num_tokens:
        _compile_model(runner, t)
        return
    saved = runner.buffers, runner.input_ids
    runner.buffers = MetadataBuffers(saved[0].max_num_seqs, t, saved[0].max_blocks_per_seq, runner.device)
    runner.input_ids = torch.zeros(t, dtype=saved[1].dtype, device=saved[1].device)
    try:
        _compile_model(runner, t)
    finally:
        runner.buffers, runner.input_ids = saved


def _start_inductor_workers() -> None:
    """Start Inductor's compile workers now, so they are up when the pieces compile. Inductor
    compiles a kernel in the calling process while its worker pool is not ready yet, and only
    ``torch.compile``'s own "inductor" backend starts the pool early: the pieces' compile
    (``compile_fx``, called here after the trace) would otherwise start it at its first kernel
    and compile the first piece's kernels one after another. Only for models on a GPU (Triton
    kernels); on a 2-core CPU machine the C++ build was 1.4 s slower with the pool started early
    (its workers start beside the trace). ``TORCH_WARM_POOL=0`` turns it off, as for
    ``torch.compile``."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def _compile_model(runner: "PiecewiseRunner", t: int) -> None:
    model, forward = runner.model, runner.forward
    t_start = time.perf_counter()
    ids = runner.input_ids[:t]
    md = runner._dummy_metadata(t)
    pos = md.positions
    cache = _trace_cache_entry(runner, t)
    if cache is not None and cache[2] is not None:  # a stored trace: no Dynamo
        _build_stored(runner, cache[2].graph, cache[2].plan, ids, md, t_start)
        return
    stored: list = []
    traced: list = []  # the backend was entered: Dynamo's trace is done

    def backend(gm: torch.fx.GraphModule, example_inputs):
        t0 = time.perf_counter()
        # Before the trace counts as done: a region that cannot be stamped is traced again flat.
        stamped = stamp_regions(gm, example_inputs)
        traced.append(True)
        inlined = inline_regions(gm)
        runner.stats.region_calls = stamped[0] + inlined[0]
        runner.stats.region_subgraphs = stamped[1] + inlined[1]
        regions = (f" ({runner.stats.region_calls} layer-region calls of {runner.stats.region_subgraphs} traced "
                   f"regions, {'stamped' if stamped[0] else 'inlined'})" if runner.stats.region_calls else "")
        runner._say(f"traced in {t0 - t_start:.1f} s: {sum(1 for _ in gm.graph.nodes)} graph nodes{regions}")
        if cache is not None:
            entry = _store_trace(runner, gm, list(example_inputs), *cache[:2])
            if entry is not None:  # built after the trace, from the stored form
                stored.append(entry)
                return gm.forward
        build(runner, gm, list(example_inputs))
        runner.stats.compile_s = time.perf_counter() - t0
        return runner.split_gm

    if forward is None:
        def fwd(input_ids, positions):
            return model(input_ids, positions)
    else:
        def fwd(input_ids, positions):
            return forward(input_ids, positions)

    def trace(regions: bool) -> None:
        # A fresh code object per trace: Dynamo caches by code object, and this one is traced
        # exactly once (the runner then calls the split graph itself).
        code = fwd.__code__.replace(co_name=f"rocm_attn_piecewise_{next(_RUNNER_IDS)}")
        compiled = torch.compile(types.FunctionType(code, fwd.__globals__, None, None, fwd.__closure__),
                                 backend=backend, fullgraph=True, dynamic=False)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        with torch.no_grad(), set_forward_context(md, layers=runner.layer_table), \
                (layer_regions.tracing(model) if regions else contextlib.nullcontext()):
            compiled(ids, pos)

    runner._trace_ids, runner._trace_pos = ids, pos
    runner._say("tracing the model with Dynamo (token dimension dynamic)")
    t0 = time.perf_counter()
    regions = layer_regions.available() and isinstance(model, torch.nn.Module) and layer_regions.marked(model)
    try:
        trace(regions=regions)
    except Exception as e:
        if traced or not regions:  # failed in the build, or no regions to blame
            raise
        # A region the stamp refuses (or, in "nested" mode, torch's nested_compile_region
        # differing between versions): a model that traces without its regions still
        # compiles (at the flat trace's cost).
        cause = _first_cause(e)
        msg = (f"compile_piecewise: the Dynamo trace with per-layer compile regions failed on torch "
               f"{torch.__version__} ({type(cause).__name__}: "
               f"{(str(cause).strip().splitlines() or [''])[0][:300]}); tracing again without them")
        runner._say(msg)
        warnings.warn(msg, stacklevel=4)
        trace(regions=False)
    runner.stats.trace_s = time.perf_counter() - t0 - runner.stats.compile_s
    if stored:
        _build_stored(runner, stored[0].graph, stored[0].plan, ids, md, None)


def _first_cause(e: BaseException) -> BaseException:
    """What a failed region trace is blamed on: the stamp's own refusal (``layer region ...``,
    ``compile_piecewise: ...``) where Dynamo's wrappers were raised from or while handling
    one, else a backend's own error, else ``e``."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if str(x).startswith(("layer region ", "compile_piecewise: ")):
            return x
        x = getattr(x, "inner_exception", None) or x.__cause__ or x.__context__
    return getattr(e, "inner_exception", None) or e


def _trace_cache_entry(runner: "PiecewiseRunner", t: int):
    """(cache, key, stored entry or None) when the trace cache is on, else None."""
    directory = resolve_trace_cache(runner._trace_cache)
    if directory is None:
        return None
    key, files = trace_key(runner.model, runner._layers.values(), runner.forward,
                           dict(trace_tokens=t, dynamic_dim=0, runner="piecewise"))
    cache = TraceCache(directory)
    runner._trace_files = files
    return cache, key, cache.load(key)


def _store_trace(runner: "PiecewiseRunner", gm: torch.fx.GraphModule, example_inputs: list,
                 cache: TraceCache, key: str) -> TraceEntry | None:
    """Store the traced graph; None when it cannot be stored (then the trace is built as is)."""
    plan = plan_by_name(plan_args(runner, example_inputs), runner.model)
    data = serialize_graph(gm) if plan is not None else None
    if data is None:
        runner._say("trace cache: this graph cannot be stored; building from the trace")
        return None
    files = dict(runner._trace_files)
    files.update({f: file_digest(f) for f in traced_files()})
    entry = TraceEntry(graph=data, plan=plan, files=files)
    try:
        cache.store(key, entry)
    except OSError as e:  # a read-only or full cache directory: this start goes on without storing
        msg = (f"compile_piecewise: trace cache: could not store the trace in {cache.directory} ({e}); "
               "building from the trace")
        runner._say(msg)
        warnings.warn(msg, stacklevel=2)
        return None
    return entry


def _build_stored(runner: "PiecewiseRunner", data: bytes, named_plan: list, ids: torch.Tensor,
                  md: AttentionMetadata, t_start: float | None) -> None:
    """Build from a stored trace (``trace_cache``): the same graph and fake inputs in a
    cold start (after storing) and a warm one (instead of tracing)."""
    t0 = time.perf_counter()
    plan = plan_by_tensor(named_plan, runner.model)
    if plan is None:
        raise RuntimeError("compile_piecewise: a stored trace names a parameter the model lacks")
    gm = deserialize_graph(data)
    if t_start is not None:
        runner.stats.trace_loaded = True
        runner.stats.trace_s = time.perf_counter() - t_start
        runner._say(f"loaded the stored trace in {runner.stats.trace_s:.1f} s: "
                    f"{sum(1 for _ in gm.graph.nodes)} graph nodes")
    with torch.no_grad(), set_forward_context(md, layers=runner.layer_table):  # as the trace's
        build(runner, gm, fake_inputs(plan, ids), plan)
    runner.stats.compile_s = time.perf_counter() - t0


def plan_args(runner: "PiecewiseRunner", example_inputs: list) -> list:
    """Placeholder -> run-time value: ("ids",) | ("pos",) | ("param", tensor) | ("sym",)."""
    params = {id(p): p for p in list(runner.model.parameters()) + list(runner.model.buffers())}
    plan = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            if x is runner._trace_ids:
                plan.append(("ids",))
            elif x is runner._trace_pos:
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
            if hint != runner._trace_ids.shape[0]:
                raise RuntimeError(f"compile_piecewise: unexpected symbolic input {x}")
            plan.append(("sym",))
        else:
            raise RuntimeError(f"compile_piecewise: unexpected graph input {type(x)}")
    return plan


def serve_layers(records: list, member_slots: list[list]) -> None:
    """Fill in ``serves`` of a shared piece's fusion records: slot alias ``j`` stands for
    slot ``j``'s layer in every member piece (``member_slots``: each member's layers by slot)."""
    serves = {slot_alias(j): tuple(slots[j].layer_name for slots in member_slots)
              for j in range(len(member_slots[0]))}
    for record in records:
        record.serves = serves.get(record.layer_name, record.serves)


def build(runner: "PiecewiseRunner", gm: torch.fx.GraphModule, example_inputs: list,
          plan: list | None = None) -> None:
    """Split ``gm`` at attention, dedup, compile each distinct piece (``example_inputs``: the
    graph's inputs, real or fake; ``plan``: the argument plan when known, else derived)."""
    from torch._inductor.compile_fx import compile_fx

    runner._arg_plan = plan if plan is not None else plan_args(runner, example_inputs)
    split, compiled_names, attn_names = split_at_attention(gm)
    runner.split_gm, runner.attention_pieces = split, attn_names
    for name in attn_names:  # eager attention: call forward directly (no Module.__call__)
        split.__dict__[name] = getattr(split, name).forward
    runner.stats.num_attention_pieces = len(attn_names)
    runner.stats.num_compiled_pieces = len(compiled_names)

    ctx, runner.stats.plugin_active = plugin_context(runner._plugin)
    if runner.stats.plugin_active:
        runner.stats.num_stand_ins = add_stand_ins(split, compiled_names)
    names = set(runner._layers)
    for name in compiled_names:  # layer names -> slot aliases, canonical node names
        sub = split._modules[name]
        runner._slot_layers[name] = [runner._layers[n] for n in normalize_layer_names(sub, names)]
        canonicalize_names(sub)
    pieces = set(compiled_names)
    sub_inputs = submodule_inputs(
        split, example_inputs, compiled_names,
        memo_key=lambda n, args: structure_key(split._modules[n], args) if n in pieces else None)
    # Group the pieces by structure: one compile per group, the first piece its representative.
    groups: dict[str, list[str]] = {}
    keys: dict[str, str] = {}
    for name in compiled_names:
        keys[name] = structure_key(split._modules[name], sub_inputs.get(name, [])) or f"unique:{name}"
        groups.setdefault(keys[name], []).append(name)
    runner._say(f"split at {len(attn_names)} attention ops into {len(compiled_names)} pieces, "
              f"{len(groups)} distinct: compiling each once with Inductor"
              f"{' and the plugin' if runner.stats.plugin_active else ''}")
    compiled: dict[str, Callable] = {}
    with ctx as manager:
        post_pass = piece_post_pass(manager)
        for i, (key, members) in enumerate(groups.items(), 1):
            first = members[0]
            for j, layer in enumerate(runner._slot_layers[first]):
                bind_alias(runner.layer_table, slot_alias(j), layer)
            t0 = time.perf_counter()
            shared = f", shared by {len(members)} pieces" if len(members) > 1 else ""
            runner._say(f"compiling piece {i} of {len(groups)} ({first}{shared})")
            seen = len(manager.report.records) if manager is not None else 0
            compiled[key] = compile_fx(split._modules[first], sub_inputs.get(first, []),
                                       config_patches={"post_grad_custom_post_pass": post_pass})
            if manager is not None:  # the records of this compile (run or replayed): name their layers
                serve_layers(manager.report.records[seen:], [runner._slot_layers[m] for m in members])
            runner._say(f"compiled piece {i} of {len(groups)} in {time.perf_counter() - t0:.1f} s")
            runner.stats.num_unique_compiles += 1
    for name in compiled_names:
        members = groups[keys[name]]
        slots = runner._slot_layers[name]
        if name != members[0]:
            follow_interleaved_v(runner._slot_layers[members[0]], slots)
        piece = CompiledPiece(name, compiled[keys[name]], slots, runner)
        split.__dict__[name] = piece  # the split graph calls it in place of the submodule
        runner.pieces.append(piece)
    runner.stats.piece_groups = list(groups.values())
