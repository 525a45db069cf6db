"""A prefix's objects on the broker (``hopsched.topology`` names them): declare them,
check the ladder, inspect their depths, upgrade those of an older hopsched, remove them.

Every operation is idempotent or resumable: run again after an interruption, it does
what is left."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aio_pika
import aiormq
from pamqp.commands import Basic

from hopsched.connect import connect
from hopsched.core.envelope import BROKER_DELIVERY_COUNT_HEADER
from hopsched.errors import (
    AccessRefusedError,
    BrokerUnavailableError,
    HopschedError,
    PrefixNotDeclaredError,
    TopologyMismatchError,
)
from hopsched.settings import QueueType, Settings
from hopsched.topology import (
    ANY_STEP_MS,
    DEAD_LETTER_ROUTING_KEY,
    LEADER_LOCATOR,
    QueueDepth,
    Topology,
    ladder_mismatch,
    stream_down_hint,
    teardown_refusal,
)

__all__ = [
    "HeldCounter",
    "Progress",
    "Teardown",
    "check_ladder",
    "declare",
    "declare_topology",
    "exists",
    "found_steps",
    "inspect",
    "passive_depth",
    "teardown",
    "upgrade",
]

#: How to unbind consumers from a due exchange (hopsched has no command for it).
UNBIND_HINT = (
    ". Unbind them (the management UI's page of the exchange, or `rabbitmqadmin delete "
    "binding source=EXCHANGE destination=QUEUE destination_type=queue properties_key=KEY`), "
    "or use --force"
)

log = logging.getLogger("hopsched.topology")

Connection = aio_pika.abc.AbstractConnection

# Arguments added by hopsched 0.2; a queue declared before lacks them (see `upgrade`).
_ADDED_IN_0_2 = frozenset({"x-delivery-limit", "x-dead-letter-exchange"})
#: ``progress(step, count)``: what a long admin operation just did, e.g.
#: ``("moved x.relay -> x.relay.upgrade", 120)`` after each message it moved (the count
#: so far) or ``("removed x.step.16", 3)`` after each queue it deleted (with the messages
#: deleted with it). For progress output; tests interrupt a tool at a chosen step.
Progress = Callable[[str, int], None]
#: ``await count(consumers)``: the unacknowledged deliveries the consumers of each queue
#: of ``consumers`` (name -> consumer count) hold (AMQP cannot tell: ``queue.declare-ok``
#: and ``queue.delete-ok`` count ready messages only), or why they cannot be counted.
HeldCounter = Callable[[Mapping[str, int]], Awaitable[Mapping[str, int] | str]]

_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for (?P<kind>queue|exchange) '(?P<queue>[^']+)' "
    r"in vhost '[^']*': "
    r"received (?P<received>.+?) but current is (?P<current>.+)$"
)
# How RabbitMQ 3.x words an argument value in that message.
_VALUE = re.compile(
    r"^(?:the value '(?P<typed>.*)' of type '[^']*'|'(?P<quoted>.*)'|(?P<bare>.*))$"
)


@dataclass
class Teardown:
    """What ``teardown`` did.

    Attributes:
        removed: queue and exchange names deleted, in order.
        missing: names that did not exist (nothing to delete).
        lost: ready messages deleted with each queue that held any (name -> count).
        consumers: consumers each queue that had any still had when it was deleted
            (a running relay); what they held is not in ``lost``.
        held: unacknowledged deliveries those consumers held, per queue, as the
            ``HeldCounter`` counted them just before the deletes; empty if not counted.
        held_unknown: why ``held`` is empty although there were consumers, else None.
    """

    removed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    lost: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    held_unknown: str | None = None


async def found_steps(topology: Topology, connection: Connection) -> frozenset[int]:
    """The TTLs (ms) of the step queues of any ladder that exist on this prefix
    (passive declares: no permission needed, nothing created)."""
    found = set()
    for step in ANY_STEP_MS:
        if await passive_depth(connection, topology.step_queue(step)) is not None:
            found.add(step)
    return frozenset(found)


async def check_ladder(topology: Topology, connection: Connection) -> None:
    """Refuse this ladder on a prefix declared with another (``ladder_mismatch``);
    log a warning for step queues another ladder uses. Nothing to check on a prefix
    without its relay queue (never declared, or being declared: the relay queue is
    declared after every step).

    Raises:
        LadderMismatchError: steps of this ladder are missing on a declared prefix.
    """
    if await passive_depth(connection, topology.relay_queue) is None:
        return
    found = await found_steps(topology, connection)
    error = ladder_mismatch(topology.prefix, topology.ladder, found)
    if error is not None:
        raise error
    extra = sorted(found - set(topology.ladder.steps))
    if extra:
        log.warning(
            "prefix %s has step queues this ladder (%s) does not use: %s; a Scheduler "
            "or relay with another ladder uses them, or they are left from one (they "
            "cost the broker a queue each: `hopsched status` lists them, `hopsched "
            "teardown` removes them with the prefix)",
            topology.prefix,
            topology.ladder.description,
            ", ".join(topology.step_queue(step) for step in extra),
        )


async def declare(
    topology: Topology,
    connection: Connection,
    names: Iterable[str] | None = None,
) -> None:
    """Declare everything (or only the queues in ``names``), idempotently: safe to run
    from every process.

    Raises:
        TopologyMismatchError: a queue exists with other arguments (AMQP 406);
            names the queue, the argument and the fix. Not worth retrying.
        LadderMismatchError: declaring every step, the prefix has another ladder's
            (``check_ladder``).
        AccessRefusedError: the user may not declare them (AMQP 403).
    """
    wanted = None if names is None else set(names)
    if wanted is None or set(topology.step_queues) <= wanted:  # a start, not one queue again
        await check_ladder(topology, connection)
    declaring = topology.expired_exchange
    channel = await connection.channel(publisher_confirms=False)
    try:
        try:
            await channel.declare_exchange(
                topology.expired_exchange, aio_pika.ExchangeType.DIRECT, durable=True
            )
            for name, arguments in topology.all_queues().items():
                if wanted is not None and name not in wanted:
                    continue
                declaring = name
                try:
                    queue = await channel.declare_queue(name, durable=True, arguments=arguments)
                except aiormq.exceptions.ChannelPreconditionFailed as error:
                    if not _leader_locator_differs(error):
                        raise
                    # Declared before hopsched set the leader locator: keep the queue
                    # as it is (placement only, not correctness), on a new channel
                    # as the 406 closed this one.
                    log.info("queue %s keeps its leader locator (%s)", name, error)
                    channel = await connection.channel(publisher_confirms=False)
                    arguments = {k: v for k, v in arguments.items() if k != LEADER_LOCATOR}
                    queue = await channel.declare_queue(name, durable=True, arguments=arguments)
                log.debug("declared queue %s %s", name, arguments)
                if name == topology.relay_queue:
                    await queue.bind(topology.expired_exchange, routing_key=DEAD_LETTER_ROUTING_KEY)
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            raise await _explain(topology, connection, declaring, error) from None
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise AccessRefusedError(
                f"declaring {declaring!r}: {error.args[0] if error.args else error}. "
                "Declaring the prefix's queues and exchange (a relay, `hopsched "
                "declare`) needs configure permission on them, and read and write for "
                "their dead-lettering: give this user the relay's or the operator's grant "
                f"(hopsched permissions --prefix {topology.prefix} --role relay|operator); "
                "a producer's grant declares nothing"
            ) from None
        except (aiormq.exceptions.AMQPError, ConnectionError) as error:
            # e.g. 404 "home node ... is down or inaccessible" while a restarted node
            # recovers its queues: worth trying again, as for a broker not answering
            reason = f"declaring {declaring!r}: {error.args[0] if error.args else error!r}"
            if declaring == topology.cancel_stream:
                reason += ". " + stream_down_hint(declaring)
            raise BrokerUnavailableError(reason) from None
    finally:
        if not channel.is_closed:
            await channel.close()


async def upgrade(
    topology: Topology,
    connection: Connection,
    *,
    progress: Progress | None = None,
) -> list[str]:
    """Re-declare ``{prefix}.relay`` and ``{prefix}.parked`` with this version's
    arguments, keeping every message; returns what it did, a line per queue.

    For a queue declared by hopsched < 0.2 (no delivery limit, no dead-lettering
    to the parking queue): its messages move to its holding queue ``{queue}.upgrade``
    (``holding_queues``), the queue is deleted and declared anew, and the messages
    move back. Expiring hops land in the holding queue meanwhile. Each message is
    published with a confirm before it is acked, one at a time, so an interruption at
    any instant (a kill) duplicates at most one message and loses none. Run again, it
    resumes where the last run stopped: it empties a holding queue left behind back
    into its queue. Run it with every relay of the prefix stopped.

    Args:
        connection: an open connection.
        progress: called after each message moved and each queue deleted or declared
            (``Progress``).

    Raises:
        PrefixNotDeclaredError: nothing of the prefix exists; nothing is declared.
        HopschedError: a relay still consumes the queue.
        TopologyMismatchError: the queue differs in something else too.
    """
    depths = await inspect(topology, connection, check_arguments=False)
    if all(depth is None for depth in depths.values()) and not await _exchange_exists(
        topology, connection
    ):
        raise _nothing_here(topology, "nothing to upgrade")
    report = progress or _quiet
    done = []
    for name, hold in zip(
        (topology.relay_queue, topology.parked_queue), topology.holding_queues, strict=True
    ):
        held = depths.get(hold) is not None  # an earlier run was interrupted
        existed = depths[name] is not None
        old = existed and await _declared_before_0_2(topology, connection, name)
        if old:
            await _hold(topology, connection, name, hold, report)
            held = True
        await declare(topology, connection, [name])
        report(f"declared {name}", 0)
        moved = await _unhold(topology, connection, name, hold, report) if held else 0
        if old:
            done.append(
                f"{name}: re-declared with this version's arguments, {moved} "
                f"message{'' if moved == 1 else 's'} kept"
            )
        elif held:
            done.append(
                f"{name}: finished an interrupted upgrade: {moved} messages moved back from {hold}"
            )
        elif not existed:
            done.append(f"{name}: did not exist; declared")
        else:
            done.append(f"{name}: up to date")
    return done


async def _declared_before_0_2(topology: Topology, connection: Connection, name: str) -> bool:
    """Whether the existing queue ``name`` lacks the arguments of hopsched 0.2 (it is
    declared again, a no-op, if it does not)."""
    try:
        await declare(topology, connection, [name])
    except TopologyMismatchError as error:
        if error.argument not in _ADDED_IN_0_2:
            raise
        return True
    return False


async def _hold(
    topology: Topology,
    connection: Connection,
    name: str,
    hold: str,
    report: Progress,
) -> None:
    """Move every message of ``name`` into ``hold`` and delete ``name``."""
    async with connection.channel() as channel:
        current = await channel.declare_queue(name, passive=True)
        consumers = current.declaration_result.consumer_count or 0
        if consumers:
            raise HopschedError(
                f"{consumers} consumer(s) on {name!r}: stop every relay of prefix "
                f"{topology.prefix!r} before `hopsched upgrade`"
            )
        holding = await channel.declare_queue(
            hold, durable=True, arguments=topology.queue_arguments()
        )
        if name == topology.relay_queue:  # hops expiring meanwhile wait in the holding queue
            await holding.bind(topology.expired_exchange, DEAD_LETTER_ROUTING_KEY)
            await current.unbind(topology.expired_exchange, DEAD_LETTER_ROUTING_KEY)
        await _move_all(channel, name, hold, report)
    report(f"removed {name}", 0)


async def _unhold(
    topology: Topology,
    connection: Connection,
    name: str,
    hold: str,
    report: Progress,
) -> int:
    """Move every message of ``hold`` back into ``name`` (declared anew) and delete
    ``hold``; returns how many moved."""
    async with connection.channel() as channel:
        holding = await channel.declare_queue(hold, passive=True)
        if (
            name == topology.relay_queue
        ):  # bound anew by declare(): a hop expiring now may arrive twice
            await holding.unbind(topology.expired_exchange, DEAD_LETTER_ROUTING_KEY)
        moved = await _move_all(channel, hold, name, report)
    report(f"removed {hold}", 0)
    return moved


def _nothing_here(topology: Topology, what: str) -> PrefixNotDeclaredError:
    prefix = topology.prefix
    return PrefixNotDeclaredError(
        f"nothing of prefix {prefix!r} exists (no queue {prefix}.relay, {prefix}.parked, "
        f"{prefix}.step.*, no exchange {topology.expired_exchange}): "
        f"{what}; check --prefix (HOPSCHED_PREFIX)",
        prefix=topology.prefix,
        queue=topology.relay_queue,
    )


async def inspect(
    topology: Topology, connection: Connection, *, check_arguments: bool = True
) -> dict[str, QueueDepth | None]:
    """Every queue's depth, None for a queue that does not exist; declares nothing new.
    A holding queue of an interrupted ``upgrade`` (``holding_queues``) and a step
    queue of another ladder (``other_step_queues``) are included if, and only if,
    they exist.

    Args:
        connection: an open connection.
        check_arguments: redeclare each existing queue with this topology's arguments,
            a no-op if they match, to detect a mismatch as ``declare()`` would.

    Raises:
        TopologyMismatchError: with ``check_arguments``, an existing queue has other
            arguments (e.g. another queue type).
        AccessRefusedError: the user may not declare them (AMQP 403).
    """
    depths: dict[str, QueueDepth | None] = {}
    for name, arguments in topology.all_queues().items():
        channel = await connection.channel(publisher_confirms=False)
        underlay = await channel.get_underlay_channel()
        try:
            ok = await underlay.queue_declare(name, passive=True)
            if check_arguments:  # the queue exists: this creates nothing
                ok = await underlay.queue_declare(name, durable=True, arguments=arguments)
            depths[name] = QueueDepth(ok.message_count or 0, ok.consumer_count or 0)
        except aiormq.exceptions.ChannelNotFoundEntity:
            depths[name] = None
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            if not _leader_locator_differs(error):
                raise await _explain(topology, connection, name, error) from None
            depths[name] = QueueDepth(ok.message_count or 0, ok.consumer_count or 0)
        except aiormq.exceptions.ChannelAccessRefused as error:
            why = (
                ": checking its arguments declares it (creating nothing), which needs "
                "configure permission on it: the relay's or the operator's grant "
                "(`hopsched permissions --role operator`)"
                if check_arguments
                else ""
            )
            raise AccessRefusedError(
                f"reading {name!r}: {error.args[0] if error.args else error}{why}"
            ) from None
        finally:
            if not channel.is_closed:
                await channel.close()
        log.debug("queue %s: %s", name, depths[name] or "missing")
    for name in (*topology.other_step_queues, *topology.holding_queues):
        if (depth := await passive_depth(connection, name)) is not None:
            depths[name] = depth
    return depths


async def teardown(
    topology: Topology,
    connection: Connection,
    *,
    force: bool = False,
    count_held: HeldCounter | None = None,
    progress: Progress | None = None,
    shared_exchanges: Iterable[str] = (),
) -> Teardown:
    """Delete every queue of ``queues()`` (and a holding queue of an interrupted
    ``upgrade``, and the step queues of another ladder on the prefix), then the
    exchange; report missing ones.

    ``shared_exchanges`` (an ingress's due exchanges, which consumers bind their queues
    to) go first; without ``force`` only if unused, as ``ingress remove`` deletes them,
    and if one is bound nothing else is deleted.

    Without ``force`` nothing is deleted while a queue holds messages or has
    consumers (``teardown_refusal``). A message published between that check and
    the delete is lost with its queue, and counted in ``Teardown.lost``. With
    ``force``, the deliveries consumers (a running relay) hold unacknowledged are
    not in that count: ``queue.delete-ok`` counts ready messages only (measured on
    RabbitMQ 3.10.8 and 4.0.5, classic and quorum); ``count_held`` counts them.
    Interrupted at any instant, run it again: it deletes what is left.

    Raises:
        PrefixNotDeclaredError: nothing of the prefix exists; nothing was deleted.
        HopschedError: without ``force``, a queue is in use, or a shared exchange is
            bound; names them all.
        AccessRefusedError: the user may not delete them (AMQP 403).
    """
    depths = await inspect(topology, connection, check_arguments=False)
    refusal = teardown_refusal(depths, topology.records, topology.holding_queues)
    if refusal is not None and not force:
        raise HopschedError(refusal)
    exchange_exists = await _exchange_exists(topology, connection)
    if not exchange_exists and all(depth is None for depth in depths.values()):
        raise _nothing_here(topology, "nothing removed")
    report = progress or _quiet
    done = Teardown(removed=await _delete_unless_bound(connection, shared_exchanges, force, report))
    done.consumers = {
        name: depth.consumers for name, depth in depths.items() if depth and depth.consumers
    }
    if done.consumers:
        counted = "not counted" if count_held is None else await count_held(done.consumers)
        if isinstance(counted, str):
            done.held_unknown = counted
        else:
            done.held = {name: counted.get(name, 0) for name in done.consumers}
    channel = await connection.channel(publisher_confirms=False)
    underlay = await channel.get_underlay_channel()
    try:
        # The cancel stream first: a running relay (this version) takes its deletion
        # for a teardown and stops, where it would declare a deleted queue again.
        order = sorted(depths.items(), key=lambda item: item[0] != topology.cancel_stream)
        for name, depth in order:
            if depth is None:
                done.missing.append(name)
                continue
            ok = await underlay.queue_delete(name)
            done.removed.append(name)
            if ok.message_count:
                done.lost[name] = ok.message_count
            report(f"removed {name}", ok.message_count or 0)
        if exchange_exists:
            await underlay.exchange_delete(topology.expired_exchange)
            done.removed.append(topology.expired_exchange)
            report(f"removed {topology.expired_exchange}", 0)
        else:
            done.missing.append(topology.expired_exchange)
    except aiormq.exceptions.ChannelAccessRefused as error:
        raise AccessRefusedError(
            f"deleting {topology.prefix}'s objects: {error.args[0] if error.args else error}"
        ) from None
    finally:
        if not channel.is_closed:
            await channel.close()
    return done


async def _delete_unless_bound(
    connection: Connection, names: Iterable[str], force: bool, report: Progress
) -> list[str]:
    """Delete exchanges ``names``, without ``force`` only those no queue is bound to;
    the deleted ones, in order.

    Raises:
        HopschedError: without ``force``, one is bound (names them, and those deleted).
    """
    removed: list[str] = []
    bound: list[str] = []
    channel = await connection.channel(publisher_confirms=False)
    try:
        for name in names:
            try:
                await channel.exchange_delete(name, if_unused=not force)
            except aiormq.exceptions.ChannelPreconditionFailed:
                bound.append(name)
                channel = await connection.channel(publisher_confirms=False)  # 406 closed it
                continue
            removed.append(name)
            report(f"removed {name}", 0)
    finally:
        if not channel.is_closed:
            await channel.close()
    if bound:
        raise HopschedError(
            f"not removed: {', '.join(bound)} still bound (consumers' queues wait for the "
            "x-delay messages through it), so nothing else either"
            + (f" but the unused {', '.join(removed)}" if removed else "")
            + UNBIND_HINT
        )
    return removed


async def _exchange_exists(topology: Topology, connection: Connection) -> bool:
    return await exists(
        connection,
        lambda channel: channel.declare_exchange(topology.expired_exchange, passive=True),
    )


async def _explain(
    topology: Topology,
    connection: Connection,
    queue: str,
    error: aiormq.exceptions.ChannelPreconditionFailed,
) -> TopologyMismatchError:
    """The mismatch, named by its root cause where that is the queue type.

    RabbitMQ names only the first argument that differs, which for a quorum/classic
    mix is a quorum-only one (x-dead-letter-strategy, x-overflow). Redeclaring with
    the other type's arguments, a no-op if they match, tells the real difference.
    """
    text = str(error.args[0] if error.args else error)
    if queue not in topology.all_queues():
        return _mismatch(text)
    if queue in (topology.relay_queue, topology.parked_queue):
        mismatch = _mismatch(text)
        if mismatch.argument in _ADDED_IN_0_2:
            return _mismatch(
                text,
                fix=(
                    f"the queue was declared by hopsched < 0.2, without the delivery limit "
                    f"and dead-lettering this version declares: stop every relay of the "
                    f"prefix and run `hopsched upgrade --prefix {topology.prefix}` (it keeps "
                    f"every message)"
                ),
            )
    other: QueueType = "classic" if topology.queue_type == "quorum" else "quorum"
    try:
        async with connection.channel(publisher_confirms=False) as channel:
            arguments = Topology(topology.prefix, topology.ladder, other).all_queues()[queue]
            await channel.declare_queue(queue, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelPreconditionFailed:
        return _mismatch(text)
    return TopologyMismatchError(queue, "x-queue-type", topology.queue_type, other, text)


def _leader_locator_differs(error: aiormq.exceptions.ChannelPreconditionFailed) -> bool:
    """Whether the 406 names only the leader locator, which ``declare()`` tolerates:
    a queue declared before hopsched set it has none."""
    match = _INEQUIVALENT.search(str(error.args[0] if error.args else error))
    return match is not None and match["arg"] == LEADER_LOCATOR


def _mismatch(text: str, fix: str | None = None) -> TopologyMismatchError:
    match = _INEQUIVALENT.search(text)
    if match is None:
        return TopologyMismatchError("?", "?", "?", "?", text, fix=fix)
    return TopologyMismatchError(
        match["queue"],
        match["arg"],
        _unquote(match["received"]),
        _unquote(match["current"]),
        text,
        kind=match["kind"],
        fix=fix,
    )


async def _move_all(
    channel: aio_pika.abc.AbstractChannel, source: str, target: str, report: Progress
) -> int:
    """Move every message of queue ``source`` to queue ``target`` and delete ``source``;
    returns how many moved. One at a time, each published (confirmed) before it is acked:
    an interruption duplicates at most the one in flight, never loses. (Quorum queues
    refuse ``queue.delete`` with if-empty: the count is checked.)

    Raises:
        HopschedError: the broker did not take a message into ``target`` (it stays in
            ``source``).
    """
    moved = 0
    step = f"moved {source} -> {target}"
    underlay = await channel.get_underlay_channel()
    while True:
        delivered = await underlay.basic_get(source, no_ack=False)
        if not isinstance(delivered.delivery, Basic.GetOk):
            left = await underlay.queue_declare(source, passive=True)
            if left.message_count:
                continue  # arrived meanwhile
            await underlay.queue_delete(source)
            return moved
        properties = delivered.header.properties
        if properties.headers:  # a quorum queue's count of this delivery, not the message's
            properties.headers.pop(BROKER_DELIVERY_COUNT_HEADER, None)
        confirm: object
        try:
            confirm = await underlay.basic_publish(
                delivered.body,
                exchange="",
                routing_key=target,
                properties=properties,
                mandatory=True,
            )
        except aiormq.exceptions.PublishError as error:  # returned: no such queue
            confirm = error
        if not isinstance(confirm, Basic.Ack):
            raise HopschedError(
                f"moving messages from {source} to {target}: the broker did not take one "
                f"({confirm!r}); it stays in {source}. Check {target} and run the command again"
            )
        moved += 1
        report(step, moved)  # before the ack: an interruption here duplicates this one
        await underlay.basic_ack(delivered.delivery_tag or 0)


async def exists(
    connection: Connection,
    declare: Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]],
) -> bool:
    """Whether a passive declare (``declare`` on a channel of its own) finds its object;
    an exclusive queue of another connection exists too (405 RESOURCE_LOCKED)."""
    channel = await connection.channel(publisher_confirms=False)
    try:
        await declare(channel)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    except aiormq.exceptions.ChannelLockedResource:
        return True
    finally:
        if not channel.is_closed:
            await channel.close()
    return True


async def passive_depth(connection: Connection, name: str) -> QueueDepth | None:
    """Queue ``name``'s depth, None if it does not exist (a passive declare).

    Raises:
        BrokerUnavailableError: the broker cannot tell now (the queue's node is down: a
            404 that does not mean "no such queue"; a lost channel or connection).
    """
    channel = await connection.channel(publisher_confirms=False)
    try:
        ok = await (await channel.get_underlay_channel()).queue_declare(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity as error:
        text = str(error.args[0] if error.args else error)
        if "home node" in text:  # e.g. a classic queue whose node is down
            raise BrokerUnavailableError(f"reading {name!r}: {text}") from None
        return None
    except (aiormq.exceptions.AMQPError, ConnectionError) as error:
        raise BrokerUnavailableError(
            f"reading {name!r}: {error.args[0] if error.args else error!r}"
        ) from None
    finally:
        if not channel.is_closed:
            await channel.close()
    return QueueDepth(ok.message_count or 0, ok.consumer_count or 0)


def _quiet(step: str, count: int) -> None:
    """A ``Progress`` that reports nothing."""


async def declare_topology(
    settings: Settings,
    names: Iterable[str] | None = None,
    *,
    first: str | None = None,
    existing: bool = False,
) -> None:
    """Declare ``settings``' topology (or only the queues in ``names``) over a connection
    of its own, to the node URL ``first`` if it answers (see ``connect``).

    With ``existing``, only on a prefix that has its relay queue (a relay or
    ``hopsched declare`` ran with it): queues missing behind it (a step an operator
    deleted, F27) are declared again, but a prefix that was never declared (a mistyped
    one) is refused rather than created, where a message would wait for ever.

    Raises:
        PrefixNotDeclaredError: with ``existing``, no relay queue; nothing was declared.
        BrokerUnavailableError, TopologyMismatchError, AccessRefusedError.
    """
    topology = Topology.from_settings(settings)
    connection = await connect(settings, name="hopsched-declare", first=first)
    try:
        if existing and await passive_depth(connection, topology.relay_queue) is None:
            raise PrefixNotDeclaredError(
                f"prefix {settings.prefix!r} has no relay queue ({topology.relay_queue}) at "
                f"{settings.masked_url}: no relay and no `hopsched declare` ran with it "
                "(nothing scheduled there would ever be relayed); check --prefix "
                "(Settings.prefix), and if it is right, start a relay first or run "
                f"`hopsched declare --prefix {settings.prefix}` (from Python: "
                "declare=True to Scheduler or schedule())",
                prefix=settings.prefix,
                queue=topology.relay_queue,
            )
        await declare(topology, connection, names)
    finally:
        # Cancelled mid-declare (a relay stopping while a restarted node recovers), the
        # channel's close is cancelled too and the broker closes the connection (504):
        # that is no error of the declare's.
        with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError):
            await connection.close()


def _unquote(value: str) -> str:
    match = _VALUE.match(value.strip())
    assert match is not None  # the pattern's last branch matches anything
    result = match["typed"] if match["typed"] is not None else match["quoted"]
    if result is None:
        result = "(not set)" if match["bare"] == "none" else match["bare"]
    return result
