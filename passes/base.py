"""What every pass shares.

``GraphPass``: a post-grad pass the pass manager runs, with its name, whether it applies
when a piece of a piecewise-split model is compiled and when a whole graph is, and a
``uuid()`` hashing its own sources (its module, the modules of its base classes and the
modules it declares in ``depends_on``). ``FusionPass`` adds what every fusion shares:
``matched_count``, one log line, timing, and its records for the fusion report.

Records survive Inductor's caches. A graph served by the FX-graph cache (or the AOTAutograd
cache) runs no pass, so each record is also counted in ``counters["inductor"]`` under a key
that encodes it (``record_key``): Inductor stores a compile's counter increments with the
compiled graph and adds them again whenever the graph is served from a cache
(``CompiledFxGraph.counter_deltas``). ``replayed_records()`` turns the increments no pass
of this process made back into records, so the report reads the same whether a graph was
compiled or loaded.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
import json
import logging
import time
import types
import uuid

import torch
from torch._dynamo.utils import counters

logger = logging.getLogger("inductor_rocm_attn.passes")


@dataclasses.dataclass
class FusionRecord:
    """One candidate a pass looked at: a layer, whether it fused, and what (or why not).

    ``interleaved_v``: the fused writer emits interleaved V, so the layer must use it;
    ``switched_interleaved_v``: the layer was switched when the record was made (else its
    impl switches it at the first fused write); ``from_cache``: replayed for a graph served
    from Inductor's cache (not printed: the report reads the same either way); ``serves``: the
    layers a slot alias (``layer_name`` of shared compiled code) stands for, filled in by the
    piecewise build after the piece's compile (empty elsewhere).
    """

    pass_name: str
    layer_name: str
    fused: bool
    detail: str
    switched_interleaved_v: bool = False
    interleaved_v: bool = False
    from_cache: bool = dataclasses.field(default=False, compare=False)
    serves: tuple[str, ...] = dataclasses.field(default=(), compare=False)


# --- records through Inductor's counters (they survive its caches) ----------------------------

_KEY_PREFIX = "rocm_attn.fusion_record "
_FIELDS = ("pass_name", "layer_name", "fused", "detail", "switched_interleaved_v", "interleaved_v")
_accounted: collections.Counter = collections.Counter()  # key -> increments already turned into records
_accounted_in = None  # the counters["inductor"] object _accounted refers to
_graph = {"tag": "0", "ordinal": 0}  # the graph being compiled: a tag of its own, records numbered


def begin_graph() -> None:
    """The passes start on a new graph (the pass manager calls this): its records get a tag
    of their own, so a cached graph's records come back together and in their order."""
    _graph["tag"], _graph["ordinal"] = uuid.uuid4().hex[:12], 0


def record_key(record: FusionRecord) -> str:
    """The ``counters["inductor"]`` key of the next record of the current graph: the prefix,
    the graph's tag and the record's number in it, then the record's fields as JSON."""
    _graph["ordinal"] += 1
    return f"{_KEY_PREFIX}{_graph['tag']}.{_graph['ordinal']} {json.dumps([getattr(record, f) for f in _FIELDS])}"


def _ledger() -> collections.Counter:
    """``_accounted``, kept across a replacement of Inductor's counters that carries them on
    (Inductor's pattern-matcher init puts back a copy of ``counters["inductor"]``) and emptied
    when they were cleared (``counters.clear()``: a count below the ledger's)."""
    global _accounted_in
    current = counters["inductor"]
    if current is not _accounted_in:
        if any(current.get(key, 0) < n for key, n in _accounted.items()):
            _accounted.clear()
        _accounted_in = current
    return _accounted


def count_record(record: FusionRecord) -> None:
    """Count a record a pass made now: Inductor keeps the increment with the compiled graph."""
    key = record_key(record)
    _ledger()[key] += 1
    counters["inductor"][key] += 1


def replayed_records() -> list[FusionRecord]:
    """Records of graphs served from Inductor's cache since the last call (in the order
    Inductor replayed them): counter increments of our keys that no pass here made."""
    ledger, out = _ledger(), []
    for key, n in list(counters["inductor"].items()):
        if not key.startswith(_KEY_PREFIX):
            continue
        extra = n - ledger[key]
        ledger[key] = n
        fields = json.loads(key.split(" ", 2)[2])
        out.extend(FusionRecord(**dict(zip(_FIELDS, fields)), from_cache=True) for _ in range(extra))
    return out


class GraphPass:
    """A post-grad pass over an FX graph, run by the pass manager.

    Subclasses set ``name``, implement ``__call__(graph)``, list in ``depends_on`` the
    modules of this package their code uses (beyond their own module and their base
    classes' modules), and say where they apply: ``applies_in_pieces`` (compiling a piece
    between two attentions of a piecewise-split model, whose attention runs outside it) and
    ``applies_in_whole_graphs`` (any other compile). The manager asks ``applies(...)``.
    """

    name: str = "pass"
    applies_in_pieces: bool = True
    applies_in_whole_graphs: bool = True
    depends_on: tuple[types.ModuleType, ...] = ()

    def __init__(self, report=None):
        self.report = report

    def __call__(self, graph: torch.fx.Graph):  # pragma: no cover - abstract
        raise NotImplementedError

    def applies(self, *, in_piece: bool) -> bool:
        """Whether the pass runs in a piece compile (``in_piece``) or a whole-graph compile."""
        return self.applies_in_pieces if in_piece else self.applies_in_whole_graphs

    @classmethod
    def source_modules(cls) -> tuple[types.ModuleType, ...]:
        """The modules whose code decides what this pass does, each once: its own, its base
        classes', and ``depends_on``."""
        mods = [inspect.getmodule(k) for k in cls.__mro__ if isinstance(k, type) and issubclass(k, GraphPass)]
        return tuple(dict.fromkeys([*mods, *cls.depends_on]))

    @classmethod
    def source_hash(cls) -> str:
        """sha256 over the source of ``source_modules()``."""
        return hash_sources(cls.source_modules())

    def uuid(self) -> str:
        """Changes whenever the pass's code (or a module it depends on) changes."""
        return self.source_hash()


def hash_sources(modules) -> str:
    """sha256 over the source of each of ``modules``, in order."""
    h = hashlib.sha256()
    for mod in modules:
        h.update(mod.__name__.encode())
        h.update(inspect.getsource(mod).encode())
    return h.hexdigest()


class FusionPass(GraphPass):
    """A post-grad pass over candidates of one fusion.

    Subclasses implement ``apply(graph) -> None`` and call ``self.fused(...)`` /
    ``self.not_fused(...)`` for every candidate they examine. ``__call__`` resets the
    per-call counters, runs ``apply``, times it and logs one line.
    """

    name: str = "fusion"

    def __init__(self, report=None):
        super().__init__(report)
        self.matched_count = 0
        self.records: list[FusionRecord] = []
        self.last_time_s = 0.0
        self.total_time_s = 0.0  # over every graph this pass has seen

    def __call__(self, graph: torch.fx.Graph) -> int:
        self.matched_count = 0
        self.records = []
        t0 = time.perf_counter()
        self.apply(graph)
        self.last_time_s = time.perf_counter() - t0
        self.total_time_s += self.last_time_s
        switched = [r.layer_name for r in self.records if r.switched_interleaved_v]
        missed = sum(1 for r in self.records if not r.fused)
        logger.info(
            "%s: fused %d, not fused %d candidate(s) in %.1f ms%s", self.name, self.matched_count, missed,
            self.last_time_s * 1e3, f"; switched to interleaved V: {', '.join(switched)}" if switched else "",
        )
        return self.matched_count

    def apply(self, graph: torch.fx.Graph) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def fused(self, layer_name: str, detail: str, switched_interleaved_v: bool = False, *,
              interleaved_v: bool | None = None) -> None:
        """A candidate fused. ``interleaved_v``: the fused writer emits interleaved V (default:
        ``switched_interleaved_v``, whether the pass switched the layer now)."""
        self.matched_count += 1
        iv = switched_interleaved_v if interleaved_v is None else interleaved_v
        self._record(FusionRecord(self.name, layer_name, True, detail, switched_interleaved_v, iv))

    def not_fused(self, layer_name: str, why: str) -> None:
        self._record(FusionRecord(self.name, layer_name, False, why))

    def _record(self, record: FusionRecord) -> None:
        self.records.append(record)
        count_record(record)
        if self.report is not None:
            self.report.add(record)
