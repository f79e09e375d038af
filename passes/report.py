"""The fusion report: which layers fused what, and for candidates that did not, why.

Passes add a ``FusionRecord`` for every candidate they examine; the report keeps them
(across compiles, until ``clear()``) and prints one line per layer and pass. Graphs served
from Inductor's FX-graph or AOTAutograd cache run no pass: their records come back through
Inductor's counters (``base.replayed_records``), and a report made with
``receives_replays=True`` (the plugin's ``fusion_report()``) takes them in whenever it is
read, so a warm start prints what the cold start printed. A replayed fusion that emits
interleaved V switches its layer again through ``interleaved_v.switch_to_interleaved_v``
(where the layer can be found then; its impl switches it at the first fused write anyway).
"""

from __future__ import annotations

from .base import FusionRecord, replayed_records
from .interleaved_v import switch_to_interleaved_v

# passes that fuse the same cache update: a miss of one is superseded by the other's fusion
_GROUP = {"qk_norm_rope_kv_cache_fusion": "kv_cache", "rope_kv_cache_fusion": "kv_cache"}


def _serves(r: FusionRecord) -> str:
    """The layers a slot alias stands for, as the report prints them."""
    if not r.serves:
        return ""
    if len(r.serves) == 1:
        return f" [{r.serves[0]}]"
    return f" [shared by {len(r.serves)} layers: {r.serves[0]} .. {r.serves[-1]}]"


class FusionReport:
    """The records of every candidate; ``receives_replays``: also those of graphs served from
    Inductor's cache (one report of a process should: the plugin's)."""

    def __init__(self, receives_replays: bool = False):
        self._records: list[FusionRecord] = []
        self.receives_replays = receives_replays

    @property
    def records(self) -> list[FusionRecord]:
        """Every record (with ``receives_replays``, those of graphs loaded from Inductor's
        cache since the last read too)."""
        for record in replayed_records() if self.receives_replays else ():
            if record.interleaved_v:
                record.switched_interleaved_v = switch_to_interleaved_v(record.layer_name) or \
                    record.switched_interleaved_v
            self._records.append(record)
        return self._records

    def add(self, record: FusionRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def fused_layers(self, pass_name: str) -> list[str]:
        return [r.layer_name for r in self.records if r.pass_name == pass_name and r.fused]

    def switched_layers(self) -> list[str]:
        return [r.layer_name for r in self.records if r.switched_interleaved_v]

    def __str__(self) -> str:
        records = self.records
        if not records:
            return "rocm_attn fusion report: no candidates seen (is the plugin enabled and the model compiled?)"
        fused = {(r.layer_name, r.serves, _GROUP.get(r.pass_name, r.pass_name)) for r in records if r.fused}
        lines = ["rocm_attn fusion report"]
        for r in records:
            if r.fused:
                mark = "FUSED"
                if r.switched_interleaved_v:
                    extra = "; layer switched to interleaved V"
                elif r.interleaved_v:
                    extra = "; layer switches to interleaved V at its first fused write"
                else:
                    extra = ""
            else:
                # a miss superseded by another pass's fusion of the same layer is informational
                mark = "skip " if (r.layer_name, r.serves, _GROUP.get(r.pass_name, r.pass_name)) in fused else "MISS "
                extra = ""
            lines.append(f"  {mark} {r.layer_name:<28} {r.pass_name:<30} {r.detail}{extra}{_serves(r)}")
        # a record of shared compiled code counts once per layer it serves
        n_fused = sum(len(r.serves) or 1 for r in records if r.fused)
        layers = {name for r in records for name in (r.serves or (r.layer_name,))}
        lines.append(f"  {n_fused} fusion(s) over {len(layers)} layer(s)")
        return "\n".join(lines)

    __repr__ = __str__
