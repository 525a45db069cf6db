"""The end-of-run check for what the tests leave on the broker (F38), on the real broker."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest
from leftovers import Thing, advice, remove, snapshot
from support import rabbitmqctl, require_rabbitmqctl


async def test_F38_the_leftover_check_finds_and_removes_what_a_test_left(
    broker_url: str,
) -> None:
    command = require_rabbitmqctl()
    tag = f"t{uuid.uuid4().hex[:10]}"
    before = await asyncio.to_thread(snapshot, command)
    connection = await aio_pika.connect(broker_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(f"{tag}.step.16", durable=True)
        await channel.declare_exchange(f"{tag}.expired", durable=True)
    finally:
        await connection.close()
    left_behind = {
        Thing("queue", f"{tag}.step.16", "/"),
        Thing("exchange", f"{tag}.expired", "/"),
        Thing("user", f"{tag}-user"),
        Thing("vhost", f"{tag} vhost é"),
        Thing("policy", f"{tag}-policy", "/"),
    }
    try:
        for args in (
            ("add_user", f"{tag}-user", "pw"),
            ("add_vhost", f"{tag} vhost é"),
            ("set_policy", "-p", "/", f"{tag}-policy", f"^{tag}", '{"max-length": 5}'),
        ):
            await rabbitmqctl(*args)

        found = await asyncio.to_thread(snapshot, command) - before
        assert left_behind <= found, found
        assert f"  (hopsched teardown --force --prefix {tag})" in advice(found)
    finally:
        problems = await asyncio.to_thread(remove, command, left_behind)

    assert not problems
    assert not left_behind & await asyncio.to_thread(snapshot, command)


def test_advice_names_a_vhost_once_and_not_what_is_in_it() -> None:
    lines = advice(
        [Thing("vhost", "v"), Thing("exchange", "amq.direct", "v"), Thing("queue", "p.relay", "/")]
    )
    assert lines == [
        "  queue 'p.relay' in vhost '/'",
        "  vhost 'v'",
        "  (hopsched teardown --force --prefix p)",
    ]


@pytest.mark.parametrize(
    ("thing", "text"),
    [
        (Thing("user", "u"), "user 'u'"),
        (Thing("policy", "p", "/"), "policy 'p' in vhost '/'"),
    ],
)
def test_a_thing_says_what_and_where(thing: Thing, text: str) -> None:
    assert str(thing) == text
