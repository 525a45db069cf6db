"""``IdTable``: a set of schedule ids numbered in the order first added, against a dict
(pure, no broker)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hopsched.core.id_table import IdTable

#: Any text, lone surrogates too (an id read from JSON may hold them), and few distinct
#: ids, so that most are added more than once.
ids = st.text(st.characters(exclude_categories=()), max_size=12)


@given(st.lists(ids | st.sampled_from(["a", "b", "c", ""]), max_size=200))
def test_ids_are_numbered_in_the_order_first_added_as_a_dict_would(added: list[str]) -> None:
    table, rows = IdTable(), dict[str, int]()
    for schedule_id in added:
        new = schedule_id not in rows
        assert table.add(schedule_id) == (rows.setdefault(schedule_id, len(rows)), new)

    assert len(table) == len(rows)
    for schedule_id, row in rows.items():
        assert table.find(schedule_id) == row
        assert table.id_at(row) == schedule_id


@given(st.sets(ids, max_size=50), st.sets(ids, max_size=50))
def test_an_id_never_added_is_not_found(added: set[str], others: set[str]) -> None:
    table = IdTable()
    for schedule_id in added:
        table.add(schedule_id)

    for schedule_id in others - added:
        assert table.find(schedule_id) == -1


def test_many_ids_grow_the_table_and_keep_their_rows() -> None:
    table = IdTable()
    for n in range(20_000):
        assert table.add(f"order-{n}") == (n, True)

    assert table.add("order-12345") == (12345, False)
    assert [table.find(f"order-{n}") for n in (0, 9_999, 19_999)] == [0, 9_999, 19_999]
    assert table.id_at(19_999) == "order-19999"
