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
    assert namespace["Cancelled"] is importlib.import_module("hopsched.client.scheduler").Cancelled


def test_internals_stay_off_the_top_level() -> None:
    """What only hopsched's own modules use lives in them (``hopsched.core.ladder.Hop``,
    ``hopsched.urls.mask_url``), not in the names a user imports."""
    for name in ("Hold", "Hop", "Envelope", "mask_url"):
        assert name not in hopsched.__all__
        assert not hasattr(hopsched, name)
