"""Tuned launch configurations of the Triton kernels, as frozen dataclasses.

Each launcher takes its config as a keyword argument (``paged_attention(decode_cfg=,
prefill_cfg=, target=)``, ``encoder_attention(cfg=)``, the cache writers' ``cfg=``); None
means the tuned default below. A test or benchmark that wants a variant builds it, e.g.
``dataclasses.replace(decode_config(128, 4, 16, torch.bfloat16), k_rows=2)``, and passes it
in: nothing here is changed at run time.

Tuned on an H200 (benchmarks/bench_decode.py, bench_prefill.py, bench_cache_writers.py),
keyed by (head_size, gqa, block_size, dtype: the cache dtype for decode, the compute dtype
for prefill). Only measured entries are in the tables; anything else takes the heuristics.
The measurements quoted are H200 runs kept under benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton

DECODE_KINDS = (
    "streams",  # _paged_decode_streams_kernel: one key stream per warp, TILE_N // num_warps keys each
    "streams3",  # the same, masked first / unmasked middle / masked last tile
    "rows",  # _paged_decode_kernel, one masked loop: warps share a [BLOCK_H, TILE_N] tile
    "rows3",  # _paged_decode_kernel, masked first / unmasked middle / masked last tile
    "keys",  # _paged_decode_kernel keys-major, one masked loop
    "keys3",  # the same, masked first / unmasked middle / masked last tile
)
_ONE_LOOP_OF = {"rows3": "rows", "keys3": "keys"}  # what a short split runs instead
# How the KV splits' partial (acc, max, sum) rows are merged (DecodeConfig.split_merge):
SPLIT_MERGES = (
    "auto",  # "last_split" up to LAST_SPLIT_MAX_SPLITS splits, else "reduce" (the default)
    "reduce",  # a second kernel, _decode_reduce_kernel, one program per (sequence, head)
    "last_split",  # no second kernel: the last split program of each row block to finish merges
)
# The last split merges alone, one warp reading every split's partial rows from L2: cheaper
# than a second kernel for few splits, far dearer for many. H200, bf16, 32/8 heads, d128,
# us reduce / last_split (results history 2026-12-04_1235): B=16 (8 splits) L=1024 33.0 /
# 31.7, L=4096 80.4 / 79.8, L=16384 256.7 / 256.4; fp8 B=64 L=4096 (2 splits) 141.8 / 139.4;
# B=1 (16-64 splits) L=1024 12.1 / 14.9, L=4096 16.2 / 28.5.
LAST_SPLIT_MAX_SPLITS = 8
# The merge's ticket counters live per device and go back to 0 at the end of every launch, so
# decode launches on one device must run in stream order (one stream, or events between
# streams): two launches running at once on two streams would share counters.
# ROCM_ATTN_SPLIT_MERGE=reduce makes every default config merge in the reduce kernel instead.
DEFAULT_SPLIT_MERGE = os.environ.get("ROCM_ATTN_SPLIT_MERGE", "auto")
if DEFAULT_SPLIT_MERGE not in SPLIT_MERGES:  # at import: on a CPU no decode config is ever built
    raise ValueError(f"inductor_rocm_attn: environment variable ROCM_ATTN_SPLIT_MERGE={DEFAULT_SPLIT_MERGE!r}: "
                     f"expected one of {SPLIT_MERGES}, or unset")

# Which kernel runs the prefill part of paged_attention: "auto" (the default: the Gluon kernel,
# kernels/gluon/prefix_prefill.py, warp-specialized, NVIDIA sm_90 only, where it covers the
# launch and the Triton it was tested with is installed; the Triton kernel everywhere else,
# silently), "gluon" (the Gluon kernel where it covers the launch; elsewhere the Triton kernel,
# with one warning per reason) or "triton" (_prefix_prefill_kernel always). Read once, at
# import; paged_attention(prefill_kernel=...) overrides it per call.
PREFILL_KERNELS = ("auto", "triton", "gluon")
DEFAULT_PREFILL_KERNEL = os.environ.get("ROCM_ATTN_PREFILL_KERNEL", "auto")
if DEFAULT_PREFILL_KERNEL not in PREFILL_KERNELS:
    raise ValueError(f"inductor_rocm_attn: environment variable ROCM_ATTN_PREFILL_KERNEL={DEFAULT_PREFILL_KERNEL!r}: "
                     f"expected one of {PREFILL_KERNELS}, or unset")

# --- knobs (the defaults of the config fields below) -----------------------------------------

# How cache tiles read K (attention_common._load_paged_kv): 0 = a [HEAD, TILE_N] gather (a
# warp's lanes on 16 packets 256 bytes apart); 1 = a tile that is one run of a block (decode's
# 16-key tiles) as the page's packet rows, TILE_N * 16 contiguous bytes each; 2 = tiles of
# several runs as well ([runs, HEAD/X, SUB*X]). Decode B=64 L=4096: 258 us with 1, 326 with 0.
# Prefill's wgmma needs K in its own shared layout, so there the rows cost a register round
# trip; still, with a 4096-token prefix level 2 ran 361 TFLOP/s against 337 (level 1) and 334
# (0), no prefix 432 / 431 / 429 (results: s11_call4_ffma). Prefill takes level 2: the
# prefill tests of the GPU matrix and a memcheck of 38 of them ran with it
# (benchmarks/results/README.md, correctness table).
PAGED_K_ROWS = 1
PREFILL_K_ROWS = 2
# Lazy softmax rescale margins (log2 units, attention_common._attn_update); 0 rescales the
# accumulator on every tile. Decode: 8 is no faster (B=64 L=4096 328 vs 325 us; the
# end-to-end shape 173.5 vs 172.3): the loop is not issue-bound. Prefill, B=4 x 4096 new
# tokens: 8 over the cached context (paged tiles) ran the 4096-token-prefix case 2.5% faster;
# 8 over dense tiles (new tokens, encoder) 10% slower: in the 8-warp tile the "any row" vote
# costs two barriers a tile, more than it saves.
DECODE_RESCALE_MARGIN = 0.0
CONTEXT_RESCALE_MARGIN = 8.0
DENSE_RESCALE_MARGIN = 0.0
# Causal prefill runs each sequence's row blocks last-first (longest first: a shorter tail):
# 397 vs 395 TFLOP/s without a prefix, 287 vs 283 with 4096 (noise ~2%).
PREFILL_LONGEST_FIRST = True
# Prefill fetches the new tokens' K/V tiles with TMA (tensor descriptors, NVIDIA sm_90+)
# instead of per-lane async copies: 407 vs 395 TFLOP/s without a prefix.
PREFILL_DENSE_TMA = True
MIN_SPLIT_TOKENS = 64  # a KV split shorter than this costs more in merging than it saves
MAX_SPLITS = 64
# KV splits aim at this many decode programs per SM (num_kv_splits), rounded down (the
# default: the grid never exceeds SPLIT_PROGRAMS_PER_SM x SMs) or up. The one-warp decode
# program compiles for sm_90 to 24 KB of shared memory (plus 1 KB static and the 1 KB the
# driver reserves per CTA) and 203 registers: 8 fit an SM (the driver reports 8). Rounded
# up, B=16 x 8 KV heads x 9 splits = 1152 programs on 132 x 8 = 1056 slots left a second
# wave of 96. H200, bf16, 32/8 heads, d128 (benchmarks/results/latest/decode_grid.md): B=16
# L=4096 81.9 us rounded down vs 90.3 up, L=16384 261.3 vs 298.6, L=1024 33.2 vs 33.1;
# B=128 identical (one split either way).
SPLIT_PROGRAMS_PER_SM = 8
# Head size 512 at 16 bits: a program of 4 warps takes up to 240 registers a thread, so an
# SM holds 2; more splits than fill those slots only queue (decode and verify configs).
D512_PROGRAMS_PER_SM = 2
SPLITS_ROUND_DOWN = True
# A split of at most this many tiles runs a tuned "rows3"/"keys3" config as one masked loop:
# three loops would each start their software pipeline cold (B=1: 17.5 vs 18.1 us).
ONE_LOOP_MAX_TILES = 8
# Speculative-decode verify batches: sequences of 2..VERIFY_MAX_QUERY_LEN query tokens
# (EAGLE/MTP draft verification) run in the decode-style split-KV kernel (paged_verify.py)
# when the launch is told max_query_len; longer ones in the prefill kernel. 1 turns it off.
VERIFY_MAX_QUERY_LEN = 8


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One decode launch: ``tile_n`` keys a tile, warps, pipeline stages, loop ``kind``
    (``DECODE_KINDS``), K read level ``k_rows`` (``PAGED_K_ROWS``), lazy-rescale margin.
    ``one_loop_max_tiles`` > 0: a split of at most that many tiles runs a three-loop kind as
    its one-loop kind (tuned defaults set it; a config built by hand runs as given).
    ``programs_per_sm`` / ``splits_round_down`` / ``one_split_ctas_per_sm``: the KV split
    rule (``num_kv_splits``).
    ``split_merge``: how the KV splits' partials are merged (``SPLIT_MERGES``).
    ``fp8_fp16_dot``: with an fp8 cache and a bf16 query, the dots run in fp16 (kinds "rows",
    "rows3"). Every e4m3/e5m2 value is exact in fp16, and one conversion instruction turns a
    pair of fp8 values into fp16 (sm_90), where bf16 takes three per pair (fp8 -> fp16 -> bf16).
    The query is divided by a power of two taken from its largest finite element in the
    program (exact: it then lies in [-2, 2), where fp16 holds every bf16 value down to 2^-17
    of that element), and the score scale multiplied by it. Other launches ignore it."""

    tile_n: int
    num_warps: int
    num_stages: int
    kind: str
    k_rows: int = PAGED_K_ROWS
    rescale_margin: float = DECODE_RESCALE_MARGIN
    one_loop_max_tiles: int = 0
    programs_per_sm: int = SPLIT_PROGRAMS_PER_SM
    splits_round_down: bool = SPLITS_ROUND_DOWN
    fp8_fp16_dot: bool = False
    one_split_ctas_per_sm: int = 2
    split_merge: str = DEFAULT_SPLIT_MERGE

    def __post_init__(self):
        if self.kind not in DECODE_KINDS:
            raise ValueError(f"paged_attention: decode kind {self.kind!r}; supported: {DECODE_KINDS}")
        if self.split_merge not in SPLIT_MERGES:
            raise ValueError(f"paged_attention: decode split_merge {self.split_merge!r} (default "
                             f"from ROCM_ATTN_SPLIT_MERGE); supported: {SPLIT_MERGES}")
        if self.split_merge == "last_split" and self.kind.startswith("streams"):
            raise ValueError(f"paged_attention: decode split_merge 'last_split' with kind "
                             f"{self.kind!r}; supported with kinds 'rows', 'rows3', 'keys', 'keys3'")
        if self.fp8_fp16_dot and self.kind not in ("rows", "rows3"):
            raise ValueError(f"paged_attention: decode fp8_fp16_dot with kind {self.kind!r}; "
                             "supported with kinds 'rows', 'rows3'")
        if self.k_rows not in (0, 1, 2):
            raise ValueError(f"paged_attention: decode k_rows {self.k_rows}; supported: 0, 1, 2")
        for name in ("programs_per_sm", "one_split_ctas_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"paged_attention: decode {name} {getattr(self, name)}; supported: >= 1")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """One prefix-prefill (or encoder) launch: ``block_m`` query rows x ``block_n`` keys a
    tile, warps, stages; K read level of the cached context (``PREFILL_K_ROWS``); lazy-rescale
    margins over the cached context and over the new (dense) tokens; causal row blocks
    longest first; the new tokens' K/V through TMA descriptors where the GPU has TMA."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    k_rows: int = PREFILL_K_ROWS
    context_margin: float = CONTEXT_RESCALE_MARGIN
    dense_margin: float = DENSE_RESCALE_MARGIN
    longest_first: bool = PREFILL_LONGEST_FIRST
    dense_tma: bool = PREFILL_DENSE_TMA

    def __post_init__(self):
        if self.k_rows not in (0, 1, 2):
            raise ValueError(f"paged_attention: prefill k_rows {self.k_rows}; supported: 0, 1, 2")


@dataclasses.dataclass(frozen=True)
class LaunchTarget:
    """The GPU a launch is planned for: its SM count (KV splits) and whether it has TMA
    (prefill's new-token K/V). ``paged_attention.launch_target(device)`` queries it."""

    num_sms: int
    tma: bool


# The interpreter runs on CPU tensors: a nominal SM count; TMA descriptors work there.
INTERPRETER_TARGET = LaunchTarget(num_sms=8, tma=True)


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """One cache-writer / RoPE launch: ``block_t`` tokens a program; ``num_warps`` None
    derives it from the tile width (``writer_num_warps``)."""

    block_t: int
    num_warps: int | None = None


def interpreting() -> bool:
    """Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- decode ----------------------------------------------------------------------------------

_DECODE_TUNED: dict[tuple, DecodeConfig] = {
    # key: (head_size, gqa, block_size, cache dtype, interleaved V). B=64, L=4096: 1 warp,
    # tile 16, three loops 323 us (one masked loop 333; 2 warps as streams 337; 4 warps sharing
    # a 64-key tile 417: cross-warp barriers). B=16: 98.9 us (one loop 100.9); B=128: 612
    # (638). B=1 (64 splits of 4 tiles) prefers one loop, 17.5 vs 18.1 us: ONE_LOOP_MAX_TILES.
    (128, 4, 16, torch.bfloat16, False): DecodeConfig(16, 1, 3, "rows3"),
    # The end-to-end model's layers (16/8 heads, interleaved V after the QK-norm fusion),
    # B=64, L=2048, V loaded as packets (_load_paged_kv): 1 warp 172 us (one loop 174); with
    # the 2-D V gather it took 269, and 4 warps 245-301.
    (128, 2, 16, torch.bfloat16, True): DecodeConfig(16, 1, 3, "rows3"),
}


@functools.cache  # called on every attention call: one dict lookup after the first
def decode_config(head_size: int, gqa: int, block_size: int, cache_dtype: torch.dtype,
                  interpret: bool = False, interleaved_v: bool = False) -> DecodeConfig:
    """The decode kernel's tuned config (``interpret``: small tiles for the CPU interpreter)."""
    if interpret:
        return DecodeConfig(32, 4, 1, "rows", one_loop_max_tiles=ONE_LOOP_MAX_TILES)
    tuned = _DECODE_TUNED.get((head_size, gqa, block_size, cache_dtype, interleaved_v))
    if tuned is None:
        elem = cache_dtype.itemsize
        # fp8 caches compute in fp16 (fp8_fp16_dot): sm_90 converts e4m3 to bf16 through fp16,
        # three conversion instructions a pair that bound the loop. H200, bf16 query, 32/8
        # heads, d128, (16, 1, 3, "rows3"), us bf16 cache / fp8 with bf16 dots / fp8 with fp16
        # dots (results history 2026-12-03_2022): B=16 L=4096 80.8 / 64.9 / 51.4, B=64 L=4096
        # 254.7 / 277.7 / 173.4, B=128 L=16384 1921 / 1594 / 982. (The generic (128, 4, 3,
        # "rows") fp8 config ran 382 at B=64 L=4096.)
        if elem <= 2 and head_size <= 128 and gqa <= 16:
            # One warp per program: the GQA rows' max/sum stay inside the warp (no barriers);
            # wider tiles (more heads or channels) would not fit one warp's registers.
            tuned = DecodeConfig(16, 1, 3, "rows3")
            if elem == 1:
                # An fp8 tile is half the bytes: at B=64 (512 programs, 2 splits) 144.4 us
                # (1.79x bf16) against 173.7 with one split; B=128 keeps one (263.4 vs 326.8).
                tuned = DecodeConfig(16, 1, 3, "rows3", fp8_fp16_dot=True, one_split_ctas_per_sm=4)
        elif head_size > 256:
            # Head size 512 (Gemma4's full-attention layers). 16-bit cache: a 16-key tile over
            # 4 warps, 3 stages (168-240 registers, no spills on sm_90). Swept on an H100
            # (32/4 heads, bf16, L=4096, 20 configs; benchmarks/results/history/
            # 2026-12-05_1454_*): B = 1 / 16 / 64 30.1 / 216.0 / 747.0 us (2.88 TB/s, 95% of
            # that GPU's read ceiling) against 42.3 / 314.1 / 1090.9 for the first choice
            # (32 keys, 8 warps, 178 KB), the fastest at every B; 8 or 16 warps and 32-key
            # tiles were slower. fp8 cache (fp16 dots): the same tile over 4 warps, from an
            # H100 A/B (history 2026-12-05_1615_*): B = 16 / 64, L=4096 145.0 / 499.8 us =
            # 1.48x / 1.51x the bf16 cache, against 201.2 / 725.9 over 8 warps (a 32-key
            # tile spilled 16 bytes). fp32 cache: chosen to compile for sm_90 without spills
            # (tests/triton_sm90_compile.py), not timed: 16 keys, 2 stages, K gathered as a
            # tile (k_rows=0): 128 registers, 130 KB (K read as packet rows spilled 2 KB a thread).
            # 16-bit cache: KV splits for 2 programs an SM (what one SM holds at 4 warps of up
            # to 240 registers), not 8: H100 split sweep (history 2026-12-05_1843_*): B=16
            # 4 splits 196.5 us against 210.5 with 16, B=64 one split 706.3 against 724.0 with
            # 4 (B=1 keeps 64: 30.2 us, 32 splits 27.6).
            tuned = {1: DecodeConfig(16, 4, 3, "rows", fp8_fp16_dot=True),
                     2: DecodeConfig(16, 4, 3, "rows", programs_per_sm=D512_PROGRAMS_PER_SM),
                     }.get(elem, DecodeConfig(16, 8, 2, "rows", k_rows=0))
        else:
            tile = 64 if head_size * elem <= 256 else 32
            if elem == 1:
                tile = 128 if head_size <= 128 else 64
            tuned = DecodeConfig(tile, 4, 3, "rows", fp8_fp16_dot=elem == 1)
    return dataclasses.replace(tuned, one_loop_max_tiles=ONE_LOOP_MAX_TILES)


def num_kv_splits(num_seqs: int, num_kv_heads: int, head_chunks: int, max_ctx: int,
                  num_sms: int, programs_per_sm: int = SPLIT_PROGRAMS_PER_SM,
                  round_down: bool = SPLITS_ROUND_DOWN, one_split_ctas_per_sm: int = 2) -> int:
    """KV splits of the decode kernel, from host shapes only (no device sync: capturable).

    One split while (seqs x KV heads) already fills the GPU ``one_split_ctas_per_sm`` times
    (2; fp8 caches 4: their programs hold half the bytes in flight); else enough splits for
    about ``programs_per_sm`` programs per SM (rounded up, or down: at most that many),
    never shorter than ``MIN_SPLIT_TOKENS`` keys.
    """
    base = max(1, num_seqs * num_kv_heads * head_chunks)
    if base >= one_split_ctas_per_sm * num_sms:
        return 1
    slots = programs_per_sm * num_sms
    want = slots // base if round_down else triton.cdiv(slots, base)
    cap = max(1, triton.cdiv(max_ctx, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


def decode_plan(cfg: DecodeConfig, num_splits: int | None, *, num_seqs: int, num_kv_heads: int,
                head_chunks: int, max_ctx: int, num_sms: int) -> tuple[str, int]:
    """(kind, KV splits) one decode launch runs with. Splits given by the caller are taken as
    they are; else ``num_kv_splits``, and a split of at most ``cfg.one_loop_max_tiles``
    tiles runs a three-loop kind as one loop."""
    kind = cfg.kind
    if num_splits is None:
        num_splits = num_kv_splits(num_seqs, num_kv_heads, head_chunks, max_ctx, num_sms,
                                   cfg.programs_per_sm, cfg.splits_round_down,
                                   cfg.one_split_ctas_per_sm)
        if (kind in _ONE_LOOP_OF and cfg.one_loop_max_tiles
                and max_ctx <= cfg.one_loop_max_tiles * cfg.tile_n * num_splits):
            kind = _ONE_LOOP_OF[kind]
    return kind, num_splits


def split_merge_of(cfg: DecodeConfig, num_splits: int) -> str:
    """The merge a launch of ``num_splits`` splits runs: ``cfg.split_merge`` with "auto"
    resolved (``LAST_SPLIT_MAX_SPLITS``); "last_split" only where the kind supports it."""
    merge = cfg.split_merge
    if merge == "auto":
        merge = ("last_split" if num_splits <= LAST_SPLIT_MAX_SPLITS
                 and not cfg.kind.startswith("streams") else "reduce")
    return merge


def reduce_num_warps(num_splits: int, head_size: int) -> int:
    """Warps of the split-merge kernels (decode's and verify's ``*_reduce_kernel``): one
    program holds every split's ``[BLOCK_S, BLOCK_D]`` fp32 partial rows, at most 128 values a
    thread (4 warps up to 64 splits x 256 channels; 64 splits of head size 512 spilled 2 KB a
    thread on sm_90 with 4 warps)."""
    tile = triton.next_power_of_2(num_splits) * triton.next_power_of_2(head_size)
    return max(4, tile // (32 * 128))


def verify_rows(gqa: int, q_max: int, head_size: int) -> int:
    """Rows a verify program holds: (query token, GQA head) pairs of one KV head, a power of
    two in [16, 64] (in [16, 32] above head size 256: 64 rows of 512 channels need 255
    registers a thread and 263 KB of shared memory on sm_90); more take several row chunks
    (grid axis 1)."""
    most = 64 if head_size <= 256 else 32
    return max(16, min(most, triton.next_power_of_2(q_max * gqa)))


@functools.cache  # called on every attention call with verify rows
def verify_config(head_size: int, gqa: int, block_size: int, cache_dtype: torch.dtype,
                  interpret: bool = False, interleaved_v: bool = False,
                  q_max: int = VERIFY_MAX_QUERY_LEN) -> DecodeConfig:
    """The verify kernel's config: the decode config of the shape (its tile, stages and K
    read), with a warp per 16 rows (up to 4) so that a warp's share of the score and
    accumulator tiles stays what a decode warp holds. Timed with ``bench_decode.py --verify``
    (benchmarks/results/README.md, the verify rows)."""
    base = decode_config(head_size, gqa, block_size, cache_dtype, interpret, interleaved_v)
    if interpret:
        return base
    if head_size > 256 and cache_dtype.itemsize <= 2:
        # Head size 512, 16-bit and fp8 caches (bf16 dots): decode's 16-key tile over 4 warps
        # with 2 stages. H100 sweep (32/4 heads, 4 query tokens, L=4096; history
        # 2026-12-05_1638_*): B = 16 / 64 297.2 / 931.6 us against 398.4 / 1290.5 for 32-key
        # tiles over 8 warps and 399-1602 for the other tiles; it spills 8 bytes a thread on
        # sm_90 (32 rows of 512 channels; tests/triton_sm90_compile.py bounds it; 3 stages: 16).
        # Splits for 2 programs an SM, as decode's: B=16 4 splits 239.1 us against 293.2 with
        # 16 (3 splits 295.9, 5 354.7: a second wave; history 2026-12-05_1843_*).
        base = DecodeConfig(16, 4, 2, "rows", one_loop_max_tiles=ONE_LOOP_MAX_TILES,
                            programs_per_sm=D512_PROGRAMS_PER_SM)
    elif base.fp8_fp16_dot:  # decode's fp8 config; the verify kernel keeps bf16 dots and the
        # generic fp8 tile it was tested with
        base = DecodeConfig(128 if head_size <= 128 else 64, 4, 3, "rows", one_loop_max_tiles=ONE_LOOP_MAX_TILES)
    warps = max(base.num_warps, min(4, verify_rows(gqa, q_max, head_size) // 16))
    if head_size > 256 and cache_dtype.itemsize == 4:
        warps = 16  # 32 fp32 rows of 512: 8 warps spilled on sm_90, 16 take 128 registers
    return dataclasses.replace(base, num_warps=warps)


# --- prefix prefill (and the encoder kernel) ---------------------------------------------------

_PREFILL_TUNED: dict[tuple, PrefillConfig] = {
    # B=4, 4096 new tokens, causal, with the new tokens' K/V fetched by TMA (results:
    # s11_call2_probe): 128x128x8x3 423 TFLOP/s (128x64x8x3 420), with a 4096-token prefix 331
    # (303). 224 KB of shared memory: NVIDIA sm_90 only (see prefill_config).
    (128, 4, 16, torch.bfloat16): PrefillConfig(128, 128, 8, 3),
}


@functools.cache  # called on every attention call with prefill rows
def prefill_config(head_size: int, gqa: int, block_size: int, dtype: torch.dtype,
                   interpret: bool = False) -> PrefillConfig:
    """The prefix-prefill (and encoder) kernel's tuned config for compute dtype ``dtype``."""
    if interpret:
        return PrefillConfig(16, 16, 4, 1)
    # The table was measured on an H200; AMD GPUs have 64 KB of LDS: the heuristics below.
    tuned = None if torch.version.hip else _PREFILL_TUNED.get((head_size, gqa, block_size, dtype))
    if tuned is not None:
        return tuned
    if head_size > 256:
        # Head size 512 (Gemma4's full-attention layers). 16-bit: 32 rows x 16 keys over 4 warps,
        # the fastest of an H100 sweep (32/4 heads, B=1, 4096 new tokens, causal; history
        # 2026-12-05_1629_*): 111 / 107 TFLOP/s with no prefix / a 4096-token prefix, SDPA 112 /
        # 108 in the same run, against 59 / 57 for the same tile over 8 warps and 105 / 91 for
        # 32 x 32 over 8 warps (the fastest tile that does not spill). It spills 56 bytes a
        # thread on sm_90 (tests/triton_sm90_compile.py allows that launch this much).
        # fp32: 16 rows, the context's K gathered as a tile (k_rows=0) and the new tokens' K/V
        # through pointers (through TMA it spilled 2-8 KB): chosen to compile, not timed.
        if dtype == torch.float32:
            return PrefillConfig(16, 16, 8, 2, k_rows=0, dense_tma=False)
        return PrefillConfig(32, 16, 4, 2)
    if dtype == torch.float32:
        return PrefillConfig(64, 32, 4, 2) if head_size <= 128 else PrefillConfig(32, 32, 4, 2)
    if head_size <= 64:
        return PrefillConfig(128, 64, 4, 3)
    if head_size <= 128:
        return PrefillConfig(128, 64, 8, 3)
    return PrefillConfig(64, 32, 4, 2)


# --- cache writers and RoPE ------------------------------------------------------------------


def writer_block_t(num_tokens: int) -> int:
    """Tokens per program of the writers. From the H200 sweep (bench_cache_writers.py --sweep;
    bf16, 32/8 heads, d=128): one token per program only for tiny batches, 2 up to a few
    hundred tokens, then 8."""
    if num_tokens <= 32:
        return 1
    if num_tokens <= 512:
        return 2
    return 8


def writer_num_warps(block_t: int, width: int) -> int:
    """Warps for a ``[block_t, width]`` tile: 8 elements (16 bytes of bf16) per thread. The RoPE
    kernels pass the half-tile width, so each half load is one 16-byte vector per thread."""
    return max(1, min(8, block_t * width // 256))
