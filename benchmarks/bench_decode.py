"""Paged-decode benchmark: Triton ``paged_attention`` vs PyTorch SDPA on the same data.

bf16, 32 query heads / 8 KV heads, head 128, block 16, blocks placed at random. For every
batch B and context L: check the Triton output against SDPA (over the same K/V made
contiguous), then time both as CUDA-graph replays (``common.graph_time_us``: do_bench
median, L2 flushed before each replay). Effective bandwidth counts K+V read once plus q and
out; the ceiling is a read-only reduction measured in the same run. Variants of the tuned
config (``--cfgs``, ``--margins``, ``--k-rows``, ``--candidates``) are passed in as
``DecodeConfig`` objects.

``--peers flashinfer``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on tensor cores
and on CUDA cores in the same run, over the same values in its own NHD pages (``peers.py``),
each output checked against SDPA; "peer unavailable: <reason>" where it cannot run.
``--candidates``: the split-rule / pipeline A/B of ``CANDIDATES`` at the ``--ab-batch`` sizes,
with the programs each launches and how many one SM holds (the driver's occupancy calculator).
``--verify Q``: speculative-decode verify batches instead (Q query tokens per sequence):
the verify kernel against the prefill kernel on the same batch, a plain decode step of the
same batch, SDPA and the FlashInfer peers.
``--fp8``: each case with a bf16 and an fp8 e4m3 cache (same geometry, same run): the fp8
speedup (goal >= 1.8x at B=64 L=4096: half the bytes).
``--head-size`` / ``--kv-heads``: another geometry (e.g. Gemma4's full layers: ``--head-size 512
--kv-heads 4``). ``--soft-cap C``: every case also with a logit soft cap of C (Gemma2's 50), timed
beside the uncapped kernel in the same run and checked against a float32 reference with the cap.

    python benchmarks/bench_decode.py [--batch 1 16 64 128] [--ctx 1024 4096 16384] [--sweep]
    python benchmarks/bench_decode.py --peers flashinfer --candidates
    python benchmarks/bench_decode.py --verify 4 --batch 16 64 --ctx 4096 --peers flashinfer
    python benchmarks/bench_decode.py --fp8 --batch 16 64 --ctx 4096 16384
    python benchmarks/bench_decode.py --head-size 512 --kv-heads 4 --soft-cap 50

Writes benchmarks/results/decode_<date>.json and .md (verify_<date> with --verify; or --out DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import graph_time_us, launched_kernels, residency, stamp, write_json  # noqa: E402
from peers import FlashInferDecode, PeerUnavailable, flashinfer_version, nhd_pages  # noqa: E402
from inductor_rocm_attn.kernels.triton import paged_attention  # noqa: E402  (the function)
from inductor_rocm_attn.kernels.triton.configs import (  # noqa: E402
    DecodeConfig, decode_config, decode_plan, verify_config, verify_rows)
from inductor_rocm_attn.kernels.triton.paged_attention import launch_target  # noqa: E402
from inductor_rocm_attn.kernels.triton.paged_decode import _paged_decode_kernel  # noqa: E402
from inductor_rocm_attn.kernels.triton.paged_verify import _paged_verify_kernel  # noqa: E402
from inductor_rocm_attn.layout import (  # noqa: E402
    CacheLayout, KVCacheSpec, allocate_kv_cache, dense_kv, k_view, v_view)

HQ, HKV, D, BS = 32, 8, 128, 16
INTERLEAVED_V = False
DTYPE = torch.bfloat16
TOL = 1e-2  # relative-norm error against SDPA, every output (bf16)

# The split-rule / pipeline A/B (--candidates): fields of the tuned DecodeConfig replaced.
# Compiled for sm_90 the default one-warp program takes 24 KB of shared memory (+1 KB static,
# +1 KB reserved per CTA) and 203 registers: 8 fit an SM. The default rule rounds the split
# count down so the grid fits one wave (B=16 x 8 KV heads: 8 splits, 1024 programs); rounded
# up it took 9 splits, 1152 programs, and a tail wave of 96 that cost 8-37 us at B=16 on the
# H200 (benchmarks/results/latest/decode_grid.md). The candidates: the old rounded-up rule,
# 4 programs an SM (4 splits, 512 programs), and 2 pipeline stages (16 KB). B=128 is the
# control: one split under every rule.
CANDIDATES = {
    "default": {},
    "round_up": dict(splits_round_down=False),
    "per_sm4_down": dict(programs_per_sm=4, splits_round_down=True),
    "stages2": dict(num_stages=2),
    # the splits' merge (DecodeConfig.split_merge): the reduce kernel; the last split program
    "reduce": dict(split_merge="reduce"),
    "last_split": dict(split_merge="last_split"),
}


def read_ceiling_tbs() -> float:
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    t = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), warmup=10, rep=100,
                                return_mode="median")
    del x
    return 2 * (1 << 30) / (t * 1e-3) / 1e12


@triton.jit
def _paged_gather_kernel(out_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, stride_kb, stride_kh,
                         stride_vb, stride_vh, stride_bt, PAGE: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr):
    """Read every K and V page of one (sequence, KV head) through the block table; nothing
    else. The bandwidth of the best paged kernel with this placement (no attention math)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    n_blocks = tl.load(seq_lens_ptr + seq) // BLOCK_SIZE
    offs = tl.arange(0, PAGE)
    acc = tl.zeros([PAGE], tl.float32)
    for i in range(0, n_blocks):
        blk = tl.load(bt_ptr + seq * stride_bt + i).to(tl.int64)
        acc += tl.load(k_ptr + blk * stride_kb + head * stride_kh + offs).to(tl.float32)
        acc += tl.load(v_ptr + blk * stride_vb + head * stride_vh + offs).to(tl.float32)
    tl.store(out_ptr + (seq * tl.num_programs(1) + head), tl.sum(acc, 0))


@triton.jit
def _paged_gather_tiles_kernel(out_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, stride_kb, stride_kh,
                               stride_vb, stride_vh, stride_bt, HEAD: tl.constexpr,
                               BLOCK_SIZE: tl.constexpr, X: tl.constexpr, TILE: tl.constexpr,
                               CHUNK: tl.constexpr):
    """The same pages as ``_paged_gather_kernel``, read with the decode kernel's tile
    addressing (K ``[HEAD, TILE]`` over the x-packed page, V ``[TILE, HEAD]``; standard V,
    TILE divides BLOCK_SIZE): what that access pattern alone costs, with no attention math.
    One warp per program and ``CHUNK`` keys each (grid axis 2), so that many warps per SM
    hide latency and only the addressing is measured. Loads land in registers (128-bit LDG,
    sm_90 SASS: Triton pipelines through shared memory only loads that feed a dot), so this
    bounds the addressing, not the kernel's cp.async path. Without the contiguity hints the
    V loads are 2-byte scalars (results of this column taken without them are void)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    n_tiles = tl.load(seq_lens_ptr + seq) // TILE
    t_lo = chunk * (CHUNK // TILE)
    t_hi = tl.minimum(t_lo + CHUNK // TILE, n_tiles)
    offs_d = tl.arange(0, HEAD)
    offs_n = tl.arange(0, TILE)
    acc = tl.zeros([HEAD, TILE], tl.float32)
    for t in range(t_lo, t_hi):
        blk = tl.load(bt_ptr + seq * stride_bt + (t * TILE) // BLOCK_SIZE).to(tl.int64)
        # contiguity hints as in the kernel: without them V loads are 2-byte scalars
        in_blk = tl.max_contiguous(tl.multiple_of((t * TILE) % BLOCK_SIZE + offs_n, TILE), TILE)
        k = tl.load(k_ptr + blk * stride_kb + head * stride_kh + (offs_d // X)[:, None] * (BLOCK_SIZE * X)
                    + in_blk[None, :] * X + (offs_d % X)[:, None])
        v = tl.load(v_ptr + blk * stride_vb + head * stride_vh + offs_d[None, :] * BLOCK_SIZE
                    + in_blk[:, None])
        acc += k.to(tl.float32) + tl.trans(v).to(tl.float32)
    pid = (seq * tl.num_programs(1) + head) * tl.num_programs(2) + chunk
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def default_decode_config() -> DecodeConfig:
    """The tuned config the launcher picks for the bench's shape (variants replace fields)."""
    return decode_config(D, HQ // HKV, BS, DTYPE, False, INTERLEAVED_V)


class DecodeCase:
    def __init__(self, b: int, L: int, seed: int = 0, layout=CacheLayout.LHBNC, sequential=False,
                 cache_dtype=DTYPE):
        g = torch.Generator(device="cuda").manual_seed(seed)
        nblk = b * L // BS
        spec = KVCacheSpec(BS, HKV, D, cache_dtype, layout)
        self.kv_cache = allocate_kv_cache(spec, nblk + 8, "cuda")
        self.kv_cache.copy_(torch.randn(self.kv_cache.shape, generator=g, device="cuda", dtype=DTYPE))
        perm = (torch.arange(nblk, device="cuda") if sequential
                else torch.randperm(nblk + 8, generator=g, device="cuda")[:nblk])
        self.block_table = perm.view(b, L // BS).to(torch.int32).contiguous()
        self.seq_lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        self.query = torch.randn(b, HQ, D, generator=g, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.scale = D ** -0.5
        self.one = torch.ones(1, device="cuda")
        self.b, self.L = b, L

    def run(self, soft_cap: float = 0.0, **kw):
        paged_attention(self.out, self.query, None, None, self.kv_cache, self.qsl, self.seq_lens,
                        self.block_table, self.scale, self.one, self.one, True, -1, None, None,
                        soft_cap, INTERLEAVED_V, None, max_query_len=1, max_seq_len=self.L, **kw)

    def gather(self, warps: int = 4):
        """The paged-read peer: every K/V page this case's attention reads, and no math."""
        kc = k_view(self.kv_cache, HKV)
        vc = v_view(self.kv_cache, HKV, INTERLEAVED_V)
        sink = torch.empty(self.b * HKV, dtype=torch.float32, device="cuda")
        _paged_gather_kernel[(self.b, HKV)](
            sink, kc, vc, self.block_table, self.seq_lens, kc.stride(0), kc.stride(1),
            vc.stride(0), vc.stride(1), self.block_table.stride(0), PAGE=BS * D,
            BLOCK_SIZE=BS, num_warps=warps, num_stages=4)

    def gather_tiles(self):
        """The gather peer with the decode kernel's tile addressing (standard V only)."""
        kc = k_view(self.kv_cache, HKV)
        vc = v_view(self.kv_cache, HKV, False)
        chunks = triton.cdiv(self.L, 256)
        sink = torch.empty(self.b * HKV * chunks, dtype=torch.float32, device="cuda")
        _paged_gather_tiles_kernel[(self.b, HKV, chunks)](
            sink, kc, vc, self.block_table, self.seq_lens, kc.stride(0), kc.stride(1),
            vc.stride(0), vc.stride(1), self.block_table.stride(0), HEAD=D, BLOCK_SIZE=BS,
            X=kc.shape[-1], TILE=16, CHUNK=256, num_warps=1, num_stages=3)

    def dense(self):
        """Contiguous K, V ``[B, HKV, L, D]`` holding the same tokens (for SDPA)."""
        kd, vd = dense_kv(self.kv_cache, HKV, INTERLEAVED_V)  # [nb, BS, HKV, D]
        kd, vd = kd.to(DTYPE), vd.to(DTYPE)  # an fp8 cache's values, exactly (scales are 1)
        bt = self.block_table.long()
        k = kd[bt].reshape(self.b, self.L, HKV, D).transpose(1, 2).contiguous()
        v = vd[bt].reshape(self.b, self.L, HKV, D).transpose(1, 2).contiguous()
        return k, v



def by_batch_slices(fn, b: int, per_seq_bytes: int, budget: int = 4 << 30) -> torch.Tensor:
    """``fn(slice)`` over slices of the batch whose temporaries fit ``budget`` bytes, joined.
    SDPA runs its math kernel at head sizes its fused kernels do not take (512): it expands
    K/V to every query head, which for the whole batch at long contexts is tens of GiB."""
    step = max(1, min(b, budget // max(1, per_seq_bytes)))
    return torch.cat([fn(slice(i, i + step)) for i in range(0, b, step)])


def sdpa_reference(q4, k, v, scale: float) -> torch.Tensor:
    """SDPA's decode output [B, HQ, 1, D] (GQA), computed a slice of the batch at a time."""
    per_seq = 2 * HQ * k.shape[2] * D * k.element_size() + HQ * k.shape[2] * 4
    return by_batch_slices(lambda s: F.scaled_dot_product_attention(q4[s], k[s], v[s], scale=scale,
                                                                    enable_gqa=True), q4.shape[0], per_seq)


def capped_reference(q4, k, v, scale: float, cap: float) -> torch.Tensor:
    """Decode attention with a logit soft cap, in float32 (SDPA has no soft cap): [B, HQ, 1, D]."""
    def part(sl):
        qf = q4[sl].float().reshape(-1, HKV, HQ // HKV, D)  # [b, HKV, G, D]: no K copies
        s = (qf @ k[sl].float().transpose(-1, -2)) * scale  # [b, HKV, G, L]
        s = cap * torch.tanh(s / cap)
        return (s.softmax(-1) @ v[sl].float()).reshape(q4[sl].shape)

    per_seq = 2 * HKV * k.shape[2] * D * 4 + 2 * HQ * k.shape[2] * 4  # float32 K/V and scores
    return by_batch_slices(part, q4.shape[0], per_seq)


def write_table(out_dir: str, name: str, lines: list[str]) -> None:
    """The run's markdown table: ``<out_dir>/<name>.md``, and printed."""
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(md)
    print(md)


def rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


class Peers:
    """The peers of one run (``--peers``): each timed on every case; an unavailable peer is
    reported once per reason and recorded in the rows."""

    def __init__(self, names):
        self.names = list(names)
        self.seen: set[str] = set()

    def unavailable(self, row: dict, key: str, why: str):
        row[key + "_us"] = None
        row[key + "_unavailable"] = why
        if why not in self.seen:
            self.seen.add(why)
            print(f"  peer unavailable: {why}", flush=True)

    def time(self, row: dict, key: str, make, ref, check=lambda out: out, ok_tol=TOL):
        """Build a peer (``make()`` -> object with ``run()``), check its output against
        ``ref``, time it; fills ``row[key + "_us"]`` and ``_err`` or ``_unavailable``."""
        try:
            peer = make()
        except PeerUnavailable as e:
            return self.unavailable(row, key, str(e))
        err = rel_err(check(peer.run()), ref)
        row[key + "_err"] = err
        if not err < ok_tol:
            return self.unavailable(row, key, f"{key}: output differs from SDPA (rel err {err:.2e})")
        try:
            row[key + "_us"] = graph_time_us(peer.run)
        except Exception as e:  # noqa: BLE001 - e.g. not capturable in a CUDA graph
            return self.unavailable(row, key, f"{key}: timing failed: {type(e).__name__}: {e}"[:300])
        row[key + "_backend"] = getattr(peer, "backend", None)
        return row[key + "_us"]


def flashinfer_decode_peers(peers: Peers, c: "DecodeCase", ref, row: dict):
    if "flashinfer" not in peers.names:
        return
    pages = nhd_pages(c.kv_cache, HKV, INTERLEAVED_V)
    for tc, key in ((True, "flashinfer_tc"), (False, "flashinfer_cuda")):
        peers.time(row, key, lambda: FlashInferDecode(pages, c.block_table, [c.L] * c.b, c.query,
                                                      c.scale, tensor_cores=tc), ref)
    del pages


def time_candidates(c: "DecodeCase", ref, sms: int, nbytes: int, t_default: float) -> list[dict]:
    """The CANDIDATES on one case: splits, programs, residency, time, check."""
    out = []
    for name, changes in CANDIDATES.items():
        cfg = dataclasses.replace(default_decode_config(), **changes)
        kind, splits = decode_plan(cfg, None, num_seqs=c.b, num_kv_heads=HKV, head_chunks=1,
                                   max_ctx=c.L, num_sms=sms)
        c.out.fill_(float("nan"))
        kern = (launched_kernels(_paged_decode_kernel, lambda: c.run(decode_cfg=cfg)) or [None])[-1]
        err = rel_err(c.out, ref)
        assert err < TOL, f"candidate {name}: rel err {err:.3e}"
        t = t_default if name == "default" else graph_time_us(lambda: c.run(decode_cfg=cfg))
        res = residency(kern)
        programs = c.b * HKV * splits
        waves = programs / (sms * res["per_sm"]) if res["per_sm"] else None
        out.append(dict(B=c.b, L=c.L, candidate=name, changes=changes, kind=kind, splits=splits,
                        programs=programs, resident_per_sm=res["per_sm"], regs=res["regs"],
                        shared_bytes=res["shared_bytes"], waves=waves, us=t,
                        tbs=nbytes / t / 1e6, vs_default=t / t_default, rel_err_vs_sdpa=err))
        print(f"  candidate {name:13s} {kind:5s} splits={splits:2d} programs={programs:5d} "
              f"resident/SM={res['per_sm']} regs={res['regs']} smem={res['shared_bytes']} "
              f"waves={'-' if waves is None else f'{waves:.2f}'}: {t:7.1f} us "
              f"{nbytes / t / 1e6:5.2f} TB/s x{t / t_default:.3f}  err {err:.1e}", flush=True)
    return out


def candidates_table(cands: list[dict], rows: list[dict]) -> list[str]:
    """Markdown: one line per (B, L), one column per candidate (us, splits, x default)."""
    if not cands:
        return []
    names = list(CANDIDATES)
    peer_cols = [k for k in ("sdpa", "flashinfer_tc", "flashinfer_cuda")
                 if any(r.get(k + "_us") for r in rows)]
    lines = ["", "A/B of the split rule and pipeline depth (us; splits; x default; same run):", "",
             "| B | L | " + " | ".join(names) + " | " + " | ".join(peer_cols) + " |",
             "|---|---|" + "---|" * (len(names) + len(peer_cols))]
    for b, L in dict.fromkeys((x["B"], x["L"]) for x in cands):
        by = {x["candidate"]: x for x in cands if x["B"] == b and x["L"] == L}
        row = next(r for r in rows if r["B"] == b and r["L"] == L)
        cells = [f"{by[n]['us']:.1f} ({by[n]['splits']}) x{by[n]['vs_default']:.2f}" for n in names]
        cells += [f"{row[k + '_us']:.1f}" if row.get(k + "_us") else "-" for k in peer_cols]
        lines.append(f"| {b} | {L} | " + " | ".join(cells) + " |")
    lines += ["", "| candidate | changes | programs at B=%d (L=%d) | resident/SM | waves | regs | shared B |"
              % (cands[0]["B"], cands[0]["L"]), "|---|---|---|---|---|---|---|"]
    for x in cands[: len(names)]:
        waves = "-" if x["waves"] is None else f"{x['waves']:.2f}"
        lines.append(f"| {x['candidate']} | {x['changes'] or 'tuned'} | {x['programs']} | "
                     f"{x['resident_per_sm']} | {waves} | {x['regs']} | {x['shared_bytes']} |")
    return lines


class VerifyCase:
    """A speculative-decode verify batch over a ``DecodeCase``'s cache: each of the B sequences
    has ``L`` tokens, its last ``q_len`` new (their K/V, already in the cache as in a model
    step, also passed as key/value: the op's contract for query_len > 1)."""

    def __init__(self, c: DecodeCase, q_len: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.c, self.q_len, self.b, self.L = c, q_len, c.b, c.L
        kd, vd = dense_kv(c.kv_cache, HKV, INTERLEAVED_V)
        bt = c.block_table.long()
        tail = slice(c.L - q_len, c.L)
        self.key = kd[bt].reshape(c.b, c.L, HKV, D)[:, tail].reshape(-1, HKV, D).contiguous()
        self.value = vd[bt].reshape(c.b, c.L, HKV, D)[:, tail].reshape(-1, HKV, D).contiguous()
        self.query = torch.randn(c.b * q_len, HQ, D, generator=g, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.qsl = torch.arange(c.b + 1, dtype=torch.int32, device="cuda") * q_len

    def run(self, **kw):
        c = self.c
        paged_attention(self.out, self.query, self.key, self.value, c.kv_cache, self.qsl,
                        c.seq_lens, c.block_table, c.scale, c.one, c.one, True, -1, None, None,
                        0.0, INTERLEAVED_V, None, max_query_len=self.q_len, max_seq_len=c.L, **kw)

    def sdpa_args(self, k, v):
        """q ``[B, HQ, q_len, D]`` and the bottom-right causal mask over ``L`` keys."""
        from torch.nn.attention.bias import causal_lower_right

        q = self.query.view(self.b, self.q_len, HQ, D).transpose(1, 2)
        return q, k, v, causal_lower_right(self.q_len, self.L)

    def as_bhqd(self, out):
        return out.view(self.b, self.q_len, HQ, D).transpose(1, 2)


FP8_TOL = 2e-2  # fp8 cache: SDPA over the same (dequantized) values, bf16 query


def parse_cfg(spec: str, **changes) -> tuple[DecodeConfig, int | None]:
    """``tile,warps,stages,kind[,splits]`` -> (config, splits or None for the heuristic)."""
    f = spec.split(",")
    return DecodeConfig(int(f[0]), int(f[1]), int(f[2]), f[3], **changes), int(f[4]) if len(f) > 4 else None


def bench_fp8(args, ceiling: float):
    """--fp8: each (B, L) with a bf16 cache and with an fp8 e4m3 cache (scales 1) of the same
    geometry, in the same run: both checked against SDPA over their own cache values, then
    timed. The fp8 cache holds half the bytes: the goal is >= 1.8x the bf16 speed. Beside the
    fp8 default (fp16 dots): the same config with bf16 dots (what fp8 ran before), and
    ``--fp8-cfgs`` (tile,warps,stages,kind[,splits], fp16 dots), each checked first."""
    rows = []
    fp8 = torch.float8_e4m3fn
    fp8_default = decode_config(D, HQ // HKV, BS, fp8, False, INTERLEAVED_V)
    variants = [("bf16_dots", dataclasses.replace(fp8_default, fp8_fp16_dot=False), None)]
    variants += [(m, dataclasses.replace(fp8_default, split_merge=m), None)
                 for m in ("reduce", "last_split") if m != fp8_default.split_merge]
    variants += [(spec, *parse_cfg(spec, fp8_fp16_dot=True)) for spec in args.fp8_cfgs]
    for b in args.batch:
        for L in args.ctx:
            row = dict(B=b, L=L, variants={})
            for name, dt in (("bf16", DTYPE), ("fp8_e4m3", fp8)):
                c = DecodeCase(b, L, seed=b * 7 + L, cache_dtype=dt)
                k, v = c.dense()
                q4 = c.query.view(b, HQ, 1, D)
                ref = F.scaled_dot_product_attention(q4, k, v, scale=c.scale, enable_gqa=True).view(b, HQ, D)
                c.out.fill_(float("nan"))
                c.run()
                err = rel_err(c.out, ref)
                assert err < (TOL if dt is DTYPE else FP8_TOL), f"B={b} L={L} {name}: rel err {err:.3e}"
                t = graph_time_us(c.run)
                nbytes = 2 * b * L * HKV * D * dt.itemsize + 2 * b * HQ * D * 2
                row.update({f"{name}_us": t, f"{name}_tbs": nbytes / t / 1e6, f"{name}_err": err})
                for vname, cfg, sp in variants if dt is fp8 else ():
                    c.out.fill_(float("nan"))
                    try:
                        c.run(decode_cfg=cfg, num_splits=sp)
                        v_err = rel_err(c.out, ref)
                        assert v_err < FP8_TOL, f"rel err {v_err:.3e}"
                        tv = graph_time_us(lambda: c.run(decode_cfg=cfg, num_splits=sp))
                    except Exception as e:  # a failing candidate must not hide the others
                        row["variants"][vname] = dict(error=f"{type(e).__name__}: {e}")
                        continue
                    row["variants"][vname] = dict(us=tv, tbs=nbytes / tv / 1e6, err=v_err)
                del c, k, v
                torch.cuda.empty_cache()
            row["fp8_speedup"] = row["bf16_us"] / row["fp8_e4m3_us"]
            for vr in row["variants"].values():
                if "us" in vr:
                    vr["speedup"] = row["bf16_us"] / vr["us"]
            rows.append(row)
            print(f"B={b:4d} L={L:6d}  bf16 {row['bf16_us']:8.1f} us {row['bf16_tbs']:5.2f} TB/s  fp8 e4m3 "
                  f"{row['fp8_e4m3_us']:8.1f} us {row['fp8_e4m3_tbs']:5.2f} TB/s  speedup x{row['fp8_speedup']:.2f}"
                  + "".join(f"  {n} " + (f"{vr['us']:.1f} us x{vr['speedup']:.2f}" if "us" in vr else vr["error"])
                            for n, vr in row["variants"].items())
                  + f"  err {row['bf16_err']:.1e} / {row['fp8_e4m3_err']:.1e}", flush=True)
    meta = dict(read_ceiling_tbs=ceiling, heads=f"{HQ}/{HKV}", head_size=D, block_size=BS,
                interleaved_v=INTERLEAVED_V, timing="CUDA-graph replay, do_bench median, L2 flushed",
                goal="fp8 e4m3 cache >= 1.8x the bf16 speed at B=64 L=4096",
                fp8_default_config=dataclasses.asdict(fp8_default),
                variants={n: dict(cfg=dataclasses.asdict(cfg), splits=sp) for n, cfg, sp in variants})
    name = f"decode_fp8_{stamp()}"
    meta = write_json(os.path.join(args.out, name + ".json"), dict(rows=rows), **meta)["meta"]
    names = [n for n, _, _ in variants]
    lines = [f"# Paged decode, fp8 e4m3 vs bf16 cache, {torch.cuda.get_device_name()} ({meta['date']})", "",
             f"`{meta['command']}`; bf16 query, heads {HQ}/{HKV}, d={D}, block {BS}; read ceiling "
             f"{ceiling:.2f} TB/s; {meta['timing']}; bytes: K+V in the cache dtype plus q and out.", "",
             f"fp8 default config {meta['fp8_default_config']}; variants (us, speedup over bf16): "
             f"bf16_dots = the default with fp8_fp16_dot off; the others tile,warps,stages,kind[,splits] "
             f"with fp16 dots.", "",
             "| B | L | bf16 us | bf16 TB/s | fp8 us | fp8 TB/s | fp8 speedup | "
             + " | ".join(names) + " | rel err bf16 / fp8 |",
             "|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        cells = [f"{r['variants'][n]['us']:.1f} (x{r['variants'][n]['speedup']:.2f})"
                 if "us" in r["variants"][n] else "failed" for n in names]
        lines.append(f"| {r['B']} | {r['L']} | {r['bf16_us']:.1f} | {r['bf16_tbs']:.2f} | {r['fp8_e4m3_us']:.1f} | "
                     f"{r['fp8_e4m3_tbs']:.2f} | {r['fp8_speedup']:.2f} | " + " | ".join(cells)
                     + f" | {r['bf16_err']:.1e} / {r['fp8_e4m3_err']:.1e} |")
    write_table(args.out, name, lines)


def bench_verify(args, sms: int, ceiling: float, peers: Peers):
    """--verify Q: the verify kernel vs the prefill kernel vs a decode step, same batch."""
    from peers import FlashInferPrefill

    q_len = args.verify
    rows = []
    for b in args.batch:
        for L in args.ctx:
            c = DecodeCase(b, L, seed=b * 11 + L)
            vc = VerifyCase(c, q_len, seed=b + L)
            k, v = c.dense()
            q, k, v, mask = vc.sdpa_args(k, v)
            kx = k.repeat_interleave(HQ // HKV, 1)  # the reference: every backend takes this
            ref = F.scaled_dot_product_attention(q, kx, v.repeat_interleave(HQ // HKV, 1),
                                                 attn_mask=mask, scale=c.scale)
            del kx
            nbytes = 2 * b * L * HKV * D * 2 + 2 * b * q_len * HQ * D * 2
            row = dict(B=b, L=L, q_len=q_len)
            for name, run in (("verify", lambda: vc.run()),
                              ("prefill_kernel", lambda: vc.run(verify_max_query_len=1))):
                vc.out.fill_(float("nan"))
                kerns = launched_kernels(_paged_verify_kernel, run)
                err = rel_err(vc.as_bhqd(vc.out), ref)
                assert err < TOL, f"B={b} L={L} {name}: rel err {err:.3e}"
                assert bool(kerns) == (name == "verify"), f"{name}: the wrong kernel ran"
                kern = kerns[-1] if kerns else None
                row[name + "_us"] = graph_time_us(run)
                row[name + "_err"] = err
                if name == "verify":
                    vcfg = verify_config(D, HQ // HKV, BS, DTYPE, False, INTERLEAVED_V, q_len)
                    rows_ = verify_rows(HQ // HKV, q_len, D)
                    row.update(verify_residency=residency(kern), verify_cfg=dataclasses.asdict(vcfg),
                               verify_block_rows=rows_, verify_kind_splits=decode_plan(
                                   vcfg, None, num_seqs=b, num_kv_heads=HKV,
                                   head_chunks=triton.cdiv(q_len * HQ // HKV, rows_), max_ctx=L,
                                   num_sms=sms))
            for spec in args.cfgs or ():  # verify configs of one's own: checked, then timed
                vcfg_, splits_ = parse_cfg(spec)
                run = lambda: vc.run(verify_cfg=vcfg_, num_splits=splits_)  # noqa: E731
                try:
                    vc.out.fill_(float("nan"))
                    run()
                    err = rel_err(vc.as_bhqd(vc.out), ref)
                    assert err < TOL, f"rel err {err:.3e}"
                    row.setdefault("verify_cfgs", {})[spec] = dict(us=graph_time_us(run), err=err)
                except Exception as e:  # noqa: BLE001  (a config that fails is a result)
                    row.setdefault("verify_cfgs", {})[spec] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                print(f"  verify cfg {spec}: {row['verify_cfgs'][spec]}", flush=True)
            c.out.fill_(float("nan"))
            c.run()  # a plain decode step of the same batch (one query token per sequence)
            row["decode_step_us"] = graph_time_us(c.run)
            sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
                q, k, v, attn_mask=mask, scale=c.scale, enable_gqa=True)
            try:
                row["sdpa_err"] = rel_err(sdpa(), ref)
                assert row["sdpa_err"] < TOL, f"output differs (rel err {row['sdpa_err']:.2e})"
                row["sdpa_us"] = graph_time_us(sdpa)
            except Exception as e:  # noqa: BLE001 - no SDPA backend takes this mask with GQA
                row["sdpa_us"] = None
                row["sdpa_unavailable"] = f"{type(e).__name__}: {e}"[:200]
            if "flashinfer" in peers.names:
                pages = nhd_pages(c.kv_cache, HKV, INTERLEAVED_V)
                peers.time(row, "flashinfer_tc", lambda: FlashInferDecode(
                    pages, c.block_table, [L] * b, vc.query, c.scale, tensor_cores=True,
                    q_len=q_len), ref, check=vc.as_bhqd)
                peers.time(row, "flashinfer_fa3_prefill", lambda: FlashInferPrefill(
                    pages, c.block_table, [L] * b, vc.query, vc.qsl, c.scale, backend="fa3"), ref,
                    check=vc.as_bhqd)
                del pages
            row["verify_vs_decode_step"] = row["verify_us"] / row["decode_step_us"]
            row["verify_tbs"] = nbytes / row["verify_us"] / 1e6
            rows.append(row)
            fi = " ".join(f"{k_[:-3]} {row[k_]:.1f}" for k_ in ("flashinfer_tc_us",
                          "flashinfer_fa3_prefill_us") if row.get(k_))
            print(f"B={b:4d} L={L:6d} q={q_len}: verify {row['verify_us']:7.1f} us "
                  f"({row['verify_tbs']:.2f} TB/s, x{row['verify_vs_decode_step']:.2f} of a decode step "
                  f"{row['decode_step_us']:.1f}) | prefill kernel {row['prefill_kernel_us']:7.1f} | SDPA "
                  f"{row['sdpa_us'] or float('nan'):7.1f} | {fi}", flush=True)
            del c, vc, q, k, v, ref
            torch.cuda.empty_cache()
    meta = dict(read_ceiling_tbs=ceiling, dtype="bf16", heads=f"{HQ}/{HKV}", head_size=D,
                block_size=BS, q_len=q_len, peers=peers.names, flashinfer=flashinfer_version()
                if "flashinfer" in peers.names else None,
                timing="CUDA-graph replay, do_bench median, L2 flushed",
                goal="verify within 1.2x of a decode step of the same batch")
    name = f"verify_{stamp()}_q{q_len}"
    meta = write_json(os.path.join(args.out, name + ".json"), dict(rows=rows), **meta)["meta"]
    lines = [f"# Speculative-decode verify, {torch.cuda.get_device_name()} ({meta['date']})", "",
             f"`{meta['command']}`; bf16, heads {HQ}/{HKV}, d={D}, block {BS}, {q_len} query tokens "
             f"per sequence (causal among themselves); {meta['timing']}. Verify: the decode-style "
             "kernel (paged_verify.py); prefill kernel: the same call with the verify path off; "
             "decode step: one query token per sequence over the same cache.", "",
             "| B | L | verify us | TB/s | verify / decode step | decode step us | prefill kernel us "
             "| SDPA us | FlashInfer tc decode (q_len_per_req) us | FlashInfer fa3 prefill us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda k_: f"{r[k_]:.1f}" if r.get(k_) else "-"  # noqa: E731
        lines.append(f"| {r['B']} | {r['L']} | {r['verify_us']:.1f} | {r['verify_tbs']:.2f} | "
                     f"{r['verify_vs_decode_step']:.2f} | {r['decode_step_us']:.1f} | "
                     f"{r['prefill_kernel_us']:.1f} | {fmt('sdpa_us')} | {fmt('flashinfer_tc_us')} | "
                     f"{fmt('flashinfer_fa3_prefill_us')} |")
    write_table(args.out, name, lines)


def main():
    global BS, HQ, HKV, D, INTERLEAVED_V
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--sweep", action="store_true", help="also sweep configs at B=64,L=4096 and splits at B=1")
    ap.add_argument("--sequential", action="store_true",
                    help="place each sequence's blocks in order (diagnostic; default random)")
    ap.add_argument("--q-heads", type=int, default=HQ, help="query heads (default 32)")
    ap.add_argument("--kv-heads", type=int, default=HKV, help="KV heads (default 8)")
    ap.add_argument("--head-size", type=int, default=D, help="head size (default 128)")
    ap.add_argument("--soft-cap", type=float, default=0.0,
                    help="also time every case with this logit soft cap (checked against float32)")
    ap.add_argument("--interleaved-v", action="store_true", help="interleaved-V cache interior")
    ap.add_argument("--cfgs", nargs="+", default=None,
                    help="only these decode configs, tile,warps,stages,kind[,splits], e.g. 16,1,3,rows "
                         "16,1,1,rows3,4 (with --sweep)")
    ap.add_argument("--block-size", type=int, default=BS, help="cache block size (default 16)")
    ap.add_argument("--margins", type=float, nargs="*", default=[],
                    help="also time the default config at these lazy-rescale margins (0: rescale every tile)")
    ap.add_argument("--k-rows", type=int, nargs="*", default=[], choices=(0, 1, 2),
                    help="also time the default config with these K read levels (DecodeConfig.k_rows; "
                         "A/B in one run; checked against SDPA)")
    ap.add_argument("--peers", nargs="*", default=[], choices=("flashinfer",),
                    help="also time these peers on every case (same values, their own layout)")
    ap.add_argument("--candidates", action="store_true",
                    help="A/B of the split rule and pipeline depth (CANDIDATES) at --ab-batch")
    ap.add_argument("--ab-batch", type=int, nargs="+", default=[16, 128],
                    help="batch sizes of the --candidates A/B (default 16 128)")
    ap.add_argument("--verify", type=int, default=0, metavar="Q",
                    help="speculative-decode verify batches of Q query tokens per sequence instead")
    ap.add_argument("--fp8", action="store_true",
                    help="an fp8 e4m3 cache beside the bf16 one on every case instead (speedup table)")
    ap.add_argument("--fp8-cfgs", nargs="*", default=[],
                    help="with --fp8: also these fp8 configs (fp16 dots), tile,warps,stages,kind[,splits]")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    BS = args.block_size
    if args.soft_cap < 0:
        ap.error(f"--soft-cap {args.soft_cap:g}: a logit soft cap must be > 0 (0: no capped run)")
    if args.kv_heads < 1 or args.q_heads % args.kv_heads:
        ap.error(f"--q-heads {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    HQ, HKV, D = args.q_heads, args.kv_heads, args.head_size
    INTERLEAVED_V = args.interleaved_v
    dev = torch.cuda.get_device_name()
    sms = launch_target(torch.device("cuda")).num_sms
    ceiling = read_ceiling_tbs()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}; read ceiling {ceiling:.2f} TB/s")
    peers = Peers(args.peers)
    if args.verify:
        return bench_verify(args, sms, ceiling, peers)
    if args.fp8:
        return bench_fp8(args, ceiling)
    rows, sweep, margins, k_rows, cands = [], [], [], [], []
    for b in args.batch:
        for L in args.ctx:
            c = DecodeCase(b, L, seed=b * 7 + L, sequential=args.sequential)
            k, v = c.dense()
            q4 = c.query.view(b, HQ, 1, D)
            ref = sdpa_reference(q4, k, v, c.scale)
            c.out.fill_(float("nan"))
            c.run()
            err = float((c.out.float() - ref.view(b, HQ, D).float()).norm() / ref.float().norm())
            assert err < 1e-2, f"B={b} L={L}: triton vs SDPA rel err {err:.3e}"
            # the split count the launch runs with (the default config's own split rule)
            splits = decode_plan(default_decode_config(), None, num_seqs=b, num_kv_heads=HKV,
                                 head_chunks=1, max_ctx=L, num_sms=sms)[1]
            t_tri = graph_time_us(c.run)
            try:  # the peer as users would call it: the whole batch in one call
                t_sdpa = graph_time_us(lambda: F.scaled_dot_product_attention(
                    q4, k, v, scale=c.scale, enable_gqa=True))
            except torch.OutOfMemoryError:  # its math kernel at head 512 and long contexts
                t_sdpa = None
                torch.cuda.empty_cache()
            t_gather = graph_time_us(c.gather)
            # the same pages with the decode kernel's tile addressing (standard V only; its
            # one-warp tile is sized for head sizes up to 256)
            t_tiles = None if INTERLEAVED_V or D > 256 else graph_time_us(c.gather_tiles)
            nbytes = 2 * b * L * HKV * D * 2 + 2 * b * HQ * D * 2
            row = dict(B=b, L=L, splits=splits, triton_us=t_tri, sdpa_us=t_sdpa, gather_us=t_gather,
                       gather_tbs=2 * b * L * HKV * D * 2 / t_gather / 1e6,
                       gather_tiles_tbs=None if t_tiles is None else 2 * b * L * HKV * D * 2 / t_tiles / 1e6,
                       triton_tbs=nbytes / t_tri / 1e6, sdpa_tbs=t_sdpa and nbytes / t_sdpa / 1e6,
                       ratio_vs_sdpa=t_sdpa and t_tri / t_sdpa, frac_of_ceiling=nbytes / t_tri / 1e6 / ceiling,
                       rel_err_vs_sdpa=err)
            if t_sdpa is None:
                row["sdpa_unavailable"] = (f"SDPA on the whole batch ran out of GPU memory at head size {D} "
                                           f"(its math kernel expands K/V to every query head)")
            rows.append(row)
            if args.soft_cap > 0:  # the capped kernel beside the uncapped one, same case
                cap_ref = capped_reference(q4, k, v, c.scale, args.soft_cap).view(b, HQ, D)
                c.out.fill_(float("nan"))
                c.run(soft_cap=args.soft_cap)
                cap_err = rel_err(c.out, cap_ref)
                assert cap_err < 1e-2, f"B={b} L={L} soft cap {args.soft_cap:g}: rel err {cap_err:.3e}"
                t_cap = graph_time_us(lambda: c.run(soft_cap=args.soft_cap))
                row.update(soft_cap=args.soft_cap, soft_cap_us=t_cap, soft_cap_tbs=nbytes / t_cap / 1e6,
                           soft_cap_vs_uncapped=t_cap / t_tri, soft_cap_rel_err=cap_err)
                print(f"  soft cap {args.soft_cap:g}: {t_cap:8.1f} us {row['soft_cap_tbs']:5.2f} TB/s"
                      f"  x{t_cap / t_tri:.3f} the uncapped  err {cap_err:.1e}", flush=True)
            flashinfer_decode_peers(peers, c, ref.view(b, HQ, D), row)
            fi = [row[k_] for k_ in ("flashinfer_tc_us", "flashinfer_cuda_us") if row.get(k_)]
            row["ratio_vs_best_flashinfer"] = t_tri / min(fi) if fi else None
            print(f"B={b:4d} L={L:6d} splits={splits:2d}  triton {t_tri:8.1f} us {row['triton_tbs']:5.2f} TB/s"
                  + (f"  sdpa {t_sdpa:8.1f} us {row['sdpa_tbs']:5.2f} TB/s  x{row['ratio_vs_sdpa']:.2f}"
                     if t_sdpa else "  sdpa out of memory")
                  + f"  gather {row['gather_tbs']:5.2f} TB/s"
                  + (f" (tiles {row['gather_tiles_tbs']:5.2f})" if t_tiles else "")
                  + "".join(f"  {k_[:-3]} {row[k_]:.1f} us" for k_ in ("flashinfer_tc_us", "flashinfer_cuda_us")
                            if row.get(k_))
                  + f"  err {err:.1e}", flush=True)
            if args.candidates and b in args.ab_batch:
                cands += time_candidates(c, ref.view(b, HQ, D), sms, nbytes, t_tri)
            for mg in args.margins:  # A/B of the lazy softmax rescale, same case, same run
                cfg = dataclasses.replace(default_decode_config(), rescale_margin=mg)
                t = graph_time_us(lambda: c.run(decode_cfg=cfg))
                margins.append(dict(B=b, L=L, margin=mg, us=t, tbs=nbytes / t / 1e6))
                print(f"  rescale margin {mg:g}: {t:7.1f} us {nbytes / t / 1e6:5.2f} TB/s", flush=True)
            for level in args.k_rows:  # A/B of the K read level, same case, same run
                cfg = dataclasses.replace(default_decode_config(), k_rows=level)
                c.out.fill_(float("nan"))
                c.run(decode_cfg=cfg)
                f_err = float((c.out.float() - ref.view(b, HQ, D).float()).norm() / ref.float().norm())
                assert f_err < 1e-2, f"k_rows={level}: rel err {f_err:.3e}"
                t = graph_time_us(lambda: c.run(decode_cfg=cfg))
                k_rows.append(dict(B=b, L=L, k_rows=level, us=t, tbs=nbytes / t / 1e6,
                                   rel_err_vs_sdpa=f_err))
                print(f"  k_rows={level}: {t:7.1f} us {nbytes / t / 1e6:5.2f} TB/s  err {f_err:.1e}",
                      flush=True)
            if args.sweep and (args.cfgs or L == 4096):
                # (config, splits): rows = warps share a [16, TILE_N] tile; streams = one key
                # stream per warp (paged_decode.py); splits None = the heuristic's
                one_warp = [DecodeConfig(16, 1, 4, "rows"), DecodeConfig(16, 1, 3, "rows"),
                            DecodeConfig(32, 1, 2, "rows"), DecodeConfig(32, 2, 2, "streams3")]
                runs = [(cfg, None) for cfg in one_warp]
                if b == 64:
                    runs += [(cfg, sp) for cfg in one_warp for sp in (2, 3)]
                    runs += [(DecodeConfig(16, 1, 2, "rows"), 2), (DecodeConfig(32, 1, 3, "rows"), 2),
                             (DecodeConfig(64, 4, 3, "rows"), 2)]
                if b == 1:
                    runs += [(cfg, sp) for cfg in one_warp[:2] for sp in (16, 64)]
                if b == 16:
                    runs += [(cfg, sp) for cfg in one_warp[:2] for sp in (4, 16)]
                if args.cfgs:  # tile,warps,stages,kind[,splits]
                    runs = [parse_cfg(spec) for spec in args.cfgs]
                for cfg, sp in runs:
                    try:  # each config checked against SDPA before it is timed
                        c.out.fill_(float("nan"))
                        c.run(decode_cfg=cfg, num_splits=sp)
                        s_err = float((c.out.float() - ref.view(b, HQ, D).float()).norm() / ref.float().norm())
                        if not s_err < 1e-2:
                            raise AssertionError(f"rel err {s_err:.3e} against SDPA")
                        t = graph_time_us(lambda: c.run(decode_cfg=cfg, num_splits=sp))
                    except Exception as e:  # e.g. out of shared memory
                        print(f"  cfg {cfg} splits {sp}: {type(e).__name__}: {str(e)[:200]}")
                        sweep.append(dict(B=b, L=L, cfg=dataclasses.asdict(cfg), splits=sp,
                                          error=f"{type(e).__name__}: {str(e)[:500]}"))
                        continue
                    sweep.append(dict(B=b, L=L, cfg=dataclasses.asdict(cfg), splits=sp, us=t,
                                      tbs=nbytes / t / 1e6, rel_err_vs_sdpa=s_err))
                    print(f"  cfg tile={cfg.tile_n} warps={cfg.num_warps} stages={cfg.num_stages} "
                          f"kind={cfg.kind} splits={sp}: {t:7.1f} us {nbytes / t / 1e6:5.2f} TB/s "
                          f"err {s_err:.1e}", flush=True)
            del c, k, v
            torch.cuda.empty_cache()
    meta = dict(read_ceiling_tbs=ceiling, dtype="bf16", heads=f"{HQ}/{HKV}", head_size=D,
                block_size=BS, interleaved_v=INTERLEAVED_V,
                placement="sequential" if args.sequential else "random",
                default_config=dataclasses.asdict(default_decode_config()),
                peers=peers.names, flashinfer=flashinfer_version() if "flashinfer" in peers.names else None,
                timing="CUDA-graph replay, do_bench median, L2 flushed")
    name = "decode_" + stamp() + ("_seq" if args.sequential else "") + (f"_bs{BS}" if BS != 16 else "")
    name += (f"_hq{HQ}" if HQ != 32 else "") + (f"_hkv{HKV}" if HKV != 8 else "")
    name += (f"_d{D}" if D != 128 else "") + (f"_cap{args.soft_cap:g}" if args.soft_cap > 0 else "")
    name += "_iv" if INTERLEAVED_V else ""
    meta = write_json(os.path.join(args.out, name + ".json"),
                      dict(rows=rows, sweep=sweep, margins=margins, k_rows=k_rows, candidates=cands),
                      **meta)["meta"]
    lines = [f"# Paged decode, {dev} ({meta['date']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, triton {meta['triton']}; bf16, "
             f"heads {HQ}/{HKV}, d={D}, block {BS}; read ceiling {ceiling:.2f} TB/s; {meta['timing']}", "",
             "Paged gather: the same K/V pages read through the block table with no attention math "
             "(the best a paged kernel can do with this placement); gather tiles: the same with the "
             "decode kernel's tile addressing, one warp (standard V only).", "",
             "| B | L | splits | Triton us | TB/s | % ceiling | SDPA us | SDPA TB/s | Triton/SDPA | gather TB/s "
             "| gather tiles TB/s | FlashInfer tc us | FlashInfer cuda us | Triton/best FlashInfer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda r, k_, f=".1f": format(r[k_], f) if r.get(k_) else "-"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['B']} | {r['L']} | {r['splits']} | {r['triton_us']:.1f} | {r['triton_tbs']:.2f} | "
                     f"{100 * r['frac_of_ceiling']:.0f}% | {fmt(r, 'sdpa_us')} | {fmt(r, 'sdpa_tbs', '.2f')} | "
                     f"{fmt(r, 'ratio_vs_sdpa', '.2f')} | {r['gather_tbs']:.2f} | {fmt(r, 'gather_tiles_tbs', '.2f')} | "
                     f"{fmt(r, 'flashinfer_tc_us')} | {fmt(r, 'flashinfer_cuda_us')} | "
                     f"{fmt(r, 'ratio_vs_best_flashinfer', '.2f')} |")
    if args.soft_cap > 0:
        lines += ["", f"Logit soft cap {args.soft_cap:g} (checked against float32 with the cap):", "",
                  "| B | L | uncapped us | capped us | capped / uncapped | capped TB/s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['B']} | {r['L']} | {r['triton_us']:.1f} | {r['soft_cap_us']:.1f} | "
                  f"{r['soft_cap_vs_uncapped']:.3f} | {r['soft_cap_tbs']:.2f} |" for r in rows]
    why = sorted({r[k_] for r in rows for k_ in r if k_.endswith("_unavailable")})
    lines += [f"\npeer unavailable: {w}" for w in why]
    lines += candidates_table(cands, rows)
    write_table(args.out, name, lines)


if __name__ == "__main__":
    main()
