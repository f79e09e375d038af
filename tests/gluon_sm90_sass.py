"""Fingerprint the Gluon prefix prefill's sm_90 SASS per specialization, to show that a change
to ``kernels/gluon/prefix_prefill.py`` left the generated code unchanged (no GPU needed).

    python tests/gluon_sm90_sass.py --save /tmp/sass_before      # on the old tree
    python tests/gluon_sm90_sass.py --compare /tmp/sass_before   # on the new tree

Each specialization is what a real launch compiles: ``launch()`` is called on CPU tensors
(nothing runs), and its arguments go through Triton's own binder (``native_specialize_impl``:
16-byte aligned pointers and ints divisible by 16 get ``tt.divisibility``, an int equal to 1
becomes a constexpr), then frontend, optimizer and ptxas for sm_90
(``gluon_sm90_compile.specialize_launch``). Launches whose specializations coincide (e.g. the
two cache layouts, which differ only in stride values) are compiled once and listed together.

The cases (``cases()``): every constexpr combination the kernel supports (bf16 / fp16, head
size 64 / 128, standard / interleaved V, every block size the cache and ``eligibility``
allow: 16, 32, 64, 128), each launched over both cache layouts, with GQA and the
decode/verify cut-off (``SHORT_QUERY_MAX``) varied across the matrix; then the runtime
specializations at bf16 / block size 16 / GQA 4 for both head sizes and V interiors: the
base case (two sequences), one sequence (``num_seqs`` a constexpr 1), a block table whose row
stride is not a multiple of 16, both, int64 index tensors.

``--save DIR`` writes ``DIR/fingerprints.json`` (per specialization: sha256 of its SASS with
the kernel's name replaced, instruction count, registers, stack, shared memory, setmaxnreg
budgets) and each SASS listing (``DIR/sass/*.sass.gz``). ``--compare DIR`` prints the
before/after table and, for a specialization whose SASS differs, how many instructions
differ (a diff of the instruction text, addresses and encodings left out) and the resource
change; exit 4 when any differs, is missing or is new. ``--quick``: one specialization per
head size and V interior (the runtime cases' bases), compared with those of the base only.
``--self-check``: the fingerprint tells a changed kernel from an unchanged copy (``self_check``).
``--variant NAME``: every case under that ``SWEEP_VARIANTS`` config (the cases it does not cover
are skipped), e.g. to show a refactor left ``v_tma``'s code unchanged too; ``--variant auto``:
what ``launch()`` runs without a config (``default_config``: K through registers and V by TMA
for standard V at blocks 16-64, K and V through registers for interleaved V, ``DEFAULT_CONFIG``
elsewhere). Without it, ``DEFAULT_CONFIG``
at every case.

Run without ``TRITON_INTERPRET``; exit 3 when this machine cannot compile for sm_90 (no
ptxas, no Gluon). The full matrix (52 specializations) takes 4 to 6 minutes of ptxas on a
shared 2-core machine (Triton's cache makes a rerun of an unchanged kernel about a minute), so
it is a script; tests/test_triton_sm90_compile.py runs its ``--self-check`` (about 15 s).
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import argparse  # noqa: E402
import difflib  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from gluon_sm90_compile import setmaxnreg_budgets, specialize_launch  # noqa: E402
from triton_sm90_compile import _cuobjdump, _probe, _resources  # noqa: E402

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def block_sizes(head_size: int) -> tuple[int, ...]:
    """The block sizes the kernel takes at this head size: the cache's (multiples of 16) that
    ``eligibility`` lets through (divisors of the key tile)."""
    from inductor_rocm_attn.kernels.gluon import eligibility

    lo = 8 * 128 // head_size
    return tuple(b for b in range(16, eligibility.BLOCK_N + 1, 16) if b >= lo and eligibility.BLOCK_N % b == 0)


def cases(quick: bool = False) -> list[dict]:
    """The launches to compile: keyword dicts for ``launch_case``."""
    out = []
    if not quick:
        i = 0
        for dtype in (torch.bfloat16, torch.float16):
            for head_size in (64, 128):
                for interleaved_v in (False, True):
                    for bs in block_sizes(head_size):
                        gqa, sqm = (1, 4, 8)[i % 3], (1, 4, 8)[(i // 3) % 3]
                        i += 1
                        for layout in ("LHBNC", "LBHNC"):
                            out.append(dict(dtype=dtype, head_size=head_size, interleaved_v=interleaved_v,
                                            block_size=bs, layout=layout, gqa=gqa, short_query_max=sqm))
    for head_size in (64, 128):
        for interleaved_v in (False, True):
            base = dict(dtype=torch.bfloat16, head_size=head_size, interleaved_v=interleaved_v, block_size=16,
                        layout="LHBNC", gqa=4, short_query_max=1)
            out.append(base)
            if quick and not interleaved_v:  # V by TMA's rows from an int64 block table (32-bit TMA coordinates)
                out.append(dict(base, index_dtype=torch.int64))
            if not quick:
                out += [dict(base, num_seqs=1), dict(base, table_width=33), dict(base, num_seqs=1, table_width=33),
                        dict(base, index_dtype=torch.int64)]
    return out


def case_label(c: dict) -> str:
    return (f"{_DTYPE_NAMES[c['dtype']]} d{c['head_size']} bs{c['block_size']} "
            f"{'interleaved' if c['interleaved_v'] else 'standard'} V {c['layout']} gqa{c['gqa']} "
            f"sqm{c['short_query_max']} seqs{c.get('num_seqs', 2)} table{c.get('table_width', 32)}"
            f"{' int64 indices' if c.get('index_dtype') == torch.int64 else ''}")


def launch_case(pp, dtype, head_size: int, interleaved_v: bool, block_size: int, layout: str, gqa: int,
                short_query_max: int, num_seqs: int = 2, table_width: int = 32, index_dtype=torch.int32,
                cfg=None):
    """``pp.launch`` of a varlen batch with these properties on CPU tensors (the kernel call
    intercepted by ``specialize_launch``; values are placeholders, shapes/strides are real)."""
    from inductor_rocm_attn.layout import CacheLayout, KVCacheSpec, allocate_kv_cache, k_view, v_view

    hkv = 2
    hq = hkv * gqa
    q_lens = [100, 200][:num_seqs] if num_seqs > 1 else [300]
    t = sum(q_lens)
    q = torch.randn(t, hq, head_size, dtype=dtype)
    k, v = (torch.randn(t, hkv, head_size, dtype=dtype) for _ in range(2))
    cache = allocate_kv_cache(KVCacheSpec(block_size, hkv, head_size, dtype, CacheLayout(layout)), 8, "cpu")
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=index_dtype)
    pp.launch(torch.empty_like(q), q, k, v, k_view(cache, hkv), v_view(cache, hkv, interleaved_v),
              torch.zeros(num_seqs, table_width, dtype=index_dtype), qsl[1:] - qsl[:-1] + 50, qsl,
              head_size ** -0.5, interleaved_v, short_query_max, **({} if cfg is None else dict(cfg=cfg)))


def spec_name(fn, sig: dict, consts: dict, attrs: dict, options) -> str:
    """A specialization's name from parameter names and values only (stable when the kernel's
    parameters move): constexprs, argument types with their attributes, options. The
    context-gather variants' constexprs (``_variant_constexprs``) are left out at the default
    config's values: the default's names are those of the kernel before the variants."""
    from inductor_rocm_attn.kernels.gluon import prefix_prefill as pp

    default = pp._variant_constexprs(pp.DEFAULT_CONFIG)
    const = ",".join(f"{fn.arg_names[p[0]]}={v!r}" for p, v in sorted(consts.items())
                     if default.get(fn.arg_names[p[0]], object()) != v)
    div = {fn.arg_names[p[0]] for p, a in attrs.items() if a}
    types = ",".join(f"{k}:{v}{'/16' if k in div else ''}" for k, v in sig.items() if v != "constexpr")
    opts = f"num_warps={options.num_warps},maxnreg={options.maxnreg},num_stages={options.num_stages}"
    return f"{const} | {types} | {opts}"


def sass_lines(kernel, name: str) -> list[str]:
    """The kernel's SASS as cuobjdump prints it (instruction and encoding lines), its symbol
    name replaced: what the fingerprint hashes."""
    sass = _cuobjdump(kernel, "-sass")
    return [ln.strip().replace(name, "KERNEL") for ln in sass.splitlines() if ln.strip().startswith("/*")]


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\* 0x[0-9a-f]+ \*/$")


def instructions(lines: list[str]) -> list[str]:
    """The instruction text of SASS lines (addresses and encodings left out), branch targets
    kept as printed: what the diff of a differing specialization counts."""
    return [m.group(1) for ln in lines if (m := _INSTR.match(ln))]


def fingerprint(kernel, name: str) -> tuple[dict, list[str]]:
    lines = sass_lines(kernel, name)
    res = _resources(kernel, name)
    return dict(sass_sha256=hashlib.sha256("\n".join(lines).encode()).hexdigest(),
                instructions=len(instructions(lines)), **res,
                setmaxnreg=setmaxnreg_budgets(kernel.asm["ptx"])), lines


def collect(todo: list[dict], module=None, log=print, variant: str | None = None) -> dict[str, dict]:
    """Compile every case's specialization once: name -> fingerprint, its cases' labels and
    (under ``"_sass"``) its SASS lines. ``module``: the kernel module (default: the library's).
    ``variant``: a ``SWEEP_VARIANTS`` name to launch every case under (a case it does not
    cover, refused by ``launch()``, is skipped and said; ``"auto"``: ``launch()``'s own choice,
    ``default_config``, at every case); None: ``DEFAULT_CONFIG`` (V gathered)
    at every case, not ``launch()``'s own choice (``default_config``: V by TMA where the cache
    allows it, registers for interleaved V), so fingerprints compare with those of kernels
    before that choice."""
    if module is None:
        from inductor_rocm_attn.kernels.gluon import prefix_prefill as module
    fn = module._gluon_prefix_prefill_kernel
    cfg = (module.DEFAULT_CONFIG if variant is None else None if variant == "auto"
           else module.SWEEP_VARIANTS[variant])
    found: dict[str, dict] = {}
    for c in todo:
        t0 = time.time()
        try:
            kernel, (sig, consts, attrs, options), _ = specialize_launch(
                module, lambda: launch_case(module, **c, cfg=cfg))
        except ValueError as e:  # the variant does not cover this case
            log(f"skip  {case_label(c)}: {e}")
            continue
        name = spec_name(fn, sig, consts, attrs, options)
        if name in found:
            found[name]["cases"].append(case_label(c))
            log(f"same  {case_label(c)}  (as {found[name]['cases'][0]})")
            continue
        fp, lines = fingerprint(kernel, fn.__name__)
        found[name] = dict(fp, cases=[case_label(c)], _sass=lines)
        log(f"ok    {case_label(c)}: {fp['instructions']} instructions, regs {fp['regs']} stack {fp['stack']} B "
            f"smem {fp['smem']} B setmaxnreg {','.join(fp['setmaxnreg'])} sha {fp['sass_sha256'][:12]} "
            f"({time.time() - t0:.1f} s)")
    return found


def _slug(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def save(found: dict, out_dir: str) -> None:
    os.makedirs(os.path.join(out_dir, "sass"), exist_ok=True)
    for name, fp in found.items():
        with gzip.open(os.path.join(out_dir, "sass", _slug(name) + ".sass.gz"), "wt") as f:
            f.write("\n".join(fp["_sass"]) + "\n")
    with open(os.path.join(out_dir, "fingerprints.json"), "w") as f:
        json.dump({n: {k: v for k, v in fp.items() if k != "_sass"} for n, fp in found.items()}, f, indent=1,
                  sort_keys=True)
    print(f"wrote {len(found)} SASS fingerprints to {out_dir}")


def diff_size(old: list[str], new: list[str]) -> tuple[int, int]:
    """(instructions removed, instructions added) between two SASS listings."""
    removed = added = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if op != "equal":
            removed += i2 - i1
            added += j2 - j1
    return removed, added


def compare(found: dict, base_dir: str, subset: bool = False) -> int:
    """The before/after table; 4 when a specialization of the base differs or is missing
    (``subset``: only those compiled now are compared)."""
    with open(os.path.join(base_dir, "fingerprints.json")) as f:
        base = json.load(f)
    if subset:
        base = {n: fp for n, fp in base.items() if n in found}
    bad = 0
    print("\n| specialization (first case) | instructions before / after | regs | stack B | smem B | verdict |")
    print("|---|---|---|---|---|---|")
    for name in sorted(set(base) | set(found), key=lambda n: (base.get(n) or found[n])["cases"][0]):
        b, a = base.get(name), found.get(name)
        same = b is not None and a is not None and b["sass_sha256"] == a["sass_sha256"]
        bad += not same  # a new specialization (not in the base) is a change too
        if same:
            verdict = "identical"
        elif a is None:
            verdict = "MISSING after"
        elif b is None:
            verdict = "NEW (not in the base)"
        else:
            path = os.path.join(base_dir, "sass", _slug(name) + ".sass.gz")
            old = gzip.open(path, "rt").read().splitlines() if os.path.exists(path) else []
            removed, added = diff_size(instructions(old), instructions(a["_sass"]))
            verdict = f"DIFFERS (-{removed} +{added} instructions)"

        def pair(key):
            return f"{b[key] if b else '-'} / {a[key] if a else '-'}"

        first = (b or a)["cases"]
        more = f" (+{len(first) - 1} launches alike)" if len(first) > 1 else ""
        print(f"| {first[0]}{more} | {pair('instructions')} | {pair('regs')} | {pair('stack')} | "
              f"{pair('smem')} | {verdict} |")
    print(f"\n{len(base)} specializations before, {len(found)} after, {bad} not identical")
    return 4 if bad else 0


# the self-check's change: the partial context tile's V packets would include the packet that
# starts at the context's end (a one-character change of the load partition's masked path)
_MUTATION = ("    packet_ok = (keys // 8) * 8 < ctx_len\n", "    packet_ok = (keys // 8) * 8 <= ctx_len\n")


def _module_copy(source: str, name: str, tmp: str):
    """Import ``source`` (the kernel module's text) as module ``name`` from a file in ``tmp``."""
    import importlib.util

    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def self_check() -> int:
    """One case (bf16, d64, block size 16, standard V) compiled, with an empty Triton cache,
    from the library module, from an unchanged copy of its source in another file and module,
    and from a copy with one character of the load partition changed (``_MUTATION``): the
    copy's fingerprint must equal the library's (a recompiled or moved kernel is no change),
    the changed one's must not. Exit 1 otherwise."""
    import tempfile

    from inductor_rocm_attn.kernels.gluon import prefix_prefill as library

    with open(library.__file__) as f:
        source = f.read()
    if source.count(_MUTATION[0]) != 1:
        print(f"FAIL self-check: the line to change is not in the kernel once: {_MUTATION[0].strip()!r}")
        return 1
    case = [dict(dtype=torch.bfloat16, head_size=64, interleaved_v=False, block_size=16, layout="LHBNC", gqa=4,
                 short_query_max=1)]
    with tempfile.TemporaryDirectory() as tmp:
        # an empty Triton cache: all three compiled here (the copy's identity then also shows
        # that compiling the same kernel twice gives the same SASS)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton_cache")
        got = {}
        for label, module in (("library", library), ("copy", _module_copy(source, "_sass_check_copy", tmp)),
                              ("changed", _module_copy(source.replace(*_MUTATION), "_sass_check_changed", tmp))):
            (fp,) = collect(case, module, log=lambda s: None).values()
            got[label] = fp["sass_sha256"]
            print(f"{label}: {fp['instructions']} instructions, sha {fp['sass_sha256'][:12]}", flush=True)
    ok = got["copy"] == got["library"] and got["changed"] != got["library"]
    print("self-check: " + ("the copy is identical, the changed kernel differs" if ok else
                            f"FAIL (copy identical: {got['copy'] == got['library']}, changed differs: "
                            f"{got['changed'] != got['library']})"))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", metavar="DIR", help="write the fingerprints and SASS listings to DIR")
    ap.add_argument("--compare", metavar="DIR", help="compare with a --save directory")
    ap.add_argument("--quick", action="store_true", help="one specialization per head size and V interior")
    ap.add_argument("--variant", metavar="NAME",
                    help="launch every case under this SWEEP_VARIANTS config, or 'auto': launch()'s own choice "
                         "(default: DEFAULT_CONFIG)")
    ap.add_argument("--self-check", action="store_true",
                    help="check that the fingerprint tells a changed kernel from an unchanged copy (one case)")
    args = ap.parse_args()
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401

        from inductor_rocm_attn.kernels.gluon import prefix_prefill
    except Exception as e:  # noqa: BLE001 - no Gluon here at all
        print(f"SKIP: the Gluon prefill does not import: {type(e).__name__}: {e}")
        return 3
    why = _probe()  # ptxas and the NVIDIA backend, on a trivial kernel
    if why is not None:
        print(f"SKIP: cannot compile for sm_90 here: {why}")
        return 3
    if args.self_check:
        return self_check()
    if args.variant not in (None, "auto", *prefix_prefill.SWEEP_VARIANTS):
        print(f"--variant {args.variant!r}: neither 'auto' nor a SWEEP_VARIANTS name "
              f"({', '.join(prefix_prefill.SWEEP_VARIANTS)})")
        return 2
    found = collect(cases(args.quick), log=lambda s: print(s, flush=True), variant=args.variant)
    print(f"{len(found)} specializations compiled")
    if args.save:
        save(found, args.save)
    if args.compare:
        return compare(found, args.compare, subset=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
