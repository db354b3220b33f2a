"""JAX-style lambdas over a tape: their parameters get types (the Tape, then Any) under pyright
strict, so a user need not write a def with annotations for a one-line function."""

from __future__ import annotations

import numpy as np

import tapegrad as tg


def main() -> float:
    x = np.array([0.5, 1.5, 2.0])
    assert tg.gradcheck(lambda t, i: tg.sum(*tg.exp(t, i)), x)
    assert tg.gradcheck(lambda t, a, b: tg.sum(*tg.mul(t, a, b)), x, x + 1.0)
    assert tg.gradcheck(lambda t, p: tg.sum(*tg.mul(t, p["w"], p["w"])), {"w": x})
    jac = tg.jacobian(lambda t, i: tg.mul(t, i, 3.0), x)
    hess = tg.hessian(lambda t, i: tg.sum(*tg.pow(t, i, 3.0)), x)
    hv = tg.hvp(lambda t, i: tg.sum(*tg.pow(t, i, 3.0)), x, np.ones(3))
    g = tg.grad(lambda t, i: tg.sum(*tg.tanh(t, i)))(x)
    out, back = tg.vjp(lambda t, i: tg.exp(t, i), x)
    (gx,) = back(np.ones(3))
    np.testing.assert_allclose(jac.numpy(), 3.0 * np.eye(3))
    np.testing.assert_allclose(hess.numpy(), np.diag(6.0 * x))
    np.testing.assert_allclose(hv.numpy(), 6.0 * x)
    np.testing.assert_allclose(g.numpy(), 1.0 - np.tanh(x) ** 2)
    np.testing.assert_allclose(gx.numpy(), out.numpy())
    return float(out.numpy().sum())


if __name__ == "__main__":
    print(main())
