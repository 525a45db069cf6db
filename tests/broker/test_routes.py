"""``schedule(check_target=True)`` (issue 24, item 4): the target is checked before
anything is scheduled, publishing nothing to it.

The routing on paper (``routes.reached``) is pure and tested from tables and a
hypothesis property; then it is compared with what RabbitMQ itself does with real
publishes, on a private node with the management API.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from support import Targets, hopsched_cli, unique
from support.private_nodes import require_rabbitmq

import hopsched
from hopsched.client.routes import (
    Binding,
    CannotTell,
    ExchangeView,
    exchange_views,
    headers_match,
    reached,
    topic_matches,
)
from hopsched.testing.localbroker import PrivateBroker, free_port, private_cluster

# --- pure ---------------------------------------------------------------------------------


def topic_reference(pattern: str, key: str) -> bool:
    """RabbitMQ's topic rule as a regex over the words (a reference for the DP)."""
    words = key.split(".") if key else []
    parts = pattern.split(".") if pattern else []
    regex = "".join(
        "(?:[^.]*\\.)*" if part == "#" else "[^.]*\\." if part == "*" else re.escape(part) + "\\."
        for part in parts
    )
    return re.fullmatch(regex, "".join(word + "." for word in words)) is not None


WORD = st.sampled_from(["a", "b", "", "ab"])


@given(
    st.lists(st.sampled_from(["a", "b", "*", "#", ""]), max_size=5).map(".".join),
    st.lists(WORD, max_size=5).map(".".join),
)
def test_topic_matching_follows_the_words_rule(pattern: str, key: str) -> None:
    assert topic_matches(pattern, key) == topic_reference(pattern, key)


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("#", "", True),
        ("*", "", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.#", "a", True),
        ("#.b", "a.x.b", True),
        ("a.*.c", "a.b.b.c", False),
        ("order.#.timeout", "order.timeout", True),
    ],
)
def test_topic_matching_table(pattern: str, key: str, matches: bool) -> None:
    assert topic_matches(pattern, key) is matches


@pytest.mark.parametrize(
    ("arguments", "headers", "matches"),
    [
        ({"k": "v"}, {"k": "v"}, True),  # x-match all by default
        ({"k": "v", "n": 1}, {"k": "v"}, False),
        ({"x-match": "any", "k": "v", "n": 1}, {"k": "v"}, True),
        ({"x-match": "any"}, {"k": "v"}, False),  # any of none
        ({"x-match": "all"}, {}, True),  # all of none
        ({"k": None}, {"k": 5}, True),  # no value: presence
        ({"n": 1}, {"n": 1.0}, True),  # numbers with numbers
        ({"n": 1}, {"n": "1"}, False),
        ({"b": True}, {"b": 1}, False),
        ({"x-k": "v"}, {}, True),  # x- keys are not matched...
        ({"x-match": "all-with-x", "x-k": "v"}, {}, False),  # ...but with -with-x
        ({"x-match": "any-with-x", "x-k": "v"}, {"x-k": "v"}, True),
    ],
)
def test_headers_matching_table(
    arguments: dict[str, Any], headers: dict[str, Any], matches: bool
) -> None:
    assert headers_match(arguments, headers) is matches


def test_reached_follows_exchange_bindings_and_alternates_once_each() -> None:
    views = {
        "orders": ExchangeView(
            "orders",
            "topic",
            alternate="unrouted",
            bindings=(
                Binding("audit", True, "audit.#", {}),
                Binding("q.timeouts", False, "order.*.timeout", {}),
            ),
        ),
        "audit": ExchangeView("audit", "fanout", bindings=(Binding("orders", True, "", {}),)),
        "unrouted": ExchangeView(
            "unrouted", "fanout", bindings=(Binding("q.dead", False, "", {}),)
        ),
    }

    assert reached(views, "orders", "order.42.timeout") == {"q.timeouts"}
    assert reached(views, "orders", "audit.x") == set()  # audit matched (a cycle): no alternate
    assert reached(views, "orders", "other") == {"q.dead"}  # nothing matched: the alternate
    with pytest.raises(CannotTell, match="'nowhere'"):
        reached(views, "nowhere", "k")
    views["odd"] = ExchangeView("odd", "x-consistent-hash")
    with pytest.raises(CannotTell, match="x-consistent-hash"):
        reached(views, "odd", "k")


# --- against RabbitMQ ---------------------------------------------------------------------


@pytest.mark.parametrize("queue_exists", [True, False])
async def test_check_target_on_the_default_exchange_delivers_nothing(
    scheduler: hopsched.Scheduler, relay: hopsched.Relay, targets: Targets, queue_exists: bool
) -> None:
    """The default exchange needs no management API: a passive declare of the queue."""
    target = await targets.queue() if queue_exists else None
    name = target.name if target is not None else unique("missing")

    if not queue_exists:
        with pytest.raises(hopsched.UnroutableTargetError, match=f"no queue '{name}'"):
            await scheduler.schedule(b"x", delay=3600, routing_key=name, check_target=True)
        return
    assert target is not None
    await scheduler.schedule(b"x", delay=0.05, routing_key=name, check_target=True)
    await target.wait_for(1, within=30)
    (delivered,) = await target.settle()  # the message, and no probe
    assert delivered.body == b"x"


async def test_check_target_without_the_management_api_says_it_cannot_tell(
    settings: hopsched.Settings, targets: Targets
) -> None:
    exchange = await targets.exchange()
    nowhere = f"http://127.0.0.1:{free_port()}/"
    async with hopsched.Scheduler(settings, declare=True, management_url=nowhere) as scheduler:
        with pytest.raises(hopsched.TargetCheckError, match="answers nowhere"):
            await scheduler.schedule(
                b"x", delay=3600, exchange=exchange, routing_key="k", check_target=True
            )
        with pytest.raises(hopsched.UnroutableTargetError, match="does not exist"):
            await scheduler.schedule(
                b"x", delay=3600, exchange="no-such-exchange", routing_key="k", check_target=True
            )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node() -> AsyncIterator[PrivateBroker]:
    async with private_cluster(1, management=True, installation=require_rabbitmq()) as cluster:
        yield cluster.nodes[0]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_routing_on_paper_is_what_rabbitmq_does(node: PrivateBroker) -> None:
    """Exchanges of each type with bindings to queues and exchanges, an alternate exchange
    and a cycle; for each (exchange, key, headers), the queues ``reached`` predicts are
    those a real publish lands in."""
    tag = uuid.uuid4().hex[:6]
    connection = await aio_pika.connect(node.url)
    channel = await connection.channel()
    queues = [f"r{tag}.q{i}" for i in range(5)]
    for queue in queues:
        await channel.declare_queue(queue, auto_delete=False, durable=False)
    declared: dict[str, aio_pika.abc.AbstractExchange] = {}
    specs = {
        "dead": ("fanout", None),
        "direct": ("direct", "dead"),
        "topic": ("topic", None),
        "fan": ("fanout", None),
        "head": ("headers", None),
    }
    for name, (kind, alternate) in specs.items():
        arguments = {"alternate-exchange": f"r{tag}.{alternate}"} if alternate else None
        declared[name] = await channel.declare_exchange(
            f"r{tag}.{name}", kind, durable=False, auto_delete=False, arguments=arguments
        )
    queue = {q.split(".")[-1]: await channel.get_queue(q) for q in queues}
    await queue["q0"].bind(declared["dead"])
    await queue["q1"].bind(declared["direct"], "k1")
    await declared["topic"].bind(declared["direct"], "k2")  # e2e: direct k2 -> topic
    await queue["q2"].bind(declared["topic"], "k2.#")
    await queue["q2"].bind(declared["topic"], "*.x")
    await declared["fan"].bind(declared["topic"], "a.*")
    await declared["topic"].bind(declared["fan"])  # a cycle: fan -> topic
    await queue["q3"].bind(declared["fan"])
    await queue["q4"].bind(declared["head"], arguments={"x-match": "any", "n": 1, "s": "v"})
    settings = hopsched.Settings(url=node.url, prefix=f"r{tag}")
    assert node.management_url is not None
    samples = [
        ("direct", "k1", {}),
        ("direct", "k2", {}),
        ("direct", "zz", {}),  # to the alternate
        ("topic", "k2.y", {}),
        ("topic", "a.b", {}),
        ("topic", "q.x", {}),
        ("topic", "none", {}),
        ("fan", "", {}),
        ("head", "", {"n": 1}),
        ("head", "", {"s": "w"}),
        ("head", "", {"n": "1"}),
    ]
    for exchange, key, headers in samples:
        views = await exchange_views(settings, node.management_url, f"r{tag}.{exchange}")
        assert not isinstance(views, str), views
        predicted = reached(views, f"r{tag}.{exchange}", key, headers)

        await declared[exchange].publish(aio_pika.Message(b"p", headers=headers), key)
        await asyncio.sleep(0.1)
        landed = set()
        for name in queues:
            while await (await channel.get_queue(name)).get(no_ack=True, fail=False):
                landed.add(name)
        print(f"{exchange}/{key!r} {headers}: {sorted(landed)}")
        assert predicted == landed, (exchange, key, headers)
    await connection.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_F07_check_target_refuses_an_unbound_key_and_the_cli_exits_2(
    node: PrivateBroker,
) -> None:
    """F07's target with no binding, found when scheduled, not at its due time; and a
    consumer of the good target receives nothing from the check itself."""
    tag = uuid.uuid4().hex[:6]
    settings = hopsched.Settings(url=node.url, prefix=f"c{tag}")
    connection = await aio_pika.connect(node.url)
    channel = await connection.channel()
    # The target is the application's own, outside hopsched's namespace (c<tag>.*), which
    # schedule() refuses as a target.
    exchange = await channel.declare_exchange(f"shop{tag}.orders", "direct")
    queue = await channel.declare_queue(f"shop{tag}.timeouts")
    await queue.bind(exchange, "timeout")
    received: list[aio_pika.abc.AbstractIncomingMessage] = []
    await queue.consume(received.append, no_ack=True)
    management = node.management_url
    assert management is not None
    async with hopsched.Scheduler(settings, declare=True, management_url=management) as scheduler:
        with pytest.raises(hopsched.UnroutableTargetError, match="no binding routes it"):
            await scheduler.schedule(
                b"x", delay=3600, exchange=exchange.name, routing_key="nope", check_target=True
            )
        await scheduler.schedule(
            b"x", delay=3600, exchange=exchange.name, routing_key="timeout", check_target=True
        )
    await asyncio.sleep(1)
    assert received == []  # the check published nothing; the message waits an hour

    status, out, err = await hopsched_cli(
        *("schedule", "--in", "1h", "--exchange", exchange.name, "--routing-key", "nope"),
        *("--check-target", "--management-url", management),
        settings=settings,
    )
    assert status == 2, (out, err)
    assert f"exchange '{exchange.name}' with routing key 'nope'" in err
    await hopsched_cli("teardown", "--force", settings=settings)
    await queue.delete(if_unused=False, if_empty=False)
    await exchange.delete()
    await connection.close()
