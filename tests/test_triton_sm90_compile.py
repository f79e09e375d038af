"""Our Triton (and Gluon) kernels compile for a Hopper GPU (sm_90), checked without one.

CPU CI runs kernels in Triton's interpreter, which skips checks the GPU frontend makes (a
kernel with a name bound to two types in the branches of a runtime ``if`` passed CI and
failed on the H200). ``triton_sm90_compile.py`` intercepts every launch of the public
wrappers and compiles it for sm_90 (frontend, optimizer, ptxas; no driver needed). The
Gluon prefill probe (``benchmarks/probe_prefill_gluon.py``) is compiled the same way, by its
own ``--compile-only``, the opt-in Gluon prefix prefill (``kernels/gluon``) by
``gluon_sm90_compile.py``.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "triton_sm90_compile.py")
    p = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip()[-300:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "FAIL" not in p.stdout


def test_gluon_prefill_probe_compiles_for_sm90_without_spills():
    """Every default config of the warp-specialized Gluon prefill probe compiles for sm_90 with
    no spills and fits sm_90's shared memory (about 10 s of ptxas), so the GPU run it is meant
    for does not start with a kernel that cannot build."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probe_prefill_gluon.py")
    p = subprocess.run([sys.executable, script, "--compile-only"], env=env, capture_output=True, text=True,
                       timeout=300)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip()[-300:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "FAIL" not in p.stdout


def test_gluon_prefix_prefill_compiles_for_sm90_without_spills():
    """The Gluon prefix prefill (kernels/gluon, opt-in) compiles for sm_90 with no spills, fits
    sm_90's shared memory and gathers the paged context in 16-byte cp.async packets, for the
    default config and the other V interior / dtype / block size / head size the GPU tests run
    (about 15 s of ptxas): the lead's GPU run must not start with a kernel that cannot build."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(root), env.get("PYTHONPATH")) if p)
    script = os.path.join(os.path.dirname(__file__), "gluon_sm90_compile.py")
    p = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip()[-300:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "FAIL" not in p.stdout
