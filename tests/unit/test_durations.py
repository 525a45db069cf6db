"""``parse_duration``: the ``--in`` and ``--max-delay`` values of the command line."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.cli.durations import describe_duration, parse_duration


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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("1m30s", timedelta(seconds=90), id="issue-24"),
        pytest.param("1h 30m", timedelta(minutes=90), id="blank-between"),
        pytest.param("2d12h", timedelta(hours=60), id="days-hours"),
        pytest.param("1s500ms", timedelta(milliseconds=1500), id="seconds-ms"),
        pytest.param("-1m30s", timedelta(seconds=-90), id="negative-whole"),
    ],
)
def test_a_compound_duration_adds_up_its_terms(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("30s1m", "from the largest unit down"),
        ("1m1m", "each unit once"),
        ("1m-30s", "not a duration"),
        ("1m 30", "not a duration"),
        ("- 5s", "not a duration"),
    ],
)
def test_a_compound_duration_out_of_order_is_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_duration(text)


@given(
    st.lists(st.integers(0, 10_000), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_any_compound_duration_is_the_sum_of_its_terms(
    numbers: list[int], present: list[bool]
) -> None:
    units = ["d", "h", "m", "s", "ms", "us"]
    sizes = [timedelta(days=1), timedelta(hours=1), timedelta(minutes=1)]
    sizes += [timedelta(seconds=1), timedelta(milliseconds=1), timedelta(microseconds=1)]
    rows = zip(numbers, units, sizes, present, strict=True)
    terms = [(n, u, size) for n, u, size, p in rows if p]
    if not terms:
        return
    text = "".join(f"{n}{u}" for n, u, _ in terms)
    assert parse_duration(text) == sum((n * size for n, _, size in terms), timedelta(0))


@pytest.mark.parametrize(
    ("span", "expected"),
    [
        (timedelta(0), "0s"),
        (timedelta(milliseconds=400), "0s"),
        (timedelta(seconds=302), "5m2s"),
        (timedelta(hours=2, seconds=5), "2h"),
        (timedelta(days=1), "1d"),
        (timedelta(days=2530, hours=17, minutes=14, seconds=4), "2530d17h (6.9 years)"),
        (-timedelta(seconds=90), "1m30s"),
    ],
)
def test_describe_duration(span: timedelta, expected: str) -> None:
    assert describe_duration(span) == expected


@given(st.integers(min_value=0, max_value=10**10))
def test_a_described_duration_reads_back_to_within_its_second_unit(seconds: int) -> None:
    """What ``describe_duration`` writes, ``parse_duration`` reads: the span cut down to
    its two largest units (under a day of error from a day on, an hour from an hour)."""
    span = timedelta(seconds=seconds)
    read = parse_duration(describe_duration(span).split(" ")[0])
    second_unit = next(
        unit
        for floor, unit in (
            (timedelta(days=1), timedelta(hours=1)),
            (timedelta(hours=1), timedelta(minutes=1)),
            (timedelta(0), timedelta(seconds=1)),
        )
        if span >= floor
    )
    assert read <= span < read + second_unit
