"""Forward context: how layer-level ops reach their layer, KV cache and per-step metadata.

Compiled graphs carry only a layer's name; the impl, cache and the metadata of the current
step are looked up here at run time, so a graph never bakes in per-step values and can be
replayed from a HIP/CUDA graph. Metadata is built outside the graph (plan), read inside (run).

A layer runs only inside a context: ``set_forward_context(metadata)`` for a step, or
``profiling_run()`` (``set_forward_context(None, profiling=True)``) for a profiling run,
which writes no cache and zero-fills the attention output. A layer called outside both
raises, so a forgotten context never passes for a profiling run.

The context is per thread (a ``contextvars.ContextVar``; asyncio tasks get their own too): two
threads stepping two models at once each read their own step's metadata, and a thread that
entered no context gets the error above, not another thread's step.

A name resolves through the step's own layer table when the context carries one (a cache
object that owns its layers, e.g. the transformers integration's ``PagedCache``: two caches
of one model, or a model and its ``copy.deepcopy``, never share state), else through the
registry of live ``Attention`` layers, where every live layer has a unique name.

The slot aliases of shared compiled code (``__rocm_attn_slot0__``, see
``compilation.dedup``) are names in a piecewise runner's own table, which the runner enters
with every step; they are never registered here, so they resolve the same way whether the
layers are the model's own modules or owned by a cache object.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .metadata import AttentionMetadata
from .validation import check_bool

if TYPE_CHECKING:
    from .layer import Attention

__all__ = ["ForwardContext", "set_forward_context", "profiling_run", "get_forward_context",
           "register_layer", "register_copy", "latest_copy_name", "get_layer", "registered_layers"]

# layer_name -> Attention, for every live layer. Weak, so dropping a model frees its names.
_LAYERS: "weakref.WeakValueDictionary[str, Attention]" = weakref.WeakValueDictionary()


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: "AttentionMetadata | None" = None  # None: profiling run, or no context
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: "Mapping[str, Attention] | None" = None  # this step's layer table; None: the registry
    profiling: bool = False  # a deliberate profiling run (attn_metadata is None)


# original name -> the name of its latest registered copy (``register_copy``)
_LATEST_COPY: dict[str, str] = {}

# the current step's context, per thread (and asyncio task): a global would hand one thread's
# step to the layers another thread runs meanwhile
_current: "contextvars.ContextVar[ForwardContext]" = contextvars.ContextVar(
    "rocm_attn_forward_context", default=ForwardContext())
SLOT_PREFIX = "__rocm_attn_slot"  # the slot aliases of shared compiled code (compilation.dedup)


def register_layer(name: str, layer: "Attention") -> None:
    old = _LAYERS.get(name)
    if old is not None and old is not layer:
        raise ValueError(
            f"rocm_attn: attention layer name {name!r} is already used by a live layer; "
            "give each layer of each live model a unique name (e.g. a model prefix)"
        )
    _LAYERS[name] = layer


def register_copy(name: str, layer: "Attention") -> str:
    """Register a copy of a layer (``copy.deepcopy``, unpickling) and return its name: ``name``
    when no other live layer holds it, else the first free ``name#copyN``, so a copy never
    resolves to (and writes the cache of) the layer it was copied from."""
    old = _LAYERS.get(name)
    if old is None or old is layer:
        _LAYERS[name] = layer
        return name
    for n in itertools.count(1):
        candidate = f"{name}#copy{n}"
        if candidate not in _LAYERS:
            _LAYERS[candidate] = layer
            _LATEST_COPY[name] = candidate
            return candidate
    raise AssertionError("unreachable")


def latest_copy_name(name: str) -> str:
    """The name of the latest live copy of the layer named ``name`` (``name`` if none)."""
    copy_name = _LATEST_COPY.get(name)
    return copy_name if copy_name is not None and copy_name in _LAYERS else name


def get_layer(name: str) -> "Attention":
    table = _current.get().layers
    if table is not None:
        try:
            return table[name]
        except KeyError:
            raise KeyError(
                f"rocm_attn: no attention layer named {name!r} in this step's layer table "
                f"(known: {sorted(table)[:8]}...)"
            ) from None
    if name.startswith(SLOT_PREFIX):
        raise KeyError(f"rocm_attn: {name!r} is a slot alias of shared compiled code; it resolves only "
                       "inside a step of the piecewise runner that compiled it (runner(input_ids, metadata))")
    try:
        return _LAYERS[name]
    except KeyError:
        raise KeyError(
            f"rocm_attn: no attention layer named {name!r} is alive (known: {sorted(_LAYERS)[:8]}...)"
        ) from None


def registered_layers() -> dict[str, "Attention"]:
    # items() skips entries collected meanwhile; dict(_LAYERS) looks keys up again and can
    # raise KeyError for a layer the garbage collector frees between the two
    return dict(_LAYERS.items())


def get_forward_context() -> ForwardContext:
    """The current step's context (its metadata, layer table and profiling flag); outside
    ``set_forward_context`` / ``profiling_run`` an empty one (``attn_metadata`` None). Per
    thread: another thread's context is not this one's."""
    return _current.get()


@contextlib.contextmanager
def set_forward_context(attn_metadata: "AttentionMetadata | None", *, profiling: bool = False,
                        layers: "Mapping[str, Attention] | None" = None, **extra: Any):
    """Make ``attn_metadata`` the metadata that layer-level ops read during this step.

    ``profiling=True`` with ``attn_metadata=None``: a profiling run (no cache writes, zero
    attention output), as ``profiling_run()``. ``layers`` (name -> ``Attention``, checked here): the
    table layer names resolve through during the step, instead of the registry of live layers.
    Other keywords are kept in the context's ``extra`` for the caller's own use (the seed's
    forward context carries such fields); one that looks like a misspelt ``layers`` or
    ``profiling`` is refused.
    """
    if extra:
        _check_extra(extra)
    check_bool("set_forward_context", "profiling", profiling)  # "no" would make this step a profiling run
    if attn_metadata is None:
        if not profiling:
            raise ValueError(
                "set_forward_context: attn_metadata is None; pass the step's metadata "
                "(inductor_rocm_attn.build_attention_metadata(...)), or profiling=True (or use "
                "inductor_rocm_attn.profiling_run()) for a profiling run that writes no cache and "
                "zero-fills the attention output"
            )
    elif profiling:
        raise ValueError("set_forward_context: profiling=True with metadata; a profiling run has no "
                         "metadata (pass None)")
    elif not isinstance(attn_metadata, AttentionMetadata):
        raise TypeError(f"set_forward_context: attn_metadata must be an AttentionMetadata (from "
                        f"build_attention_metadata), got {type(attn_metadata).__name__}")
    if layers is not None:
        _check_layer_table(layers)
    ctx = ForwardContext(attn_metadata, extra, layers, profiling)
    prev = _current.get()
    _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.set(prev)


def _check_extra(extra: dict) -> None:
    """A keyword meant as ``layers`` or ``profiling`` but misspelt (``layer=table``) would be
    kept as an extra and ignored: the step would resolve names through the registry instead of
    the table, or not be a profiling run, silently."""
    import difflib

    for name in extra:
        close = difflib.get_close_matches(name, _KEYWORDS, n=1, cutoff=0.7)
        if close:
            raise TypeError(f"set_forward_context() got an unexpected keyword argument {name!r}; did you mean "
                            f"{close[0]!r}? (its keywords: attn_metadata, profiling, layers; other keywords are kept "
                            "in the context's extra, for the caller's own use)")


# the keywords whose misspelling changes the step silently (the seed's fields, e.g. dp_metadata or
# virtual_engine, are not close to them)
_KEYWORDS = ("layers", "profiling")


def _check_layer_table(layers) -> None:
    """A step's layer table maps names to ``Attention`` layers: anything else would fail in
    the first op that looks a name up (a list: "list indices must be integers", a value
    that is no layer: an AttributeError on ``.impl``), far from the call that passed it."""
    if not isinstance(layers, Mapping):
        raise TypeError(f"set_forward_context: layers must be a mapping of layer name -> Attention (or None: "
                        f"the registry of live layers), got {type(layers).__name__}")
    from .layer import Attention  # layer imports this module

    # every step enters a runner's table: the entries in two C-level passes
    if (all(map(isinstance, layers.values(), itertools.repeat(Attention)))
            and all(map(isinstance, layers, itertools.repeat(str)))):
        return
    name, layer = next((n, v) for n, v in layers.items() if not (isinstance(n, str) and isinstance(v, Attention)))
    raise TypeError(f"set_forward_context: layers must map layer names (str) to Attention layers, got "
                    f"{type(name).__name__} {name!r:.60} -> {type(layer).__name__} {layer!r:.60}")


def profiling_run(*, layers: "Mapping[str, Attention] | None" = None, **extra: Any):
    """A profiling run's context (the seed's step without metadata, made deliberate): layers
    write no cache and return zeros. ``with inductor_rocm_attn.profiling_run(): model(...)``."""
    return set_forward_context(None, profiling=True, layers=layers, **extra)
