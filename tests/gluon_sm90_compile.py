"""Compile the Gluon prefix prefill (``kernels/gluon/prefix_prefill.py``) for sm_90 without a GPU.

One line per launch variant: registers, stack (spills), shared memory, the partitions'
setmaxnreg budgets, and the 16-byte / smaller cp.async counts of the gather. A variant
FAILs when it does not compile, spills, needs more shared memory than sm_90 has, or has a
gather that lost its 16-byte packets. Exit 1 on a FAIL, 3 when this machine cannot compile
Gluon for sm_90 at all (no ptxas...). Run without ``TRITON_INTERPRET``; used by
tests/test_triton_sm90_compile.py.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
SM90_SMEM = 232448  # bytes of shared memory a block may use on sm_90

# (label, compile_sm90 keywords): the default config's launch (the bench's shape), then the
# other V interior, dtype, block size, GQA and head size the GPU tests run
VARIANTS = [
    ("bf16 d128 bs16 gqa4 standard V", dict()),
    ("fp16 d128 bs32 gqa8 interleaved V", dict(dtype=torch.float16, block_size=32, gqa=8, num_heads=8,
                                               interleaved_v=True)),
    ("bf16 d64 bs16 gqa1 interleaved V", dict(head_size=64, gqa=1, num_heads=8, interleaved_v=True)),
]


def main() -> int:
    try:
        from inductor_rocm_attn.kernels.gluon.prefix_prefill import compile_sm90
    except Exception as e:  # noqa: BLE001 - no Gluon here at all
        print(f"SKIP: the Gluon prefill does not import: {type(e).__name__}: {e}")
        return 3
    bad = 0
    for label, kw in VARIANTS:
        try:
            r = compile_sm90(**kw)
        except Exception as e:  # noqa: BLE001 - one line per variant
            text = str(e)
            if "ptxas" in text and ("not found" in text or "No such file" in text):
                print(f"SKIP: cannot compile for sm_90 here: {text.strip().splitlines()[-1][:300]}")
                return 3
            bad += 1
            print(f"{label}: FAIL {type(e).__name__}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}")
            continue
        problems = [p for p, bad_ in (("spills", r["stack"] > 0), ("shared memory over 227 KB", r["smem"] > SM90_SMEM),
                                      ("gather not in 16-byte cp.async", r["cp_async_16"] == 0 or r["cp_async_small"]))
                    if bad_]
        bad += bool(problems)
        print(f"{label}: regs {r['regs']} stack {r['stack']} B smem {r['smem']} B setmaxnreg "
              f"{','.join(r['setmaxnreg'])} cp.async 16 B x{r['cp_async_16']}"
              + (f"  FAIL ({', '.join(problems)})" if problems else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
