"""Configuration mistakes are errors at construction, each naming the op, the parameter, the
value and what is supported (issue 14, items 3 and 6)."""

import math
import re
import os

import pytest
import torch

import inductor_rocm_attn as ira
from inductor_rocm_attn.__main__ import main

from reliability_steps import BS, D, H, HKV, qkv, run_layer_ops


def _layer(name, **kw):
    return ira.Attention(H, D, num_kv_heads=HKV, layer_name=f"cfg.{name}", **kw)


@pytest.mark.parametrize("scale", [0.0, -0.5, math.nan, math.inf, "0.1"])
def test_attention_scale(scale):
    with pytest.raises(ValueError, match=rf"RocmAttentionImpl: scale must be a positive finite number, got "
                                         rf"{scale!r}"):
        _layer(f"scale{scale}", scale=scale)


@pytest.mark.parametrize("cap", [math.nan, math.inf, -1.0])
def test_logits_soft_cap(cap):
    with pytest.raises(ValueError, match=rf"RocmAttentionImpl: logits_soft_cap must be None, 0 \(off\) or a positive "
                                         rf"finite number, got {cap!r}"):
        _layer(f"cap{cap}", logits_soft_cap=cap)


@pytest.mark.parametrize("field, value", [("num_heads", -4), ("num_heads", 0), ("num_kv_heads", -2),
                                          ("num_heads", 4.0), ("num_kv_heads", True)])
def test_head_counts(field, value):
    kw = dict(num_heads=H, num_kv_heads=HKV)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"RocmAttentionImpl: {field} must be a positive int, got {value!r}"):
        ira.Attention(kw["num_heads"], D, num_kv_heads=kw["num_kv_heads"], layer_name=f"cfg.{field}{value}")


@pytest.mark.parametrize("field", ["k_scale", "v_scale", "q_scale"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_quant_scales(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a positive finite number, got {value!r}"):
        _layer(f"{field}{value}", **{field: value})


def test_sliding_window_must_be_a_positive_int():
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=rf"RocmAttentionImpl: sliding_window must be None or a positive int, "
                                             rf"got {bad!r}"):
            _layer(f"win{bad}", sliding_window=bad)


@pytest.mark.parametrize("head_size", [0, -64, 64.0])
def test_head_size_checked_before_the_default_scale(head_size):
    """The default scale is head_size ** -0.5: a bad head size names itself, not a
    ZeroDivisionError or a complex number."""
    with pytest.raises(ValueError, match=rf"Attention: head_size {head_size!r} is not supported; supported: "):
        ira.Attention(4, head_size, layer_name=f"bad_head_{head_size}")


def test_unknown_cache_layout():
    with pytest.raises(ValueError, match=r"Attention: cache_layout 'NHD' is not supported; supported: "
                                         r"'LHBNC', 'LBHNC'"):
        _layer("layout", cache_layout="NHD")
    with pytest.raises(ValueError, match=r"cache_layout 'XYZ' is not supported; supported: 'LHBNC', 'LBHNC'"):
        ira.CacheLayout("XYZ")


def test_sinks_as_a_list_are_taken_as_a_tensor():
    layer = _layer("sinks_list", sinks=[0.5, -1.0, 0.0, 2.0])
    assert isinstance(layer.impl.sinks, torch.Tensor) and layer.impl.sinks.dtype == torch.float32
    with pytest.raises(ValueError, match=r"RocmAttentionImpl: sinks must be \[num_heads\] = \[4\], got \(3,\)"):
        _layer("sinks_short", sinks=[0.5, -1.0, 0.0])
    with pytest.raises(ValueError, match=r"RocmAttentionImpl: sinks must not hold NaN"):
        _layer("sinks_nan", sinks=[0.5, math.nan, 0.0, 1.0])
    with pytest.raises(TypeError, match=r"RocmAttentionImpl: sinks must be a tensor or a list of floats, got 'str'"):
        _layer("sinks_str", sinks="abcd")
    with pytest.raises(TypeError, match=r"RocmAttentionImpl: sinks must be a float tensor \(float32, bfloat16, "
                                        r"float16 or float64\), got torch.int64"):
        _layer("sinks_int", sinks=torch.arange(4))
    # a strided view is taken as its values: the layer keeps a contiguous copy for the kernels
    wide = torch.tensor([0.5, 9.0, -1.0, 9.0, 0.0, 9.0, 2.0, 9.0])
    layer = _layer("sinks_strided", sinks=wide[::2])
    assert layer.impl.sinks.is_contiguous() and layer.impl.sinks.tolist() == [0.5, -1.0, 0.0, 2.0]


def test_alibi_slopes_must_be_finite():
    with pytest.raises(ValueError, match=r"RocmAttentionImpl: alibi_slopes must be finite"):
        _layer("alibi_nan", alibi_slopes=[0.5, math.nan, 0.25, 0.125])


def test_block_size_zero_in_the_builder():
    with pytest.raises(ValueError, match=r"build_attention_metadata: block_size 0 is not supported; it must be a "
                                         r"positive multiple of 16"):
        ira.build_attention_metadata([3], [0], [[0]], 0)


def test_builder_checks_block_ids():
    with pytest.raises(IndexError, match=r"build_attention_metadata: block_tables\[1\]\[0\] = -1 is not a block id "
                                         r"\(block ids are >= 0\)"):
        ira.build_attention_metadata([3, 2], [0, 0], [[0], [-1]], BS)
    with pytest.raises(IndexError, match=r"build_attention_metadata: block_tables\[0\]\[1\] = 8 is outside the cache "
                                         r"\(num_blocks 8: valid block ids 0\.\.7\)"):
        ira.build_attention_metadata([3], [20], [[0, 8]], BS, num_blocks=8)
    with pytest.raises(ValueError, match=r"build_attention_metadata: sequence 0 has query_len -1"):
        ira.build_attention_metadata([-1], [0], [[0]], BS)


def test_builder_records_block_size_and_plan():
    md = ira.build_attention_metadata([3, 1], [0, 17], [[2], [5, 6]], BS)
    assert md.block_size == BS
    assert md.plan.max_block_id == 6 and md.plan.max_position == 17


def test_bind_kv_caches_num_blocks():
    layer = _layer("bind0")
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match=rf"bind_kv_caches: num_blocks must be a positive int, got {bad!r}"):
            ira.bind_kv_caches(layer, bad, torch.float32)


def test_bind_kv_caches_needs_attention_layers():
    """A model without Attention layers (a transformers model, a wrong sub-module) bound
    nothing and returned {} without a word."""
    with pytest.raises(ValueError, match=r"bind_kv_caches: Sequential holds no inductor_rocm_attn.Attention layer; "
                                         r"for a transformers model use .*PagedCache"):
        ira.bind_kv_caches(torch.nn.Sequential(torch.nn.Linear(4, 4)), 4, torch.float32)
    with pytest.raises(TypeError, match=r"bind_kv_caches: model must be a torch.nn.Module, got dict"):
        ira.bind_kv_caches({"attn": _layer("bind_dict")}, 4, torch.float32)


def test_cli_device_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as e:
        main(["demo", "--eager", "--device", "cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: this torch build has no usable CUDA/ROCm GPU" in err and "Traceback" not in err


def test_cli_unknown_device(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--eager", "--device", "tpu"])
    assert e.value.code == 2
    assert "--device 'tpu' is not supported; supported: cpu, cuda" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu:x", "cpu:", "cuda:x"])
def test_cli_malformed_device(capsys, device):
    """A malformed device string passed the CLI's check and failed inside the demo, as a
    RuntimeError traceback (exit code 1)."""
    with pytest.raises(SystemExit) as e:
        main(["demo", "--eager", "--device", device])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--device {device!r} is not a device string; supported: cpu, cuda" in err and "Traceback" not in err


def test_hand_built_metadata_states_its_block_size():
    layer = _layer("hand_built")
    ira.bind_kv_caches(layer, 4, torch.float32)
    md = ira.AttentionMetadata(
        num_actual_tokens=2, max_query_len=2, query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        max_seq_len=2, seq_lens=torch.tensor([2], dtype=torch.int32), block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([16, 17]), positions=torch.tensor([0, 1]), block_size=32)
    g = torch.Generator().manual_seed(0)
    q, k, v = qkv(2, g)
    with pytest.raises(ValueError, match=r"metadata built for block_size 32, but the layer's KV cache has block_size 16"):
        run_layer_ops(layer, md, q, k, v, torch.empty(2, H, D))


@pytest.mark.parametrize("field, value", [("head_size", 64.0), ("block_size", 16.0), ("block_size", "16")])
def test_sizes_must_be_ints(field, value):
    kw = dict(head_size=D, block_size=BS)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"{field} {value!r} is not supported"):
        ira.Attention(H, kw["head_size"], num_kv_heads=HKV, layer_name=f"cfg.int.{field}", block_size=kw["block_size"])


def test_numpy_ints_and_floats_are_taken():
    np = pytest.importorskip("numpy")
    layer = ira.Attention(np.int64(H), np.int64(D), num_kv_heads=np.int64(HKV), layer_name="cfg.numpy",
                          scale=np.float32(0.125), block_size=np.int64(BS))
    assert (layer.num_heads, layer.head_size, layer.block_size) == (H, D, BS) and type(layer.num_heads) is int
    md = ira.build_attention_metadata(np.array([3, 1]), np.array([0, 17]), [np.array([2]), [5, 6]], BS)
    assert md.max_query_len == 3 and type(md.max_query_len) is int


def test_builder_rejects_float_block_ids():
    with pytest.raises(ValueError, match=r"build_attention_metadata: block_tables must hold integer block ids"):
        ira.build_attention_metadata([3], [0], [[1.5]], BS)


def test_block_allocator_arguments():
    with pytest.raises(ValueError, match=r"BlockAllocator: num_blocks must be a positive int, got 0"):
        ira.BlockAllocator(0, BS)
    alloc = ira.BlockAllocator(4, BS)
    with pytest.raises(ValueError, match=r"BlockAllocator.allocate: num_new_tokens must be an int >= 0, got -3"):
        alloc.allocate("a", -3)
    # Python's "unhashable type: 'list'" named no method; free's KeyError named none either
    for method, args in (("allocate", (1,)), ("free", ()), ("truncate", (0,)), ("block_table", ()), ("num_tokens", ())):
        with pytest.raises(TypeError, match=rf"BlockAllocator\.{method}: seq_id must be hashable \(e\.g\. an int or a "
                                            r"str\), got list \['a'\]"):
            getattr(alloc, method)(["a"], *args)
    alloc.allocate("a", 3)
    alloc.free("a")
    with pytest.raises(KeyError, match=r"BlockAllocator\.free: unknown sequence 'a' \(never allocated, or freed already\)"):
        alloc.free("a")
    assert alloc.num_free_blocks == 4


def test_bind_kv_caches_dtype():
    layer = _layer("bind_dtype")
    with pytest.raises(ValueError, match=r"bind_kv_caches: dtype 'float16' is not supported"):
        ira.bind_kv_caches(layer, 4, "float16")


def test_layer_inputs_must_be_tensors():
    layer = _layer("not_tensors")
    ira.bind_kv_caches(layer, 4, torch.float32)
    md = ira.build_attention_metadata([2], [0], [[0]], BS)
    with pytest.raises(TypeError, match=r"Attention 'cfg.not_tensors': query, key and value must be tensors, got "
                                        r"Tensor, NoneType, Tensor"), ira.set_forward_context(md):
        layer(torch.randn(2, H * D), None, torch.randn(2, HKV * D))


_RUNNER_CASES = [
    (dict(capture_sizes=[]), ValueError, r"capture_sizes is empty"),
    (dict(capture_sizes=[0, 2]), ValueError, r"capture_sizes must hold positive ints, got 0 in \[0, 2\]"),
    (dict(capture_sizes=[2.5]), ValueError, r"capture_sizes must hold positive ints, got 2.5"),
    (dict(capture_sizes=3), TypeError, r"capture_sizes must be a sequence of positive ints, got 3"),
    (dict(max_num_seqs=0), ValueError, r"max_num_seqs must be a positive int, got 0"),
    (dict(max_num_tokens=-1), ValueError, r"max_num_tokens must be a positive int, got -1"),
    (dict(max_num_tokens=2), ValueError, r"max_num_tokens 2 is below the largest capture size 4"),
    (dict(max_model_len=0), ValueError, r"max_model_len must be a positive int, got 0"),
    (dict(mixed_graphs="yes"), TypeError, r"mixed_graphs must be True or False, got 'yes'"),
    (dict(plugin=1), TypeError, r"plugin must be True, False or None, got 1"),
    (dict(trace_cache=123), TypeError, r"trace_cache must be True, False, None or a directory path, got 123"),
    (dict(compile_threads=0), ValueError, r"compile_threads must be a positive int, got 0"),
    (dict(compile_threads=2.0), ValueError, r"compile_threads must be a positive int, got 2.0"),
    (dict(compile_threads=True), ValueError, r"compile_threads must be a positive int, got True"),
    # failed only after the trace and every compile: at the capture (AttributeError) or the first message
    (dict(graph_backend=True), TypeError, r"graph_backend must be a graph backend \(CudaGraphBackend\(\), "
                                          r"RerunGraphBackend\(\) or an object with warmup, capture, capture_step, "
                                          r"synchronize\), got True"),
    (dict(progress="yes"), TypeError, r"progress must be callable \(e.g. print\) or None, got 'yes'"),
    # a list of layers failed as "'list' object has no attribute 'values'"
    (dict(layers=[]), TypeError, r"layers must be a mapping of layer name -> Attention \(e.g. runner.layers\), "
                                 r"got a list"),
    (dict(layers={"l0": torch.nn.Linear(2, 2)}), TypeError, r"layers must be a mapping .*, got 'l0': Linear"),
]


@pytest.mark.parametrize("kw, exc, message", _RUNNER_CASES, ids=[next(iter(c[0])) + str(i) for i, c in
                                                                  enumerate(_RUNNER_CASES)])
def test_compile_piecewise_config(kw, exc, message):
    """Refused before anything is traced or allocated (the model needs no cache for that)."""
    from inductor_rocm_attn.compilation import compile_piecewise

    model = torch.nn.Linear(2, 2)
    args = dict(capture_sizes=[1, 2, 4], capture=False)
    args.update(kw)
    with pytest.raises(exc, match=rf"compile_piecewise: {message}"):
        compile_piecewise(model, **args)


def test_compile_piecewise_layers_keyed_by_their_names():
    """The traced ops name a layer by its layer_name: a mapping key of another name was ignored."""
    from inductor_rocm_attn.compilation import compile_piecewise

    with pytest.raises(ValueError, match=r"compile_piecewise: layers key 'wrong' maps to the layer named "
                                         r"'cfg\.runner_key'; the keys are the layers' layer_name"):
        compile_piecewise(torch.nn.Linear(2, 2), [1, 2], capture=False, layers={"wrong": _layer("runner_key")})


def test_compile_piecewise_refuses_a_model_without_parameters():
    from inductor_rocm_attn.compilation import compile_piecewise

    class NoWeights(torch.nn.Module):
        def forward(self, input_ids, positions):
            return input_ids

    with pytest.raises(ValueError, match=r"compile_piecewise: NoWeights has no parameters"):  # a bare StopIteration
        compile_piecewise(NoWeights(), [1, 2])


def test_trace_cache_directory_that_cannot_be_created(tmp_path):
    from inductor_rocm_attn.compilation.trace_cache import TraceCache

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"trace_cache: the directory .* cannot be created"):
        TraceCache(str(blocker / "traces"))


def test_block_allocator_refusal_keeps_the_sequence():
    """A refused allocation changes nothing: a sequence allocated with no tokens yet used to be
    dropped by it (its table gone, free() and block_table() then raising KeyError)."""
    alloc = ira.BlockAllocator(4, BS)
    alloc.allocate("a", 0)
    with pytest.raises(MemoryError, match=r"BlockAllocator: sequence 'a' needs 7 more blocks, 4 free of 4"):
        alloc.allocate("a", 7 * BS)
    assert alloc.block_table("a") == [] and alloc.num_tokens("a") == 0 and alloc.num_free_blocks == 4
    assert alloc.allocate("a", BS + 1) == [0, 1]
    with pytest.raises(MemoryError):
        alloc.allocate("b", 3 * BS)
    with pytest.raises(KeyError, match=r"BlockAllocator\.block_table: unknown sequence 'b' \(allocate it first\)"):
        alloc.block_table("b")
    alloc.free("a")
    assert alloc.num_free_blocks == 4


@pytest.mark.parametrize("tables, exc, match", [
    ([[2**31, 0]], IndexError, r"block_tables\[0\]\[0\] = 2147483648 is not a block id \(block ids are < 2\*\*31: "
                            r"the block table is int32\)"),
    ([[2**62, 0]], IndexError, r"block_tables\[0\]\[0\] = 4611686018427387904 is not a block id"),
    ([["3", 0]], TypeError, r"block_tables\[0\]\[0\] = '3' is not a block id \(an int\)"),
    ([[1, None]], TypeError, r"block_tables\[0\]\[1\] = None is not a block id \(an int\)"),
    ([3], TypeError, r"block_tables\[0\] must be a sequence of block ids, got int 3"),
], ids=["int32_overflow", "int64_overflow", "str", "none", "flat_list"])
def test_builder_block_ids_it_cannot_store(tables, exc, match):
    """A block id past int32 wrapped in the int32 block table (the slots pointed elsewhere: a
    bincount IndexError or an int64 overflow); a non-int entry or a flat list raised Python's
    comparison or len() errors. Each names the entry now."""
    with pytest.raises(exc, match=rf"build_attention_metadata: {match}"):
        ira.build_attention_metadata([BS + 4], [0], tables, BS)  # two blocks


def test_plugin_flags_are_checked_before_any_is_applied():
    """enable(rope_kv_cache_fusion="false") turned the pass on (bool("false")); an unknown flag
    after a valid one left the valid one applied. Every flag is checked first."""
    import importlib

    plugin = importlib.import_module("inductor_rocm_attn.compilation.plugin")
    was = plugin.is_enabled()
    manager = ira.enable()
    try:
        flags = dict(manager.flags)
        with pytest.raises(TypeError, match=r"enable: rope_kv_cache_fusion must be True or False, got 'false'"):
            ira.enable(rope_kv_cache_fusion="false")
        # an unknown keyword was a KeyError: a TypeError naming enable() and its options, as for any function
        with pytest.raises(TypeError, match=r"enable\(\) got an unexpected keyword argument 'rope_fusion'; its options "
                                            r"are the fusion passes: attn_quant_fusion, .*rope_kv_cache_fusion"):
            ira.enable(rope_kv_cache_fusion=False, rope_fusion=False)
        with pytest.raises(KeyError, match=r"set_pass_flag: unknown pass 'rope_fusion'"):
            plugin.set_pass_flag("rope_fusion", False)
        with pytest.raises(TypeError, match=r"set_pass_flag: attn_quant_fusion must be True or False, got 0"):
            plugin.set_pass_flag("attn_quant_fusion", 0)
        # plugin() on an enabled plugin read the flags' values back first: a bare KeyError('rope_fusion')
        with pytest.raises(TypeError, match=r"plugin\(\) got an unexpected keyword argument 'rope_fusion'"):
            with ira.plugin(rope_fusion=False):
                pass
        with pytest.raises(TypeError, match=r"plugin: rope_kv_cache_fusion must be True or False, got 'no'"):
            with ira.plugin(rope_kv_cache_fusion="no"):
                pass
        assert manager.flags == flags
    finally:
        if not was:
            ira.disable()


def test_set_pass_flag_with_the_plugin_off_names_the_flag_and_the_fix():
    """With the plugin off, set_pass_flag("rope_fusion", ...) (a misspelt pass) said only "the
    plugin is not enabled": an unknown name is refused first, and a known one names the call
    and enable()."""
    import importlib

    plugin = importlib.import_module("inductor_rocm_attn.compilation.plugin")
    if plugin.is_enabled():
        pytest.skip("the plugin is enabled in this process")
    with pytest.raises(KeyError, match=r"set_pass_flag: unknown pass 'rope_fusion'"):
        plugin.set_pass_flag("rope_fusion", False)
    with pytest.raises(RuntimeError, match=r"set_pass_flag\('rope_kv_cache_fusion', False\): the plugin is not "
                                           r"enabled; call enable\(\) first"):
        plugin.set_pass_flag("rope_kv_cache_fusion", False)
    assert not plugin.is_enabled()


class _NoStepRunner:
    """A runner's limits and caches (8 blocks of 16 tokens); any step it is asked to plan fails
    the test: generate() must refuse its arguments before the first step."""

    block_size, max_num_tokens, max_num_seqs, max_model_len = BS, 16, 4, 96

    def __init__(self):
        layer = _layer(f"gen.{id(self)}")
        ira.bind_kv_caches(layer, 8, torch.float32)
        self.layers = {layer.layer_name: layer}

    def prepare(self, *args, **kwargs):
        raise AssertionError("generate() planned a step before refusing its arguments")


_GENERATE_CASES = [
    # 0 stood for "the runner's default" (`x or default`), 2.5 failed inside BlockAllocator
    (dict(max_tokens_per_step=0), ValueError, r"max_tokens_per_step must be a positive int, got 0"),
    (dict(max_seqs_per_step=0), ValueError, r"max_seqs_per_step must be a positive int, got 0"),
    (dict(num_blocks=0), ValueError, r"num_blocks must be a positive int, got 0"),
    (dict(max_tokens_per_step=2.5), ValueError, r"max_tokens_per_step must be a positive int, got 2\.5"),
    # past the runner's limits: refused at the first step that reached them, after steps ran
    (dict(max_tokens_per_step=32), ValueError, r"max_tokens_per_step 32 is above the runner's max_num_tokens \(16\)"),
    (dict(max_seqs_per_step=5), ValueError, r"max_seqs_per_step 5 is above the runner's max_num_seqs \(4\)"),
    (dict(num_blocks=9), ValueError, r"num_blocks 9 is above the blocks of the runner's caches \(8\)"),
    # a prompt that can never fit: refused when its chunks or decodes reached the limit
    (dict(prompts=[[3] * 90], max_new_tokens=8), ValueError,
     r"prompt 0 \(90 tokens\) with max_new_tokens 8 reaches 97 cached tokens, above the runner's max_model_len 96"),
    (dict(prompts=[[3] * 20], max_new_tokens=60, num_blocks=4), ValueError,
     r"prompt 0 \(20 tokens\) with max_new_tokens 60 reaches 79 cached tokens, more than 4 blocks of 16 hold"),
    # token ids that are not ints were truncated (3.7 -> 3) or failed in int()/iteration
    (dict(prompts=[[3, 4.7]]), TypeError, r"prompt 0 holds 4\.7 \(float\); token ids are ints"),
    (dict(prompts=[[3, True]]), TypeError, r"prompt 0 holds True \(bool\); token ids are ints"),
    (dict(prompts=[torch.tensor([3.0, 4.0])]), TypeError,
     r"prompt 0 must be a 1-D integer tensor of token ids, got \(2,\) torch\.float32"),
    (dict(prompts=[torch.tensor([[3, 4]])]), TypeError, r"prompt 0 must be a 1-D integer tensor of token ids"),
    (dict(prompts=[3, 4]), TypeError, r"prompt 0 must be a list of token ids or a 1-D integer tensor, got int 3"),
    (dict(prompts=["ab"]), TypeError, r"prompt 0 must be a list of token ids or a 1-D integer tensor, got str 'ab'"),
    (dict(on_step=5), TypeError, r"on_step must be callable or None, got int"),
    # "generate: empty prompt" named none of the prompts
    (dict(prompts=[[3, 4], torch.tensor([], dtype=torch.long)]), ValueError,
     r"prompt 1 is empty; every prompt needs at least one token id"),
    # unordered: a set's ids ran in hash order, a dict of prompts gave its keys as prompts
    (dict(prompts=[{5, 3, 4}]), TypeError, r"prompt 0 is a set, which has no token order"),
    (dict(prompts=[{3: 1, 4: 1}]), TypeError, r"prompt 0 is a dict, which has no token order"),
    (dict(prompts={(3, 4), (5, 6)}), TypeError, r"prompts must be a list of prompts .*, got a set, which has no order"),
    (dict(prompts={"a": [3, 4]}), TypeError, r"prompts must be a list of prompts .*, got a dict, which has no order"),
    # prompts not a list of prompts: list(5) failed with "'int' object is not iterable"
    (dict(prompts=5), TypeError, r"prompts must be a list of prompts \(token id lists or 1-D integer tensors\), "
                                 r"got int 5"),
]


@pytest.mark.parametrize("kw, exc, match", _GENERATE_CASES, ids=[f"{i}" for i in range(len(_GENERATE_CASES))])
def test_generate_arguments_are_checked_before_the_first_step(kw, exc, match):
    from inductor_rocm_attn.integrations.batching import generate

    args = dict(prompts=[[3, 4, 5]], max_new_tokens=2)
    args.update(kw)
    with pytest.raises(exc, match=rf"generate: {match}"):
        generate(_NoStepRunner(), args.pop("prompts"), args.pop("max_new_tokens"), **args)


class _BlockCheckingRunner(_NoStepRunner):
    """Runs steps (logits favour token 7) and checks that no block serves two sequences."""

    def prepare(self, query_lens, context_lens, block_tables):
        used = [b for table in block_tables for b in table]
        assert len(used) == len(set(used)), f"a block serves two sequences: {block_tables}"
        self.peak = max(getattr(self, "peak", 0), len(used))
        return sum(query_lens)

    def replays_whole_step(self, md):
        return False

    device = torch.device("cpu")

    def __call__(self, ids, num_tokens):
        logits = torch.zeros(num_tokens, 11)
        logits[:, 7] = 1.0
        return logits


def test_generate_admits_a_prompt_only_when_its_blocks_fit():
    """5 prompts of 40 tokens with 16 new ones each hold 4 blocks of 16 at their longest; the
    runner has 8 blocks. Every prompt was admitted at once and the third one's allocation
    raised MemoryError mid-generation, after steps had run; now at most two run at a time and
    the others wait for their blocks."""
    from inductor_rocm_attn.integrations.batching import generate

    runner = _BlockCheckingRunner()
    result = generate(runner, [[3] * 40 for _ in range(5)], max_new_tokens=16)
    assert result.tokens == [[7] * 16] * 5
    assert runner.peak <= 8
    assert max(step.num_seqs for step in result.steps) == 2


@pytest.mark.parametrize("value", ["ture", "2", "enabled"])
def test_env_switches_refuse_values_they_do_not_know(monkeypatch, value):
    """ROCM_ATTN_CHECK_INDICES read any value but "1" as off (a GPU then skipped the index
    checks the user asked for), ROCM_ATTN_PLUGIN any value but an on spelling."""
    from inductor_rocm_attn import validation
    from inductor_rocm_attn.compilation.plugin import enable_from_env

    monkeypatch.setenv("ROCM_ATTN_CHECK_INDICES", value)
    with pytest.raises(ValueError, match=rf"environment variable ROCM_ATTN_CHECK_INDICES={value!r}: expected one of"):
        validation.index_checks_on(torch.device("cuda"))
    assert validation.index_checks_on(torch.device("cpu"))  # always on there
    monkeypatch.setenv("ROCM_ATTN_PLUGIN", value)
    with pytest.raises(ValueError, match=rf"environment variable ROCM_ATTN_PLUGIN={value!r}: expected one of"):
        enable_from_env()
    for on, off in (("1", "0"), ("TRUE", "false"), ("on", "off"), ("yes", "")):
        monkeypatch.setenv("ROCM_ATTN_CHECK_INDICES", off)
        assert not validation.index_checks_on(torch.device("cuda"))
        monkeypatch.setenv("ROCM_ATTN_CHECK_INDICES", on)
        assert validation._check_indices_on_device()


@pytest.mark.parametrize("value, on", [("false", False), ("off", False), ("No", False), ("0", False),
                                       ("true", True), ("yes", True), ("1", True)])
def test_trace_cache_env_spellings(monkeypatch, value, on):
    """ROCM_ATTN_TRACE_CACHE=false (or off, no) named a directory "false" in the working
    directory, so the cache was on; true/yes another such directory instead of the default."""
    import os

    from inductor_rocm_attn.compilation.trace_cache import resolve_trace_cache

    monkeypatch.setenv("ROCM_ATTN_TRACE_CACHE", value)
    got = resolve_trace_cache(None)
    assert (got is None) == (not on)
    if on:
        assert got == resolve_trace_cache(True) and os.path.isabs(got)
    monkeypatch.setenv("ROCM_ATTN_TRACE_CACHE", "some/dir")
    assert resolve_trace_cache(None) == "some/dir"


def test_trace_cache_unreadable_entries_are_misses(tmp_path):
    """A truncated or corrupted entry file raised from unpickling (UnicodeDecodeError,
    ValueError, OverflowError, MemoryError ...) and failed the compile, and an entry whose
    stored graph bytes were corrupt was served; each is a miss now (traced and stored again)."""
    import pickle
    import random

    from inductor_rocm_attn.compilation import trace_cache as tc

    cache = tc.TraceCache(str(tmp_path))
    rows = [("placeholder", "x", "x", (), {}, None), ("output", "output", "output", (tc._NodeRef(0),), {}, None)]
    good = tc.TraceEntry(pickle.dumps(rows), [], {})
    cache.store("k", good)
    assert cache.load("k") is not None
    data = (tmp_path / "k.trace").read_bytes()
    rng = random.Random(0)
    for i in range(200):
        bad = bytearray(data[:rng.randrange(len(data))] if i % 3 == 0 else data)
        if i % 3:
            for _ in range(3):
                bad[rng.randrange(len(bad))] = rng.randrange(256)
        (tmp_path / "k.trace").write_bytes(bytes(bad))
        entry = cache.load("k")  # never raises
        assert entry is None or isinstance(entry, tc.TraceEntry)
    for entry in (tc.TraceEntry(b"garbage", [], {}), tc.TraceEntry(good.graph, [], None),
                  tc.TraceEntry(pickle.dumps("not rows"), [], {}), ["not", "an", "entry"]):
        (tmp_path / "k.trace").write_bytes(pickle.dumps(entry))
        assert cache.load("k") is None


def test_trace_key_covers_values_dynamo_bakes_in():
    """Dynamo bakes into the trace the values forward reads from a dict keyed by ints, a set, a
    functools.partial's arguments and a function's closure and defaults; the key described
    such a dict as nothing and the others by name only, so a stored trace of other values
    was served (a model computing with the old ones, silently)."""
    import functools

    from inductor_rocm_attn.compilation import trace_cache as tc

    def key(value):
        m = torch.nn.Linear(4, 4)
        m.opts = value
        return tc.trace_key(m, [], None, {})[0]

    def scaled(s):
        return lambda x: x * s

    def with_default(x, s=2.0):
        return x * s

    def with_default3(x, s=3.0):
        return x * s
    with_default3.__qualname__ = with_default.__qualname__

    for a, b in (({0: 1.0}, {0: 2.0}), ({1.0}, {2.0}), (functools.partial(torch.mul, other=2.0),
                 functools.partial(torch.mul, other=3.0)), (scaled(2.0), scaled(3.0)),
                 (with_default, with_default3)):
        assert key(a) == key(a) and key(a) != key(b), (a, b)
    assert key(scaled(2.0)) == key(scaled(2.0))


def test_trace_key_covers_what_the_traced_forward_closes_over():
    """The traced ``forward=`` itself: two forwards of one code that differ only in a value
    they close over, a default or a partial's bound argument got one key (the code's), so a
    later start loaded the other's trace and served its values, silently."""
    import functools

    from inductor_rocm_attn.compilation import trace_cache as tc

    m = torch.nn.Linear(4, 4)

    def key(forward):
        return tc.trace_key(m, [], forward, {})[0]

    def scaled(s):
        return lambda ids, pos: m(ids) * s

    def with_default(ids, pos, s=2.0):
        return m(ids) * s

    def with_default3(ids, pos, s=3.0):
        return m(ids) * s
    with_default3.__code__ = with_default.__code__.replace(co_consts=with_default.__code__.co_consts)
    with_default3.__defaults__ = (3.0,)

    def f(ids, pos, s):
        return m(ids) * s

    for a, b in ((scaled(1.0), scaled(2.0)), (with_default, with_default3),
                 (functools.partial(f, s=1.0), functools.partial(f, s=2.0))):
        assert key(a) == key(a) and key(a) != key(b), (a, b)
    assert key(scaled(2.0)) == key(scaled(2.0)) and key(functools.partial(f, s=1.0)) == key(functools.partial(f, s=1.0))
    assert key(functools.partial(f, s=1.0)) != key(functools.partial(with_default, s=1.0))  # the code too


def test_generate_refuses_a_second_generate_on_the_same_caches():
    """A generate() started from on_step (or another thread) on the same runner handed out the
    same block ids as the running one and overwrote its cached tokens, silently."""
    from inductor_rocm_attn.integrations.batching import generate

    runner = _BlockCheckingRunner()
    nested = []

    def on_step(record):
        if not nested:
            nested.append(record)
            generate(runner, [[3] * 20], max_new_tokens=2)

    with pytest.raises(RuntimeError, match=r"generate: another generate\(\) is running on this runner's KV caches"):
        generate(runner, [[3] * 20], max_new_tokens=4, on_step=on_step)
    # a refused or finished generate holds nothing: the next one runs
    assert generate(runner, [[3] * 20], max_new_tokens=2).tokens == [[7, 7]]


def test_block_allocator_hands_out_copies_of_its_tables():
    """allocate() and block_table() returned the allocator's own list: a caller that appended
    to it (or kept it across a truncate) changed the allocator's record, so a block it listed
    was handed out to another sequence too."""
    alloc = ira.BlockAllocator(4, BS)
    table = alloc.allocate("a", BS)
    table.append(1)  # the caller's list: the allocator still holds block 0 only for "a"
    alloc.block_table("a").append(2)
    assert alloc.block_table("a") == [0] and alloc.num_free_blocks == 3
    assert alloc.allocate("b", 2 * BS) == [1, 2]
    kept = alloc.allocate("a", BS)
    alloc.truncate("a", 1)
    assert kept == [0, 3] and alloc.block_table("a") == [0]


def test_split_merge_env_is_checked_at_import():
    """ROCM_ATTN_SPLIT_MERGE was read at import and checked only when a GPU decode config was
    built: on a CPU a misspelled value was never refused."""
    import subprocess
    import sys

    code = "import inductor_rocm_attn.kernels.triton.configs as c; print(c.DEFAULT_SPLIT_MERGE)"
    bad = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ROCM_ATTN_SPLIT_MERGE="reduced"),
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "ROCM_ATTN_SPLIT_MERGE='reduced': expected one of" in bad.stderr
    good = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ROCM_ATTN_SPLIT_MERGE="reduce"),
                          capture_output=True, text=True)
    assert good.returncode == 0 and good.stdout.strip() == "reduce"


@pytest.mark.parametrize("kw, match", [
    (dict(rope_impl="ops"), r"rope_impl 'ops' is not supported; supported: \('torch', 'op'\)"),
    (dict(norm_impl="Op"), r"norm_impl 'Op' is not supported; supported: \('torch', 'op'\)"),
    (dict(rotary_dim=0), r"rotary_dim must be None \(the whole head\) or an even int in \[2, head_size 64\], got 0"),
    (dict(rotary_dim=33, rope_impl="op"), r"rotary_dim must be .*, got 33"),
    (dict(rotary_dim=128, rope_impl="op"), r"rotary_dim must be .*, got 128"),
    (dict(rotary_dim=32.0, rope_impl="op"), r"rotary_dim must be .*, got 32\.0"),
    (dict(rms_eps=-1e-6), r"rms_eps must be a finite number >= 0, got -1e-06"),
])
def test_tiny_decoder_config(kw, match):
    """An unknown rope_impl / norm_impl ran the plain-PyTorch form, rotary_dim 0 rotated the
    whole head and an odd rotary_dim (op form) a table one channel wider, all silently."""
    from inductor_rocm_attn.models import DecoderConfig, TinyDecoder
    with pytest.raises(ValueError, match=rf"DecoderConfig: {match}"):
        TinyDecoder(DecoderConfig(num_layers=1, **kw))
    with pytest.raises(ValueError, match=rf"DecoderConfig: {match}"):
        TinyDecoder(DecoderConfig(num_layers=0, **kw))
    TinyDecoder(DecoderConfig(num_layers=1, rotary_dim=32, rope_impl="op"))  # partial rotary: the op form


def test_bind_kv_caches_refused_keeps_every_layer_s_cache():
    """A refused bind (a sharing layer of another geometry after a layer with a cache) had
    already replaced the earlier layers' caches: their cached tokens were gone."""
    target = _layer("bind_keep.t")
    model = torch.nn.ModuleList([target])
    old = ira.bind_kv_caches(model, 4, torch.float32)[target.layer_name]
    old.fill_(1.0)
    model.append(ira.Attention(H, D, num_kv_heads=HKV, block_size=2 * BS, layer_name="cfg.bind_keep.s",
                               kv_sharing_target_layer_name=target.layer_name))
    with pytest.raises(ValueError, match=r"bind_kv_caches: layer 'cfg\.bind_keep\.s' .* cannot read the cache of "
                                         r"'cfg\.bind_keep\.t' .*: the geometry differs"):
        ira.bind_kv_caches(model, 8, torch.float32)
    assert target.kv_cache is old and bool((old == 1.0).all())
    with pytest.raises(ValueError, match=r"bind_kv_caches: device 'gpu' is not a torch device"):
        ira.bind_kv_caches(model[:1], 8, torch.float32, "gpu")
    assert target.kv_cache is old


@pytest.mark.parametrize("entry", ["bind_kv_caches", "allocate_kv_cache", "build_attention_metadata",
                                   "MetadataBuffers"])
def test_a_gpu_this_process_lacks_is_named(entry):
    # torch's "Torch not compiled with CUDA enabled" (an AssertionError) or "invalid device ordinal", raised at the
    # first allocation, named neither the call nor the device
    import inductor_rocm_attn.layout as layout

    bad = f"cuda:{torch.cuda.device_count()}"  # no GPU here: any cuda device; else one past the last
    layer = _layer(f"gpu_missing.{entry}")
    call = {
        "bind_kv_caches": lambda: ira.bind_kv_caches(layer, 4, torch.float32, bad),
        "allocate_kv_cache": lambda: ira.allocate_kv_cache(layer.kv_cache_spec(torch.float32), 4, bad),
        "build_attention_metadata": lambda: ira.build_attention_metadata([1], [0], [[0]], BS, bad),
        "MetadataBuffers": lambda: ira.MetadataBuffers(2, 8, 2, bad),
    }[entry]
    why = layout._gpu_unavailable(torch.cuda.device_count())
    with pytest.raises(ValueError, match=rf"{entry}: device '{bad}': " + re.escape(why)):
        call()
    assert layer.kv_cache.dim() != 4  # nothing bound


def _flag_calls(value):
    """(what, call, check that the refused call changed nothing) for each flag of the public
    API that a value of the wrong type reaches."""
    from inductor_rocm_attn.integrations.batching import generate
    from inductor_rocm_attn.kernels import native
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, convert_v_layout_
    from inductor_rocm_attn.passes.pass_manager import PassManager

    bound = _layer("flag_bound")
    ira.bind_kv_caches(bound, 4, torch.float32)
    unbound = _layer("flag_unbound")
    cache = allocate_kv_cache(KVCacheSpec(BS, HKV, D, torch.float32, CacheLayout.LHBNC), 4, "cpu").normal_()
    before = cache.clone()
    mgr = PassManager()
    return [
        ("Attention: register", lambda: _layer("flag_register", register=value),
         lambda: "cfg.flag_register" not in ira.forward_context.registered_layers()),
        ("bind_kv_caches: poison", lambda: ira.bind_kv_caches(unbound, 4, torch.float32, poison=value),
         lambda: unbound.kv_cache.numel() == 0),
        ("set_interleaved_v_cache: enabled", lambda: bound.set_interleaved_v_cache(value),
         lambda: not bound.interleaved_v),
        ("convert_v_layout_: to_interleaved", lambda: convert_v_layout_(cache, HKV, to_interleaved=value),
         lambda: torch.equal(cache, before)),
        ("set_forward_context: profiling", lambda: ira.set_forward_context(None, profiling=value).__enter__(),
         lambda: ira.get_forward_context().attn_metadata is None and not ira.get_forward_context().profiling),
        ("generate: return_logits", lambda: generate(None, [[1]], 1, return_logits=value), lambda: True),
        ("native.build: force", lambda: native.build(force=value), lambda: True),
        ("PassManager.set_flag: rope_kv_cache_fusion", lambda: mgr.set_flag("rope_kv_cache_fusion", value),
         lambda: mgr.flags["rope_kv_cache_fusion"] is True),
        ("PagedCache: poison", lambda: ira.integrations.transformers.paged_layers(None, 4, poison=value,
                                                                                   who="PagedCache"),
         lambda: True),
        ("run_demo: compile", lambda: ira.demo.run_demo(compile=value), lambda: True),
    ]


@pytest.mark.parametrize("value", ["no", 0, None])
def test_flags_refuse_what_is_not_a_bool(value):
    """Flags took any truthy value: poison="no" poisoned the caches, profiling="no" made a
    step a profiling run (no cache write, zero output), to_interleaved="no" converted the
    cache, register="no" registered the layer. Each refuses a non-bool, changing nothing."""
    import inductor_rocm_attn.demo  # noqa: F401
    import inductor_rocm_attn.integrations.transformers  # noqa: F401

    for what, call, untouched in _flag_calls(value):
        fn, name = what.split(": ")
        with pytest.raises(TypeError, match=rf"{re.escape(fn)}: {name} must be True or False, got {value!r}"):
            call()
        assert untouched(), what


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "bfloat16"])
@pytest.mark.parametrize("field", ["k_scale", "v_scale"])
def test_cache_scales_need_an_fp8_cache(kv_cache_dtype, field):
    """A 16-bit cache stores values as they are and reads no scale: a k_scale / v_scale given
    with one was taken and ignored (the transformers helpers refused it, the layer did not)."""
    with pytest.raises(ValueError, match=rf"Attention: {field}=0\.5 with kv_cache_dtype={kv_cache_dtype!r}; the "
                                         r"cache scales apply only to an fp8 kv_cache_dtype"):
        _layer(f"scale16_{kv_cache_dtype}_{field}", kv_cache_dtype=kv_cache_dtype, **{field: 0.5})
    _layer(f"scale8_{kv_cache_dtype}_{field}", kv_cache_dtype="fp8", **{field: 0.5})


def test_a_sharing_layer_s_own_scales_must_be_its_target_s():
    """A layer sharing another's cache reads it with the target's k/v scales: scales of its own
    that differ were ignored; bind_kv_caches refuses them (and binds no layer). Default scales
    (1.0) stand for none given."""
    target = _layer("share_scale_t", kv_cache_dtype="fp8", k_scale=0.5)
    reader = _layer("share_scale_r", kv_cache_dtype="fp8", k_scale=0.25,
                    kv_sharing_target_layer_name="cfg.share_scale_t")
    model = torch.nn.ModuleList([target, reader])
    with pytest.raises(ValueError, match=r"bind_kv_caches: layer 'cfg\.share_scale_r' \(k_scale 0\.25, v_scale 1\.0\) "
                                         r"reads the cache of 'cfg\.share_scale_t' with that layer's scales "
                                         r"\(k_scale 0\.5, v_scale 1\.0\)"):
        ira.bind_kv_caches(model, 4, torch.float32)
    assert target.kv_cache.numel() == 0
    same = _layer("share_scale_s", kv_cache_dtype="fp8", k_scale=0.5, kv_sharing_target_layer_name="cfg.share_scale_t")
    unscaled = _layer("share_scale_u", kv_cache_dtype="fp8", kv_sharing_target_layer_name="cfg.share_scale_t")
    ira.bind_kv_caches(torch.nn.ModuleList([target, same, unscaled]), 4, torch.float32)
    assert target.kv_cache.numel()
