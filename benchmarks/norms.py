"""A norm's forward and backward alone: launches and time, eager and under tg.jit, against
torch in the same run (float32, y = norm(x) * r summed, the gradients of x, weight and bias).

    python -m benchmarks.norms    # layer norm over (512, 64), batch norm over (16, 16, 32, 32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg

from ._harness import median_times

Norm = Callable[..., tuple[tg.Tape, tg.Id]]


def _step(norm: Norm) -> Callable[..., tuple[tg.AnyTensor, ...]]:
    def step(x: Any, w: Any, b: Any, r: Any) -> tuple[tg.AnyTensor, ...]:
        tape = tg.Tape(x.device)
        tape, xi = tg.leaf(tape, x, requires_grad=True)
        tape, wi = tg.leaf(tape, w, requires_grad=True)
        tape, bi = tg.leaf(tape, b, requires_grad=True)
        tape, ri = tg.leaf(tape, r)
        tape, y = norm(tape, xi, wi, bi)
        tape, y = tg.mul(tape, y, ri)
        tape, s = tg.sum(tape, y)
        grads = tg.backward(tape, s, wrt=[xi, wi, bi])
        return grads[xi], grads[wi], grads[bi]
    return step


def _torch(name: str, arrays: list[np.ndarray[Any, Any]]) -> Callable[[], object] | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    torch.set_num_threads(2)
    x, w, b = (torch.tensor(a, requires_grad=True) for a in arrays[:3])
    r = torch.tensor(arrays[3])

    def step() -> object:
        if name == "layer_norm":
            y = F.layer_norm(x, (x.shape[-1],), w, b)
        else:
            y = F.batch_norm(x, None, None, w, b, training=True)
        return torch.autograd.grad((y * r).sum(), [x, w, b])
    return step


def main() -> None:
    rng = np.random.default_rng(0)
    for name, norm, shape, size in (("layer_norm", tg.layer_norm, (512, 64), 64),
                                    ("batch_norm", tg.batch_norm, (16, 16, 32, 32), 16)):
        arrays = [rng.standard_normal(s).astype(np.float32) for s in (shape, size, size, shape)]
        tensors = [tg.AnyTensor.from_numpy(a) for a in arrays]
        device = tensors[0].device
        eager = _step(norm)
        jitted = tg.jit(eager)

        def run(f: Callable[..., object], tensors: list[tg.AnyTensor] = tensors,
                device: Any = device) -> Callable[[], object]:
            return lambda: (f(*tensors), device.finish())

        for _ in range(3):
            run(jitted)()
        t_eager, t_jit, t_torch = median_times([run(eager), run(jitted), _torch(name, arrays)])
        assert t_eager is not None and t_jit is not None
        torch_text = "-" if t_torch is None else f"{t_torch * 1e6:.0f}"
        print(f"{name} {shape}: eager {t_eager * 1e6:.0f} us, tg.jit {t_jit * 1e6:.0f} us "
              f"({jitted.last_launches} launches), torch {torch_text} us")


if __name__ == "__main__":
    main()
