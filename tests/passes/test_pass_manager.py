"""The pass manager: order, where passes apply (whole graphs / pieces), and the uuid that keys
Inductor's FX-graph cache (composed from each pass's own source hash, the flags and the mode)."""

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from inductor_rocm_attn.passes import pass_manager
from inductor_rocm_attn.passes.base import FusionPass, GraphPass
from inductor_rocm_attn.passes.pass_manager import LAST_PASSES, PASS_CLASSES, PassManager
from inductor_rocm_attn.passes.rope_kv_cache_fusion import RopeKVCacheFusionPass


class UserPass(CustomGraphPass):
    def __init__(self, tag="u1", log=None):
        self.calls, self.tag, self.log = 0, tag, log

    def __call__(self, graph):
        self.calls += 1
        if self.log is not None:
            self.log.append(self.tag)

    def uuid(self):
        return self.tag


def test_uuid_covers_flags_and_user_pass():
    base = PassManager().uuid()
    assert base == PassManager().uuid()  # stable
    assert PassManager(flags={"rope_kv_cache_fusion": False}).uuid() != base
    assert PassManager(user_pass=UserPass("a")).uuid() != PassManager(user_pass=UserPass("b")).uuid()
    assert PassManager(user_pass=lambda g: None).uuid() is None  # unhashable user pass: no caching
    both = PassManager(user_pass=[UserPass("a"), UserPass("b")])
    assert both.uuid() not in (None, PassManager(user_pass=[UserPass("a")]).uuid())
    both(torch.fx.Graph())
    assert [p.calls for p in both.user_pass] == [1, 1]  # a list of user passes all run
    with pytest.raises(KeyError, match="unknown pass"):
        PassManager(flags={"nope": True})


def test_piece_mode_uuid_differs_and_shares_flags():
    whole = PassManager()
    pieces = whole.for_pieces()
    assert pieces.in_piece and not whole.in_piece
    assert pieces.uuid() != whole.uuid()
    assert pieces.uuid() == PassManager().for_pieces().uuid()  # stable
    before = pieces.uuid()
    whole.set_flag("rope_kv_cache_fusion", False)  # one flag table for both modes
    assert pieces.flags["rope_kv_cache_fusion"] is False and pieces.uuid() != before


def test_a_pass_source_change_changes_the_uuid(monkeypatch):
    base, pieces = PassManager().uuid(), PassManager().for_pieces().uuid()
    monkeypatch.setattr(RopeKVCacheFusionPass, "source_hash", classmethod(lambda cls: "edited"))
    assert PassManager().uuid() != base
    assert PassManager().for_pieces().uuid() != pieces


def test_a_new_pass_enters_the_uuid_without_a_source_list(monkeypatch):
    class NewPass(FusionPass):
        name = "new_fusion"

        def apply(self, graph):
            pass

    base = PassManager().uuid()
    monkeypatch.setattr(pass_manager, "PASS_CLASSES", (*PASS_CLASSES, NewPass))
    mgr = PassManager()
    assert mgr.flags["new_fusion"] is True and mgr.uuid() != base
    with_hash = mgr.uuid()
    monkeypatch.setattr(NewPass, "source_hash", classmethod(lambda cls: "edited"))
    assert PassManager().uuid() != with_hash


def test_a_lowering_source_change_changes_the_uuid(monkeypatch):
    base = PassManager().uuid()
    real = pass_manager.hash_sources

    def edited(modules):
        modules = list(modules)
        names = [m.__name__ for m in modules]
        return real(modules) + ("edited" if "inductor_rocm_attn.lowering.kv_cache" in names else "")

    monkeypatch.setattr(pass_manager, "hash_sources", edited)
    assert PassManager().uuid() != base


class _Recorder(GraphPass):
    log: list = []

    def __call__(self, graph):
        self.log.append(self.name)


def _recorder(name, in_pieces=True, in_whole=True):
    return type(name, (_Recorder,), {"name": name, "applies_in_pieces": in_pieces,
                                     "applies_in_whole_graphs": in_whole})


def test_order_and_where_passes_apply(monkeypatch):
    log = []
    _Recorder.log = log
    fusions = (_recorder("a"), _recorder("whole_only", in_pieces=False), _recorder("b"))
    last = (_recorder("pieces_only", in_whole=False),)
    monkeypatch.setattr(pass_manager, "PASS_CLASSES", fusions)
    monkeypatch.setattr(pass_manager, "LAST_PASSES", last)
    mgr = PassManager(user_pass=UserPass("user", log), flags={"b": False})
    mgr(torch.fx.Graph())
    assert log == ["a", "whole_only", "user"]
    log.clear()
    mgr.for_pieces()(torch.fx.Graph())
    assert log == ["a", "user", "pieces_only"]  # asked, not flipped: the flags are untouched
    assert mgr.flags == {"a": True, "whole_only": True, "b": False}


def test_the_real_passes_declare_where_they_apply():
    mgr = PassManager()
    in_pieces = [p.name for p in (*mgr.passes, *mgr.last_passes) if p.applies(in_piece=True)]
    in_whole = [p.name for p in (*mgr.passes, *mgr.last_passes) if p.applies(in_piece=False)]
    assert in_pieces == ["qk_norm_rope_kv_cache_fusion", "rope_kv_cache_fusion", "remove_stand_ins"]
    assert in_whole == ["qk_norm_rope_kv_cache_fusion", "rope_kv_cache_fusion", "attn_quant_fusion",
                        "kv_sharing_order"]
    assert [cls.name for cls in LAST_PASSES] == ["kv_sharing_order", "remove_stand_ins"]
    # not switchable: piece compiles need the one, KV-sharing models the other
    assert "remove_stand_ins" not in mgr.flags and "kv_sharing_order" not in mgr.flags
