"""Look-up requests and answers (``hopsched.journal.lookups``): what a relay encodes
reads back as the same ids and infos; anything else is refused, never misread."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.journal.lookups import (
    MAX_IDS,
    decode_answer,
    decode_request,
    encode_answer,
    encode_request,
)
from hopsched.journal.records import STATES, ScheduleInfo

ids = st.text(alphabet="0123456789abcdef-", min_size=1, max_size=40)
maybe_us = st.none() | st.integers(min_value=0, max_value=2**62)
text = st.none() | st.text(max_size=30)
infos = st.builds(
    ScheduleInfo,
    schedule_id=ids,
    state=st.sampled_from(sorted(STATES)),
    due_us=st.integers(min_value=0, max_value=2**62),
    created_us=st.integers(min_value=0, max_value=2**62),
    exchange=st.text(max_size=20),
    routing_key=st.text(max_size=20),
    size=st.none() | st.integers(min_value=0, max_value=2**31),
    owner=text,
    origin=text,
    delivered_us=maybe_us,
    parked_us=maybe_us,
    cancelled_us=maybe_us,
    parked_reason=text,
    occurrence=st.integers(min_value=0, max_value=2**31),
    user=text,
)


@given(st.lists(ids, max_size=50))
def test_a_request_reads_back_as_its_ids(asked: list[str]) -> None:
    assert decode_request(encode_request(asked)) == asked


@given(st.lists(st.none() | infos, max_size=20))
def test_an_answer_reads_back_as_the_same_infos_in_the_request_s_order(
    answers: list[ScheduleInfo | None],
) -> None:
    asked = [f"{n}-{'' if a is None else a.schedule_id}" for n, a in enumerate(answers)]
    answers = [None if a is None else _renamed(a, i) for a, i in zip(answers, asked, strict=True)]

    read = decode_answer(encode_answer(answers), asked)

    assert read == dict(zip(asked, answers, strict=True))


@given(st.text(max_size=40))
def test_an_unavailable_answer_reads_as_its_reason(why: str) -> None:
    assert decode_answer(encode_answer(None, why), ["a"]) == why


def test_an_answer_for_other_ids_or_another_count_is_refused() -> None:
    info = ScheduleInfo("a", "pending", 1, 1, "", "q")
    with pytest.raises(ValueError, match="'a' where 'b' was asked"):
        decode_answer(encode_answer([info]), ["b"])
    with pytest.raises(ValueError, match="1 rows to a request of 2 ids"):
        decode_answer(encode_answer([info]), ["a", "b"])


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"ids": "abc"}', "list of strings"),
        (b'{"ids": [1, 2]}', "list of strings"),
        (json.dumps({"ids": ["a"] * (MAX_IDS + 1)}).encode(), f"at most {MAX_IDS}"),
    ],
)
def test_a_request_that_is_not_one_is_refused(body: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_request(body)


@pytest.mark.parametrize("body", [b"\xff not json", b"{}", b"[1]", b"null", b'{"ids": null}'])
def test_a_request_that_is_not_json_or_has_no_ids_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - JSON's own message, or ours
        decode_request(body)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"[]", "no JSON object"),
        (b'{"infos": 3}', "no rows to a request of 1 ids"),
        (b'{"infos": [7]}', "row for 'a' is no JSON object"),
        (b'{"infos": [{"schedule_id": "a"}]}', "row for 'a'"),
    ],
)
def test_an_answer_that_is_not_one_is_refused(body: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_answer(body, ["a"])


def _renamed(info: ScheduleInfo, schedule_id: str) -> ScheduleInfo:
    return dataclasses.replace(info, schedule_id=schedule_id)
