"""``python -m inductor_rocm_attn info`` and ``build-native`` on this machine."""

import subprocess
import sys

import torch


def _run(*args):
    return subprocess.run([sys.executable, "-m", "inductor_rocm_attn", *args], capture_output=True,
                          text=True, timeout=300)


def test_info_lists_every_provider_with_its_state():
    from inductor_rocm_attn import providers

    p = _run("info")
    assert p.returncode == 0, p.stderr
    for name, provider in providers.REGISTRY.items():
        why = provider.unavailable_reason()
        line = next(l for l in p.stdout.splitlines() if l.strip().startswith(name + " "))
        assert ("usable" in line) if why is None else (why in line), line


def test_build_native_says_why_it_cannot_build_here():
    p = _run("build-native", "--quiet")
    if torch.cuda.is_available():  # a GPU machine builds (or says which toolchain is missing)
        assert "build-native:" in p.stdout
        return
    assert p.returncode == 1
    assert "build-native: no GPU" in p.stdout


def test_unknown_option_is_an_error():
    p = _run("info", "--bogus")
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr
