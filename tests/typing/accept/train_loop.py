"""The training loop the README leads with: parameters in a dict, value_and_grad, adam."""

from __future__ import annotations

import numpy as np
from jaxtyping import Float

import tapegrad as tg

Params = dict[str, tg.AnyTensor]


def loss_fn(
    tape: tg.Tape, params: dict[str, tg.Id], x: Float[tg.Id, "batch 3"],
    y: Float[tg.Id, "batch 1"],
) -> tuple[tg.Tape, tg.Id]:
    tape, h = tg.linear(tape, x, params["w1"], params["b1"])
    tape, h = tg.tanh(tape, h)
    tape, out = tg.linear(tape, h, params["w2"], params["b2"])
    return tg.mse(tape, out, y)


def main() -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True) ** 2
    params: Params = {
        "w1": tg.nn.init.glorot_uniform((3, 8), seed=0),
        "b1": tg.nn.init.zeros((8,)),
        "w2": tg.nn.init.glorot_uniform((8, 1), seed=1),
        "b2": tg.nn.init.zeros((1,)),
    }
    state = None
    first = last = 0.0
    for step in range(30):
        loss, grads = tg.value_and_grad(loss_fn)(params, x, y)
        params, state = tg.optim.adam(params, grads, state, lr=0.05)
        last = float(loss)
        if step == 0:
            first = last
    assert last < first / 2, (first, last)
    return last


if __name__ == "__main__":
    print(main())
