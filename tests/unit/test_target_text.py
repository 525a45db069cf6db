"""``hopsched pending``'s target column: as ``--allow-target`` spells a target
(``orders/timeout.eu``, ``/reminders``), quoted when a name would make that ambiguous;
either way it reads back as the one target it came from."""

from __future__ import annotations

import ast

from hypothesis import given
from hypothesis import strategies as st

from hopsched.cli.schedule import target_text

names = st.text(max_size=12) | st.sampled_from(
    ["", "orders", "a/b", "a b", "it's", '"x', "amq.topic", "caf\u00e9"]
)


def read_back(text: str) -> tuple[str, str]:
    """The (exchange, routing key) a target text names: the only reading of it."""
    readings = set()
    if not text.startswith(("'", '"')):
        exchange, _, routing_key = text.partition("/")
        readings.add((exchange, routing_key))
    for at, char in enumerate(text):
        if char != "/":
            continue
        try:
            left, right = ast.literal_eval(text[:at]), ast.literal_eval(text[at + 1 :])
        except (ValueError, SyntaxError):
            continue
        if isinstance(left, str) and isinstance(right, str) and text[:at] == repr(left):
            readings.add((left, right))
    assert len(readings) == 1, (text, readings)
    return readings.pop()


@given(names, names)
def test_a_target_reads_back_as_itself(exchange: str, routing_key: str) -> None:
    assert read_back(target_text(exchange, routing_key)) == (exchange, routing_key)


def test_plain_targets_are_spelled_as_allow_target_spells_them() -> None:
    assert target_text("orders", "timeout.eu") == "orders/timeout.eu"
    assert target_text("", "reminders") == "/reminders"
    assert target_text("", "") == "''/''"
    assert target_text("a/b", "c") == "'a/b'/'c'"
    assert target_text('"x', "y") == "'\"x'/'y'"
