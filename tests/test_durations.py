"""``parse_duration``: the ``--in`` and ``--max-delay`` values of the command line."""

from __future__ import annotations

from datetime import timedelta

import pytest

from hopsched.durations import parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("90s", timedelta(seconds=90), id="seconds"),
        pytest.param("250ms", timedelta(milliseconds=250), id="ms"),
        pytest.param("1.5d", timedelta(days=1.5), id="fraction"),
        pytest.param(" 2h ", timedelta(hours=2), id="blanks"),
        pytest.param("0.0000001s", timedelta(microseconds=1), id="rounds-up"),
        pytest.param("-5s", timedelta(seconds=-5), id="negative"),
        pytest.param("0", timedelta(0), id="bare-zero"),
        pytest.param("-0", timedelta(0), id="minus-zero"),
        pytest.param("0.0", timedelta(0), id="zero-point-zero"),
        pytest.param("0s", timedelta(0), id="zero-seconds"),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["5", "-5", "0.5", "abc", "", "5 parsecs", "s"])
def test_a_number_other_than_zero_needs_a_unit(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)
