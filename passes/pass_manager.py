"""The pass manager Inductor runs as ``post_grad_custom_post_pass``.

Runs the enabled fusion passes in a fixed order (QK-norm before plain RoPE, so a Qwen3-style
layer fuses into the larger op; attention + quant last), then the custom pass the user had
installed before the plugin. ``uuid()`` hashes the source of every pass module and the flags,
plus the user pass's uuid, so Inductor's FX-graph cache never serves a graph compiled with
other passes or flags.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from inductor_rocm_attn import lowering
from inductor_rocm_attn.lowering import _fallback, attention, kv_cache, norm_quant

from . import attn_quant_fusion, base, forms, qk_norm_rope_kv_cache_fusion, report, rope_kv_cache_fusion
from .attn_quant_fusion import AttnQuantFusionPass
from .qk_norm_rope_kv_cache_fusion import QKNormRopeKVCacheFusionPass
from .report import FusionReport
from .rope_kv_cache_fusion import RopeKVCacheFusionPass

logger = logging.getLogger("inductor_rocm_attn.passes")

PASS_CLASSES = (QKNormRopeKVCacheFusionPass, RopeKVCacheFusionPass, AttnQuantFusionPass)
# everything that decides what code a compile produces: passes, forms and our lowerings
_SOURCES = (base, forms, report, rope_kv_cache_fusion, qk_norm_rope_kv_cache_fusion, attn_quant_fusion,
            lowering, _fallback, attention, kv_cache, norm_quant)


class PassManager(CustomGraphPass):
    """Runs our fusion passes, then ``user_pass`` (the post pass installed before us, if any).

    ``flags``: pass name -> enabled (all on by default); change them with ``set_flag``.
    """

    def __init__(self, user_pass=None, flags: dict[str, bool] | None = None,
                 report: FusionReport | None = None):
        self.user_pass = user_pass
        self.report = report if report is not None else FusionReport()
        self.passes = [cls(self.report) for cls in PASS_CLASSES]
        self.flags = {p.name: True for p in self.passes}
        for name, on in (flags or {}).items():
            self.set_flag(name, on)

    def set_flag(self, name: str, enabled: bool) -> None:
        if name not in self.flags:
            raise KeyError(f"rocm_attn: unknown pass {name!r}; passes: {sorted(self.flags)}")
        self.flags[name] = bool(enabled)

    def get_pass(self, name: str):
        return next(p for p in self.passes if p.name == name)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            if self.flags[p.name]:
                p(graph)
        for user_pass in _as_tuple(self.user_pass):
            user_pass(graph)

    def uuid(self):
        h = hashlib.sha256()
        for mod in _SOURCES:
            h.update(base.FusionPass.hash_source(mod).encode())
        h.update(repr(sorted(self.flags.items())).encode())
        for user_pass in _as_tuple(self.user_pass):
            user_uuid = getattr(user_pass, "uuid", None)
            u = user_uuid() if user_uuid is not None else None
            if u is None:  # a plain callable (or a pass that opts out): nothing safe to hash
                return None
            h.update(repr(u).encode())
        return h.hexdigest()


def _as_tuple(user_pass) -> tuple:
    """The user's post pass(es): Inductor accepts one pass or a list of them."""
    if user_pass is None:
        return ()
    return tuple(user_pass) if isinstance(user_pass, (list, tuple)) else (user_pass,)
