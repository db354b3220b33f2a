"""The installed distribution's version, read from its metadata (pyproject.toml is the one
place it is written)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tapegrad")
except PackageNotFoundError:  # the source tree imported without being installed
    __version__ = "0+unknown"
