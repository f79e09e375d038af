"""Piecewise graph capture of transformers models (``compile_transformers``): ragged prompts
served by continuous batching (prefill, mixed prefill+decode steps with a chunked prompt,
decode-only steps: each replayed as one whole-step graph) against the same weights under
``attn_implementation="eager"`` generating each prompt with its own cache.

On CPU the ``RerunGraphBackend`` stands in for CUDA graphs: a replay reruns a piece on the
tensors it was captured with, so an input the runner failed to route through its persistent
buffers would come out stale. Tolerance: fp32 logits within 1e-5 of the step's largest
|logit| (measured 4-6e-7 here; our CPU kernels accumulate in float64, eager in fp32), greedy
tokens identical. Compiles are cold (the passes run) and shared per model. The shared
runner captures mixed whole-step graphs (opt-in); the piecewise graphs that serve mixed steps
by default are checked on CPU by tests/test_graph_capture.py and here on the GPU.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import inductor_rocm_attn as ira  # noqa: E402
from inductor_rocm_attn.compilation import RerunGraphBackend  # noqa: E402
from inductor_rocm_attn.forward_context import get_layer, registered_layers  # noqa: E402
from inductor_rocm_attn.integrations.batching import generate  # noqa: E402
from inductor_rocm_attn.integrations.transformers import PagedCache  # noqa: E402
from inductor_rocm_attn.forward_context import set_forward_context  # noqa: E402
from inductor_rocm_attn.integrations.transformers_runner import (  # noqa: E402
    compile_transformers, eager_runner, step_forward)

pytestmark = pytest.mark.compile

TOL = 1e-5
PROMPT_LENS = [5, 11, 8, 10]
NEW_TOKENS = 9  # the prompt's last token picks the first; then 8 decode steps
STEP_TOKENS = 16  # budget: prompts 3 and 4 join while 1 and 2 decode, prompt 4 in two chunks
SIZES = [1, 2, 4, 8, 16]
LAYERS = 3  # first piece, one shared middle piece (layers 1-2), last piece

_COMMON = dict(vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda n: transformers.LlamaConfig(**_COMMON, num_hidden_layers=n, hidden_size=128,
                                                intermediate_size=256, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=32),
    "qwen3": lambda n: transformers.Qwen3Config(**_COMMON, num_hidden_layers=n, hidden_size=128,
                                                intermediate_size=256, num_attention_heads=2,
                                                num_key_value_heads=1, head_dim=64),
    "mistral": lambda n: transformers.MistralConfig(**_COMMON, num_hidden_layers=n, hidden_size=64,
                                                    intermediate_size=128, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=32, sliding_window=6),
    "gemma2": lambda n: transformers.Gemma2Config(**_COMMON, num_hidden_layers=n, hidden_size=128,
                                                  intermediate_size=256, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=32, sliding_window=6,
                                                  attn_logit_softcapping=2.0, query_pre_attn_scalar=24,
                                                  layer_types=(["sliding_attention", "full_attention"] * n)[:n]),
}


def build(name, impl, layers=LAYERS, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](layers), attn_implementation=impl, dtype=dtype).to(device).eval()


def twin(model, impl):
    other = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(model.config), attn_implementation=impl, dtype=model.dtype).to(model.device).eval()
    other.load_state_dict(model.state_dict())
    return other


def prompts(lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


def eager_reference(eager, prompt_list, new_tokens=NEW_TOKENS):
    """transformers' own generate (its DynamicCache), one prompt at a time: tokens and logits."""
    tokens, logits = [], []
    for p in prompt_list:
        ids = torch.tensor([p], device=eager.device)
        out = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append([x[0].float().cpu() for x in out.logits])
    return tokens, logits


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def compiled(request):
    name = request.param
    model = build(name, "rocm_attn")
    ira.fusion_report().clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # cold: the passes run
        runner = compile_transformers(model, num_blocks=32, capture_sizes=SIZES, max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, poison=True, mixed_graphs=True,
                                      graph_backend=RerunGraphBackend(), progress=print)
    report = ira.fusion_report()
    print(report)
    return name, model, runner, list(report.records)


def test_ragged_batch_matches_eager_transformers(compiled):
    name, model, runner, _ = compiled
    want_tokens, want_logits = eager_reference(twin(model, "eager"), prompts())
    captures = runner.stats.num_captures
    got = generate(runner, prompts(), NEW_TOKENS, max_tokens_per_step=STEP_TOKENS, return_logits=True)
    assert got.tokens == want_tokens
    errs = [rel(a, b) for got_p, want_p in zip(got.logits, want_logits) for a, b in zip(got_p, want_p)]
    assert len(errs) == len(PROMPT_LENS) * NEW_TOKENS and max(errs) < TOL, max(errs)
    kinds = [s.kind for s in got.steps]
    assert kinds[0] == "prefill" and kinds.count("mixed") >= 2 and kinds.count("decode") >= 8, kinds
    # every step replays one whole-step graph: decode-only steps their size's decode graph,
    # prefill and mixed steps their size's mixed graph (tests/test_mixed_step_graphs.py)
    assert all(s.whole_step_graph for s in got.steps)
    assert all(runner.padded_size(s.num_tokens) in runner._captured for s in got.steps)
    assert runner.stats.num_captures == captures  # steady state: nothing captured again


def test_pieces_are_shared_and_graphs_equal_the_pieces(compiled):
    name, model, runner, _ = compiled
    st = runner.stats
    assert (st.num_attention_pieces, st.num_compiled_pieces, st.num_unique_compiles) == (LAYERS, LAYERS + 1, 3)
    assert [p.name for p in runner.pieces[1:-1]] in st.piece_groups
    # a prefill, a decode step and a mixed step, each with graphs and without: bitwise equal
    alloc = ira.BlockAllocator(32, runner.block_size, shuffle_seed=3)
    tables = [list(alloc.allocate(i, n)) for i, n in enumerate([5, 3, 10])]
    for qlens, clens in (([4, 2, 6], [0, 0, 0]), ([1, 1, 1], [4, 2, 6]), ([1, 1, 4], [4, 2, 6])):
        md = runner.prepare(qlens, clens, tables)
        assert runner.whole_step_shape(md).kind == ("decode" if qlens == [1, 1, 1] else "mixed")
        ids = torch.randint(3, 256, (sum(qlens),))
        pieces = runner(ids, md, use_graphs=False).clone()
        graphs = runner(ids, md).clone()
        assert torch.equal(pieces, graphs) and pieces.isfinite().all()


def test_fusion_report_covers_every_piece_with_a_cache_write(compiled):
    """The plugin ran inside the pieces (stand-ins for every layer) and reported on each
    distinct piece that writes the cache; a fused site switches all layers sharing it."""
    name, model, runner, records = compiled
    st = runner.stats
    assert st.plugin_active and st.num_stand_ins == LAYERS
    sites = [r for r in records if r.pass_name in ("rope_kv_cache_fusion", "qk_norm_rope_kv_cache_fusion")]
    assert sites and all(r.layer_name.startswith("__rocm_attn_slot") for r in sites)
    assert len(sites) >= 2 and all(r.detail for r in sites)  # the first piece and the shared one
    fused = any(r.fused for r in sites)
    layers = list(runner.layers.values())
    # each alias record names the layers its code serves: layer 0 alone, then the shared piece's
    names = [layer.layer_name for layer in layers]
    served = {r.serves for r in sites}
    assert served == {(names[0],), tuple(names[1:])}, served
    summary = str(ira.fusion_report()).splitlines()[-1]
    assert summary.endswith(f"over {LAYERS} layer(s)"), summary
    if fused:
        assert f"[shared by {LAYERS - 1} layers: {names[1]} .. {names[-1]}]" in str(ira.fusion_report())
    if fused:  # every layer that shares the fused piece's code follows its V layout
        assert len({layer.interleaved_v for layer in layers[1:]}) == 1


def test_slot_aliases_live_in_the_runner_table(compiled):
    """Aliases are bound in the runner's own table, never globally: outside a runner step
    they do not resolve, and a PagedCache of the same model (its own per-step layer table)
    runs between the runner's steps without either disturbing the other."""
    name, model, runner, _ = compiled
    assert not any(n.startswith("__rocm_attn_slot") for n in registered_layers())
    assert any(n.startswith("__rocm_attn_slot") for n in runner.layer_table)
    with pytest.raises(KeyError, match="slot alias of shared compiled code"):
        get_layer("__rocm_attn_slot0__")
    ids = torch.tensor(prompts([6, 6], seed=4))
    want = twin(model, "eager").generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                         do_sample=False, eos_token_id=None)
    cache = PagedCache(model, num_blocks=8)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         eos_token_id=None, past_key_values=cache)
    assert torch.equal(got, want)
    again = generate(runner, ids.tolist(), 4)
    assert again.tokens == want[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_runner_matches_eager_transformers(name):
    """The traced forward (all tokens of a step as one row) run eagerly on the paged path:
    sliding windows (Mistral, Gemma2) and soft caps (Gemma2) included."""
    model = build(name, "rocm_attn", layers=2)
    want_tokens, want_logits = eager_reference(twin(model, "eager"), prompts())
    runner = eager_runner(model, num_blocks=32, max_num_seqs=8, max_num_tokens=STEP_TOKENS, poison=True)
    got = generate(runner, prompts(), NEW_TOKENS, return_logits=True)
    assert got.tokens == want_tokens
    assert max(rel(a, b) for g, w in zip(got.logits, want_logits) for a, b in zip(g, w)) < TOL


_HEADS_FIRST = {  # the cached key and query are [B, H, T, D]: the token count at dim -2
    # Gemma3: (1 + weight) QK-norm on heads-first q/k, then RoPE (fused)
    "gemma3": lambda: transformers.Gemma3TextConfig(**_COMMON, num_hidden_layers=2, hidden_size=64,
                                                    intermediate_size=128, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=32, sliding_window=6,
                                                    query_pre_attn_scalar=24,
                                                    layer_types=["sliding_attention", "full_attention"]),
    # GPT-2: no RoPE (learned positions)
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_layer=2, n_embd=64, n_head=2, n_positions=128,
                                            bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


@pytest.mark.parametrize("name", list(_HEADS_FIRST))
def test_heads_first_models_compile_with_a_dynamic_token_dim(name):
    """The fusion passes read a head count from the query/key at dim -2, the token count of a
    heads-first [B, H, T, D] tensor: int() of it guarded the dynamic token dim to the trace's
    size, and compile_transformers crashed in Dynamo (ConstraintViolationError) for Gemma3
    (QK-norm matcher) and GPT-2 (RoPE matcher)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_HEADS_FIRST[name](), attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    want_tokens, want_logits = eager_reference(twin(model, "eager"), prompts())
    with torch._inductor.config.patch(force_disable_caches=True):
        runner = compile_transformers(model, num_blocks=32, capture_sizes=[1, 2, 8, 16], max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, poison=True, graph_backend=RerunGraphBackend())
    got = generate(runner, prompts(), NEW_TOKENS, return_logits=True)
    assert got.tokens == want_tokens
    assert max(rel(a, b) for g, w in zip(got.logits, want_logits) for a, b in zip(g, w)) < TOL
    assert len({s.num_tokens for s in got.steps}) >= 3 and all(s.whole_step_graph for s in got.steps)


def test_hunyuan_fuses_every_layer_and_matches_eager():
    """Hunyuan normalizes q/k after RoPE (heads-first [B, H, T, D]): every layer's QK-norm,
    RoPE and cache write fuse into the writer's norm_after_rope form in the compiled pieces,
    and the served prompts match eager transformers, as they do through eager_runner."""
    torch.manual_seed(0)
    config = transformers.HunYuanDenseV1Config(**_COMMON, num_hidden_layers=LAYERS, hidden_size=64,
                                               intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=32)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    with torch.no_grad():  # norm weights start at 1, where the two orders agree: make them differ
        for name, p in model.named_parameters():
            if "layernorm" in name and "self_attn" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    want_tokens, want_logits = eager_reference(twin(model, "eager"), prompts())
    runner = eager_runner(model, num_blocks=32, max_num_seqs=8, max_num_tokens=STEP_TOKENS, poison=True)
    got = generate(runner, prompts(), NEW_TOKENS, return_logits=True)
    assert got.tokens == want_tokens
    assert max(rel(a, b) for g, w in zip(got.logits, want_logits) for a, b in zip(g, w)) < TOL
    ira.fusion_report().clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        runner = compile_transformers(model, num_blocks=32, capture_sizes=[1, 2, 8, 16], max_num_seqs=8,
                                      max_num_tokens=STEP_TOKENS, poison=True, graph_backend=RerunGraphBackend())
    records = [r for r in ira.fusion_report().records if r.pass_name == "qk_norm_rope_kv_cache_fusion"]
    assert records and all(r.fused and "QK-norm (eps=1e-06) after it" in r.detail for r in records), records
    assert {name for r in records for name in r.serves} == set(runner.layers)  # every layer
    assert all(layer.interleaved_v for layer in runner.layers.values())
    got = generate(runner, prompts(), NEW_TOKENS, return_logits=True)
    assert got.tokens == want_tokens
    assert max(rel(a, b) for g, w in zip(got.logits, want_logits) for a, b in zip(g, w)) < TOL


def test_learned_positions_bound_the_sequence_length():
    """GPT-2's learned position embedding holds n_positions rows: a runner that allowed longer
    sequences (compile_transformers' max_model_len above it; eager_runner's cache) crashed in
    the compiled embedding's bounds check ("index out of bounds") mid-generation (on a GPU:
    a device-side assert). Refused up front; up to n_positions the steps match eager."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_HEADS_FIRST["gpt2"](), attn_implementation="rocm_attn",
                                                          dtype=torch.float32).eval()
    with pytest.raises(ValueError, match=r"compile_transformers: max_model_len 256 is above the 128 positions of "
                                         r"GPT2LMHeadModel's learned position embedding"):
        compile_transformers(model, num_blocks=32, max_model_len=256)
    runner = eager_runner(model, num_blocks=32, max_num_tokens=STEP_TOKENS, poison=True)
    with pytest.raises(ValueError, match=r"prompt 0 \(125 tokens\) with max_new_tokens 5 reaches 129 cached "
                                         r"tokens, above the runner's max_model_len 128"):
        generate(runner, prompts([125]), 5)
    with pytest.raises(ValueError, match=r"EagerRunner.prepare: the step has 129 tokens in its longest sequence, "
                                         r"more than max_model_len=128"):  # a step planned by hand
        runner.prepare([1], [128], [list(range(9))])
    with pytest.raises(ValueError, match=r"EagerRunner.prepare: the step has \d+ tokens, more than max_num_tokens"):
        runner.prepare([STEP_TOKENS + 1], [0], [list(range(9))])
    want_tokens, want_logits = eager_reference(twin(model, "eager"), prompts([124, 6]), 5)
    got = generate(runner, prompts([124, 6]), 5, return_logits=True)
    assert got.tokens == want_tokens
    assert max(rel(a, b) for g, w in zip(got.logits, want_logits) for a, b in zip(g, w)) < TOL


def test_trace_passes_through_the_paged_cache_hooks():
    """A model that has a PagedCache (its planning hooks on the decoder) still traces in one
    graph: the hooks are no-ops Dynamo can see through when no PagedCache is passed."""
    model = build("llama", "rocm_attn", layers=1)
    PagedCache(model, num_blocks=4)
    runner = eager_runner(model, num_blocks=4, poison=True)
    traced = torch.compile(step_forward(model), backend="eager", fullgraph=True)
    md = runner.prepare([5], [0], [[0]])
    ids = torch.tensor(prompts([5])[0])
    with torch.no_grad(), set_forward_context(md, layers=runner.layers):
        got = traced(ids, md.positions)
    assert torch.equal(got, runner(ids, md))


def test_refusals():
    with pytest.raises(ValueError, match='load it with attn_implementation="rocm_attn"'):
        compile_transformers(build("llama", "eager", layers=1), num_blocks=4)
    model = build("llama", "rocm_attn", layers=1).train()
    with pytest.raises(ValueError, match="training mode"):
        compile_transformers(model, num_blocks=4)
    model.eval()
    with pytest.raises(ValueError, match="compile_transformers: num_blocks must be a positive int, got 0"):
        compile_transformers(model, num_blocks=0)
    with pytest.raises(ValueError, match=r"compile_transformers: capture_sizes must hold positive ints, got -1"):
        compile_transformers(model, num_blocks=4, capture_sizes=[-1, 2])
    with pytest.raises(TypeError, match=r"compile_transformers: progress must be callable \(e.g. print\) or None"):
        compile_transformers(model, num_blocks=4, progress="yes")  # failed at its first message, mid-compile
    runner = eager_runner(model.eval(), num_blocks=4)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=rf"max_new_tokens must be an int >= 1, got {bad}"):
            generate(runner, [[3, 4]], bad)
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        generate(runner, [[]], 2)
    for bad in (256, -1):  # vocab_size 256
        with pytest.raises(ValueError, match=rf"prompt 1 holds token id {bad}, outside the model's vocabulary \[0, 256\)"):
            generate(runner, [[3, 4], [5, bad]], 2)
    with pytest.raises(ValueError, match="eager_runner: num_blocks must be a positive int, got 0"):
        eager_runner(model, num_blocks=0)
    with pytest.raises(ValueError, match="PagedCache: num_blocks must be a positive int, got -1"):
        PagedCache(model, num_blocks=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_cuda_graphs_match_eager_transformers(name):
    """CUDA graphs (bf16): every generated token's logits against eager transformers run on
    the tokens we generated (teacher forcing: a near-tie cannot fork the comparison), and
    graph replay bitwise equal to the compiled pieces without graphs."""
    model = build(name, "rocm_attn", device="cuda", dtype=torch.bfloat16)
    eager = twin(model, "eager")
    runner = compile_transformers(model, num_blocks=64, capture_sizes=[1, 2, 4, 8, 16, 32], max_num_seqs=8,
                                  max_num_tokens=32, poison=True)
    ps = prompts([5, 11, 8, 10, 17, 3, 30, 9])
    got = generate(runner, ps, NEW_TOKENS, max_tokens_per_step=32, return_logits=True)
    assert sum(s.whole_step_graph for s in got.steps) >= 8
    with torch.no_grad():
        for p, toks, logits in zip(ps, got.tokens, got.logits):
            seq = torch.tensor([p + toks[:-1]], device="cuda")
            want = eager(seq).logits[0, len(p) - 1:].float().cpu()
            assert max(rel(a, b) for a, b in zip(logits, want)) < 4e-2
    # A decode step over contexts written first (the cache is poisoned: an unwritten slot
    # would make both sides NaN, and NaN != NaN).
    alloc = ira.BlockAllocator(64, runner.block_size, shuffle_seed=3)
    lens = [12, 9, 10]
    tables = [list(alloc.allocate(i, n + 1)) for i, n in enumerate(lens)]
    runner(torch.randint(3, 256, (sum(lens),), device="cuda"), runner.prepare(lens, [0, 0, 0], tables))
    md = runner.prepare([1, 1, 1], lens, tables)
    ids = torch.randint(3, 256, (3,), device="cuda")
    pieces = runner(ids, md, use_graphs=False).clone()
    assert pieces.isfinite().all()
    assert torch.equal(pieces, runner(ids, md)) and runner.replays_whole_step(md)


@pytest.mark.compile
def test_trace_cache_warm_start_generates_as_eager(tmp_path):
    """A second runner of the same model loads the stored trace (no Dynamo) and its pieces,
    built from the stored graph by a fake run (the Python dispatcher keeps the token
    dimension symbolic: torch 2.11's C++ matmul specialized it), serve every step size."""
    model = build("qwen3", "rocm_attn")
    kw = dict(num_blocks=32, capture_sizes=SIZES, max_num_seqs=8, max_num_tokens=STEP_TOKENS, poison=True,
              graph_backend=RerunGraphBackend(), trace_cache=str(tmp_path))
    cold = compile_transformers(model, **kw)
    warm = compile_transformers(twin(model, "rocm_attn"), **kw)
    assert not cold.stats.trace_loaded and warm.stats.trace_loaded
    want_tokens, want_logits = eager_reference(twin(model, "eager"), prompts())
    got = generate(warm, prompts(), NEW_TOKENS, max_tokens_per_step=STEP_TOKENS, return_logits=True)
    assert got.tokens == want_tokens
    errs = [rel(a, b) for got_p, want_p in zip(got.logits, want_logits) for a, b in zip(got_p, want_p)]
    assert len(errs) == len(PROMPT_LENS) * NEW_TOKENS and max(errs) < TOL, max(errs)
    assert len({s.num_tokens for s in got.steps}) >= 3  # steps of several sizes


def test_a_step_on_caches_a_generate_holds_is_refused():
    """A step run from on_step (or another thread, or another runner over the same caches)
    while a generate holds the caches wrote into blocks its sequences had cached, and the
    generate went on with the overwritten tokens, silently. Refused now; the generate that
    raised holds nothing afterwards and the next one matches."""
    model = build("qwen3", "rocm_attn", layers=1)
    eager = eager_runner(model, num_blocks=8, max_num_seqs=4, max_num_tokens=16)
    runner = compile_transformers(model, num_blocks=8, capture_sizes=[1, 2, 4], max_num_seqs=4, max_num_tokens=16,
                                  graph_backend=RerunGraphBackend())
    batch = prompts([5, 11, 8])
    want = generate(eager, batch, 4).tokens
    assert generate(runner, batch, 4).tokens == want
    for r, who in ((eager, "EagerRunner"), (runner, "PiecewiseRunner")):
        def step_inside(record, r=r):
            if record.index == 1:
                r(torch.tensor([3, 4]), r.prepare([2], [0], [[0]]))

        with pytest.raises(RuntimeError, match=rf"{who}\.prepare: a running generate\(\) holds these KV caches"):
            generate(r, batch, 4, on_step=step_inside)
        assert generate(r, batch, 4).tokens == want
    before = eager.prepare([2], [0], [[0]])  # metadata built before the generate began

    def run_before(record):
        if record.index == 1:
            eager(torch.tensor([3, 4]), before)

    with pytest.raises(RuntimeError, match=r"EagerRunner: a running generate\(\) holds these KV caches"):
        generate(eager, batch, 4, on_step=run_before)
    assert generate(eager, batch, 4).tokens == want

    layer = next(iter(eager.layers.values()))

    def rebind(record):  # generate went on over the new, empty cache
        if record.index == 1:
            layer.kv_cache = torch.zeros_like(layer.kv_cache)

    with pytest.raises(RuntimeError, match=r"binding a KV cache: a running generate\(\) holds these KV caches .*; "
                                           r"binding another cache would drop the tokens"):
        generate(eager, batch, 4, on_step=rebind)
    assert generate(eager, batch, 4).tokens == want


def test_eager_runner_refuses_a_model_in_training_mode():
    """compile_transformers refused a model in training mode, eager_runner took it: its
    dropouts (a GPT-2's resid_pdrop, embd_pdrop) then gave other logits on every run."""
    model = build("llama", "rocm_attn", layers=1)
    with pytest.raises(ValueError, match=r"eager_runner: the model is in training mode; call model\.eval\(\) first"):
        eager_runner(model.train(), num_blocks=4)
    runner = eager_runner(model.eval(), num_blocks=4)
    want = generate(runner, [[3, 4, 5]], 3).tokens
    model.train()
    with pytest.raises(ValueError, match=r"EagerRunner: the model is in training mode \(its dropouts would run\)"):
        generate(runner, [[3, 4, 5]], 3)
    with pytest.raises(ValueError, match=r"EagerRunner: the model is in training mode"):
        runner(torch.tensor([3]), runner.prepare([1], [0], [[0]]))
    model.eval()
    assert generate(runner, [[3, 4, 5]], 3).tokens == want
