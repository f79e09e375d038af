"""The generic FX helpers, on small ``make_fx`` graphs with fake values."""

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_rocm_attn.passes import fx_utils

aten = torch.ops.aten


def _graph():
    def f(x):
        y = x.view(4, 6).reshape(24)
        a, b = torch.split(y, [16, 8])
        return a * 2, b

    return make_fx(f, tracing_mode="fake")(torch.randn(2, 12)).graph


def _node(graph, target):
    return next(n for n in graph.nodes if n.op == "call_function" and n.target is target)


def test_val_strip_views_and_getitems():
    g = _graph()
    x = next(n for n in g.nodes if n.op == "placeholder")
    split = _node(g, aten.split_with_sizes.default)
    assert fx_utils.strip_views(split.args[0]) is x
    assert fx_utils.val(x).shape == (2, 12) and fx_utils.val(split) is None  # a list, not a tensor
    b = fx_utils.getitem_user(split, 1)
    assert fx_utils.is_getitem(b, 1) and not fx_utils.is_getitem(b, 0) and not fx_utils.is_getitem(x)
    assert fx_utils.val(b).shape == (8,)
    assert fx_utils.getitem_user(split, 2) is None


def test_call_reshape_like_and_finish():
    g = _graph()
    split = _node(g, aten.split_with_sizes.default)
    a = fx_utils.getitem_user(split, 0)
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        sq = fx_utils.call(g, aten.mul.Tensor, (a, a))
        like = fx_utils.call(g, aten.reshape.default, (sq, [2, 8]))
        back = fx_utils.reshape_like(g, sq, like)  # [16] -> [-1, 8]
        fx_utils.call(g, aten.neg.default, (a,))  # dead
    assert fx_utils.val(sq).shape == (16,) and fx_utils.val(back).shape == (2, 8)
    assert back.target is aten.reshape.default and back.args[1] == [-1, 8]
    assert fx_utils.reshape_like(g, like, back) is like  # same trailing dims: no reshape
    out.args = ((back,),)
    fx_utils.finish(g)
    assert not any(n.target is aten.neg.default for n in g.nodes)
    assert not any(n.target is aten.mul.Tensor and n.args == (a, 2) for n in g.nodes)  # old output gone


def test_auto_functionalized_op():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    op = torch.ops.rocm_attn.unified_attention_with_output.default
    af = g.call_function(torch.ops.higher_order.auto_functionalized_v2, (op,), {"_all_bases": [x]})
    item = g.call_function(operator.getitem, (af, 1))
    assert fx_utils.auto_functionalized_op(af) is op
    assert fx_utils.auto_functionalized_op(item) is None and fx_utils.auto_functionalized_op(x) is None
