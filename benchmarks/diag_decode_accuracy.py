"""Diagnostic: worst single-element decode error per config (the fp8-output test failed once
per config after the default moved to one warp). Prints, per decode config, the worst
|out - oracle| over the row's rms across seeds, and how many fp8-output checks fail.
    python benchmarks/diag_decode_accuracy.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cases  # noqa: E402
from attention_checks import check_paged  # noqa: E402
from inductor_rocm_attn.kernels.triton import paged_attention  # noqa: E402
from inductor_rocm_attn.kernels.triton.configs import DecodeConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFGS = [None, DecodeConfig(16, 1, 3, "rows"), DecodeConfig(16, 1, 1, "rows"),
        DecodeConfig(64, 4, 3, "rows"), DecodeConfig(32, 2, 3, "streams3")]
for cfg in CFGS:
    worst, where, fp8_fail = 0.0, None, 0
    for seed in range(int(os.environ.get("SEEDS", 6))):
        c = cases.make_paged_case([1, 200, 1], [900, 300, 5], num_heads=16, num_kv_heads=4,
                                  head_size=128, block_size=16, dtype=torch.bfloat16,
                                  device=DEV, seed=seed)
        out = cases.poison(torch.empty_like(c.query))
        for splits in (None, 3):
            paged_attention(out, c.query, c.key, c.value, c.kv_cache, c.query_start_loc,
                            c.seq_lens, c.block_table, 128 ** -0.5, c.k_scale, c.v_scale, True, -1,
                            None, None, 0.0, False, None, num_splits=splits, decode_cfg=cfg)
            ref = cases.dense_oracle(c, scale=128 ** -0.5, causal=True, sliding_window=-1,
                                     alibi_slopes=None, sinks=None, logits_soft_cap=0.0)
            got = out.double().cpu()
            rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
            e = ((got - ref).abs() / rms)
            if e.max() > worst:
                worst = e.max().item()
                idx = (e == e.max()).nonzero()[0].tolist()
                where = (seed, splits, idx, got[tuple(idx)].item(), ref[tuple(idx)].item())
            try:
                check_paged("triton", [1, 200, 1], [900, 300, 5], num_heads=16, num_kv_heads=4,
                            head_size=128, dtype=torch.bfloat16, out_fp8=True, device=DEV,
                            decode_cfg=cfg, num_splits=splits)
            except AssertionError as err:
                fp8_fail += 1
                print("   fp8:", str(err)[:160])
    print(f"cfg {cfg}: worst |err|/row rms {worst:.4f} at (seed, splits, [tok, head, ch], got, want) "
          f"{where}; fp8-output failures {fp8_fail}/12", flush=True)
