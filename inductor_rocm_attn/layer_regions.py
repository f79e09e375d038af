"""Per-layer compile regions: the code of a decoder layer around its attention, traced by
Dynamo once and reused for every identical layer while ``compile_piecewise`` traces.

A model marks the parts of its layer that hold no attention op with :func:`region`
(``models.DecoderLayer``: the qkv projection with norms and RoPE; the output projection and
the MLP), and each module that takes the region path carries ``compile_regions = True``. The
attention op stays outside the regions: it names its layer (``layer_name``, a per-layer
constant), so a region around it could not be reused. Only inside :func:`tracing`
(``compile_piecewise``'s trace) does a model take the region path; ``compile_piecewise``
then expands the regions (``compilation.regions``), so the split, the dedup and the fusion
passes see the same flat graph as without regions, traced in a fraction of the time. Eager
runs and a plain ``torch.compile`` of the model (whose fusion passes must see a layer's
RoPE next to its cache update) never take it.

Two ways to reuse a region's trace (:data:`MODE`):

- ``"stamp"``, the default on every torch: Dynamo's own reuse is missing in torch 2.11
  (it traces every call of a nested region again and only dedups the resulting subgraphs,
  so those regions save no trace time) and merges layers that differ in ways its guards do
  not see (a tensor aliased in one layer only, another grad / autocast mode, 0.0 vs -0.0). Here
  :func:`tracing` groups the region modules by a structural signature (:func:`signature`:
  the module tree, its plain attributes, its tensors' names and metadata, its attention
  layers' attributes; no hooks); the
  first module of a group runs its region inline between identity markers
  (:func:`region_input` / :func:`region_output`), every other one calls :func:`region_copy`,
  an opaque call (``allow_in_graph``) that Dynamo does not trace into and that takes the
  module's own tensors. ``compilation.regions.stamp_regions`` then copies the marked
  segment in place of each copy call with that module's tensors, and drops the markers.
- ``"nested"``, on request where Dynamo can reuse region traces (torch 2.13:
  :func:`_dynamo_reuses_regions`): ``torch.compiler.nested_compile_region``, Dynamo traces a
  region once and reuses the trace for later identical calls itself (guarded).

A region reads what differs per layer only from its module: a value looked up elsewhere by
the module (a global table keyed by it) is the first layer's in every copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from typing import Any, Callable, Iterator

import torch

__all__ = ["MODE", "active", "available", "marked", "plan", "region", "region_copy", "region_input",
           "region_output", "signature", "tracing"]

_TRACING = False
# torch.compiler.nested_compile_region (torch >= 2.8).
_NESTED = getattr(torch.compiler, "nested_compile_region", None)


def _dynamo_reuses_regions() -> bool:
    """Whether Dynamo reuses a nested region's trace for identical calls (its guarded
    subgraph reuse, ``torch._guards.InvokeSubgraphReuseEntry``); torch 2.11 lacks it."""
    return _NESTED is not None and hasattr(torch._guards, "InvokeSubgraphReuseEntry")


# How regions are reused: "stamp" (ours) on every torch, so CI's torch runs the path the GPU
# host's does, and the stamp tells apart layers Dynamo's nested reuse merges (aliasing, grad /
# autocast modes, -0.0); "nested" (Dynamo's own reuse, torch 2.13; traced the same time on the
# CPU machine) on request; None: the regions are plain calls (the flat trace).
MODE: str | None = "stamp"

_REGIONS: list[Callable] = []  # region functions by index (the markers name them by it)
_PLAN: "_Plan | None" = None  # the stamp plan of the running trace


def available() -> bool:
    """Whether this torch can reuse region traces (else :func:`tracing` leaves them off)."""
    return MODE is not None


def marked(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a module that takes a region path (``compile_regions = True``)."""
    return any(getattr(m, "compile_regions", False) is True for m in model.modules())


def active() -> bool:
    """Whether a model should take its region path (inside :func:`tracing`): one global read."""
    return _TRACING


def region(fn: Callable) -> Callable:
    """Mark ``fn(module, *tensors)`` (holding no attention op) as a region."""
    index = len(_REGIONS)
    _REGIONS.append(fn)
    nested = _NESTED(fn) if _NESTED is not None else fn

    @functools.wraps(fn)
    def call(module, *args):
        if MODE == "stamp":
            return _stamped(index, fn, module, args)
        if MODE == "nested":
            return nested(module, *args)
        return fn(module, *args)

    return call


# --- stamp mode: what Dynamo traces ------------------------------------------------------


def _stamped(index: int, fn: Callable, module, args: tuple):
    """A region call in stamp mode (traced by Dynamo; every branch is a trace-time constant)."""
    role = getattr(module, "_region_stamp", None)  # (group, member), set by tracing()
    if role is None or not args or not all(isinstance(a, torch.Tensor) for a in args):
        return fn(module, *args)  # not stamped: traced inline
    group, member = role
    if member == 0:  # the group's representative: traced inline between markers
        out = fn(module, *(region_input(a, index, group, i) for i, a in enumerate(args)))
        if isinstance(out, tuple):
            return tuple(region_output(o, index, group, i, len(out)) for i, o in enumerate(out))
        return region_output(out, index, group, 0, 0)
    return region_copy(index, group, member, len(args), *args, *module._region_tensors)


def region_input(x: torch.Tensor, index: int, group: int, i: int) -> torch.Tensor:
    """Marks argument ``i`` of a representative's region call (identity). Under Dynamo's fake
    run it records the argument for :func:`region_copy`'s checks."""
    if _PLAN is not None:
        rec = _PLAN.record(index, group)
        rec.inputs[i], rec.state = x, _global_state()
    return x


def region_output(x: torch.Tensor, index: int, group: int, i: int, n: int) -> torch.Tensor:
    """Marks output ``i`` of ``n`` (0: a single tensor) of a representative's region call
    (identity); records it for :func:`region_copy`'s fake outputs."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"layer region {_REGIONS[index].__qualname__}: returns a {type(x).__name__}; "
                        "a region returns a tensor or a tuple of tensors")
    if _PLAN is not None:
        rec = _PLAN.record(index, group)
        rec.outputs[i], rec.num_outputs = x, n
    return x


def region_copy(index: int, group: int, member: int, num_args: int, *flat: torch.Tensor):
    """The region call of a group's later member: ``flat`` is its arguments, then the
    module's tensors (graph inputs of the trace, for the stamp). Under Dynamo's fake run it
    checks the arguments against the representative's and returns fakes of its outputs;
    run for real, it runs the region."""
    from torch._subclasses.fake_tensor import FakeTensor

    if _PLAN is None:
        raise RuntimeError("layer_regions.region_copy: called outside compile_piecewise's trace")
    fn = _REGIONS[index]
    args = flat[:num_args]
    if not any(isinstance(a, FakeTensor) for a in args):
        return fn(_PLAN.groups[group][member], *args)
    rec = _PLAN.records.get((index, group))
    if rec is None or len(rec.inputs) != num_args or rec.num_outputs is None:
        raise RuntimeError(f"layer region {fn.__qualname__}: a copy call before its representative's")
    for i, a in enumerate(args):
        if _meta(a) != _meta(rec.inputs[i]):
            raise RuntimeError(f"layer region {fn.__qualname__}: argument {i} of a copy differs from the "
                               f"representative's ({_meta(a)} vs {_meta(rec.inputs[i])})")
    if _global_state() != rec.state:
        raise RuntimeError(f"layer region {fn.__qualname__}: a copy runs under another grad / inference / autocast "
                           f"mode than its representative ({_global_state()} vs {rec.state})")
    outs = [rec.outputs[i] for i in range(max(rec.num_outputs, 1))]
    if any(o.requires_grad for o in outs):
        raise RuntimeError(f"layer region {fn.__qualname__}: outputs that require grad cannot be stamped")
    fresh = tuple(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) for o in outs)
    return fresh if rec.num_outputs else fresh[0]


for _marker in (region_input, region_output, region_copy):
    torch._dynamo.allow_in_graph(_marker)


def _global_state() -> tuple:
    """The global modes a region's code may read (``torch.is_grad_enabled()``, autocast) and
    that change what its ops compute: a copy stamped from a trace under other modes would
    compute the representative's."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


def _meta(x: torch.Tensor) -> tuple:
    """A tensor's metadata, symbolic sizes as their expressions with what the trace has
    learned since substituted (compared without guards)."""
    return (tuple(map(_expr, x.shape)), tuple(map(_expr, x.stride())), x.dtype, x.device, x.requires_grad)


def _expr(n) -> str:
    if isinstance(n, torch.SymInt):
        return str(n.node.shape_env.simplify(n.node.expr))
    return str(n)


# --- stamp mode: the plan ----------------------------------------------------------------


@dataclasses.dataclass
class _Record:
    """What the representative's markers saw under Dynamo's fake run."""
    inputs: dict = dataclasses.field(default_factory=dict)
    outputs: dict = dataclasses.field(default_factory=dict)
    num_outputs: int | None = None
    state: tuple | None = None  # _global_state() at the representative's call


@dataclasses.dataclass
class _Plan:
    groups: list  # per group: its modules, the representative first
    names: list  # per group: the names of the tensors region_copy takes (the members' own)
    records: dict = dataclasses.field(default_factory=dict)  # (region, group) -> _Record

    def record(self, index: int, group: int) -> _Record:
        return self.records.setdefault((index, group), _Record())


_MODULE_STATE = frozenset(vars(torch.nn.Module())) - {"training"}
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device, enum.Enum)


def _region_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers outside its attention layers (the regions hold
    no attention), by name."""
    from .layer import Attention

    out = []
    for name, sub in _region_modules(module, Attention):
        for kind in (sub._parameters, sub._buffers):
            out += [(f"{name}.{k}" if name else k, t) for k, t in kind.items() if t is not None]
    return out


def _region_modules(module: torch.nn.Module, skip: type, prefix: str = ""):
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None and not isinstance(child, skip):
            yield from _region_modules(child, skip, f"{prefix}.{name}" if prefix else name)


def _hooked(m: torch.nn.Module) -> bool:
    return any(getattr(m, k, None) for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                             "_backward_pre_hooks"))


def signature(module: torch.nn.Module) -> tuple | None:
    """What makes two modules trace to the same region graph (their own tensors aside): the
    module tree (names, classes), each module's plain attributes (values; a tensor as the
    index of the module's own tensor it is, other objects by identity), its tensors' names,
    metadata and aliasing, and what its attention layers compute with (their plain
    attributes and their impl's, their layer names aside: a region may read a head count or
    a scale there). None for a module with hooks (never stamped)."""
    from .layer import Attention

    tensors = _region_tensors(module)
    own: dict[int, int] = {}
    for i, (_, t) in enumerate(tensors):
        own.setdefault(id(t), i)
    tree = []
    for name, sub in _region_modules(module, Attention):
        if _hooked(sub):
            return None
        attrs = tuple(sorted((k, _value_key(v, own)) for k, v in vars(sub).items()
                             if k not in _MODULE_STATE and not k.startswith("_region_")))
        tree.append((name, type(sub), attrs))
    attention = tuple((name, _attention_key(m, own)) for name, m in module.named_modules()
                      if isinstance(m, Attention))
    meta = tuple((name, type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, own[id(t)])
                 for name, t in tensors)
    return type(module), tuple(tree), attention, meta


# An attention layer's attributes that name it or hold its cache binding (they differ from
# layer to layer; a region never reads them: the stamp refuses ops naming a layer).
_LAYER_NAMES = frozenset({"layer_name", "kv_sharing_target_layer_name"})
_CACHE_STATE = frozenset({"kv_cache", "registered", "impl"})


def _attention_key(attn: torch.nn.Module, own: dict) -> tuple:
    """An attention layer's public attributes and its impl's (a layer name only as set or
    not); the impl's private attributes are its run-time state."""
    def public(obj, skip):
        return tuple(sorted((k, v is not None if k in _LAYER_NAMES else _value_key(v, own))
                            for k, v in vars(obj).items() if not k.startswith("_") and k not in skip))

    impl = getattr(attn, "impl", None)
    return type(attn), public(attn, _CACHE_STATE), type(impl), public(impl, ()) if impl is not None else ()


class _Same:
    """Compares by identity (an object whose equality says nothing about tracing)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _value_key(v: Any, own: dict) -> Any:
    """``own``: the module's region tensors by id -> index (a tensor attribute that is one of
    them is substituted like them; another tensor is the same one for every member)."""
    if isinstance(v, float):  # by bits: 0.0 == -0.0 compares equal, one nan never equals another
        return type(v), v.hex()
    if isinstance(v, _PLAIN):
        return type(v), v
    if isinstance(v, torch.Tensor) and id(v) in own:
        return "own", own[id(v)]
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_value_key(x, own) for x in v)
    if isinstance(v, dict):
        return dict, tuple((_value_key(k, own), _value_key(x, own)) for k, x in v.items())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return type(v), tuple((f.name, _value_key(getattr(v, f.name), own)) for f in dataclasses.fields(v))
    return _Same(v)


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    return any(getattr(m, k, None) for k in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                             "_global_backward_hooks", "_global_backward_pre_hooks"))


def _stamp_plan(model: torch.nn.Module | None) -> _Plan | None:
    """Group ``model``'s region modules by :func:`signature`; set each one's role
    (``_region_stamp``: (group, member) or None) and tensors (``_region_tensors``)."""
    if model is None or _global_hooks():
        return None
    groups: list[list] = []
    sigs: list = []
    for m in model.modules():
        if getattr(m, "compile_regions", False) is not True:
            continue
        sig = signature(m)
        where = next((g for g, s in enumerate(sigs) if sig is not None and s == sig), None)
        if sig is None:
            m._region_stamp = None
            continue
        if where is None:
            where = len(groups)
            groups.append([])
            sigs.append(sig)
        m._region_stamp = (where, len(groups[where]))
        groups[where].append(m)
    names = []
    for members in groups:
        names.append([n for n, _ in _region_tensors(members[0])])
        for m in members:
            m._region_tensors = tuple(t for _, t in _region_tensors(m))
    return _Plan(groups, names)


def _clear(model: torch.nn.Module | None) -> None:
    if model is None:
        return
    for m in model.modules():
        for k in ("_region_stamp", "_region_tensors"):
            if k in m.__dict__:
                delattr(m, k)


def plan() -> _Plan | None:
    """The stamp plan of the running trace (``compilation.regions.stamp_regions`` reads it)."""
    return _PLAN


@contextlib.contextmanager
def tracing(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Models take their region path inside (``compile_piecewise``'s Dynamo trace of
    ``model``; in stamp mode ``model``'s region modules are grouped for the stamp)."""
    global _TRACING, _PLAN
    before, _TRACING = _TRACING, MODE is not None
    saved_plan = _PLAN
    try:
        if MODE == "stamp":
            _PLAN = _stamp_plan(model)
            if _PLAN is None:  # nothing to stamp with: the regions trace inline
                _TRACING = False
        yield
    finally:
        _TRACING, _PLAN = before, saved_plan
        if MODE == "stamp":
            _clear(model)
