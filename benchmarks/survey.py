"""Research models outside the benchmark, written as a user would: tapegrad against PyTorch.

    python -m benchmarks.survey [names] [rounds]   # names: comma-separated, default all
    python -m benchmarks.survey --fresh [names]    # each timed from its first steps

Each model's training step (forward, backward, Adam, as `benchmarks.models.Trainer`) is timed
eagerly and under `tg.jit` against the same step in PyTorch ops, in one process (medians of
alternating blocks, `median_times`), `rounds` times; then four steps eagerly and four jitted
from the same weights are compared bitwise (losses and parameters). The models are not tuned
for: they check that the benchmark's three do not speak for tapegrad alone.

`--fresh` times each model as an outside suite might time one it has just built: its three
trainers made, three warm-up steps each, then medians of 20 steps in alternating blocks, with
no wait for the inline lane's builds (what a step pays in its first hundred calls shows).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg
from benchmarks import models
from benchmarks._harness import median_times
from benchmarks.models import Batch, Model, _twin, torch

Arr = np.ndarray[Any, Any]
Params = dict[str, Arr]
Ids = dict[str, tg.Id]
Step = tuple[tg.Tape, tg.Id]


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _w(rng: np.random.Generator, *shape: int, std: float | None = None) -> Arr:
    fan_in = shape[0] if len(shape) == 2 else math.prod(shape[1:])
    scale = std if std is not None else 1 / math.sqrt(fan_in)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _zeros(*shape: int) -> Arr:
    return np.zeros(shape, np.float32)


def _ones(*shape: int) -> Arr:
    return np.ones(shape, np.float32)


def _model(name: str, loss: Callable[[tg.Tape, Ids, Ids], Step],
           torch_loss: Callable[[Any, Batch], Any], params: Params, batch: Batch) -> Model:
    return Model(name, loss, params, batch, lambda: {"torch": _twin(torch_loss, params, batch)})


def mlp_ln() -> Model:
    """An MLP with layer norm and GELU, classifying 256 features (batch 128)."""
    rng = _rng()
    p = {"w1": _w(rng, 256, 512), "b1": _zeros(512), "g": _ones(512), "b": _zeros(512),
         "w2": _w(rng, 512, 512), "b2": _zeros(512), "w3": _w(rng, 512, 10), "b3": _zeros(10)}
    batch = {"x": rng.standard_normal((128, 256)).astype(np.float32),
             "y": rng.integers(0, 10, 128)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.linear(t, b["x"], p["w1"], p["b1"])
        t, h = tg.layer_norm(t, h, p["g"], p["b"])
        t, h = tg.gelu(t, h)
        t, h = tg.linear(t, h, p["w2"], p["b2"])
        t, h = tg.relu(t, h)
        t, h = tg.linear(t, h, p["w3"], p["b3"])
        return tg.cross_entropy(t, h, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        F = torch.nn.functional
        h = F.gelu(F.layer_norm(b["x"] @ p["w1"] + p["b1"], (512,), p["g"], p["b"]))
        h = torch.relu(h @ p["w2"] + p["b2"])
        return F.cross_entropy(h @ p["w3"] + p["b3"], b["y"])

    return _model("mlp_ln", loss, torch_loss, p, batch)


def lenet() -> Model:
    """LeNet-style: two 5x5 convolutions with max pools, a dense head (batch 64 of 28x28)."""
    rng = _rng()
    p = {"c1": _w(rng, 8, 1, 5, 5), "c1b": _zeros(8), "c2": _w(rng, 16, 8, 5, 5),
         "c2b": _zeros(16), "w": _w(rng, 256, 10), "b": _zeros(10)}
    batch = {"x": rng.standard_normal((64, 1, 28, 28)).astype(np.float32),
             "y": rng.integers(0, 10, 64)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.conv2d(t, b["x"], p["c1"], p["c1b"])
        t, h = tg.relu(t, h)
        t, h = tg.max_pool2d(t, h, 2)
        t, h = tg.conv2d(t, h, p["c2"], p["c2b"])
        t, h = tg.relu(t, h)
        t, h = tg.max_pool2d(t, h, 2)
        t, h = tg.reshape(t, h, (64, 256))
        t, h = tg.linear(t, h, p["w"], p["b"])
        return tg.cross_entropy(t, h, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        F = torch.nn.functional
        h = F.max_pool2d(torch.relu(F.conv2d(b["x"], p["c1"], p["c1b"])), 2)
        h = F.max_pool2d(torch.relu(F.conv2d(h, p["c2"], p["c2b"])), 2)
        return F.cross_entropy(h.reshape(64, 256) @ p["w"] + p["b"], b["y"])

    return _model("lenet", loss, torch_loss, p, batch)


def gru() -> Model:
    """A GRU cell written in ops, unrolled 16 steps (batch 32, input 64, hidden 128)."""
    rng = _rng()
    B, I, H, T = 32, 64, 128, 16
    p = {"wx": _w(rng, I, 3 * H), "wh": _w(rng, H, 3 * H), "b": _zeros(3 * H),
         "wo": _w(rng, H, 10), "bo": _zeros(10)}
    batch = {"x": rng.standard_normal((T, B, I)).astype(np.float32),
             "y": rng.integers(0, 10, B)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, xs = tg.split(t, b["x"], T, axis=0)
        t, x = tg.reshape(t, xs[0], (B, I))
        t, gx = tg.linear(t, x, p["wx"], p["b"])
        t, (_, u, c) = tg.split(t, gx, 3, axis=-1)
        t, u = tg.sigmoid(t, u)
        t, c = tg.tanh(t, c)
        t, keep = tg.sub(t, 1.0, u)
        t, h = tg.mul(t, keep, c)
        for i in range(1, T):
            t, x = tg.reshape(t, xs[i], (B, I))
            t, gx = tg.linear(t, x, p["wx"], p["b"])
            t, gh = tg.matmul(t, h, p["wh"])
            t, (xr, xu, xc) = tg.split(t, gx, 3, axis=-1)
            t, (hr, hu, hc) = tg.split(t, gh, 3, axis=-1)
            t, r = tg.add(t, xr, hr)
            t, r = tg.sigmoid(t, r)
            t, u = tg.add(t, xu, hu)
            t, u = tg.sigmoid(t, u)
            t, c = tg.mul(t, r, hc)
            t, c = tg.add(t, xc, c)
            t, c = tg.tanh(t, c)
            t, d = tg.sub(t, h, c)
            t, d = tg.mul(t, u, d)
            t, h = tg.add(t, c, d)
        t, out = tg.linear(t, h, p["wo"], p["bo"])
        return tg.cross_entropy(t, out, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        _, u, c = (b["x"][0] @ p["wx"] + p["b"]).split(H, -1)
        u = torch.sigmoid(u)
        h = (1 - u) * torch.tanh(c)
        for i in range(1, T):
            xr, xu, xc = (b["x"][i] @ p["wx"] + p["b"]).split(H, -1)
            hr, hu, hc = (h @ p["wh"]).split(H, -1)
            r, u = torch.sigmoid(xr + hr), torch.sigmoid(xu + hu)
            c = torch.tanh(xc + r * hc)
            h = c + u * (h - c)
        return torch.nn.functional.cross_entropy(h @ p["wo"] + p["bo"], b["y"])

    return _model("gru", loss, torch_loss, p, batch)


def encoder() -> Model:
    """A post-norm transformer encoder, 2 layers (batch 8, 64 tokens, width 128, 4 heads),
    mean-pooled into a classifier."""
    rng = _rng()
    B, T, D, NH, L = 8, 64, 128, 4, 2
    hd = D // NH
    p = {"emb": _w(rng, 100, D, std=0.02), "cls": _w(rng, D, 5), "clsb": _zeros(5)}
    for i in range(L):
        p |= {f"{i}qkv": _w(rng, D, 3 * D), f"{i}qkvb": _zeros(3 * D), f"{i}o": _w(rng, D, D),
              f"{i}ob": _zeros(D), f"{i}g1": _ones(D), f"{i}b1": _zeros(D),
              f"{i}f1": _w(rng, D, 2 * D), f"{i}f1b": _zeros(2 * D),
              f"{i}f2": _w(rng, 2 * D, D), f"{i}f2b": _zeros(D), f"{i}g2": _ones(D),
              f"{i}b2": _zeros(D)}
    batch = {"x": rng.integers(0, 100, (B, T)), "y": rng.integers(0, 5, B)}

    def heads(t: tg.Tape, x: tg.Id) -> Step:
        t, x = tg.reshape(t, x, (B, T, NH, hd))
        return tg.transpose(t, x, (0, 2, 1, 3))

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.embedding(t, p["emb"], b["x"])
        for i in range(L):
            t, qkv = tg.linear(t, h, p[f"{i}qkv"], p[f"{i}qkvb"])
            t, (q, k, v) = tg.split(t, qkv, 3, axis=-1)
            t, q = heads(t, q)
            t, k = heads(t, k)
            t, v = heads(t, v)
            t, kt = tg.transpose(t, k, (0, 1, 3, 2))
            t, a = tg.matmul(t, q, kt)
            t, a = tg.mul(t, a, 1 / math.sqrt(hd))
            t, a = tg.softmax(t, a)
            t, y = tg.matmul(t, a, v)
            t, y = tg.transpose(t, y, (0, 2, 1, 3))
            t, y = tg.reshape(t, y, (B, T, D))
            t, y = tg.linear(t, y, p[f"{i}o"], p[f"{i}ob"])
            t, h = tg.add(t, h, y)
            t, h = tg.layer_norm(t, h, p[f"{i}g1"], p[f"{i}b1"])
            t, y = tg.linear(t, h, p[f"{i}f1"], p[f"{i}f1b"])
            t, y = tg.relu(t, y)
            t, y = tg.linear(t, y, p[f"{i}f2"], p[f"{i}f2b"])
            t, h = tg.add(t, h, y)
            t, h = tg.layer_norm(t, h, p[f"{i}g2"], p[f"{i}b2"])
        t, h = tg.mean(t, h, axis=1)
        t, out = tg.linear(t, h, p["cls"], p["clsb"])
        return tg.cross_entropy(t, out, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        F = torch.nn.functional
        h = F.embedding(b["x"], p["emb"])
        for i in range(L):
            q, k, v = (t.reshape(B, T, NH, hd).transpose(1, 2)
                       for t in (h @ p[f"{i}qkv"] + p[f"{i}qkvb"]).split(D, -1))
            a = ((q @ k.transpose(-2, -1)) * (1 / math.sqrt(hd))).softmax(-1)
            y = (a @ v).transpose(1, 2).reshape(B, T, D) @ p[f"{i}o"] + p[f"{i}ob"]
            h = F.layer_norm(h + y, (D,), p[f"{i}g1"], p[f"{i}b1"])
            y = torch.relu(h @ p[f"{i}f1"] + p[f"{i}f1b"]) @ p[f"{i}f2"] + p[f"{i}f2b"]
            h = F.layer_norm(h + y, (D,), p[f"{i}g2"], p[f"{i}b2"])
        return F.cross_entropy(h.mean(1) @ p["cls"] + p["clsb"], b["y"])

    return _model("encoder", loss, torch_loss, p, batch)


def autoencoder() -> Model:
    """A dense autoencoder 784-256-64-256-784 with a sigmoid output and MSE (batch 128)."""
    rng = _rng()
    p = {"e1": _w(rng, 784, 256), "e1b": _zeros(256), "e2": _w(rng, 256, 64),
         "e2b": _zeros(64), "d1": _w(rng, 64, 256), "d1b": _zeros(256),
         "d2": _w(rng, 256, 784), "d2b": _zeros(784)}
    batch = {"x": rng.random((128, 784)).astype(np.float32)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.linear(t, b["x"], p["e1"], p["e1b"])
        t, h = tg.relu(t, h)
        t, h = tg.linear(t, h, p["e2"], p["e2b"])
        t, h = tg.tanh(t, h)
        t, h = tg.linear(t, h, p["d1"], p["d1b"])
        t, h = tg.relu(t, h)
        t, h = tg.linear(t, h, p["d2"], p["d2b"])
        t, h = tg.sigmoid(t, h)
        return tg.mse(t, h, b["x"])

    def torch_loss(p: Any, b: Batch) -> Any:
        h = torch.tanh(torch.relu(b["x"] @ p["e1"] + p["e1b"]) @ p["e2"] + p["e2b"])
        h = torch.sigmoid(torch.relu(h @ p["d1"] + p["d1b"]) @ p["d2"] + p["d2b"])
        return torch.nn.functional.mse_loss(h, b["x"])

    return _model("autoencoder", loss, torch_loss, p, batch)


def cnn_wide() -> Model:
    """Three padded 3x3 convolutions (32, 32, 64 channels, no norm), an average pool and a
    global mean (batch 32 of 3x32x32)."""
    rng = _rng()
    p = {"c1": _w(rng, 32, 3, 3, 3), "c1b": _zeros(32), "c2": _w(rng, 32, 32, 3, 3),
         "c2b": _zeros(32), "c3": _w(rng, 64, 32, 3, 3), "c3b": _zeros(64),
         "w": _w(rng, 64, 10), "b": _zeros(10)}
    batch = {"x": rng.standard_normal((32, 3, 32, 32)).astype(np.float32),
             "y": rng.integers(0, 10, 32)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.conv2d(t, b["x"], p["c1"], p["c1b"], padding=1)
        t, h = tg.relu(t, h)
        t, h = tg.conv2d(t, h, p["c2"], p["c2b"], padding=1)
        t, h = tg.relu(t, h)
        t, h = tg.avg_pool2d(t, h, 2)
        t, h = tg.conv2d(t, h, p["c3"], p["c3b"], padding=1)
        t, h = tg.relu(t, h)
        t, h = tg.mean(t, h, axis=(2, 3))
        t, h = tg.linear(t, h, p["w"], p["b"])
        return tg.cross_entropy(t, h, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        F = torch.nn.functional
        h = torch.relu(F.conv2d(b["x"], p["c1"], p["c1b"], padding=1))
        h = F.avg_pool2d(torch.relu(F.conv2d(h, p["c2"], p["c2b"], padding=1)), 2)
        h = torch.relu(F.conv2d(h, p["c3"], p["c3b"], padding=1)).mean((2, 3))
        return F.cross_entropy(h @ p["w"] + p["b"], b["y"])

    return _model("cnn_wide", loss, torch_loss, p, batch)


def rnn() -> Model:
    """An Elman RNN over 30 steps (batch 32, input 16, hidden 64): the input projection made
    once and sliced per step (x[:, t]), an output per step, MSE against a target sequence."""
    rng = _rng()
    B, T, I, H = 32, 30, 16, 64
    p = {"wx": _w(rng, I, H), "wh": _w(rng, H, H), "b": _zeros(H), "wo": _w(rng, H, 1),
         "bo": _zeros(1)}
    batch = {"x": rng.standard_normal((B, T, I)).astype(np.float32),
             "y": rng.standard_normal((B, T, 1)).astype(np.float32)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.leaf(t, np.zeros((B, H), np.float32))
        t, xw = tg.matmul(t, b["x"], p["wx"])
        outs: list[tg.Id] = []
        for step in range(T):
            t, xs = tg.slice(t, xw, np.s_[:, step])
            t, hh = tg.matmul(t, h, p["wh"])
            t, a = tg.add(t, xs, hh)
            t, a = tg.add(t, a, p["b"])
            t, h = tg.tanh(t, a)
            outs.append(h)
        t, hs = tg.stack(t, outs, axis=1)
        t, out = tg.linear(t, hs, p["wo"], p["bo"])
        return tg.mse(t, out, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        h = torch.zeros(B, H)
        xw = b["x"] @ p["wx"]
        outs: list[Any] = []
        for step in range(T):
            h = torch.tanh(xw[:, step] + h @ p["wh"] + p["b"])
            outs.append(h)
        return torch.nn.functional.mse_loss(torch.stack(outs, 1) @ p["wo"] + p["bo"], b["y"])

    return _model("rnn", loss, torch_loss, p, batch)


def textcnn() -> Model:
    """A text CNN (Kim's): embeddings (batch 32 of 40 tokens, width 64), windows of 3, 4 and 5
    tokens as wide as the embedding (32 filters each), max over time, dropout, a classifier."""
    rng = _rng()
    B, L, V, E, K = 32, 40, 500, 64, 32
    widths = (3, 4, 5)
    p = {"emb": _w(rng, V, E, std=0.1), "out": _w(rng, K * len(widths), 4), "outb": _zeros(4)}
    for k in widths:
        p |= {f"c{k}": _w(rng, K, 1, k, E), f"c{k}b": _zeros(K)}
    batch = {"x": rng.integers(0, V, (B, L)), "y": rng.integers(0, 4, B)}

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, e = tg.embedding(t, p["emb"], b["x"])
        t, e = tg.reshape(t, e, (B, 1, L, E))
        features: list[tg.Id] = []
        for k in widths:
            t, c = tg.conv2d(t, e, p[f"c{k}"], p[f"c{k}b"])
            t, c = tg.relu(t, c)
            t, c = tg.max(t, c, axis=(2, 3))
            features.append(c)
        t, h = tg.concat(t, features, axis=1)
        t, h = tg.dropout(t, h, 0.5, 7)
        t, out = tg.linear(t, h, p["out"], p["outb"])
        return tg.cross_entropy(t, out, b["y"])

    def torch_loss(p: Any, b: Batch) -> Any:
        F = torch.nn.functional
        e = F.embedding(b["x"], p["emb"]).reshape(B, 1, L, E)
        h = torch.cat([torch.relu(F.conv2d(e, p[f"c{k}"], p[f"c{k}b"])).amax((2, 3))
                       for k in widths], 1)
        return F.cross_entropy(F.dropout(h, 0.5) @ p["out"] + p["outb"], b["y"])

    return _model("textcnn", loss, torch_loss, p, batch)


def conv_autoencoder() -> Model:
    """A convolutional autoencoder on 28x28 (batch 32): two convolutions with max pools, two
    nearest-neighbour upsamplings (reshape and broadcast) each before a convolution, the last
    to one channel, a sigmoid and MSE."""
    rng = _rng()
    p = {"e1": _w(rng, 16, 1, 3, 3), "e1b": _zeros(16), "e2": _w(rng, 32, 16, 3, 3),
         "e2b": _zeros(32), "d1": _w(rng, 16, 32, 3, 3), "d1b": _zeros(16),
         "d2": _w(rng, 1, 16, 3, 3), "d2b": _zeros(1)}
    batch = {"x": rng.random((32, 1, 28, 28)).astype(np.float32)}

    def up(t: tg.Tape, h: tg.Id) -> Step:
        n, c, rows, cols = h.shape
        t, h = tg.reshape(t, h, (n, c, rows, 1, cols, 1))
        t, h = tg.broadcast_to(t, h, (n, c, rows, 2, cols, 2))
        return tg.reshape(t, h, (n, c, rows * 2, cols * 2))

    def loss(t: tg.Tape, p: Ids, b: Ids) -> Step:
        t, h = tg.conv2d(t, b["x"], p["e1"], p["e1b"], padding=1)
        t, h = tg.relu(t, h)
        t, h = tg.max_pool2d(t, h, 2)
        t, h = tg.conv2d(t, h, p["e2"], p["e2b"], padding=1)
        t, h = tg.relu(t, h)
        t, h = tg.max_pool2d(t, h, 2)
        t, h = up(t, h)
        t, h = tg.conv2d(t, h, p["d1"], p["d1b"], padding=1)
        t, h = tg.relu(t, h)
        t, h = up(t, h)
        t, h = tg.conv2d(t, h, p["d2"], p["d2b"], padding=1)
        t, h = tg.sigmoid(t, h)
        return tg.mse(t, h, b["x"])

    def torch_loss(p: Any, b: Batch) -> Any:
        F = torch.nn.functional
        h = F.max_pool2d(torch.relu(F.conv2d(b["x"], p["e1"], p["e1b"], padding=1)), 2)
        h = F.max_pool2d(torch.relu(F.conv2d(h, p["e2"], p["e2b"], padding=1)), 2)
        h = torch.relu(F.conv2d(F.interpolate(h, scale_factor=2), p["d1"], p["d1b"], padding=1))
        h = torch.sigmoid(F.conv2d(F.interpolate(h, scale_factor=2), p["d2"], p["d2b"],
                                   padding=1))
        return F.mse_loss(h, b["x"])

    return _model("conv_autoencoder", loss, torch_loss, p, batch)


SURVEY: dict[str, Callable[[], Model]] = {
    f.__name__: f for f in (mlp_ln, lenet, gru, encoder, autoencoder, cnn_wide, rnn, textcnn,
                            conv_autoencoder)}


def bitwise(model: Model, steps: int = 4) -> bool:
    """Whether `steps` jitted steps give eager's losses and parameters, bit for bit."""
    runs: list[list[Arr]] = []
    for jit in (False, True):
        trainer = models.Trainer(model.loss_fn, model.params, model.batch, jit)
        values: list[Arr] = []
        for _ in range(steps):
            trainer()
            assert trainer.loss is not None
            values.append(trainer.loss.numpy())
        tg.tree_map(lambda t, into=values: into.append(t.numpy()), trainer.params)
        runs.append(values)
    return all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))


def _report(name: str, eager: float | None, jitted: float | None,
            reference: float | None) -> None:
    assert eager is not None and jitted is not None and reference is not None
    print(f"{name:16s} eager {eager * 1e3:6.2f} ms  jit {jitted * 1e3:6.2f} ms  "
          f"torch {reference * 1e3:6.2f} ms  eager/torch {eager / reference:.2f}  "
          f"jit/torch {jitted / reference:.2f}", flush=True)


def _steps(model: Model) -> list[Callable[[], object] | None]:
    """The model's eager and jitted trainers and its PyTorch twin, fresh."""
    return [models.Trainer(model.loss_fn, model.params, model.batch, False),
            models.Trainer(model.loss_fn, model.params, model.batch, True),
            next(iter(model.torch_twins().values()))]


def fresh(names: list[str]) -> None:
    """Each model timed from its first steps (see the module's doc)."""
    for name in names:
        _report(name, *median_times(_steps(SURVEY[name]()), warmup=3, repeat=20, block=5))


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--fresh"]
    names = args[0].split(",") if args else list(SURVEY)
    rounds = int(args[1]) if len(args) > 1 else 2
    if torch is None:
        raise SystemExit("the survey compares with PyTorch: `make torch` installs it")
    torch.set_num_threads(2)
    if "--fresh" in sys.argv:
        fresh(names)
        return
    chosen = {name: SURVEY[name]() for name in names}
    for name, model in chosen.items():
        print(f"{name}: jit {'bitwise' if bitwise(model) else 'DIFFERS from'} eager")
    trainers: dict[str, list[Callable[[], object] | None]] = {}
    for name, model in chosen.items():
        steps = _steps(model)
        for _ in range(5):
            for step in steps:
                assert step is not None
                step()
        trainers[name] = steps
    tg.default_device().wait_for_inline_builds()
    for _ in range(rounds):
        for name, steps in trainers.items():
            _report(name, *median_times(steps, warmup=2, repeat=15, budget_s=20))


if __name__ == "__main__":
    main()
