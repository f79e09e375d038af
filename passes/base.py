"""What every pass shares.

``GraphPass``: a post-grad pass the pass manager runs, with its name, whether it applies
when a piece of a piecewise-split model is compiled and when a whole graph is, and a
``uuid()`` hashing its own sources (its module, the modules of its base classes and the
modules it declares in ``depends_on``). ``FusionPass`` adds what every fusion shares:
``matched_count``, one log line, timing, and its records for the fusion report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import time
import types

import torch

logger = logging.getLogger("inductor_rocm_attn.passes")


@dataclasses.dataclass
class FusionRecord:
    """One candidate a pass looked at: a layer, whether it fused, and what (or why not)."""

    pass_name: str
    layer_name: str
    fused: bool
    detail: str
    switched_interleaved_v: bool = False


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

    def fused(self, layer_name: str, detail: str, switched_interleaved_v: bool = False) -> None:
        self.matched_count += 1
        self._record(FusionRecord(self.name, layer_name, True, detail, switched_interleaved_v))

    def not_fused(self, layer_name: str, why: str) -> None:
        self._record(FusionRecord(self.name, layer_name, False, why))

    def _record(self, record: FusionRecord) -> None:
        self.records.append(record)
        if self.report is not None:
            self.report.add(record)
