"""Which brokers take a consumer without credit (``hopsched.broker.idle_consumers``): pure,
no broker. That it keeps a quorum queue in use and takes nothing is in
broker/test_policy_watch.py, against the test broker."""

from __future__ import annotations

import pytest

from hopsched.broker.idle_consumers import takes_credit


@pytest.mark.parametrize(
    ("properties", "expected"),
    [
        ({"product": b"RabbitMQ", "version": b"3.10.8"}, True),
        ({"product": "RabbitMQ", "version": "3.13.7"}, True),
        ({"product": b"RabbitMQ", "version": b"4.0.5"}, False),
        ({"product": b"RabbitMQ", "version": b"4.3.0"}, False),
        ({"product": b"LavinMQ", "version": b"2.0.0"}, False),  # not RabbitMQ's argument
        ({"product": b"RabbitMQ"}, False),
        ({}, False),
    ],
)
def test_only_rabbitmq_before_4_takes_credit(properties: dict[str, object], expected: bool) -> None:
    assert takes_credit(properties) is expected
