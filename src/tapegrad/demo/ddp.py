"""The digits CNN trained data-parallel: `mpiexec -n 2 python -m tapegrad.demo.ddp`.

The same model, data and schedule as `python -m tapegrad.demo` (`digits.py`: its functions are
used here), with each minibatch of 64 split across the ranks: every rank computes the gradient
of its share, `tg.distributed.allreduce` averages them (with the loss, in the same messages),
and every rank takes the same Adam step, so all ranks hold bitwise the same parameters. Rank 0
prints the progress and writes the loss and accuracy plot. One process (`python -m
tapegrad.demo.ddp`, no MPI needed) trains exactly as the plain demo's CNN does.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import numpy as np

import tapegrad as tg
from tapegrad.demo import digits

dist = tg.distributed


def shard(batch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """This rank's contiguous share of the minibatch `batch` (indices). The batch is cut to a
    multiple of the ranks so the shares are equal and the mean of their mean losses is the
    whole batch's mean loss (at most size() - 1 images of an epoch's last batch are left out)."""
    ranks = dist.size()
    usable = batch[:len(batch) - len(batch) % ranks]
    return np.split(usable, ranks)[dist.rank()]


def train(model: digits.Model, params: digits.Params, data: digits.Data, epochs: int,
          lr: float, batch: int = 64, seed: int = 0
          ) -> tuple[digits.Params, digits.History, float]:
    """Adam on minibatches of `batch` images split across the ranks, with the demo's cosine
    schedule; rank 0 prints a line per epoch. Returns the parameters, the history (losses
    averaged over the ranks, accuracies from rank 0) and the mean seconds per step."""
    loss_and_grads = tg.value_and_grad(digits.classifier_loss(model))
    rng = np.random.default_rng(seed)  # the same on every rank: the same batches everywhere
    state: dict[str, Any] | None = None
    history = digits.History()
    n = len(data.y_train)
    steps = -(-n // batch)
    lead = dist.rank() == 0
    name = f"CNN x{dist.size()}"
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n)
        epoch_losses: list[tg.AnyTensor] = []
        for step in range(steps):
            mine = shard(order[step * batch:(step + 1) * batch])
            loss, grads = loss_and_grads(params, data.x_train[mine], data.y_train[mine])
            loss, grads = dist.allreduce((loss, grads))  # the means over the ranks
            progress = ((epoch - 1) * steps + step) / (epochs * steps)
            step_lr = lr * 0.5 * (1.0 + math.cos(math.pi * progress))
            params, state = tg.optim.adam(params, grads, state, lr=step_lr)
            epoch_losses.append(loss)
        history.losses.append(float(np.mean([t.item() for t in epoch_losses])))
        if lead:  # the others go on to the next epoch and meet rank 0 at its first allreduce
            history.accuracies.append(
                digits.accuracy(model, params, data.x_test, data.y_test))
            print(f"{name} epoch {epoch:2d}/{epochs} loss {history.losses[-1]:.4f}  "
                  f"test accuracy {100 * history.accuracies[-1]:5.1f}%  "
                  f"{time.perf_counter() - start:5.1f} s", flush=True)
    return params, history, (time.perf_counter() - start) / (epochs * steps)


def main(out_dir: str = "out", epochs: int | None = None) -> digits.History:
    """Train the demo's CNN across the ranks; rank 0 prints and writes
    `out_dir/ddp_loss.png`. Returns this rank's history."""
    digits.require_demo_extras()
    dist.init()  # MPI up first: an error on one rank then ends them all
    lead = dist.rank() == 0
    if lead:
        print(f"{dist.size()} rank(s); rank 0's device: {tg.default_device()}", flush=True)
    data = digits.load()
    [(_, model, initial_params, model_epochs, lr)] = [m for m in digits.MODELS if m[0] == "CNN"]
    params = dist.broadcast(initial_params())  # the same start on every rank
    if lead:
        print(f"digits: {len(data.y_train)} train images, batches of 64 split across "
              f"{dist.size()} rank(s)", flush=True)
    _, history, step_s = train(model, params, data,
                               model_epochs if epochs is None else epochs, lr)
    if lead:
        print(f"CNN x{dist.size()}: test accuracy {100 * history.accuracies[-1]:.1f}%, "
              f"{1e3 * step_s:.1f} ms a step")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "ddp_loss.png")
        digits.plot({f"CNN on {dist.size()} rank(s)": history}, path)
        print(f"loss and accuracy curves written to {path}")
    return history


if __name__ == "__main__":
    main(epochs=int(sys.argv[1]) if len(sys.argv) > 1 else None)
