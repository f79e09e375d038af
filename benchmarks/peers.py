"""FlashInfer as a peer of the attention benchmarks, on the same K/V values as ours.

FlashInfer keeps its paged cache in its own layout: here ``NHD`` pages
``[num_pages, 2, page_size, num_kv_heads, head_dim]``. ``nhd_pages`` copies our cache into
that layout page for page, so FlashInfer reads the same values through the same block ids
(the same random placement). The wrappers are planned once (host work, outside the timed
region); ``run()`` is what the benches time as CUDA-graph replays, and what they check
against SDPA.

FlashInfer is imported only when a bench is given ``--peers flashinfer``. The wheel the
device stage installs (``device_run.sh``, stage ``peers``) carries modules built ahead of time
for sm_90a (bf16, head 128, page 16, 32 query / 8 KV heads: decode on CUDA cores and on
tensor cores, paged prefill fa2/fa3). ``FLASHINFER_DISABLE_JIT=1`` (set here unless the
environment sets it) makes any other configuration fail at once instead of compiling with
nvcc for many minutes. Any failure is a ``PeerUnavailable`` with its reason, which the
benches print as a "peer unavailable: <reason>" row.
"""

from __future__ import annotations

import os

import torch
import triton

WORKSPACE_BYTES = 256 << 20


class PeerUnavailable(Exception):
    """The peer cannot run here; the message says why."""


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def load_flashinfer():
    """The flashinfer module (JIT compilation off unless the environment turns it on)."""
    os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - not installed, or its runtime missing
        raise PeerUnavailable(f"flashinfer import failed: {_why(e)}") from e
    return flashinfer


def flashinfer_version() -> str | None:
    try:
        return load_flashinfer().__version__
    except PeerUnavailable:
        return None


def nhd_pages(kv_cache: torch.Tensor, num_kv_heads: int, interleaved_v: bool) -> torch.Tensor:
    """Our cache's K/V as FlashInfer NHD pages ``[num_blocks, 2, block_size, heads, head]``."""
    from inductor_rocm_attn.layout import dense_kv

    kd, vd = dense_kv(kv_cache, num_kv_heads, interleaved_v)  # [nb, block_size, heads, head]
    return torch.stack([kd, vd], 1).contiguous()


def write_tokens(pages: torch.Tensor, block_table: torch.Tensor, start: int, key: torch.Tensor,
                 value: torch.Tensor) -> None:
    """Write each sequence's ``n`` new tokens (``key``/``value`` ``[B * n, heads, head]``) at
    positions ``start .. start + n`` of its pages (FlashInfer reads every key from pages)."""
    b = block_table.shape[0]
    n = key.shape[0] // b
    bs = pages.shape[2]
    pos = torch.arange(start, start + n, device=pages.device)
    blk = block_table[:, pos // bs].long()  # [B, n]
    off = (pos % bs).expand(b, n)
    pages[blk, 0, off] = key.view(b, n, *key.shape[1:]).to(pages.dtype)
    pages[blk, 1, off] = value.view(b, n, *value.shape[1:]).to(pages.dtype)


def _page_lists(block_table: torch.Tensor, kv_lens: list[int], block_size: int):
    """FlashInfer's CSR page lists: indptr ``[B+1]``, indices, last page length ``[B]``."""
    pages = [triton.cdiv(n, block_size) for n in kv_lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.cat([block_table[s, :p].cpu() for s, p in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([(n - 1) % block_size + 1 for n in kv_lens], dtype=torch.int32)
    dev = block_table.device
    return indptr.to(dev), indices.to(dev), last.to(dev)


class FlashInferDecode:
    """``BatchDecodeWithPagedKVCacheWrapper`` over ``pages``: ``q_len`` query tokens per
    sequence (> 1: speculative verify rows, tensor cores only, causal among themselves)."""

    def __init__(self, pages, block_table, kv_lens: list[int], query, scale: float, *,
                 tensor_cores: bool, q_len: int = 1):
        fi = load_flashinfer()
        _, _, bs, hkv, d = pages.shape
        hq = query.shape[1]
        self.pages, self.query, self.q_len = pages, query, q_len
        self.out = torch.empty_like(query)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        try:
            self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores)
            kw = dict(pos_encoding_mode="NONE", q_data_type=query.dtype, kv_data_type=pages.dtype,
                      sm_scale=scale)
            if q_len > 1:
                kw["q_len_per_req"] = q_len
            self.wrapper.plan(*_page_lists(block_table, kv_lens, bs), hq, hkv, d, bs, **kw)
            self.backend = str(getattr(self.wrapper, "resolved_backend", None)
                               or getattr(self.wrapper, "_backend", "?"))
            self.run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a module not built ahead, an API change ...
            raise PeerUnavailable(f"flashinfer decode (tensor_cores={tensor_cores}, "
                                  f"q_len={q_len}): {_why(e)}") from e

    def run(self):
        kw = dict(q_len_per_req=self.q_len) if self.q_len > 1 else {}
        self.wrapper.run(self.query, self.pages, out=self.out, **kw)
        return self.out


class FlashInferPrefill:
    """``BatchPrefillWithPagedKVCacheWrapper`` (``backend``, causal) over ``pages``: each
    sequence's queries are its last ``n`` tokens, every key (prefix and new) read from pages."""

    def __init__(self, pages, block_table, kv_lens: list[int], query, query_start_loc, scale: float,
                 *, backend: str = "fa3"):
        fi = load_flashinfer()
        _, _, bs, hkv, d = pages.shape
        hq = query.shape[1]
        self.pages, self.query = pages, query
        self.out = torch.empty_like(query)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        self.backend = backend
        try:
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                  backend=backend)
            self.wrapper.plan(query_start_loc.to(torch.int32), *_page_lists(block_table, kv_lens, bs),
                              hq, hkv, d, bs, causal=True, q_data_type=query.dtype,
                              kv_data_type=pages.dtype, sm_scale=scale)
            self.run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            raise PeerUnavailable(f"flashinfer prefill ({backend}): {_why(e)}") from e

    def run(self):
        self.wrapper.run(self.query, self.pages, out=self.out)
        return self.out
