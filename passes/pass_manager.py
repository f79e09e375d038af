"""The pass manager Inductor runs as ``post_grad_custom_post_pass``.

Order, and why:

1. the enabled fusion passes of ``PASS_CLASSES``, in that order (QK-norm before plain RoPE,
   so a Qwen3-style layer fuses into the larger op; attention + quant last);
2. the custom post pass the user had installed before the plugin;
3. ``LAST_PASSES``: passes every compile of their kind needs, not switchable by flags:
   the ordering of each KV-sharing read after its target's write (whole graphs; after the
   fusions, which match a token with one consumer, and the user's pass, which may rewrite
   the writes), then the removal of the stand-in attentions of a piecewise piece (it must
   see the graph after every pass that could still use the stand-ins).

A manager compiles whole graphs; ``for_pieces()`` gives the same manager for the pieces of a
piecewise-split model. Every pass is asked whether it applies there (``GraphPass.applies``).

``uuid()`` composes each pass's uuid (a hash of its own sources), the hash of this module and
of ``lowering/`` (the fallbacks ``enable()`` registers), the flags, the mode (piece or whole
graph) and the user pass's uuid, so Inductor's FX-graph cache never serves a graph compiled
with other passes, flags or mode. Adding a pass: its file, and one line in ``PASS_CLASSES``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import pkgutil
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from inductor_rocm_attn import lowering
from inductor_rocm_attn.validation import check_bool

from .attn_quant_fusion import AttnQuantFusionPass
from .base import begin_graph, hash_sources
from .kv_sharing_order import KVSharingOrderPass
from .qk_norm_rope_kv_cache_fusion import QKNormRopeKVCacheFusionPass
from .remove_stand_ins import RemoveStandInsPass
from .report import FusionReport
from .rope_kv_cache_fusion import RopeKVCacheFusionPass

#: the fusion passes, in the order they run; each one's ``name`` is its flag
PASS_CLASSES = (
    QKNormRopeKVCacheFusionPass,
    RopeKVCacheFusionPass,
    AttnQuantFusionPass,
)
#: passes that run after the user's post pass, wherever they apply (no flag)
LAST_PASSES = (KVSharingOrderPass, RemoveStandInsPass)


def _lowering_modules() -> list:
    """``lowering`` and each of its modules: they decide the code our ops become."""
    names = sorted(f"{lowering.__name__}.{m.name}" for m in pkgutil.iter_modules(lowering.__path__))
    return [lowering, *(importlib.import_module(n) for n in names)]


class PassManager(CustomGraphPass):
    """Runs our passes around ``user_pass`` (the post pass installed before us, if any).

    ``flags``: fusion pass name -> enabled (all on by default); change them with
    ``set_flag``. ``in_piece``: whether this manager compiles pieces of a piecewise-split
    model (see ``for_pieces``).
    """

    def __init__(self, user_pass=None, flags: dict[str, bool] | None = None,
                 report: FusionReport | None = None):
        self.user_pass = user_pass
        self.report = report if report is not None else FusionReport()
        self.passes = [cls(self.report) for cls in PASS_CLASSES]
        self.last_passes = [cls(self.report) for cls in LAST_PASSES]
        self.flags = {p.name: True for p in self.passes}
        self.in_piece = False
        for name, on in (flags or {}).items():
            self.set_flag(name, on)

    def for_pieces(self) -> PassManager:
        """This manager for piece compiles: the same passes, flags, report and user pass
        (shared, so a flag set on one holds for both), with ``in_piece`` set."""
        view = copy.copy(self)
        view.in_piece = True
        return view

    def set_flag(self, name: str, enabled: bool) -> None:
        if name not in self.flags:
            raise KeyError(f"rocm_attn: unknown pass {name!r}; passes: {sorted(self.flags)}")
        check_bool("PassManager.set_flag", name, enabled)
        self.flags[name] = enabled

    def get_pass(self, name: str):
        return next(p for p in (*self.passes, *self.last_passes) if p.name == name)

    def __call__(self, graph: torch.fx.Graph) -> None:
        begin_graph()
        for p in self.passes:
            if self.flags[p.name] and p.applies(in_piece=self.in_piece):
                p(graph)
        for user_pass in _as_tuple(self.user_pass):
            user_pass(graph)
        for p in self.last_passes:
            if p.applies(in_piece=self.in_piece):
                p(graph)

    def uuid(self):
        h = hashlib.sha256()
        h.update(hash_sources([sys.modules[__name__], *_lowering_modules()]).encode())
        for p in (*self.passes, *self.last_passes):
            h.update(f"{p.name}:{p.uuid()}".encode())
        h.update(repr(sorted(self.flags.items())).encode())
        h.update(b"pieces" if self.in_piece else b"whole graphs")
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
