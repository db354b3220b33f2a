"""Initialisers: arrays drawn on the host from a seed (numpy's PCG64), uploaded once.

A 2-D weight is `(in, out)`, as `tg.linear` takes it, so fan_in is `shape[0]` (`_nn_init`).
"""

from .._nn_init import fans as fans
from .._nn_init import glorot_normal as glorot_normal
from .._nn_init import glorot_uniform as glorot_uniform
from .._nn_init import he_normal as he_normal
from .._nn_init import he_uniform as he_uniform
from .._nn_init import zeros as zeros

__all__ = ["fans", "glorot_normal", "glorot_uniform", "he_normal", "he_uniform", "zeros"]
