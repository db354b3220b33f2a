"""The main job (`make demo`): an MLP and a small CNN trained on scikit-learn's bundled 8x8 digits.

The training loop is the one to copy (README, "The training loop to copy"): the parameters are a
dict of tensors, the loss is a tape function `loss_fn(tape, params, images, labels) -> (tape,
loss)`, each step is

    loss, grads = tg.value_and_grad(loss_fn)(params, images, labels)
    params, state = tg.optim.adam(params, grads, state, lr=lr)

and `grads` is a dict with the params' keys. The data ship inside scikit-learn (nothing is
downloaded). Forward, backward and the Adam updates run on the default OpenCL device; the host
reads back only the losses for the progress line and the test logits for accuracy. Layer
functions carry jaxtyping annotations checked by beartype (`tg.typed`), so a shape mistake
names the layer and the dimension.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jaxtyping import Float, Int

import tapegrad as tg

Params = dict[str, tg.AnyTensor]  # a model's parameters, on the device
ParamIds = dict[str, tg.Id]  # the same parameters as ids on a tape
Model = Callable[[tg.Tape, ParamIds, tg.Id], tuple[tg.Tape, tg.Id]]  # (tape, images) -> logits
LossFn = Callable[[tg.Tape, ParamIds, tg.Id, tg.Id], tuple[tg.Tape, tg.Id]]

INSTALL_EXTRAS = 'pip install "tapegrad[demo]"'
# module to import: the package that provides it
DEMO_EXTRAS = {"sklearn.datasets": "scikit-learn", "matplotlib": "matplotlib"}

typed = tg.typed  # jaxtyping + beartype on these user functions; tapegrad's ops stay unchecked


# --- layers -------------------------------------------------------------------------------------

@typed
def dense(tape: tg.Tape, x: Float[tg.Id, "batch fin"], w: Float[tg.Id, "fin fout"],
          b: Float[tg.Id, " fout"]) -> tuple[tg.Tape, Float[tg.Id, "batch fout"]]:
    """`x @ w + b`."""
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
def cross_entropy(tape: tg.Tape, logits: Float[tg.Id, "batch 10"],
                  labels: Int[tg.Id, " batch"]) -> tuple[tg.Tape, Float[tg.Id, ""]]:
    """Mean cross-entropy of the logits against integer labels."""
    return tg.cross_entropy(tape, logits, labels)


# --- models -------------------------------------------------------------------------------------

def mlp(tape: tg.Tape, params: ParamIds, images: tg.Id) -> tuple[tg.Tape, tg.Id]:
    """64-128-10 with a ReLU: logits of shape (batch, 10)."""
    tape, x = tg.reshape(tape, images, (images.shape[0], 64))
    tape, h = dense(tape, x, params["w1"], params["b1"])
    tape, h = tg.relu(tape, h)
    return dense(tape, h, params["w2"], params["b2"])


def cnn(tape: tg.Tape, params: ParamIds, images: tg.Id) -> tuple[tg.Tape, tg.Id]:
    """conv-pool, conv-pool, linear: logits of shape (batch, 10)."""
    tape, h = conv_block(tape, images, params["c1"], params["cb1"])  # (N, 8, 4, 4)
    tape, h = conv_block(tape, h, params["c2"], params["cb2"])  # (N, 16, 2, 2)
    tape, h = tg.reshape(tape, h, (h.shape[0], -1))
    return dense(tape, h, params["w"], params["b"])


def mlp_params(seed: int) -> Params:
    """The MLP's initial parameters, drawn from `seed`."""
    init = tg.nn.init
    return {"w1": init.he_uniform((64, 128), seed), "b1": init.zeros((128,)),
            "w2": init.glorot_uniform((128, 10), seed + 1), "b2": init.zeros((10,))}


def cnn_params(seed: int) -> Params:
    """The CNN's initial parameters, drawn from `seed`."""
    init = tg.nn.init
    return {"c1": init.he_uniform((8, 1, 3, 3), seed), "cb1": init.zeros((8,)),
            "c2": init.he_uniform((16, 8, 3, 3), seed + 1), "cb2": init.zeros((16,)),
            "w": init.glorot_uniform((64, 10), seed + 2), "b": init.zeros((10,))}


def classifier_loss(model: Model) -> LossFn:
    """`model`'s training loss as a tape function, the `f` of `tg.value_and_grad(f)`:
    `loss_fn(tape, params, images, labels) -> (tape, mean cross-entropy)`."""

    def loss_fn(tape: tg.Tape, params: ParamIds, images: tg.Id, labels: tg.Id
                ) -> tuple[tg.Tape, tg.Id]:
        tape, logits = model(tape, params, images)
        return cross_entropy(tape, logits, labels)

    return loss_fn


# --- extras and data ----------------------------------------------------------------------------

def require_demo_extras() -> None:
    """Exit with the command that installs them if scikit-learn or matplotlib is missing."""
    for module in DEMO_EXTRAS:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise SystemExit(
                f"the digits demo needs tapegrad's demo extras ({', '.join(DEMO_EXTRAS.values())})"
                f": {err}\nInstall them with:\n    {INSTALL_EXTRAS}") from None


@dataclass(frozen=True)
class Data:
    """Images (N, 1, 8, 8) in [0, 1], float32, and their labels (N,), int64."""

    x_train: np.ndarray[Any, Any]
    y_train: np.ndarray[Any, Any]
    x_test: np.ndarray[Any, Any]
    y_test: np.ndarray[Any, Any]


def load(seed: int = 0) -> Data:
    """The 1797 digits, shuffled by `seed`; a fifth of them held out for testing."""
    datasets: Any = importlib.import_module("sklearn.datasets")  # untyped package
    digits: Any = datasets.load_digits()
    x = (np.asarray(digits.images, np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(digits.target, np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_test = len(y) // 5
    return Data(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


# --- training and evaluation --------------------------------------------------------------------

@dataclass
class History:
    """One model's training, epoch by epoch."""

    losses: list[float] = field(default_factory=list[float])  # mean training loss
    accuracies: list[float] = field(default_factory=list[float])  # on the test set, in [0, 1]


def on_tape(tape: tg.Tape, params: Params, *, requires_grad: bool = False, named: bool = False
            ) -> tuple[tg.Tape, ParamIds]:
    """`params` as leaves of `tape` (named by their keys if `named`, for drawings)."""
    ids: ParamIds = {}
    for key, tensor in params.items():
        tape, ids[key] = tg.leaf(tape, tensor, requires_grad=requires_grad,
                                 name=key if named else None)
    return tape, ids


def accuracy(model: Model, params: Params, images: np.ndarray[Any, Any],
             labels: np.ndarray[Any, Any]) -> float:
    """The fraction of `images` whose largest logit is at their label."""
    tape, param_ids = on_tape(tg.Tape(), params)
    tape, x = tg.leaf(tape, images)
    tape, logits = model(tape, param_ids, x)
    predicted: np.ndarray[Any, Any] = tg.value(tape, logits).numpy().argmax(axis=1)
    hits: np.ndarray[Any, Any] = predicted == labels
    return float(hits.mean())


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def train(name: str, model: Model, params: Params, data: Data, epochs: int, lr: float,
          batch: int = 64, seed: int = 0) -> tuple[Params, History]:
    """Adam on minibatches of `batch` images, the learning rate decaying to 0 over `epochs`;
    prints a progress line per epoch. Returns the trained parameters and the history."""
    loss_and_grads = tg.value_and_grad(classifier_loss(model))  # grads of argument 0, params
    rng = np.random.default_rng(seed)
    state: dict[str, Any] | None = None  # Adam's step count and moments; None: a fresh start
    history = History()
    n = len(data.y_train)
    steps = -(-n // batch)
    tty = sys.stdout.isatty()
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n)
        # kept on the device until the epoch ends: reading each one would wait for its step
        epoch_losses: list[tg.AnyTensor] = []
        for step in range(steps):
            in_batch = order[step * batch:(step + 1) * batch]
            loss, grads = loss_and_grads(params, data.x_train[in_batch], data.y_train[in_batch])
            # Cosine decay: large early steps, small late ones, so the last epoch is settled.
            progress = ((epoch - 1) * steps + step) / (epochs * steps)
            step_lr = lr * 0.5 * (1.0 + math.cos(math.pi * progress))
            params, state = tg.optim.adam(params, grads, state, lr=step_lr)
            epoch_losses.append(loss)
            if tty:
                print(f"\r{name} epoch {epoch:2d}/{epochs} {_bar(step + 1, steps)}", end="",
                      flush=True)
        history.losses.append(float(np.mean([t.item() for t in epoch_losses])))
        history.accuracies.append(accuracy(model, params, data.x_test, data.y_test))
        print(f"\r{name} epoch {epoch:2d}/{epochs} {_bar(steps, steps)} "
              f"loss {history.losses[-1]:.4f}  test accuracy {100 * history.accuracies[-1]:5.1f}%"
              f"  {time.perf_counter() - start:5.1f} s", flush=True)
    return params, history


# --- outputs ------------------------------------------------------------------------------------

def plot(histories: dict[str, History], path: str) -> None:
    """Training loss (left) and test accuracy (right) per epoch of each model, as a PNG."""
    # matplotlib's annotations are partial; it is used as an untyped module here.
    mpl: Any = importlib.import_module("matplotlib")
    mpl.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    ticker: Any = importlib.import_module("matplotlib.ticker")
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for label, history in histories.items():
        epochs = range(1, len(history.losses) + 1)
        loss_ax.plot(epochs, history.losses, marker="o", label=label)
        acc_ax.plot(epochs, [100 * a for a in history.accuracies], marker="o",
                    label=f"{label}, final {100 * history.accuracies[-1]:.1f}%")
    loss_ax.set_ylabel("mean training loss (cross-entropy)")
    loss_ax.set_yscale("log")
    loss_ax.set_title("training loss")
    acc_ax.set_ylabel("test accuracy (%)")
    acc_ax.set_title("test accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.legend()
    fig.suptitle("tapegrad on scikit-learn's 8x8 digits")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_tape(data: Data, out_dir: str) -> str:
    """One training step of the CNN, recorded on a tape and drawn (SVG with Graphviz, else DOT
    source); returns the file's path."""
    tape, param_ids = on_tape(tg.Tape(), cnn_params(0), requires_grad=True, named=True)
    tape, images = tg.leaf(tape, data.x_train[:4], name="images")
    tape, labels = tg.leaf(tape, data.y_train[:4], name="labels")
    # The tape-first form records the forward and the backward on this tape, to be drawn.
    tape, (loss, _) = tg.value_and_grad(classifier_loss(cnn))(tape, param_ids, images, labels)
    try:
        return str(tg.render(tape, os.path.join(out_dir, "cnn_tape.svg"), highlight=loss))
    except tg.TapegradError:  # no Graphviz `dot` here: keep the DOT source instead
        path = os.path.join(out_dir, "cnn_tape.dot")
        with open(path, "w") as f:
            f.write(tg.to_dot(tape, highlight=loss))
        return path


# Each model: its name, function, initial parameters, epochs and peak learning rate.
MODELS: tuple[tuple[str, Model, Callable[[], Params], int, float], ...] = (
    ("MLP", mlp, lambda: mlp_params(0), 15, 3e-3),
    ("CNN", cnn, lambda: cnn_params(10), 20, 1e-2),
)


def main(out_dir: str = "out", epochs: int | None = None) -> dict[str, History]:
    """Train both models (each for its own number of epochs, or `epochs`), print their progress,
    write the curves and the CNN's tape to `out_dir`; returns each model's history."""
    require_demo_extras()
    print(f"device: {tg.default_device()}")
    data = load()
    print(f"digits: {len(data.y_train)} train, {len(data.y_test)} test images of 8x8")
    histories: dict[str, History] = {}
    for name, model, initial_params, model_epochs, lr in MODELS:
        start = time.perf_counter()
        _, history = train(name, model, initial_params(), data,
                           model_epochs if epochs is None else epochs, lr)
        histories[name] = history
        print(f"{name}: test accuracy {100 * history.accuracies[-1]:.1f}% in "
              f"{time.perf_counter() - start:.1f} s")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "digits_loss.png")
    plot(histories, path)
    print(f"loss and accuracy curves written to {path}")
    print(f"the CNN's tape drawn at {draw_tape(data, out_dir)}")
    return histories


if __name__ == "__main__":
    main()
