"""The README's "With transformers" snippets run as written and match eager attention.

The snippets are the ```python blocks of README.md's "With transformers" section, run as
written: the first (generate on a PagedCache), then the second in the same namespace
(compile_transformers + continuous batching).
"""

import copy
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

def readme_snippets() -> list[str]:
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text() if readme.exists() else ""
    section = re.search(r"^## With transformers\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        pytest.fail("README.md has no '## With transformers' section")
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 2, "README's 'With transformers' section should hold two ```python blocks"
    return blocks


def readme_snippet() -> str:
    return readme_snippets()[0]


def test_readme_snippet_runs_and_matches_eager(capsys):
    scope = {}
    torch.manual_seed(0)
    exec(compile(readme_snippet(), "README.md: With transformers", "exec"), scope)
    model, out = scope["model"], scope["out"]
    assert out.shape == (2, 13) and "tensor(" in capsys.readouterr().out
    eager = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(model.config), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    want = eager.generate(scope["input_ids"], attention_mask=scope["attention_mask"], max_new_tokens=8,
                          do_sample=False)
    assert torch.equal(out, want)


@pytest.mark.compile
def test_readme_serving_snippet_runs_and_matches_eager(capsys):
    first, second = readme_snippets()
    scope = {}
    torch.manual_seed(0)
    exec(compile(first, "README.md: With transformers", "exec"), scope)
    exec(compile(second, "README.md: With transformers (serving)", "exec"), scope)
    model, result, prompts = scope["model"], scope["result"], scope["prompts"]
    assert [len(t) for t in result.tokens] == [16, 16] and str(result.tokens) in capsys.readouterr().out
    eager = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(model.config), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    for prompt, tokens in zip(prompts, result.tokens):
        ids = torch.tensor([prompt])
        want = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert want[0, len(prompt):].tolist() == tokens
