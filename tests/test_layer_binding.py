"""How layer names resolve: copies of a model get their own names and caches; a forward
context can carry its own layer table."""

import copy
import pickle

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.forward_context import get_layer
from inductor_rocm_attn.models import TinyDecoder, llama_config

from cases import poison


def _step(model, ids, alloc, cfg, seq=0):
    start = alloc.num_tokens(seq)
    alloc.allocate(seq, ids.shape[0])
    md = ira.build_attention_metadata([ids.shape[0]], [start], [alloc.block_table(seq)], cfg.block_size)
    with torch.no_grad(), ira.set_forward_context(md):
        return model(ids, md.positions)


def test_step_layer_table_must_be_a_mapping():
    """A list of layers passed as the table failed in the first op, as "list indices must be
    integers or slices, not str"."""
    layer = ira.Attention(2, 32, layer_name="binding.list", register=False)
    md = ira.build_attention_metadata([3], [0], [[1]], 16)
    for ctx in (lambda: ira.set_forward_context(md, layers=[layer]), lambda: ira.profiling_run(layers=(layer,))):
        with pytest.raises(TypeError, match=r"set_forward_context: layers must be a mapping of layer name -> "
                                            r"Attention \(or None: the registry of live layers\), got (list|tuple)"):
            with ctx():
                pass
    assert ira.get_forward_context().layers is None


def test_deepcopy_of_a_model_writes_its_own_cache():
    cfg = llama_config(num_layers=2, vocab_size=64, hidden_size=64, head_size=32)
    torch.manual_seed(0)
    model = TinyDecoder(cfg, name="binding").eval()
    ira.bind_kv_caches(model, 8, torch.float32, poison=True)
    clone = copy.deepcopy(model)
    names = [layer.layer_name for layer in ira.attention_layers(clone)]
    assert names == [f"binding.layers.{i}.attn#copy1" for i in range(2)]
    assert all(get_layer(n) is layer for n, layer in zip(names, ira.attention_layers(clone)))
    before = [layer.kv_cache.clone() for layer in ira.attention_layers(model)]
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(1))
    got = _step(clone, ids, ira.BlockAllocator(8, cfg.block_size), cfg)
    for b, layer in zip(before, ira.attention_layers(model)):  # the original's cache: untouched
        assert torch.equal(b.isnan(), layer.kv_cache.isnan())
    assert torch.equal(got, _step(model, ids, ira.BlockAllocator(8, cfg.block_size), cfg))
    assert all(not layer.kv_cache.isnan().all() for layer in ira.attention_layers(clone))
    assert [layer.layer_name for layer in ira.attention_layers(copy.deepcopy(model))] == [
        f"binding.layers.{i}.attn#copy2" for i in range(2)]  # #copy1 is still alive


def test_unpickled_layer_keeps_a_free_name():
    layer = ira.Attention(2, 32, layer_name="binding.pickled")
    data = pickle.dumps(layer)
    del layer
    restored = pickle.loads(data)
    assert restored.layer_name == "binding.pickled" and get_layer("binding.pickled") is restored


def test_step_layer_table_overrides_the_registry():
    registered = ira.Attention(2, 32, layer_name="binding.table")
    own = ira.Attention(2, 32, num_kv_heads=1, layer_name="binding.table", register=False)  # same name
    own.kv_cache = poison(ira.allocate_kv_cache(own.kv_cache_spec(torch.float32), 2))
    md = ira.build_attention_metadata([3], [0], [[1]], 16)
    q = torch.randn(3, 2, 32)
    with ira.set_forward_context(md, layers={"binding.table": own}):
        assert get_layer("binding.table") is own
        out = own(q, q[:, :1].clone(), q[:, :1].clone())  # 3-D inputs go in as they are
        with pytest.raises(KeyError, match="no attention layer named 'other' in this step's layer table"):
            get_layer("other")
    assert get_layer("binding.table") is registered
    assert out.shape == (3, 64) and out.isfinite().all()


@pytest.mark.parametrize("entry", ["not a layer", "name -> None", "int name"])
def test_step_layer_table_values_must_be_attention_layers(entry):
    """A table whose value is no Attention layer was taken, and the first op failed on it with
    a bare AttributeError ("'str' object has no attribute 'impl'")."""
    layer = ira.Attention(2, 32, layer_name="binding.values", register=False)
    table = {"binding.values": layer, **{"not a layer": {"binding.other": "binding.values"},
                                         "name -> None": {"binding.other": None},
                                         "int name": {3: layer}}[entry]}
    md = ira.build_attention_metadata([3], [0], [[1]], 16)
    for ctx in (lambda: ira.set_forward_context(md, layers=table), lambda: ira.profiling_run(layers=table)):
        with pytest.raises(TypeError, match=r"set_forward_context: layers must map layer names \(str\) to Attention "
                                            r"layers, got (str 'binding\.other' -> (str 'binding\.values'|NoneType "
                                            r"None)|int 3 -> Attention)"):
            with ctx():
                pass
    assert ira.get_forward_context().layers is None


def test_two_writing_layers_cannot_share_one_cache():
    """Binding a layer to memory another registered layer writes (the same cache, or a view
    overlapping it) is refused: each would overwrite the other's keys and values. A view of
    the same allocation that does not overlap is fine; a layer that reads another's cache
    names it in kv_sharing_target_layer_name and holds none."""
    import inductor_rocm_attn as ira

    a = ira.Attention(4, 64, num_kv_heads=2, layer_name="share_a", block_size=16)
    b = ira.Attention(4, 64, num_kv_heads=2, layer_name="share_b", block_size=16)
    ira.bind_kv_caches(torch.nn.ModuleList([a, b]), 4, torch.float32)
    own_b = b.kv_cache
    with pytest.raises(ValueError, match=r"Attention 'share_b': this KV cache shares memory with the cache of layer "
                                         r"'share_a'.*kv_sharing_target_layer_name='share_a'"):
        b.kv_cache = a.kv_cache
    assert b.kv_cache is own_b
    with pytest.raises(ValueError, match=r"shares memory with the cache of layer 'share_a'"):
        b.kv_cache = a.kv_cache[1:]  # a view inside it
    two = torch.empty((2,) + tuple(a.kv_cache.shape), dtype=a.kv_cache.dtype)
    a.kv_cache, b.kv_cache = two[0], two[1]  # halves of one allocation, apart
    assert b.kv_cache.data_ptr() != a.kv_cache.data_ptr()
