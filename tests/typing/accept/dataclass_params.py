"""Parameters as a generic dataclass (as equinox users write them), no registration needed:
gradients and updates come back as the same dataclass; a static field is structure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

import tapegrad as tg

T = TypeVar("T")


@dataclass(frozen=True)
class Linear(Generic[T]):
    w: T
    b: T
    activation: str = field(default="tanh", metadata={"static": True})


def loss_fn(tape: tg.Tape, layer: Linear[tg.Id], x: tg.Id, y: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, out = tg.linear(tape, x, layer.w, layer.b)
    if layer.activation == "tanh":
        tape, out = tg.tanh(tape, out)
    return tg.mse(tape, out, y)


def main() -> int:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    y = np.tanh(x @ np.ones((3, 1), np.float32))
    layer: Linear[tg.AnyTensor] = Linear(tg.nn.init.glorot_uniform((3, 1), seed=0),
                                         tg.nn.init.zeros((1,)))
    loss, grads = tg.value_and_grad(loss_fn)(layer, x, y)
    assert isinstance(grads, Linear) and grads.activation == "tanh"
    layer, _ = tg.optim.sgd(layer, grads, lr=0.1)
    assert isinstance(layer, Linear)
    sizes: Linear[int] = tg.tree_map(lambda t: t.size, layer)
    assert (sizes.w, sizes.b) == (3, 1) and float(loss) > 0.0
    return sizes.w


if __name__ == "__main__":
    print(main())
