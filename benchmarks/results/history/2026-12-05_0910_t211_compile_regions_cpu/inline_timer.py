"""Exclusive process time per function Dynamo inlines (InliningInstructionTranslator.inline_call_)."""
import collections, sys, time, runpy
from torch._dynamo import symbolic_convert as sc
excl = collections.Counter(); calls = collections.Counter(); stack = []
orig = sc.InliningInstructionTranslator.inline_call_
def timed(self):
    name = f"{self.f_code.co_filename.split('/')[-1]}:{self.f_code.co_qualname}"
    t0 = time.process_time(); stack.append(0.0)
    try:
        return orig(self)
    finally:
        dt = time.process_time() - t0; child = stack.pop()
        excl[name] += dt - child; calls[name] += 1
        if stack: stack[-1] += dt
sc.InliningInstructionTranslator.inline_call_ = timed
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    tot = sum(excl.values())
    print(f"inlined total {tot:.2f} s")
    for k, v in excl.most_common(25):
        print(f"{v:7.3f} s {calls[k]:5d}  {k}")
