"""The public surface: every name in ``hopsched.__all__`` exists, so that
``from hopsched import *`` works (``Cancelled`` was listed and never imported)."""

from __future__ import annotations

import importlib

import hopsched


def test_every_name_in_all_exists() -> None:
    missing = [name for name in hopsched.__all__ if not hasattr(hopsched, name)]
    assert missing == []


def test_star_import_works() -> None:
    namespace: dict[str, object] = {}
    exec("from hopsched import *", namespace)
    assert set(hopsched.__all__) <= set(namespace)
    assert namespace["Cancelled"] is importlib.import_module("hopsched.scheduler").Cancelled
