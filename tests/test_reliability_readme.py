"""The README's "Using it" block runs as written, and its decode step matches dense attention.

The block is the first ```python block of the "## Using it" section of README.md, run as
written.
"""

import gc
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def using_it_block(path: pathlib.Path) -> str:
    text = path.read_text() if path.exists() else ""
    section = re.search(r"^## Using it\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        pytest.fail(f"{path.name} has no '## Using it' section")
    block = re.search(r"```python\n(.*?)```", section.group(1), re.S)
    assert block, f"{path.name}'s 'Using it' section has no ```python block"
    return block.group(1)


def test_using_it_runs_and_matches_dense_attention(capsys):
    source = "README.md"
    code = using_it_block(ROOT / source)
    scope = {}
    torch.manual_seed(0)
    exec(compile(code, f"{source}: Using it", "exec"), scope)
    assert "torch.Size([2, 512])" in capsys.readouterr().out
    model, out, H, HKV, D = (scope[n] for n in ("model", "out", "H", "HKV", "D"))
    try:
        # Dense causal attention over each whole sequence (prompt + decode token), no cache:
        # its last row is what the decode step computed from the paged cache.
        for row, seq in enumerate(("a", "b")):
            x = torch.cat([scope["prompts"][seq], scope["decode"][seq]])
            with torch.no_grad():
                q, k, v = model.qkv(x).split([H * D, HKV * D, HKV * D], dim=-1)
                q, k, v = (t.view(x.shape[0], -1, D).transpose(0, 1).double() for t in (q, k, v))
                k, v = k.repeat_interleave(H // HKV, 0), v.repeat_interleave(H // HKV, 0)
                att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                want = model.o_proj(att.transpose(0, 1).reshape(x.shape[0], H * D).to(x.dtype))[-1]
            assert torch.allclose(out[row], want, rtol=1e-4, atol=1e-4), (seq, (out[row] - want).abs().max())
    finally:
        del scope, model  # frees the layer name "readme.layers.0.attn" for the next source
        gc.collect()
