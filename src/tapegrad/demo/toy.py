"""A first example: a two-layer network fits a smooth function of two inputs, and its gradients
match float64 finite differences.

It is the training loop to copy (README, "The training loop to copy"): parameters in a dict, a
loss that is a tape function, `tg.value_and_grad` for the loss and the gradients (a dict with
the params' keys), `tg.optim.adam` for the update. Everything runs on the default OpenCL
device; parameters stay there between steps and the host reads only the printed losses. No
extras are needed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from jaxtyping import Float

import tapegrad as tg

Params = dict[str, tg.AnyTensor]  # the network's parameters, on the device
ParamIds = dict[str, tg.Id]  # the same parameters as ids on a tape


@tg.typed
def loss_fn(tape: tg.Tape, params: ParamIds, x: Float[tg.Id, "batch 2"],
            y: Float[tg.Id, "batch 1"]) -> tuple[tg.Tape, Float[tg.Id, ""]]:
    """Mean squared error of `tanh(x @ w1 + b1) @ w2 + b2` against `y`."""
    tape, h = tg.linear(tape, x, params["w1"], params["b1"])
    tape, h = tg.tanh(tape, h)
    tape, out = tg.linear(tape, h, params["w2"], params["b2"])
    return tg.mse(tape, out, y)


def initial_params(hidden: int = 32, seed: int = 0) -> Params:
    """Glorot-uniform weights and zero biases for 2 inputs, `hidden` tanh units, 1 output."""
    init = tg.nn.init
    return {"w1": init.glorot_uniform((2, hidden), seed), "b1": init.zeros((hidden,)),
            "w2": init.glorot_uniform((hidden, 1), seed + 1), "b2": init.zeros((1,))}


def make_data(n: int = 256, seed: int = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """`n` points x of [-2, 2]^2 and y = sin(x0) cos(x1), float32 of shapes (n, 2), (n, 1)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (n, 2)).astype(np.float32)
    return x, (np.sin(x[:, :1]) * np.cos(x[:, 1:])).astype(np.float32)


def train(steps: int = 300, lr: float = 1e-2, report_every: int = 50) -> tuple[Params, list[float]]:
    """Full-batch Adam for `steps` steps; prints the loss every `report_every` steps. Returns
    the trained parameters and the losses printed."""
    x, y = make_data()
    params = initial_params()
    loss_and_grads = tg.value_and_grad(loss_fn)  # grads of argument 0: the params dict
    state: dict[str, Any] | None = None  # Adam's step count and moments; None: a fresh start
    printed: list[float] = []
    for step in range(steps + 1):
        loss, grads = loss_and_grads(params, x, y)
        params, state = tg.optim.adam(params, grads, state, lr=lr)
        if step % report_every == 0:
            printed.append(loss.item())
            print(f"step {step:4d}  loss {printed[-1]:.5f}")
    return params, printed


def main(steps: int = 300) -> None:
    """Train, then check the trained network's gradients against finite differences."""
    print(f"device: {tg.default_device()}")
    start = time.perf_counter()
    params, _ = train(steps)
    print(f"{steps} steps in {time.perf_counter() - start:.2f} s")
    x, y = make_data(8)
    # Finite differences need float64: the check runs on host copies of the trained params.
    params64 = {key: tensor.numpy().astype(np.float64) for key, tensor in params.items()}
    tg.gradcheck(loss_fn, params64, x.astype(np.float64), y.astype(np.float64))
    print("gradients agree with float64 finite differences: ok")


if __name__ == "__main__":
    main()
