"""The README's "With transformers" snippet runs as written and matches eager attention.

The snippet is taken from README.md's "With transformers" section when it has one, else from
the copy below (the text proposed for that section).
"""

import copy
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

SNIPPET = '''\
import torch
import inductor_rocm_attn  # registers attn_implementation="rocm_attn" with transformers
from inductor_rocm_attn.integrations.transformers import PagedCache
from transformers import AutoModelForCausalLM, Qwen3Config

# Any model whose attention goes through transformers' AttentionInterface (Llama, Qwen2/3,
# Mistral, Gemma2, ...); from_pretrained(name, attn_implementation="rocm_attn") works the same.
config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, pad_token_id=0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="rocm_attn").eval()
# on a GPU: model.to("cuda", torch.bfloat16), and the inputs below .to("cuda")

# Two ragged prompts, left-padded as a tokenizer does (0 = padding).
input_ids = torch.tensor([[0, 0, 0, 11, 12], [21, 22, 23, 24, 25]])
attention_mask = (input_ids != 0).long()

cache = PagedCache(model, num_blocks=64)  # paged KV cache: 64 blocks of 16 tokens per layer
out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                     max_new_tokens=8, do_sample=False)
print(out[:, input_ids.shape[1]:])  # the 8 new tokens of each prompt
'''


def readme_snippet() -> str:
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text() if readme.exists() else ""
    section = re.search(r"^#+ With transformers\s*$(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    if section is None:
        return SNIPPET
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
