"""FastStream (a Python framework whose RabbitMQ users declare an x-delayed-message
exchange) publishing through hopsched's ingress as docs/migrating-from-the-delayed-
message-plugin.md says: the exchange not declared by the app, the x-delay header kept."""

from __future__ import annotations

import json
import time

from support import Cleanup, Targets, missing

import hopsched
from hopsched.broker.ingress import bind_to_due_exchange, declare_ingress
from hopsched.core.ingress import DELAY_HEADER, Ingress

try:
    from faststream import rabbit
except ImportError:  # pragma: no cover - the dev extra installs it
    rabbit = None


async def test_a_faststream_publisher_reaches_the_consumer_when_due(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets, cleanup: Cleanup
) -> None:
    if rabbit is None:
        missing("FastStream is not installed (pip install -e '.[dev]')")
    exchange = f"{settings.prefix}-orders"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    await declare_ingress(settings, Ingress(exchange, "direct"))
    target = await targets.queue()
    await bind_to_due_exchange(settings, exchange, target.name, "created")

    broker = rabbit.RabbitBroker(settings.url, logger=None)
    async with broker:
        published = time.time()
        await broker.publish(
            {"order": 42},
            exchange=rabbit.RabbitExchange(exchange, declare=False),  # hopsched's, as is
            routing_key="created",
            headers={DELAY_HEADER: 700},
            message_id="faststream-order-42",
        )
    [message] = await target.wait_for(1, within=15)

    assert message.received_us / 1e6 >= published + 0.7 - 0.001
    assert json.loads(message.body) == {"order": 42}
    assert message.schedule_id == "faststream-order-42"
    assert message.headers[DELAY_HEADER] == -700
    assert message.properties.content_type == "application/json"
