"""``rotary_embedding`` (NeoX and GPT-J, in place) of every provider against the float64
oracle (``writer_checks.oracle_rope``)."""

from __future__ import annotations

import pytest
import torch

import providers_under_test as put
from cases import rel_err
from inductor_rocm_attn.kernels.triton.configs import WriterConfig
from writer_checks import (
    DEV, GPU_PAD_CASES, PAD_CASES, gen, guarded_rows, make_cos_sin, make_qkv, oracle_rope, round_tol,
    split,
)

OP = "rotary_embedding"
PROVIDERS = put.providers_for(OP)


def _kernel(provider, dtype, head_size, rot_dim):
    return put.kernel(provider, OP, device=DEV, dtype=dtype, head_size=head_size,
                      features=("partial_rotary",) if rot_dim < head_size else ())


@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 64), (80, 80), (256, 256), (80, 32), (512, 128)])
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
    assert rel_err(qkv[:, : (hq + hkv) * head_size], want) < round_tol(dtype)
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
    assert rel_err(q, oracle_rope(q_in, positions, cos_sin, True).half()) < round_tol(torch.float16)


def _padding(provider, t, n_real, block_t, *, dtype, hq, hkv, d):
    fn = _kernel(provider, dtype, d, d)
    rows = guarded_rows(t, (hq + 2 * hkv) * d, dtype, seed=t + n_real)
    qkv = rows.t
    qkv_in = qkv.cpu().clone()
    positions = torch.randint(0, 500, (t,), generator=gen(t)).to(DEV)
    positions[n_real:] = 0  # padding tokens at position 0, as engines pad
    cos_sin = make_cos_sin(512, d, torch.float32)
    q, k, _ = split(qkv, hq, hkv, d)
    fn(positions, q, k, d, cos_sin, True,
       **(dict(cfg=WriterConfig(block_t)) if provider == "triton" and block_t else {}))
    rows.assert_intact("qkv")
    qe, ke, _ = split(qkv_in, hq, hkv, d)
    want = torch.cat([oracle_rope(x.reshape(t, -1, d), positions, cos_sin, True).reshape(t, -1).to(dtype)
                      for x in (qe, ke)], dim=1)
    assert rel_err(qkv[:n_real, : (hq + hkv) * d], want[:n_real]) < round_tol(dtype)
    assert torch.equal(qkv[:, (hq + hkv) * d:].cpu(), qkv_in[:, (hq + hkv) * d:])  # v untouched


@pytest.mark.parametrize("t,n_slots,n_real,block_t", PAD_CASES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rotary_embedding_padding(provider, t, n_slots, n_real, block_t):
    """Token counts that are multiples of no tile: the real tokens rotated, nothing written
    outside q/k (guard rows around qkv)."""
    _padding(provider, t, n_real, block_t, dtype=torch.float16, hq=4, hkv=2, d=64)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n_slots,n_real,block_t", GPU_PAD_CASES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rotary_embedding_padding_gpu(provider, t, n_slots, n_real, block_t):
    _padding(provider, t, n_real, block_t, dtype=torch.bfloat16, hq=32, hkv=8, d=128)
