"""A cache of the Dynamo-traced graph of a model, so a warm start skips the trace.

Dynamo re-traces the whole model in every process: all layers, although the dedup then
compiles the identical ones once (about half of a warm start of a 28-layer model). With
``compile_piecewise(..., trace_cache=...)`` the runner stores the traced graph here and a
later process with the same key loads it instead of tracing; the pieces then hit Inductor's
FX-graph cache as before.

**What the key covers.** A stored graph is reused only when all of these match:

- the versions of torch, triton and Python, and this package's source (every ``.py`` file);
- the source files Dynamo traced through (``TracingContext.traced_code``, checked by content
  hash at load) and the files defining every module class of the model;
- the model's structure: each module's class and its plain attributes (numbers, strings,
  flags, dtypes, enums, dataclass and config objects by value, hook functions by name, any
  other object by its class and public attributes),
  every parameter and buffer's name, shape, stride, dtype, device and ``requires_grad``;
- the attention layers the ops name (their plain attributes, KV-cache shape and dtype);
- the traced ``forward`` (its code) and how the runner traces (token count, dynamic dim);
- Dynamo's configuration.

Anything else a trace could depend on, e.g. a module-level global or an environment
variable read by model code in a file Dynamo did not trace, is not covered: the cache is
opt-in for that reason (``trace_cache=True`` or a directory; env ``ROCM_ATTN_TRACE_CACHE``).

**What is stored.** The graph as a list of nodes (op, name, target, args, kwargs), custom
ops by name, so the graph comes back node for node; and the runner's argument plan
(parameters by name). Node meta (fake values, stack traces) is not stored: the runner builds
both the cold and the warm start from the stored form, so the pieces, and so Inductor's cache keys, are the
same in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import pickle
import sys
import types
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = ["TraceCache", "TraceEntry", "deserialize_graph", "fake_inputs", "file_digest", "plan_by_name",
           "plan_by_tensor", "resolve_trace_cache", "serialize_graph", "trace_key", "traced_files"]

_FORMAT = 1
ENV = "ROCM_ATTN_TRACE_CACHE"


# --- graph (de)serialization -------------------------------------------------------------------


class _OpRef:
    """A custom op (overload packet or overload) by name: ``torch.ops`` objects do not pickle."""

    __slots__ = ("namespace", "name", "overload")

    def __init__(self, namespace: str, name: str, overload: str | None):
        self.namespace, self.name, self.overload = namespace, name, overload

    def resolve(self):
        packet = getattr(getattr(torch.ops, self.namespace), self.name)
        return packet if self.overload is None else getattr(packet, self.overload)


class _NodeRef:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _encode(x: Any, index: Mapping[torch.fx.Node, int]) -> Any:
    if isinstance(x, torch.fx.Node):
        return _NodeRef(index[x])
    if isinstance(x, torch._ops.OpOverloadPacket):
        ns, name = x._qualified_op_name.split("::")
        return _OpRef(ns, name, None)
    if isinstance(x, torch._ops.OpOverload):
        return _OpRef(x.namespace, x._schema.name.split("::")[-1], x._overloadname)
    if isinstance(x, (tuple, list)):
        return type(x)(_encode(a, index) for a in x)
    if isinstance(x, dict):
        return {k: _encode(v, index) for k, v in x.items()}
    if isinstance(x, slice):
        return slice(_encode(x.start, index), _encode(x.stop, index), _encode(x.step, index))
    return x


def _decode(x: Any, nodes: list[torch.fx.Node]) -> Any:
    if isinstance(x, _NodeRef):
        return nodes[x.index]
    if isinstance(x, _OpRef):
        return x.resolve()
    if isinstance(x, (tuple, list)):
        return type(x)(_decode(a, nodes) for a in x)
    if isinstance(x, dict):
        return {k: _decode(v, nodes) for k, v in x.items()}
    if isinstance(x, slice):
        return slice(_decode(x.start, nodes), _decode(x.stop, nodes), _decode(x.step, nodes))
    return x


def serialize_graph(gm: torch.fx.GraphModule) -> bytes | None:
    """The nodes of ``gm`` as bytes; None when it cannot be stored (module state: get_attr or
    call_module nodes, or a value that does not pickle)."""
    index: dict[torch.fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        rows.append((node.op, node.name, _encode(node.target, index), _encode(node.args, index),
                     _encode(node.kwargs, index), node.type))
    try:
        return pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a target or constant that does not pickle: trace every time
        return None


def deserialize_graph(data: bytes) -> torch.fx.GraphModule:
    """The graph ``serialize_graph`` stored, node for node."""
    graph = torch.fx.Graph()
    nodes: list[torch.fx.Node] = []
    for op, name, target, args, kwargs, type_expr in pickle.loads(data):
        target, args, kwargs = _decode(target, nodes), _decode(args, nodes), _decode(kwargs, nodes)
        if op == "output":
            nodes.append(graph.output(args[0], type_expr=type_expr))
        elif op == "placeholder":
            nodes.append(graph.placeholder(name, type_expr=type_expr))
        else:
            nodes.append(graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


# --- the key --------------------------------------------------------------------------------------

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _plain(v: Any, depth: int = 0) -> Any:
    """A stable description of a value a trace may read, or None to leave it out."""
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__qualname__}.{v.name}"
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}{v.stride()}{v.dtype}{v.device}{v.requires_grad}"
    if depth > 3:
        return type(v).__qualname__
    if isinstance(v, (tuple, list)):
        return [_plain(a, depth + 1) for a in v]
    if isinstance(v, (set, frozenset)):  # Dynamo bakes a set's members
        return sorted((_plain(a, depth + 1) for a in v), key=repr)
    if isinstance(v, dict):  # by value (keys: strings, numbers, enums); any other keys (a kernel cache) left out
        if not all(isinstance(k, str) for k in v):
            if not all(isinstance(k, _PLAIN + (enum.Enum,)) for k in v):
                return None
            return sorted(([_plain(k), _plain(a, depth + 1)] for k, a in v.items()), key=repr)
        return {k: _plain(a, depth + 1) for k, a in sorted(v.items())}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v)}
    if hasattr(v, "to_dict") and hasattr(v, "model_type"):  # a transformers config
        return json.dumps(v.to_dict(), sort_keys=True, default=repr)
    if isinstance(v, functools.partial):  # Dynamo bakes the bound arguments
        return ["partial", _plain(v.func, depth + 1), _plain(list(v.args), depth + 1),
                _plain(dict(v.keywords), depth + 1)]
    if callable(v):
        name = f"fn:{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__qualname__)}"
        if not isinstance(v, types.FunctionType):
            return name
        # A function's source is keyed by its file; the values it closes over and its
        # defaults are baked into the trace as well (one factory's closures share a source).
        cells = []
        for cell in v.__closure__ or ():
            try:
                cells.append(_plain(cell.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                cells.append(None)
        return [name, cells, _plain(list(v.__defaults__ or ()), depth + 1), _plain(v.__kwdefaults__ or {}, depth + 1)]
    # Any other object (a SimpleNamespace, a hand-written options class): by its class and
    # public attributes. Dynamo bakes the values forward reads from it into the trace, so
    # leaving it out served a trace of other values (a needless miss only re-traces).
    # Private ones are left out: they hold per-process values (transformers'
    # GenerationConfig keeps its object hash) that would make every start miss.
    cls = f"{type(v).__module__}.{type(v).__qualname__}"
    attrs = getattr(v, "__dict__", None)
    if not isinstance(attrs, dict):
        return cls
    return [cls, _plain({k: a for k, a in attrs.items() if not k.startswith("_")}, depth + 1)]


def _forward_digest(forward: Callable | None) -> Any:
    """The traced ``forward=``: its code, and the values Dynamo bakes into the trace with it,
    those it closes over, its defaults and, for a ``functools.partial``, the bound arguments
    (the code alone served one forward's trace to another that differs only in them)."""
    if forward is None:
        return ""
    fn = forward
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    return [_code_digest(code) if code is not None else "", _plain(forward)]


def _attributes(obj: Any) -> dict[str, Any]:
    out = {}
    for k, v in sorted(vars(obj).items()):
        if k in ("_parameters", "_buffers", "_modules"):
            continue
        if "hooks" in k and isinstance(v, dict):  # keyed by process-wide handle ids: values only
            v = list(v.values())
        d = _plain(v)
        if d is not None:
            out[k] = d
    return out


def _class_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


@functools.cache
def _package_digest() -> str:
    """Hash of this package's Python sources (subpackages installed elsewhere included)."""
    import inductor_rocm_attn

    roots = set(inductor_rocm_attn.__path__)
    for sub in ("passes", "lowering"):
        module = sys.modules.get(f"inductor_rocm_attn.{sub}")
        if module is not None:
            roots.update(module.__path__)
    h = hashlib.sha256()
    for root in sorted(roots):
        for dirpath, dirnames, files in sorted(os.walk(root)):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()


def file_digest(path: str) -> str | None:
    """sha256 of a file's content (None if unreadable)."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def _dynamo_config() -> dict[str, Any]:
    """Dynamo's settings that can change a trace (those not marked compile-ignored)."""
    config = torch._dynamo.config
    ignored = getattr(config, "_compile_ignored_keys", set())
    out = {}
    for k, v in sorted(config.get_config_copy().items()):
        if k not in ignored:
            out[k] = _plain(sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v)
    return out


def _code_digest(code) -> str:
    """A code object's content: bytecode, names and constants, nested code included.
    (Not ``marshal.dumps``: its output depends on reference counts, so one function's
    code hashed differently from one call to the next.)"""
    h = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_name, code.co_argcount, code.co_kwonlyargcount, code.co_flags):
        h.update(repr(part).encode())
    for const in code.co_consts:
        h.update((_code_digest(const) if hasattr(const, "co_code") else repr(const)).encode())
    return h.hexdigest()


def trace_key(model: torch.nn.Module, layers: Iterable[Any], forward: Callable | None,
              settings: Mapping[str, Any]) -> tuple[str, dict[str, str | None]]:
    """(key, {source file: content hash}) of one trace (see the module docstring)."""
    import triton

    modules, files = [], set()
    for name, mod in model.named_modules(remove_duplicate=False):
        cls = type(mod)
        files.add(_class_file(cls))
        modules.append((name, f"{cls.__module__}.{cls.__qualname__}", _attributes(mod)))
    tensors = [(n, _plain(t)) for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [(n, _plain(t)) for n, t in model.named_buffers(remove_duplicate=False)]
    layer_desc = []
    for layer in layers:
        layer_desc.append((getattr(layer, "layer_name", None), type(layer).__qualname__, _attributes(layer),
                           _attributes(layer.impl) if hasattr(layer, "impl") else None))
    code = _forward_digest(forward)
    desc = json.dumps(dict(
        format=_FORMAT, torch=torch.__version__, triton=triton.__version__, python=sys.version,
        package=_package_digest(), modules=modules, tensors=tensors, layers=layer_desc,
        forward=code, settings=dict(settings),
        dynamo=_dynamo_config(),
        grad=torch.is_grad_enabled(), default_dtype=str(torch.get_default_dtype()),
    ), sort_keys=True, default=repr)
    files.discard(None)
    return hashlib.sha256(desc.encode()).hexdigest(), {f: file_digest(f) for f in sorted(files)}


# --- the store ------------------------------------------------------------------------------------


def resolve_trace_cache(trace_cache: bool | str | os.PathLike | None) -> str | None:
    """The directory of the trace cache, or None when off: ``None`` reads ``ROCM_ATTN_TRACE_CACHE``
    (unset or an off spelling, ``validation.ENV_OFF``: off; an on spelling, ``ENV_ON``: the
    default directory; else a directory: "false" named no directory "false"); ``True``: the
    default directory (``rocm_attn_traces`` in Inductor's cache directory); a path: that
    directory."""
    from inductor_rocm_attn.validation import ENV_OFF, ENV_ON

    if trace_cache is None:
        trace_cache = os.environ.get(ENV, "")
        word = trace_cache.strip().lower()
        if word in ENV_OFF:
            return None
        if word in ENV_ON:
            trace_cache = True
    if trace_cache is False:
        return None
    if trace_cache is True:
        from torch._inductor.runtime.runtime_utils import cache_dir

        return os.path.join(cache_dir(), "rocm_attn_traces")
    return os.fspath(trace_cache)


@dataclasses.dataclass
class TraceEntry:
    graph: bytes  # serialize_graph's form
    plan: list  # the runner's argument plan, parameters by name
    files: dict  # source file -> content hash at store time


class TraceCache:
    """Traced graphs under ``directory``, one file per key."""

    def __init__(self, directory: str):
        """Creates ``directory`` when missing; a clear error when it cannot be (before any
        trace, rather than when the first entry is stored)."""
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise ValueError(f"trace_cache: the directory {directory!r} cannot be created ({e.strerror}); "
                             "give a writable directory, or trace_cache=False") from None
        self.directory = directory

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.trace")

    def load(self, key: str) -> TraceEntry | None:
        """The entry of ``key`` whose recorded source files are unchanged, else None (also for a
        file that is not a readable entry: truncated, corrupted, of another format; the
        trace is then made again and stored over it)."""
        try:
            with open(self._path(key), "rb") as fh:
                entry = pickle.load(fh)
            if not (isinstance(entry, TraceEntry) and isinstance(entry.graph, bytes)
                    and isinstance(entry.plan, list) and isinstance(entry.files, dict)):
                return None
            if any(file_digest(f) != digest for f, digest in entry.files.items()):
                return None
            rows = pickle.loads(entry.graph)  # the stored graph's nodes read back
            if not (isinstance(rows, list) and all(isinstance(r, tuple) and len(r) == 6 for r in rows)):
                return None
        except Exception:  # unpickling garbage raises almost anything (UnicodeDecodeError, ValueError, ...)
            return None
        return entry

    def store(self, key: str, entry: TraceEntry) -> None:
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self._path(key)}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                pickle.dump(entry, fh, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))  # atomic: readers see the old file or the new one
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise


def traced_files() -> set[str]:
    """Source files of the code the running Dynamo trace went through (in a backend)."""
    ctx = torch._guards.TracingContext.try_get()
    codes = getattr(ctx, "traced_code", None) or []
    return {c.co_filename for c in codes if os.path.isfile(c.co_filename)}


# --- the runner's argument plan and the fake inputs of a stored graph ---------------------------


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def plan_by_name(plan: list, model: torch.nn.Module) -> list | None:
    """A runner's argument plan with parameters/buffers by name (None if one has none)."""
    names: dict[int, str] = {}
    for name, t in _named_tensors(model).items():
        names.setdefault(id(t), name)
    out = []
    for entry in plan:
        if entry[0] == "param":
            if id(entry[1]) not in names:
                return None
            entry = ("param", names[id(entry[1])])
        out.append(entry)
    return out


def plan_by_tensor(plan: list, model: torch.nn.Module) -> list | None:
    """The inverse of ``plan_by_name`` on ``model`` (None if a name is missing)."""
    named = _named_tensors(model)
    out = []
    for entry in plan:
        if entry[0] == "param":
            if entry[1] not in named:
                return None
            entry = ("param", named[entry[1]])
        out.append(entry)
    return out


def fake_inputs(plan: list, input_ids: torch.Tensor) -> list:
    """Example inputs of a stored graph: ``input_ids`` / positions as fakes whose token
    dimension is one symbol (named as Dynamo names it), the symbol itself for the size
    input, the real parameters (made fake by whoever runs the graph under this mode)."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ids = mode.from_tensor(input_ids, source=LocalSource("input_ids"),
                           symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))
    with mode:
        pos = torch.empty(ids.shape[0], dtype=torch.int64, device=input_ids.device)
    by_kind = {"ids": ids, "pos": pos, "sym": ids.shape[0]}
    return [entry[1] if entry[0] == "param" else by_kind[entry[0]] for entry in plan]
