"""Helpers for building networks: `tg.nn.init` initialisers."""

from . import init as init

__all__ = ["init"]
