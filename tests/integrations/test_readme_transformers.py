"""The README's "With transformers" snippet runs as written and matches eager attention.

The snippet is the ```python block of README.md's "With transformers" section, run as written.
"""

import copy
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

def readme_snippet() -> str:
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text() if readme.exists() else ""
    section = re.search(r"^## With transformers\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        pytest.fail("README.md has no '## With transformers' section")
    block = re.search(r"```python\n(.*?)```", section.group(1), re.S)
    assert block, "README's 'With transformers' section has no ```python block"
    return block.group(1)


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
