"""What every fusion pass shares: its name and flag, ``matched_count``, one log line, timing,
its records for the fusion report, and the hash of its source for the pass manager's uuid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import time

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


class FusionPass:
    """A post-grad pass over candidates of one fusion.

    Subclasses implement ``apply(graph) -> None`` and call ``self.fused(...)`` /
    ``self.not_fused(...)`` for every candidate they examine. ``__call__`` resets the
    per-call counters, runs ``apply``, times it and logs one line.
    """

    name: str = "fusion"

    def __init__(self, report=None):
        self.report = report
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

    @classmethod
    def hash_source(cls, *objects) -> str:
        """sha256 over the source of this pass's module and of ``objects`` (modules, classes)."""
        h = hashlib.sha256()
        for obj in objects or (inspect.getmodule(cls),):
            h.update(inspect.getsource(obj).encode())
        return h.hexdigest()
