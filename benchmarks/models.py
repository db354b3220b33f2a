"""Three research models, written as a user writes them, against their PyTorch twins (issue 19).

    python -m benchmarks.models             # the three rows of `make bench`, printed
    python -m benchmarks.models --profile   # cProfile of steady steps of each model

Each model is a loss `loss_fn(tape, params, batch) -> (tape, loss_id)` over parameters in a
dict (the LSTM's in a dataclass), trained by the README's loop: `tg.value_and_grad` for the
loss and the gradients, `tg.optim.adam` for the update. A step is forward, backward and Adam,
and ends with the device synchronised. The PyTorch twin has the same architecture, sizes and
initial weights (the same numpy arrays) and runs `loss.backward()` and `torch.optim.Adam`.
Each model is timed eagerly and under `tg.jit` (which replays the recorded step's launches
without running its Python), interleaved with torch's step in the same run.
"""

from __future__ import annotations

import io
import math
import os
import pstats
import sys
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

import tapegrad as tg
from tapegrad._device import Device
from tapegrad._jit import Program

from ._harness import Row, median_times, profiled

torch: Any
try:
    import torch as _torch  # pyright: ignore[reportMissingImports]

    torch = _torch
except ImportError:  # pragma: no cover - the bench target installs it where it can
    torch = None

# Where the PyTorch twins run: "cpu" (the default), or "cuda" on a GPU machine, for a table
# of tapegrad through the GPU's OpenCL beside PyTorch CUDA.
TORCH_DEVICE = os.environ.get("TAPEGRAD_BENCH_TORCH_DEVICE", "cpu")

Arr = np.ndarray[Any, Any]
Batch = dict[str, Any]
LossFn = Callable[[tg.Tape, Any, Any], tuple[tg.Tape, tg.Id]]
LR = 1e-3
T = TypeVar("T")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> Arr:
    return (rng.standard_normal(shape) * std).astype(np.float32)


# --- 1. a char-level GPT ------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 76
    block: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4
    batch: int = 16


def gpt_init(cfg: GPTConfig, seed: int = 0) -> tuple[dict[str, Arr], Batch]:
    rng = np.random.default_rng(seed)
    c = cfg.width
    p: dict[str, Arr] = {"wte": _normal(rng, (cfg.vocab, c), 0.02),
                         "wpe": _normal(rng, (cfg.block, c), 0.02)}
    for i in range(cfg.layers):
        p[f"h{i}.ln1.w"], p[f"h{i}.ln1.b"] = np.ones(c, np.float32), np.zeros(c, np.float32)
        p[f"h{i}.qkv.w"] = _normal(rng, (c, 3 * c), 0.02)
        p[f"h{i}.qkv.b"] = np.zeros(3 * c, np.float32)
        p[f"h{i}.proj.w"] = _normal(rng, (c, c), 0.02 / math.sqrt(2 * cfg.layers))
        p[f"h{i}.proj.b"] = np.zeros(c, np.float32)
        p[f"h{i}.ln2.w"], p[f"h{i}.ln2.b"] = np.ones(c, np.float32), np.zeros(c, np.float32)
        p[f"h{i}.fc.w"] = _normal(rng, (c, 4 * c), 0.02)
        p[f"h{i}.fc.b"] = np.zeros(4 * c, np.float32)
        p[f"h{i}.fc2.w"] = _normal(rng, (4 * c, c), 0.02 / math.sqrt(2 * cfg.layers))
        p[f"h{i}.fc2.b"] = np.zeros(c, np.float32)
    p["lnf.w"], p["lnf.b"] = np.ones(c, np.float32), np.zeros(c, np.float32)
    p["head.w"] = _normal(rng, (c, cfg.vocab), 0.02)
    text = rng.integers(0, cfg.vocab, (cfg.batch, cfg.block + 1))
    batch: Batch = {"x": text[:, :-1].astype(np.int64),
                    "y": text[:, 1:].reshape(-1).astype(np.int64),
                    "pos": np.arange(cfg.block, dtype=np.int64),
                    "mask": np.tril(np.ones((cfg.block, cfg.block), bool))}
    return p, batch


def gpt_loss_fn(cfg: GPTConfig) -> LossFn:
    B, T_, C, H = cfg.batch, cfg.block, cfg.width, cfg.heads
    hd = C // H

    def heads(tape: tg.Tape, t: tg.Id) -> tuple[tg.Tape, tg.Id]:  # (B, T, C) -> (B, H, T, hd)
        tape, t = tg.reshape(tape, t, (B, T_, H, hd))
        return tg.transpose(tape, t, (0, 2, 1, 3))

    def loss_fn(tape: tg.Tape, p: dict[str, tg.Id], batch: dict[str, tg.Id]
                ) -> tuple[tg.Tape, tg.Id]:
        tape, tok = tg.embedding(tape, p["wte"], batch["x"])
        tape, pos = tg.embedding(tape, p["wpe"], batch["pos"])
        tape, h = tg.add(tape, tok, pos)
        for i in range(cfg.layers):
            tape, a = tg.layer_norm(tape, h, p[f"h{i}.ln1.w"], p[f"h{i}.ln1.b"])
            tape, qkv = tg.linear(tape, a, p[f"h{i}.qkv.w"], p[f"h{i}.qkv.b"])
            tape, (q, k, v) = tg.split(tape, qkv, 3, axis=-1)
            tape, q = heads(tape, q)
            tape, k = heads(tape, k)
            tape, v = heads(tape, v)
            tape, kt = tg.transpose(tape, k, (0, 1, 3, 2))
            tape, att = tg.matmul(tape, q, kt)
            tape, att = tg.mul(tape, att, 1.0 / math.sqrt(hd))
            tape, att = tg.where(tape, batch["mask"], att, -1e9)
            tape, att = tg.softmax(tape, att)
            tape, y = tg.matmul(tape, att, v)
            tape, y = tg.transpose(tape, y, (0, 2, 1, 3))
            tape, y = tg.reshape(tape, y, (B, T_, C))
            tape, y = tg.linear(tape, y, p[f"h{i}.proj.w"], p[f"h{i}.proj.b"])
            tape, h = tg.add(tape, h, y)
            tape, a = tg.layer_norm(tape, h, p[f"h{i}.ln2.w"], p[f"h{i}.ln2.b"])
            tape, a = tg.linear(tape, a, p[f"h{i}.fc.w"], p[f"h{i}.fc.b"])
            tape, a = tg.gelu(tape, a)
            tape, a = tg.linear(tape, a, p[f"h{i}.fc2.w"], p[f"h{i}.fc2.b"])
            tape, h = tg.add(tape, h, a)
        tape, h = tg.layer_norm(tape, h, p["lnf.w"], p["lnf.b"])
        tape, logits = tg.linear(tape, h, p["head.w"])
        tape, logits = tg.reshape(tape, logits, (B * T_, cfg.vocab))
        return tg.cross_entropy(tape, logits, batch["y"])

    return loss_fn


def gpt_torch_loss(cfg: GPTConfig) -> Callable[[dict[str, Any], Batch], Any]:
    F = torch.nn.functional
    B, T_, C, H = cfg.batch, cfg.block, cfg.width, cfg.heads
    hd = C // H

    def loss(p: dict[str, Any], batch: Batch) -> Any:
        h = F.embedding(batch["x"], p["wte"]) + F.embedding(batch["pos"], p["wpe"])
        for i in range(cfg.layers):
            a = F.layer_norm(h, (C,), p[f"h{i}.ln1.w"], p[f"h{i}.ln1.b"])
            q, k, v = (a @ p[f"h{i}.qkv.w"] + p[f"h{i}.qkv.b"]).split(C, dim=-1)
            q, k, v = (t.reshape(B, T_, H, hd).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = torch.where(batch["mask"], att, -1e9).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T_, C)
            h = h + (y @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"])
            a = F.layer_norm(h, (C,), p[f"h{i}.ln2.w"], p[f"h{i}.ln2.b"])
            a = F.gelu(a @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"])
            h = h + (a @ p[f"h{i}.fc2.w"] + p[f"h{i}.fc2.b"])
        h = F.layer_norm(h, (C,), p["lnf.w"], p["lnf.b"])
        return F.cross_entropy((h @ p["head.w"]).reshape(B * T_, cfg.vocab), batch["y"])

    return loss


# --- 2. a ResNet-style CNN ----------------------------------------------------------------------

@dataclass(frozen=True)
class ResNetConfig:
    batch: int = 16
    size: int = 32       # input H = W; two 2x2 max pools, then a global average pool
    widths: tuple[int, int] = (16, 32)
    classes: int = 10


def resnet_init(cfg: ResNetConfig, seed: int = 0) -> tuple[dict[str, Arr], Batch]:
    rng = np.random.default_rng(seed)
    c1, c2 = cfg.widths
    p: dict[str, Arr] = {}

    def conv(name: str, cin: int, cout: int) -> None:
        p[name + ".w"] = _normal(rng, (cout, cin, 3, 3), math.sqrt(2.0 / (9 * cin)))
        p[name + ".g"], p[name + ".b"] = np.ones(cout, np.float32), np.zeros(cout, np.float32)

    conv("stem", 3, c1)
    conv("b1.c1", c1, c1)
    conv("b1.c2", c1, c1)
    conv("up", c1, c2)
    conv("b2.c1", c2, c2)
    conv("b2.c2", c2, c2)
    conv("b3.c1", c2, c2)
    conv("b3.c2", c2, c2)
    p["fc.w"] = _normal(rng, (c2, cfg.classes), 1 / math.sqrt(c2))
    p["fc.b"] = np.zeros(cfg.classes, np.float32)
    batch: Batch = {
        "x": rng.standard_normal((cfg.batch, 3, cfg.size, cfg.size)).astype(np.float32),
        "y": rng.integers(0, cfg.classes, cfg.batch).astype(np.int64)}
    return p, batch


def resnet_loss_fn(cfg: ResNetConfig) -> LossFn:
    def conv_bn(tape: tg.Tape, p: dict[str, tg.Id], name: str, x: tg.Id
                ) -> tuple[tg.Tape, tg.Id]:
        tape, h = tg.conv2d(tape, x, p[name + ".w"], padding=1)
        return tg.batch_norm(tape, h, p[name + ".g"], p[name + ".b"])

    def block(tape: tg.Tape, p: dict[str, tg.Id], name: str, x: tg.Id
              ) -> tuple[tg.Tape, tg.Id]:
        tape, h = conv_bn(tape, p, name + ".c1", x)
        tape, h = tg.relu(tape, h)
        tape, h = conv_bn(tape, p, name + ".c2", h)
        tape, h = tg.add(tape, h, x)
        return tg.relu(tape, h)

    def loss_fn(tape: tg.Tape, p: dict[str, tg.Id], batch: dict[str, tg.Id]
                ) -> tuple[tg.Tape, tg.Id]:
        tape, h = conv_bn(tape, p, "stem", batch["x"])
        tape, h = tg.relu(tape, h)
        tape, h = block(tape, p, "b1", h)
        tape, h = tg.max_pool2d(tape, h, 2)
        tape, h = conv_bn(tape, p, "up", h)
        tape, h = tg.relu(tape, h)
        tape, h = block(tape, p, "b2", h)
        tape, h = tg.max_pool2d(tape, h, 2)
        tape, h = block(tape, p, "b3", h)
        tape, h = tg.avg_pool2d(tape, h, cfg.size // 4)
        tape, h = tg.reshape(tape, h, (cfg.batch, cfg.widths[1]))
        tape, logits = tg.linear(tape, h, p["fc.w"], p["fc.b"])
        return tg.cross_entropy(tape, logits, batch["y"])

    return loss_fn


def resnet_torch_loss(cfg: ResNetConfig) -> Callable[[dict[str, Any], Batch], Any]:
    F = torch.nn.functional

    def conv_bn(p: dict[str, Any], name: str, x: Any) -> Any:
        h = F.conv2d(x, p[name + ".w"], padding=1)
        return F.batch_norm(h, None, None, p[name + ".g"], p[name + ".b"], training=True)

    def block(p: dict[str, Any], name: str, x: Any) -> Any:
        h = torch.relu(conv_bn(p, name + ".c1", x))
        return torch.relu(conv_bn(p, name + ".c2", h) + x)

    def loss(p: dict[str, Any], batch: Batch) -> Any:
        h = torch.relu(conv_bn(p, "stem", batch["x"]))
        h = F.max_pool2d(block(p, "b1", h), 2)
        h = torch.relu(conv_bn(p, "up", h))
        h = F.max_pool2d(block(p, "b2", h), 2)
        h = F.avg_pool2d(block(p, "b3", h), cfg.size // 4)
        logits = h.reshape(cfg.batch, cfg.widths[1]) @ p["fc.w"] + p["fc.b"]
        return F.cross_entropy(logits, batch["y"])

    return loss


# --- 3. an LSTM unrolled over time --------------------------------------------------------------

@dataclass(frozen=True)
class LSTMConfig:
    steps: int = 20
    batch: int = 16
    inputs: int = 32
    hidden: int = 64
    classes: int = 10


@dataclass
class LSTMParams(Generic[T]):
    """A dataclass of parameters: a pytree of its fields (arrays, then ids, then tensors)."""

    wx: T    # (inputs, 4 hidden): gates i, f, g, o, as nn.LSTM's order
    wh: T    # (hidden, 4 hidden)
    b: T     # (4 hidden,)
    head_w: T
    head_b: T


def lstm_init(cfg: LSTMConfig, seed: int = 0) -> tuple[LSTMParams[Arr], Batch]:
    rng = np.random.default_rng(seed)
    k = 1 / math.sqrt(cfg.hidden)
    p = LSTMParams(
        wx=rng.uniform(-k, k, (cfg.inputs, 4 * cfg.hidden)).astype(np.float32),
        wh=rng.uniform(-k, k, (cfg.hidden, 4 * cfg.hidden)).astype(np.float32),
        b=rng.uniform(-k, k, 4 * cfg.hidden).astype(np.float32),
        head_w=_normal(rng, (cfg.hidden, cfg.classes), k),
        head_b=np.zeros(cfg.classes, np.float32))
    batch: Batch = {
        "x": rng.standard_normal((cfg.steps, cfg.batch, cfg.inputs)).astype(np.float32),
        "y": rng.integers(0, cfg.classes, cfg.batch).astype(np.int64),
        "h0": np.zeros((cfg.batch, cfg.hidden), np.float32)}
    return p, batch


def lstm_loss_fn(cfg: LSTMConfig) -> LossFn:
    def cell(tape: tg.Tape, p: LSTMParams[tg.Id], x: tg.Id, h: tg.Id, c: tg.Id
             ) -> tuple[tg.Tape, tg.Id, tg.Id]:
        tape, gx = tg.linear(tape, x, p.wx, p.b)
        tape, gh = tg.matmul(tape, h, p.wh)
        tape, gates = tg.add(tape, gx, gh)
        tape, (i, f, g, o) = tg.split(tape, gates, 4, axis=1)
        tape, i = tg.sigmoid(tape, i)
        tape, f = tg.sigmoid(tape, f)
        tape, g = tg.tanh(tape, g)
        tape, o = tg.sigmoid(tape, o)
        tape, fc = tg.mul(tape, f, c)
        tape, ig = tg.mul(tape, i, g)
        tape, c = tg.add(tape, fc, ig)
        tape, tc = tg.tanh(tape, c)
        tape, h = tg.mul(tape, o, tc)
        return tape, h, c

    def loss_fn(tape: tg.Tape, p: LSTMParams[tg.Id], batch: dict[str, tg.Id]
                ) -> tuple[tg.Tape, tg.Id]:
        h = c = batch["h0"]
        for t in range(cfg.steps):
            tape, xt = tg.slice(tape, batch["x"], t)
            tape, h, c = cell(tape, p, xt, h, c)
        tape, logits = tg.linear(tape, h, p.head_w, p.head_b)
        return tg.cross_entropy(tape, logits, batch["y"])

    return loss_fn


def lstm_torch_loss(cfg: LSTMConfig) -> Callable[[LSTMParams[Any], Batch], Any]:
    """The same cell in torch ops."""
    F = torch.nn.functional

    def loss(p: LSTMParams[Any], batch: Batch) -> Any:
        h = c = batch["h0"]
        for t in range(cfg.steps):
            i, f, g, o = (batch["x"][t] @ p.wx + p.b + h @ p.wh).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return F.cross_entropy(h @ p.head_w + p.head_b, batch["y"])

    return loss


def lstm_torch_module(cfg: LSTMConfig, p: LSTMParams[Arr]
                      ) -> tuple[list[Any], Callable[[Batch], Any]]:
    """`nn.LSTM` with the same weights (bias_hh zero, frozen) and the same head: (params, loss)."""
    F = torch.nn.functional
    lstm = torch.nn.LSTM(cfg.inputs, cfg.hidden).to(TORCH_DEVICE)
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.from_numpy(p.wx.T.copy()).to(TORCH_DEVICE))
        lstm.weight_hh_l0.copy_(torch.from_numpy(p.wh.T.copy()).to(TORCH_DEVICE))
        lstm.bias_ih_l0.copy_(torch.from_numpy(p.b).to(TORCH_DEVICE))
        lstm.bias_hh_l0.zero_()
    lstm.bias_hh_l0.requires_grad_(False)  # one bias, as the cell's: frozen at zero
    head_w = torch.from_numpy(p.head_w.copy()).to(TORCH_DEVICE).requires_grad_()
    head_b = torch.from_numpy(p.head_b.copy()).to(TORCH_DEVICE).requires_grad_()

    def loss(batch: Batch) -> Any:
        out, _ = lstm(batch["x"])
        return F.cross_entropy(out[-1] @ head_w + head_b, batch["y"])

    params = [q for q in lstm.parameters() if q.requires_grad]
    return [*params, head_w, head_b], loss


# --- the training step, as a user writes it -----------------------------------------------------

def make_step(loss_fn: LossFn, lr: float = LR) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]:
    """README's loop as a function: (params, adam state, batch) -> (params, state, loss)."""
    loss_and_grads = tg.value_and_grad(loss_fn)

    def train_step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = loss_and_grads(params, batch)
        params, state = tg.optim.adam(params, grads, state, lr=lr)
        return params, state, loss

    return train_step


def to_device(tree: T) -> T:
    return tg.tree_map(lambda a: tg.AnyTensor.from_numpy(a), tree)


class Trainer:
    """A tapegrad model's training state, stepped eagerly or under `tg.jit`."""

    def __init__(self, loss_fn: LossFn, params: Any, batch: Batch, jit: bool) -> None:
        step = make_step(loss_fn)
        self.step_fn: Callable[[Any, Any, Any], tuple[Any, Any, Any]] = (
            tg.jit(step) if jit else step)
        self.params: Any = to_device(params)
        self.state: Any = None
        self.batch: Any = to_device(batch)
        self.device = tg.default_device()
        self.loss: tg.AnyTensor | None = None

    def __call__(self) -> None:
        self.params, self.state, self.loss = self.step_fn(self.params, self.state, self.batch)
        self.device.finish()


class TorchTrainer:
    def __init__(self, params: list[Any], loss: Callable[[], Any], lr: float = LR) -> None:
        self.params, self.loss_fn = params, loss
        self.opt = torch.optim.Adam(params, lr=lr)
        self.loss: Any = None

    def __call__(self) -> None:
        self.opt.zero_grad()
        self.loss = self.loss_fn()
        self.loss.backward()
        self.opt.step()
        if TORCH_DEVICE != "cpu":
            torch.cuda.synchronize()


def torch_tree(tree: T, grad: bool) -> T:
    def conv(a: Any) -> Any:
        t = torch.from_numpy(np.array(a)).to(TORCH_DEVICE)
        return t.requires_grad_() if grad else t
    return tg.tree_map(conv, tree)


@dataclass
class Model:
    """A model of the benchmark: its tapegrad loss, initial params and batch, torch twins."""

    name: str
    loss_fn: LossFn
    params: Any           # a pytree of numpy arrays
    batch: Batch
    torch_twins: Callable[[], dict[str, TorchTrainer]]  # name -> a fresh torch trainer


def _twin(loss: Callable[[Any, Batch], Any], params: Any, batch: Batch) -> TorchTrainer:
    """A torch trainer of `loss` from the same initial arrays (copied)."""
    tp, tb = torch_tree(params, True), torch_tree(batch, False)
    flat: list[Any] = []
    tg.tree_map(lambda t: flat.append(t), tp)
    return TorchTrainer(flat, lambda: loss(tp, tb))


def gpt_model(cfg: GPTConfig = GPTConfig()) -> Model:
    params, batch = gpt_init(cfg)

    def twins() -> dict[str, TorchTrainer]:
        return {} if torch is None else {"torch": _twin(gpt_torch_loss(cfg), params, batch)}

    return Model(f"char GPT (vocab {cfg.vocab}, block {cfg.block}, width {cfg.width}, "
                 f"{cfg.layers} layers, {cfg.heads} heads, batch {cfg.batch})",
                 gpt_loss_fn(cfg), params, batch, twins)


def resnet_model(cfg: ResNetConfig = ResNetConfig()) -> Model:
    params, batch = resnet_init(cfg)

    def twins() -> dict[str, TorchTrainer]:
        return {} if torch is None else {"torch": _twin(resnet_torch_loss(cfg), params, batch)}

    return Model(f"ResNet-style CNN ({cfg.batch}x3x{cfg.size}x{cfg.size}, 3 basic blocks, "
                 f"widths {cfg.widths[0]}-{cfg.widths[1]}, batch norm)",
                 resnet_loss_fn(cfg), params, batch, twins)


def lstm_model(cfg: LSTMConfig = LSTMConfig()) -> Model:
    params, batch = lstm_init(cfg)

    def twins() -> dict[str, TorchTrainer]:
        if torch is None:
            return {}
        tb = torch_tree(batch, False)
        module_params, module_loss = lstm_torch_module(cfg, params)
        return {"torch (same cell)": _twin(lstm_torch_loss(cfg), params, batch),
                "torch nn.LSTM": TorchTrainer(module_params, lambda: module_loss(tb))}

    return Model(f"LSTM unrolled {cfg.steps} steps (batch {cfg.batch}, input {cfg.inputs}, "
                 f"hidden {cfg.hidden})", lstm_loss_fn(cfg), params, batch, twins)


# --- measuring ------------------------------------------------------------------------------------

@contextmanager
def counting_launches() -> Generator[list[int]]:
    """Count kernel launches while inside: `Device.launch` calls (every eager enqueue goes
    through it) and the launches of replayed sweeps (a recorded program's, which bypass it)."""
    count = [0]
    original = Device.launch
    run_on = Program.run_on

    def launch(self: Device, *args: Any, largest: int | None = None) -> None:
        count[0] += 1
        original(self, *args, largest=largest)

    def replay(self: Program, *args: Any) -> list[Any]:
        count[0] += len(self.launches)
        return run_on(self, *args)

    Device.launch = launch  # type: ignore[method-assign]
    Program.run_on = replay  # type: ignore[method-assign]
    try:
        yield count
    finally:
        Device.launch = original  # type: ignore[method-assign]
        Program.run_on = run_on  # type: ignore[method-assign]


def forward_nodes(model: Model) -> int:
    """Nodes of the forward tape of one step (leaves included)."""
    tape, _ = model.loss_fn(*_leaves(model))
    return len(tape)


def _leaves(model: Model) -> tuple[Any, ...]:
    tape = tg.Tape()

    def leaf(grad: bool) -> Callable[[Any], tg.Id]:
        def make(a: Any) -> tg.Id:
            nonlocal tape
            tape, i = tg.leaf(tape, a, requires_grad=grad)
            return i
        return make

    params = tg.tree_map(leaf(True), model.params)
    batch = tg.tree_map(leaf(False), model.batch)
    return tape, params, batch


def first_losses(model: Model, steps: int, jit: bool) -> list[float]:
    trainer = Trainer(model.loss_fn, model.params, model.batch, jit)
    out: list[float] = []
    for _ in range(steps):
        trainer()
        assert trainer.loss is not None
        out.append(float(trainer.loss.numpy()))
    return out


def torch_first_losses(model: Model, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, trainer in model.torch_twins().items():
        losses: list[float] = []
        for _ in range(steps):
            trainer()
            losses.append(float(trainer.loss.detach()))
        out[name] = losses
    return out


def bench_model(model: Model, tag: str, check_steps: int = 6) -> list[Row]:
    if torch is not None:
        torch.set_num_threads(2)
    # First calls: the first step of this model in the process (kernel programs on disk warm,
    # those of earlier workloads loaded), eagerly, then the first (tracing) call under tg.jit.
    eager, jitted = (Trainer(model.loss_fn, model.params, model.batch, jit)
                     for jit in (False, True))
    t0 = time.perf_counter()
    eager()
    first_eager = time.perf_counter() - t0
    t0 = time.perf_counter()
    jitted()
    first_jit = time.perf_counter() - t0
    # jit must equal eager bitwise: the same steps from the same weights.
    e_losses = first_losses(model, check_steps, jit=False)
    j_losses = first_losses(model, check_steps, jit=True)
    assert np.array_equal(np.array(e_losses, np.float32), np.array(j_losses, np.float32)), (
        f"{model.name}: tg.jit's losses {j_losses} differ from eager's {e_losses}")
    twins = model.torch_twins()
    for _ in range(3):
        eager()
        jitted()
    # Steady state: the inline lane (PoCL's CPU) starts after a few thousand small launches
    # and builds its programs on a thread; a long training run works with it built.
    tg.default_device().wait_for_inline_builds()
    for _ in range(2):
        eager()
        jitted()
    with counting_launches() as count:
        eager()
    assert isinstance(jitted.step_fn, tg.Jitted)
    launches = [count[0], jitted.step_fn.last_launches]  # a replay bypasses Device.launch
    # host CPU time of this thread per step (Python, enqueues), PoCL's threads not counted
    c0 = time.thread_time()
    for _ in range(5):
        eager()
    host = (time.thread_time() - c0) / 5
    fns: list[Callable[[], object] | None] = [eager, jitted, *twins.values()]
    times = median_times(fns, warmup=3, repeat=15, budget_s=40)
    ms = [None if t is None else t * 1e3 for t in times]
    nodes = forward_nodes(model)
    t_eager, t_jit = ms[0], ms[1]
    ref_name, t_ref = (next(iter(twins)), ms[2]) if twins else ("torch", None)
    rows = [Row(f"{tag}. {model.name}: train step, eager", "ms", t_eager, t_ref,
                note=f"{launches[0]} launches/step; host {host * 1e3:.1f} ms/step "
                     f"({host / launches[0] * 1e6:.0f} us/launch; {nodes}-node forward tape); "
                     f"first step {first_eager * 1e3:.0f} ms"),
            Row(f"{tag}. same under tg.jit", "ms", t_jit, t_ref,
                note=f"{launches[1]} launches/step; first (tracing) call {first_jit * 1e3:.0f} "
                     f"ms; losses bitwise eager's over {check_steps} steps"
                     + ("" if ref_name == "torch" else f"; torch column: {ref_name}"))]
    for (name, _), t in zip(list(twins.items())[1:], ms[3:], strict=True):
        rows.append(Row(f"{tag}. same, eager, against {name}", "ms", t_eager, t))
    return rows


def bench_gpt() -> list[Row]:
    return bench_model(gpt_model(), "7")


def bench_resnet() -> list[Row]:
    return bench_model(resnet_model(), "8")


def bench_lstm() -> list[Row]:
    return bench_model(lstm_model(), "9")


def profile(steps: int = 20, top: int = 18) -> None:
    """cProfile of `steps` steady eager steps of each model, by own time."""
    for model in (gpt_model(), resnet_model(), lstm_model()):
        trainer = Trainer(model.loss_fn, model.params, model.batch, jit=False)
        prof = profiled(trainer, steps, warm_up=5)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print(f"=== {model.name}: {steps} steps\n{out.getvalue()}")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top + 12)
        print(out.getvalue())


def main() -> None:
    if "--profile" in sys.argv:
        profile()
        return
    from .__main__ import table

    print(f"device: {tg.default_device()}")
    for bench in (bench_gpt, bench_resnet, bench_lstm):
        for row in bench():
            print(table([row]).splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
