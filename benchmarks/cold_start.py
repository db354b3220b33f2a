"""First MLP step, and a model's first jitted step, in a fresh process with empty caches.

pyopencl and PoCL keep built programs on disk (under XDG_CACHE_HOME); pointing that at an empty
folder measures the real first-run cost: program builds plus PoCL's per-kernel compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_CHILD = """
import time
t0 = time.perf_counter()
import numpy as np
import tapegrad as tg
t1 = time.perf_counter()
import sys
sys.modules["torch"] = None  # the workloads module compares with torch; not needed here
from benchmarks.workloads import mlp_data, tg_mlp_step
x, y, params = mlp_data()
t1b = time.perf_counter()
tg_mlp_step(tg.AnyTensor.from_numpy(x), tg.AnyTensor.from_numpy(y),
            [tg.AnyTensor.from_numpy(p) for p in params])
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1b:.3f} {tg.default_device().builds}")
"""


# A research model's first jitted training step (benchmarks.models), then its second.
_MODEL_CHILD = """
import sys, time
sys.modules["torch"] = None
import tapegrad as tg
from benchmarks import models
model = getattr(models, sys.argv[1] + "_model")()
trainer = models.Trainer(model.loss_fn, model.params, model.batch, jit=True)
t0 = time.perf_counter()
trainer()
t1 = time.perf_counter()
trainer()
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.4f} {tg.default_device().builds}")
"""


def _child(code: str, args: list[str], cold: bool) -> list[str]:
    """The words `code` prints in a fresh process, with empty cache folders if `cold`."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            env["XDG_CACHE_HOME"] = cache
            env["POCL_CACHE_DIR"] = os.path.join(cache, "pocl")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=root,
                              check=True, capture_output=True, text=True).stdout.split()


def run(cold: bool = True) -> tuple[float, float, int]:
    """(import seconds, first-step seconds, programs built) in a fresh process."""
    out = _child(_CHILD, [], cold)
    return float(out[0]), float(out[1]), int(out[2])


def run_model(name: str, cold: bool = True) -> tuple[float, float, int]:
    """A fresh process's first call of `name`'s jitted training step ("gpt", "resnet",
    "lstm"): (first-call seconds, second-call seconds, programs built), with empty caches if
    `cold`, else with the caches this machine's runs left on disk."""
    out = _child(_MODEL_CHILD, [name], cold)
    return float(out[0]), float(out[1]), int(out[2])


if __name__ == "__main__":
    for label, cold in (("cold", True), ("warm", False)):
        imp, first, builds = run(cold)
        print(f"{label}: import {imp:.2f} s, first MLP step {first:.2f} s, {builds} programs")
        first, second, builds = run_model("gpt", cold)
        print(f"{label}: first jitted GPT step {first:.2f} s, second {second:.3f} s, "
              f"{builds} programs")
