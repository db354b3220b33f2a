"""Optimizers as pure functions over parameter pytrees, computed on the device.

    params, state = tg.optim.adam(params, grads, state, lr=1e-3)

Nothing is mutated: a step returns new parameters and a new state (`_optim` holds the kernels).
"""

from ._optim import adam as adam
from ._optim import sgd as sgd

__all__ = ["adam", "sgd"]
