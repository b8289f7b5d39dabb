"""Run bench/w4a16_kernel.py with its lean child check relaxed from bit-identity with the register ring (no longer
true after the zero fold) to 2e-3 relative: the child still runs first in its own process (a kernel fault there
cannot poison this one). Arguments pass through."""
import importlib.util
import os
import sys
from pathlib import Path

repo = Path(os.environ["REPO"])
spec = importlib.util.spec_from_file_location("w4a16_kernel_bench", repo / "bench" / "w4a16_kernel.py")
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
old = "if not torch.equal(y, twin) and why is None:"
assert old in mod.LEAN_CHILD
mod.LEAN_CHILD = mod.LEAN_CHILD.replace(
    old, "if not float((y.double() - twin.double()).norm() / twin.double().norm()) <= 2e-3 and why is None:")
sys.exit(mod.main(sys.argv[1:]))
