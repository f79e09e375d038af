"""Our Triton (and Gluon) kernels compile for a Hopper GPU (sm_90), checked without one.

CPU CI runs kernels in Triton's interpreter, which skips checks the GPU frontend makes (a
kernel with a name bound to two types in the branches of a runtime ``if`` passed CI and
failed on the H200). ``triton_sm90_compile.py`` intercepts every launch of the public
wrappers and compiles it for sm_90 (frontend, optimizer, ptxas; no driver needed). The
Gluon prefill probe (``benchmarks/probe_prefill_gluon.py``) is compiled the same way, by its
own ``--compile-only``, the Gluon prefix prefill (``kernels/gluon``) by
``gluon_sm90_compile.py``. ``gluon_sm90_sass.py`` fingerprints the Gluon prefill's SASS for
every specialization (a refactor runs it before and after: ``--save`` / ``--compare``, about
4 minutes of ptxas, so not run here); its ``--self-check`` is.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _run_compile_script(script: str, *args: str, timeout: int, pythonpath: bool = False) -> None:
    """Run one compile-check script without TRITON_INTERPRET: skip when it says this machine
    cannot compile for sm_90 (exit 3), else it must pass and print no FAIL line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath:  # a script that imports the package from this checkout
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip()[-300:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "FAIL" not in p.stdout


def test_kernels_compile_for_sm90():
    _run_compile_script(os.path.join(os.path.dirname(__file__), "triton_sm90_compile.py"), timeout=900)


def test_gluon_prefill_probe_compiles_for_sm90_without_spills():
    """Every default config of the warp-specialized Gluon prefill probe compiles for sm_90 with
    no spills and fits sm_90's shared memory (about 10 s of ptxas), so the GPU run it is meant
    for does not start with a kernel that cannot build."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _run_compile_script(os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probe_prefill_gluon.py"),
                        "--compile-only", timeout=300)


def test_gluon_prefix_prefill_compiles_for_sm90_without_spills():
    """The Gluon prefix prefill (kernels/gluon) compiles for sm_90 with no spills, fits
    sm_90's shared memory and gathers the paged context in 16-byte cp.async packets, for the
    default config and the other V interior / dtype / block size / head size the GPU tests run
    (about 15 s of ptxas): a GPU run does not start with a kernel that cannot build."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _run_compile_script(os.path.join(os.path.dirname(__file__), "gluon_sm90_compile.py"), timeout=300,
                        pythonpath=True)


def test_gluon_prefix_prefill_sweep_variants_compile_for_sm90_without_spills():
    """The GPU sweep's context-gather variants that change the load partition most (the one-op
    tile gather at 4 and 8 load warps, joint K/V publication, K through registers with V by
    TMA) compile for sm_90 at the benchmark's shape with no spills and 16-byte packets (about
    50 s of ptxas; all of them at every shape: ``gluon_sm90_compile.py --variants``, minutes)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _run_compile_script(os.path.join(os.path.dirname(__file__), "gluon_sm90_compile.py"), "--variants", "tile",
                        "load8", "load8_tile_joint", "k_regs_v_tma", "--bench-shape-only", timeout=600,
                        pythonpath=True)


def test_gluon_prefill_interleaved_v_default_compiles_for_sm90_without_spills():
    """The launcher's interleaved-V config (``KV_REGS_CONFIG``: K and V through registers, the
    load partition at 72 registers) compiles for sm_90 at both interleaved shapes of the
    compile check (fp16 d128 block 32 GQA 8, bf16 d64 block 16 GQA 1) with no spills and
    within sm_90's shared memory (about 12 s of ptxas): its 64-key / 64-channel passes spill
    at consumer_regs=224, so a change to either budget shows here before a GPU run."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _run_compile_script(os.path.join(os.path.dirname(__file__), "gluon_sm90_compile.py"), "--variants", "kv_regs",
                        timeout=300, pythonpath=True)


def test_gluon_prefill_k_regs_v_tma_compiles_for_sm90_at_both_index_dtypes():
    """The launcher's standard-V config (K through registers, V by TMA) compiles for sm_90 at
    the quick cases, an int64 block table among them: TMA's row coordinate is 32-bit, so a row
    computed from int64 block ids must be narrowed (about 20 s of ptxas)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _run_compile_script(os.path.join(os.path.dirname(__file__), "gluon_sm90_sass.py"), "--variant", "k_regs_v_tma",
                        "--quick", timeout=300, pythonpath=True)


def test_gluon_sass_check_tells_a_changed_kernel():
    """``gluon_sm90_sass.py``'s fingerprint (what its ``--compare`` calls identical) equals the
    library kernel's for an unchanged copy of the module in another file, and differs for a
    copy with one character of the load partition changed (about 15 s of ptxas): the check a
    kernel refactor relies on can fail, and a moved kernel does not fail it."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _run_compile_script(os.path.join(os.path.dirname(__file__), "gluon_sm90_sass.py"), "--self-check",
                        timeout=300, pythonpath=True)
