"""Finite-difference checks of analytic VJPs, in float64.

The scalar checked is sum(f(x) * r) for a fixed random cotangent r, so every output element
counts and one backward gives the analytic gradient of every input element.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from optree import PyTreeSpec

from ._device import Device, get_device
from ._errors import DTypeError, GradcheckError, ShapeError, at_site, number, shown
from ._sweep import backward
from ._tape import Id, Tape, leaf, value
from ._tensor import AnyTensor, host_array
from ._transforms import TapeFn, _id_out, call, function  # pyright: ignore[reportPrivateUsage]
from ._tree import flatten, leaf_paths


def _run(f: TapeFn, arrays: Sequence[np.ndarray[Any, Any]], grad_mask: Sequence[bool],
         trees: Sequence[PyTreeSpec], device: Device | str | None
         ) -> tuple[Tape, Id, list[Id]]:
    """f over leaves made of `arrays`, rebuilt into f's arguments by `trees` (each argument's
    structure; its leaves are the next `num_leaves` of `arrays`)."""
    tape = Tape(get_device(device, "gradcheck"))
    ids: list[Id] = []
    for array, wants in zip(arrays, grad_mask, strict=True):
        tape, i = leaf(tape, array, requires_grad=wants)
        ids.append(i)
    args: list[Any] = []
    start = 0
    for spec in trees:
        args.append(spec.unflatten(ids[start:start + spec.num_leaves]))
        start += spec.num_leaves
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
    tuple, dataclass...) of arrays, as for `tg.grad`: f gets the same tree of ids.

    A float32 (or float16) argument warns (a UserWarning at the caller's line): finite
    differences in float32 are unreliable, so it is checked as a float64 copy, and the float32
    computation the caller runs is not the one checked.
    """
    function(f, "gradcheck")
    for name, given in (("eps", eps), ("atol", atol), ("rtol", rtol)):
        v = number("gradcheck", name, given)
        if not (v > 0 if name == "eps" else v >= 0) or v == float("inf"):
            raise ShapeError(at_site(
                f"gradcheck: {name} must be a finite number {'> 0' if name == 'eps' else '>= 0'}"
                f", got {shown(v)}"))
    if seed is not None and (  # pyright: ignore[reportUnnecessaryComparison]
            isinstance(seed, bool) or not isinstance(seed, int | np.integer)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(f"gradcheck: seed must be an int >= 0 or None, got {shown(seed)}"))
    if seed is not None and seed < 0:  # pyright: ignore[reportUnnecessaryComparison]
        raise ShapeError(at_site(f"gradcheck: seed must be an int >= 0, got {shown(seed)}"))
    trees: list[PyTreeSpec] = []
    names: list[str] = []
    leaves: list[Any] = []
    for k, arg in enumerate(args):
        parts, spec = flatten(arg)
        trees.append(spec)
        leaves += parts
        names += [f"argument {k}{path}" for path in leaf_paths(spec)]
    arrays = [host_array(a.numpy() if isinstance(a, AnyTensor) else a, "gradcheck", name)
              for a, name in zip(leaves, names, strict=True)]
    for array, name in zip(arrays, names, strict=True):
        if array.dtype.kind == "f" and array.dtype.itemsize < 8:
            warnings.warn(
                f"gradcheck: {name} is {array.dtype}: finite differences in {array.dtype} are "
                "unreliable, so it is checked as a float64 copy, which is not the computation "
                "f runs on it; pass float64 arrays (.astype(np.float64))", UserWarning,
                stacklevel=2)
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
