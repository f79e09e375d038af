"""The pass base classes: counting and records of a fusion pass, where a pass applies, and the
sources a pass's uuid hashes (every module of this package its code uses)."""

import inspect
import types

import torch

from inductor_rocm_attn.passes import base, pass_manager
from inductor_rocm_attn.passes.base import FusionPass, GraphPass
from inductor_rocm_attn.passes.report import FusionReport


class _Pass(FusionPass):
    name = "demo_fusion"

    def apply(self, graph):
        self.fused("layer.a", "fused a", switched_interleaved_v=True)
        self.not_fused("layer.b", "b is not a candidate")


def test_fusion_pass_counts_and_reports_each_call():
    report = FusionReport()
    p = _Pass(report)
    assert p(torch.fx.Graph()) == 1 and p.matched_count == 1
    assert [(r.layer_name, r.fused, r.switched_interleaved_v) for r in p.records] == [
        ("layer.a", True, True), ("layer.b", False, False)]
    p(torch.fx.Graph())
    assert p.matched_count == 1 and len(p.records) == 2  # per call
    assert len(report.records) == 4  # the report keeps every call's records
    assert p.total_time_s >= p.last_time_s >= 0


def test_applies_reads_the_class_declarations():
    class PieceOnly(GraphPass):
        applies_in_whole_graphs = False

    assert GraphPass().applies(in_piece=True) and GraphPass().applies(in_piece=False)
    assert PieceOnly().applies(in_piece=True) and not PieceOnly().applies(in_piece=False)


def test_uuid_hashes_own_module_bases_and_declared_modules():
    class WithDep(GraphPass):
        depends_on = (base,)

    mods = WithDep.source_modules()
    assert mods[0] is inspect.getmodule(WithDep) and base in mods and len(mods) == len(set(mods))
    assert WithDep().uuid() == base.hash_sources(mods)
    assert base.hash_sources([base]) != base.hash_sources([pass_manager])


def _package_modules_used(module: types.ModuleType, package: str) -> set:
    """The modules of ``package`` that ``module``'s globals reach, transitively."""
    seen, todo = set(), [module]
    while todo:
        mod = todo.pop()
        for value in vars(mod).values():
            used = value if isinstance(value, types.ModuleType) else inspect.getmodule(value)
            if used is None or not used.__name__.startswith(package + ".") or used in seen:
                continue
            seen.add(used)
            todo.append(used)
    return seen


def test_every_pass_declares_the_package_modules_it_uses():
    """A pass that starts using another module of ``passes`` must list it in ``depends_on``,
    or its uuid (so Inductor's FX-graph cache) would miss edits to that module."""
    for cls in (*pass_manager.PASS_CLASSES, *pass_manager.LAST_PASSES):
        module = inspect.getmodule(cls)
        used = _package_modules_used(module, "inductor_rocm_attn.passes") - {module}
        missing = sorted(m.__name__ for m in used - set(cls.source_modules()))
        assert not missing, f"{cls.__name__}.depends_on misses {missing}"
