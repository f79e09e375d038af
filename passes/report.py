"""The fusion report: which layers fused what, and for candidates that did not, why.

Passes add a ``FusionRecord`` for every candidate they examine; the report keeps them
(across compiles, until ``clear()``) and prints one line per layer and pass.
"""

from __future__ import annotations

from .base import FusionRecord


# passes that fuse the same cache update: a miss of one is superseded by the other's fusion
_GROUP = {"qk_norm_rope_kv_cache_fusion": "kv_cache", "rope_kv_cache_fusion": "kv_cache"}


class FusionReport:
    def __init__(self):
        self.records: list[FusionRecord] = []

    def add(self, record: FusionRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def fused_layers(self, pass_name: str) -> list[str]:
        return [r.layer_name for r in self.records if r.pass_name == pass_name and r.fused]

    def switched_layers(self) -> list[str]:
        return [r.layer_name for r in self.records if r.switched_interleaved_v]

    def __str__(self) -> str:
        if not self.records:
            return "rocm_attn fusion report: no candidates seen (is the plugin enabled and the model compiled?)"
        fused = {(r.layer_name, _GROUP.get(r.pass_name, r.pass_name)) for r in self.records if r.fused}
        lines = ["rocm_attn fusion report"]
        for r in self.records:
            if r.fused:
                mark = "FUSED"
                extra = "; layer switched to interleaved V" if r.switched_interleaved_v else ""
            else:
                # a miss superseded by another pass's fusion of the same layer is informational
                mark = "skip " if (r.layer_name, _GROUP.get(r.pass_name, r.pass_name)) in fused else "MISS "
                extra = ""
            lines.append(f"  {mark} {r.layer_name:<28} {r.pass_name:<30} {r.detail}{extra}")
        n_fused = sum(r.fused for r in self.records)
        lines.append(f"  {n_fused} fusion(s) over {len({r.layer_name for r in self.records})} layer(s)")
        return "\n".join(lines)

    __repr__ = __str__
