"""``rotary_embedding`` (NeoX and GPT-J, in place) of every provider against the float64
oracle (``writer_checks.oracle_rope``)."""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from cases import rel_err
from writer_checks import DEV, gen, make_cos_sin, make_qkv, oracle_rope, split

OP = "rotary_embedding"
PROVIDERS = put.providers_for(OP)


def _kernel(provider, dtype, head_size, rot_dim):
    return put.kernel(provider, OP, device=DEV, dtype=dtype, head_size=head_size,
                      features=("partial_rotary",) if rot_dim < head_size else ())


@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 64), (80, 80), (256, 256), (80, 32)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rotary_embedding(provider, head_size, rot_dim, is_neox, dtype):
    fn = _kernel(provider, dtype, head_size, rot_dim)
    t, hq, hkv = 9, 4, 2
    seed = head_size + rot_dim + is_neox
    qkv = make_qkv(t, hq, hkv, head_size, dtype, seed, pad_cols=16)
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 500, (t,), generator=gen(seed)).to(DEV)
    cos_sin = make_cos_sin(512, rot_dim, torch.float32 if seed % 2 else dtype)
    q, k, _ = split(qkv, hq, hkv, head_size)
    q3 = q.view(t, hq, head_size) if is_neox else q  # 3-D and 2-D forms
    fn(positions, q3, k, head_size, cos_sin, is_neox)
    qe, ke, _ = split(qkv_in, hq, hkv, head_size)
    want = torch.cat([oracle_rope(x.reshape(t, -1, head_size), positions, cos_sin, is_neox)
                      .reshape(t, -1).to(dtype) for x in (qe, ke)], dim=1)
    tol = 2e-3 if dtype == torch.float16 else 1e-6
    assert rel_err(qkv[:, : (hq + hkv) * head_size], want) < tol
    # v and the padding columns are not touched
    assert torch.equal(qkv[:, (hq + hkv) * head_size:].cpu(), qkv_in[:, (hq + hkv) * head_size:])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_rotary_embedding_no_key(provider):
    t, hq, d = 5, 3, 64
    fn = _kernel(provider, torch.float16, d, d)
    q = torch.randn(t, hq, d, generator=gen(3)).half().to(DEV)
    q_in = q.cpu().clone()
    positions = torch.randint(0, 100, (t,), generator=gen(4)).to(DEV)
    cos_sin = make_cos_sin(128, d, torch.float32)
    fn(positions, q, None, d, cos_sin, True)
    assert rel_err(q, oracle_rope(q_in, positions, cos_sin, True).half()) < 2e-3
