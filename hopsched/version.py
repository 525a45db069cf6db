"""The installed hopsched's version (``hopsched.__version__``), read from the package's
metadata (``importlib.metadata``): pyproject.toml's ``version``, one place."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("hopsched")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
