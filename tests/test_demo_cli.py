"""``python -m inductor_rocm_attn demo``: the default model, each transformers architecture
(eager: fast), one compiled transformers run (progress lines, fusion report) and the
fallback to this package's model without transformers. Run in-process through ``main``."""

import importlib.util

import pytest

from inductor_rocm_attn import demo
from inductor_rocm_attn.__main__ import main

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


def run(capsys, *argv):
    rc = main(["demo", *argv])
    return rc, capsys.readouterr().out


def test_default_demo_eager(capsys):
    rc, out = run(capsys, "--eager", "--device", "cpu")
    assert rc == 0, out
    assert "step 1: prefill a[0:30], b[0:33]" in out and "step 2: decode a" in out
    assert "paged path MATCHES dense attention" in out


@needs_transformers
@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral", "gemma2"])
def test_transformers_demo_eager(capsys, arch):
    rc, out = run(capsys, "--model", arch, "--eager", "--device", "cpu")
    assert rc == 0, out
    assert f"model: transformers {arch.capitalize()}ForCausalLM from config" in out
    kinds = [line.split(": ")[1].split(",")[0] for line in out.splitlines() if "] step " in line]
    assert kinds[0] == "prefill" and "mixed" in kinds and kinds.count("decode") >= 6, kinds
    assert out.count("same as eager") == len(demo.PROMPT_LENS)
    assert "paged path MATCHES eager transformers" in out


@needs_transformers
@pytest.mark.compile
def test_transformers_demo_compiled_prints_progress(capsys):
    rc, out = run(capsys, "--model", "llama", "--device", "cpu")
    assert rc == 0, out
    for line in ("tracing the model with Dynamo", "split at 4 attention ops into 5 pieces, 3 distinct",
                 "compiling piece 1 of 3", "compiled piece 3 of 3 in", "(submod_2, shared by 3 pieces)",
                 "] step 0: prefill", "rocm_attn fusion report",
                 "piece submod_2 (shared code): __rocm_attn_slot0__ = transformers.layers.1, "
                 "transformers.layers.2, transformers.layers.3", "paged path MATCHES eager transformers"):
        assert line in out, line
    timed = [line for line in out.splitlines() if line.lstrip().startswith("[")]
    assert len(timed) >= 10 and all(" s] " in line for line in timed)


def test_falls_back_to_the_default_model_without_transformers(monkeypatch):
    monkeypatch.setattr(demo, "transformers_available", lambda: False)
    lines = []
    result = demo.run_model_demo("gemma2", compile=False, device="cpu", out=lambda s: lines.append(str(s)))
    assert result["ok"]
    assert lines[0] == ("transformers is not installed: running this package's small Qwen3-style model "
                        "instead of gemma2")
    assert any("paged path MATCHES dense attention" in line for line in lines)


def test_unknown_model_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", "gpt9"])
    assert e.value.code == 2 and "invalid choice: 'gpt9'" in capsys.readouterr().err
