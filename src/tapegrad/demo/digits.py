"""The main job: an MLP and a small CNN trained on scikit-learn's bundled 8x8 digits.

The data ships inside scikit-learn (nothing is downloaded). Forward, backward and the Adam
updates run on the default OpenCL device; the host reads back only the loss for the progress
line and the test logits for accuracy. Layer functions carry jaxtyping annotations checked by
beartype, so a shape mistake names the layer and the dimension.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jaxtyping import Float, Int

import tapegrad as tg

Params = dict[str, tg.AnyTensor]
Ids = dict[str, tg.Id]
Out = tuple[tg.Tape, Any]
Model = Callable[[tg.Tape, Ids, tg.Id], tuple[tg.Tape, tg.Id]]

typed = tg.typed  # jaxtyping + beartype on these user functions; tapegrad's ops stay unchecked


# --- layers -------------------------------------------------------------------------------------

@typed
def dense(tape: tg.Tape, x: Float[tg.Id, "batch fin"], w: Float[tg.Id, "fin fout"],
          b: Float[tg.Id, " fout"]) -> tuple[tg.Tape, Float[tg.Id, "batch fout"]]:
    return tg.linear(tape, x, w, b)


@typed
def conv_block(tape: tg.Tape, x: Float[tg.Id, "batch cin h w"],
               w: Float[tg.Id, "cout cin 3 3"], b: Float[tg.Id, " cout"]
               ) -> tuple[tg.Tape, Float[tg.Id, "batch cout h//2 w//2"]]:
    """3x3 convolution (same padding), ReLU, 2x2 max pool."""
    tape, h = tg.conv2d(tape, x, w, b, stride=1, padding=1)
    tape, h = tg.relu(tape, h)
    return tg.max_pool2d(tape, h, 2)


@typed
def loss_fn(tape: tg.Tape, logits: Float[tg.Id, "batch 10"], labels: Int[tg.Id, " batch"]
            ) -> tuple[tg.Tape, Float[tg.Id, ""]]:
    return tg.cross_entropy(tape, logits, labels)


def mlp(tape: tg.Tape, p: Ids, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, x = tg.reshape(tape, x, (x.shape[0], 64))
    tape, h = dense(tape, x, p["w1"], p["b1"])
    tape, h = tg.relu(tape, h)
    return dense(tape, h, p["w2"], p["b2"])


def cnn(tape: tg.Tape, p: Ids, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, h = conv_block(tape, x, p["c1"], p["cb1"])     # (N, 8, 4, 4)
    tape, h = conv_block(tape, h, p["c2"], p["cb2"])     # (N, 16, 2, 2)
    tape, h = tg.reshape(tape, h, (h.shape[0], -1))
    return dense(tape, h, p["w"], p["b"])


def mlp_params(seed: int) -> Params:
    init = tg.nn.init
    return {"w1": init.he_uniform((64, 128), seed), "b1": init.zeros((128,)),
            "w2": init.glorot_uniform((128, 10), seed + 1), "b2": init.zeros((10,))}


def cnn_params(seed: int) -> Params:
    init = tg.nn.init
    return {"c1": init.he_uniform((8, 1, 3, 3), seed), "cb1": init.zeros((8,)),
            "c2": init.he_uniform((16, 8, 3, 3), seed + 1), "cb2": init.zeros((16,)),
            "w": init.glorot_uniform((64, 10), seed + 2), "b": init.zeros((10,))}


# --- data, training, reporting -----------------------------------------------------------------

@dataclass(frozen=True)
class Data:
    x_train: np.ndarray[Any, Any]
    y_train: np.ndarray[Any, Any]
    x_test: np.ndarray[Any, Any]
    y_test: np.ndarray[Any, Any]


def load(seed: int = 0) -> Data:
    import importlib

    datasets: Any = importlib.import_module("sklearn.datasets")  # untyped package
    digits: Any = datasets.load_digits()
    x = (np.asarray(digits.images, np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(digits.target, np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_test = len(y) // 5
    return Data(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def accuracy(model: Model, params: Params, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]
             ) -> float:
    tape = tg.Tape()
    ids: Ids = {}
    for k, v in params.items():
        tape, ids[k] = tg.leaf(tape, v)
    tape, xi = tg.leaf(tape, x)
    tape, logits = model(tape, ids, xi)
    predicted: np.ndarray[Any, Any] = tg.value(tape, logits).numpy().argmax(axis=1)
    hits: np.ndarray[Any, Any] = predicted == y
    return float(hits.mean())


def train(name: str, model: Model, params: Params, data: Data, epochs: int, lr: float,
          batch: int = 64, seed: int = 0) -> tuple[Params, list[float], float]:
    rng = np.random.default_rng(seed)
    state: Any = None
    losses: list[float] = []
    n = len(data.y_train)
    steps = -(-n // batch)
    tty = sys.stdout.isatty()
    start = time.perf_counter()
    acc = 0.0
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n)
        epoch_losses: list[tg.AnyTensor] = []
        for step in range(steps):
            idx = order[step * batch:(step + 1) * batch]
            tape = tg.Tape()
            ids: Ids = {}
            for k, v in params.items():
                tape, ids[k] = tg.leaf(tape, v, requires_grad=True)
            tape, xi = tg.leaf(tape, data.x_train[idx])
            tape, yi = tg.leaf(tape, data.y_train[idx])
            tape, logits = model(tape, ids, xi)
            tape, loss = loss_fn(tape, logits, yi)
            grads = tg.backward(tape, loss)
            # Cosine decay: large early steps, small late ones, so the last epoch is settled.
            progress = ((epoch - 1) * steps + step) / (epochs * steps)
            step_lr = lr * 0.5 * (1.0 + math.cos(math.pi * progress))
            params, state = tg.optim.adam(params, {k: grads[i] for k, i in ids.items()}, state,
                                          lr=step_lr)
            epoch_losses.append(tg.value(tape, loss))
            if tty:
                print(f"\r{name} epoch {epoch:2d}/{epochs} {_bar(step + 1, steps)}", end="",
                      flush=True)
        mean_loss = float(np.mean([t.item() for t in epoch_losses]))
        losses.append(mean_loss)
        acc = accuracy(model, params, data.x_test, data.y_test)
        print(f"\r{name} epoch {epoch:2d}/{epochs} {_bar(steps, steps)} loss {mean_loss:.4f}  "
              f"test accuracy {100 * acc:5.1f}%  {time.perf_counter() - start:5.1f} s",
              flush=True)
    return params, losses, acc


def plot(curves: dict[str, list[float]], path: str) -> None:
    import importlib

    # matplotlib's annotations are partial; it is used as an untyped module here.
    mpl: Any = importlib.import_module("matplotlib")
    mpl.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training loss (cross-entropy)")
    ax.set_yscale("log")
    ax.set_title("tapegrad on scikit-learn digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(out_dir: str = "out") -> dict[str, float]:
    print(f"device: {tg.default_device()}")
    data = load()
    print(f"digits: {len(data.y_train)} train, {len(data.y_test)} test images of 8x8")
    results: dict[str, float] = {}
    curves: dict[str, list[float]] = {}
    for name, model, params, epochs, lr in (
        ("MLP", mlp, mlp_params(0), 15, 3e-3),
        ("CNN", cnn, cnn_params(10), 20, 1e-2),
    ):
        start = time.perf_counter()
        _, losses, acc = train(name, model, params, data, epochs, lr)
        results[name] = acc
        curves[name] = losses
        print(f"{name}: test accuracy {100 * acc:.1f}% in {time.perf_counter() - start:.1f} s")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.abspath(os.path.join(out_dir, "digits_loss.png"))
    plot(curves, path)
    print(f"loss curves written to {path}")
    print(f"the CNN's tape drawn at {draw_tape(out_dir)}")
    return results


def draw_tape(out_dir: str) -> str:
    """One training step of the CNN as a picture (SVG with Graphviz, else DOT source)."""
    data = load()
    tape = tg.Tape()
    ids: Ids = {}
    for k, v in cnn_params(0).items():
        tape, ids[k] = tg.leaf(tape, v, requires_grad=True, name=k)
    tape, xi = tg.leaf(tape, data.x_train[:4], name="images")
    tape, yi = tg.leaf(tape, data.y_train[:4], name="labels")
    tape, logits = cnn(tape, ids, xi)
    tape, loss = loss_fn(tape, logits, yi)
    try:
        return str(tg.render(tape, os.path.join(out_dir, "cnn_tape.svg"), highlight=loss))
    except tg.TapegradError:  # no Graphviz `dot` here: keep the DOT source instead
        path = os.path.abspath(os.path.join(out_dir, "cnn_tape.dot"))
        with open(path, "w") as f:
            f.write(tg.to_dot(tape, highlight=loss))
        return path


if __name__ == "__main__":
    main()
