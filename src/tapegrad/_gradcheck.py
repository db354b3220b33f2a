"""Finite-difference checks of analytic VJPs, in float64.

The scalar checked is sum(f(x) * r) for a fixed random cotangent r, so every output element
counts and one backward gives the analytic gradient of every input element.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._device import Device, get_device
from ._errors import DTypeError, GradcheckError, ShapeError, at_site, number
from ._sweep import backward
from ._tape import Id, Tape, leaf, value
from ._tensor import AnyTensor, host_array
from ._transforms import _id_out, call, flatten, function  # pyright: ignore[reportPrivateUsage]

TapeFn = Callable[..., tuple[Tape, Id]]


def _run(f: TapeFn, arrays: Sequence[np.ndarray[Any, Any]], grad_mask: Sequence[bool],
         trees: Sequence[tuple[int, Callable[[list[Any]], Any]]], device: Device | str | None
         ) -> tuple[Tape, Id, list[Id]]:
    """f over leaves made of `arrays`, rebuilt into f's arguments by `trees` (each argument's
    leaf count and rebuild, see `_transforms.flatten`)."""
    tape = Tape(get_device(device, "gradcheck"))
    ids: list[Id] = []
    for array, wants in zip(arrays, grad_mask, strict=True):
        tape, i = leaf(tape, array, requires_grad=wants)
        ids.append(i)
    args: list[Any] = []
    start = 0
    for count, rebuild in trees:
        args.append(rebuild(ids[start:start + count]))
        start += count
    tape, out = call(f, "gradcheck", tape, *args)
    out = _id_out(out, "gradcheck")
    return tape, out, ids


def gradcheck(
    f: TapeFn, *args: Any, eps: float = 1e-6, atol: float = 1e-6, rtol: float = 1e-5,
    seed: int = 0, device: Device | str | None = None,
) -> bool:
    """Compare `f`'s analytic gradients with central differences; True or `GradcheckError`.

    `f(tape, *ids) -> (tape, id)`. Float arguments are taken in float64 and checked; integer
    and bool arguments are passed as constants. An argument may be a pytree (dict, list,
    tuple) of arrays, as for `tg.grad`: f gets the same tree of ids.
    """
    function(f, "gradcheck")
    for name, given in (("eps", eps), ("atol", atol), ("rtol", rtol)):
        v = number("gradcheck", name, given)
        if not (v > 0 if name == "eps" else v >= 0) or v == float("inf"):
            raise ShapeError(at_site(
                f"gradcheck: {name} must be a finite number {'> 0' if name == 'eps' else '>= 0'}"
                f", got {v!r}"))
    if seed is not None and (  # pyright: ignore[reportUnnecessaryComparison]
            isinstance(seed, bool) or not isinstance(seed, int | np.integer)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(f"gradcheck: seed must be an int >= 0 or None, got {seed!r}"))
    if seed is not None and seed < 0:  # pyright: ignore[reportUnnecessaryComparison]
        raise ShapeError(at_site(f"gradcheck: seed must be an int >= 0, got {seed!r}"))
    trees: list[tuple[int, Callable[[list[Any]], Any]]] = []
    names: list[str] = []
    leaves: list[Any] = []
    for k, arg in enumerate(args):
        parts, rebuild = flatten(arg)
        trees.append((len(parts), rebuild))
        leaves += parts
        names += [f"argument {k}" + ("" if len(parts) == 1 and parts[0] is arg else f" leaf {n}")
                  for n in range(len(parts))]
    arrays = [host_array(a, "gradcheck", name) for a, name in zip(leaves, names, strict=True)]
    arrays = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays]
    mask = [a.dtype.kind == "f" for a in arrays]
    tape, out, ids = _run(f, arrays, mask, trees, device)
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(out.shape)
    wrt = [i for i, m in zip(ids, mask, strict=True) if m]
    grads: Mapping[Id, AnyTensor] = (
        backward(tape, out, wrt=wrt, seed=r.astype(out.dtype)) if wrt else {})
    worst: tuple[float, str] = (0.0, "")
    for k, (array, wants) in enumerate(zip(arrays, mask, strict=True)):
        if not wants:
            continue
        analytic: np.ndarray[Any, Any] = grads[ids[k]].numpy()
        numeric: np.ndarray[Any, Any] = np.zeros_like(array)
        flat: np.ndarray[Any, Any] = numeric.reshape(-1)
        for j in range(array.size):
            total: list[float] = []
            for sign in (1.0, -1.0):
                moved = [a.copy() for a in arrays]
                moved[k].reshape(-1)[j] += sign * eps
                t2, o2, _ = _run(f, moved, [False] * len(moved), trees, device)
                total.append(float(np.sum(value(t2, o2).numpy() * r)))
            flat[j] = (total[0] - total[1]) / (2 * eps)
        err = np.abs(analytic - numeric)
        bound = atol + rtol * np.abs(numeric)
        ratio = np.where(np.isnan(err), np.inf, err / bound)
        if ratio.size and float(ratio.max()) > 1.0:
            j = int(np.argmax(ratio))
            idx = np.unravel_index(j, array.shape)
            score = float(ratio.reshape(-1)[j])
            if score > worst[0]:
                worst = (score, (
                    f"{names[k]}, element {tuple(int(i) for i in idx)}: analytic "
                    f"{analytic.reshape(-1)[j]:.8g} vs finite difference "
                    f"{numeric.reshape(-1)[j]:.8g} "
                    f"(|diff| {err.reshape(-1)[j]:.3g} > atol {atol} + rtol {rtol} * |fd|)"))
    if worst[0] > 0:
        raise GradcheckError(at_site(f"gradcheck failed; worst: {worst[1]}"))
    return True
