"""Every broker object's name and arguments, built in one place, and ``declare()``."""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aio_pika
import aiormq
from pamqp.commands import Basic

from hopsched.connect import connect
from hopsched.core.envelope import BROKER_DELIVERY_COUNT_HEADER
from hopsched.core.ladder import MAX_STEP_MS, Ladder, describe_steps, ladder_of, retention_bound_us
from hopsched.errors import (
    AccessRefusedError,
    BrokerUnavailableError,
    HopschedError,
    LadderMismatchError,
    PrefixNotDeclaredError,
    TopologyMismatchError,
)
from hopsched.settings import QueueType, Settings

__all__ = [
    "ANY_STEP_MS",
    "CANCEL_RETENTION_US",
    "DEAD_LETTER_ROUTING_KEY",
    "HOLDING_SUFFIX",
    "JOURNAL_MAX_BYTES",
    "JOURNAL_RETENTION_US",
    "LEADER_LOCATOR",
    "PARKED_DELIVERY_LIMIT",
    "RELAY_CONSUMER_ARGUMENTS",
    "RELAY_DELIVERY_LIMIT",
    "ROLES",
    "TOLERATED_MISSING_STEPS",
    "HeldCounter",
    "Permissions",
    "Progress",
    "QueueDepth",
    "Teardown",
    "Topology",
    "declare_topology",
    "exists",
    "ladder_mismatch",
    "teardown_refusal",
]

log = logging.getLogger("hopsched.topology")

#: Who holds a grant (``Topology.permissions``; docs/security.md says what each may do).
Role = Literal["producer", "relay", "operator"]
ROLES: tuple[Role, ...] = ("producer", "relay", "operator")

#: Every step queue dead-letters with this routing key, whatever key the message had.
DEAD_LETTER_ROUTING_KEY = "expired"

#: How often a delivery may return to ``{prefix}.relay`` (relay crashes, lost connections
#: while a relay held it) before the broker dead-letters it to ``{prefix}.parked``. Set
#: explicitly: RabbitMQ >= 4.0 gives quorum queues a default of 20 and then *drops* the
#: message unless a dead-letter exchange is set
#: (https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling). The relay
#: itself never returns a delivery to the queue.
RELAY_DELIVERY_LIMIT = 100
#: The relay's ``basic.consume`` arguments on ``{prefix}.relay``: a consumer timeout of
#: 30 min (RabbitMQ's default ``consumer_timeout``). From RabbitMQ 4.3 a quorum queue's
#: consumer timeout can also come from a ``consumer-timeout`` policy or queue argument,
#: and a consumer's own argument takes precedence over both
#: (https://www.rabbitmq.com/docs/consumers#acknowledgement-timeout): so a short policy
#: cannot take back the deliveries a relay holds until their due time (at most
#: ``MAX_HOLD_MS``, 60 s). RabbitMQ < 4.3 ignores the argument (3.10.8 and 4.0.5 tested).
RELAY_CONSUMER_ARGUMENTS = {"x-consumer-timeout": 1_800_000}
#: The same for ``{prefix}.parked``, where nothing should ever be dropped: listing the
#: parked messages returns each to the queue, which RabbitMQ < 4.3 counts as a delivery.
#: (-1, "unlimited" on 4.x, means "drop at the first return" on 3.10.)
PARKED_DELIVERY_LIMIT = 1_000_000
#: How long the cancellation stream keeps a record, µs: the top step (every pending
#: message comes by a relay at least that often) and a day (``hopsched.core.cancel``).
CANCEL_RETENTION_US = MAX_STEP_MS * 1000 + 86_400_000_000
#: How long the journal ``{prefix}.journal`` keeps a record, µs: the oldest the newest
#: record of a pending message can be (``ladder.retention_bound_us``: the top step and
#: two refresh steps: about 51.3 days) and a day. RabbitMQ drops a stream's records a
#: whole segment at a time, once all of the segment is older (at least this long).
JOURNAL_RETENTION_US = retention_bound_us(MAX_STEP_MS) + 86_400_000_000
#: The journal's size at most, bytes (``x-max-length-bytes``), in segments of
#: ``JOURNAL_SEGMENT_BYTES`` (``x-stream-max-segment-size-bytes``; RabbitMQ's default is
#: 500 MB): a high rate of short delays must not fill the broker's disk within the
#: retention, which would raise its disk alarm and block every publisher. Past it the
#: oldest segment goes: records of long-pending schedules may go with it (docs/design.md).
JOURNAL_MAX_BYTES = 10 * 2**30
JOURNAL_SEGMENT_BYTES = 100 * 2**20
#: Quorum step and relay queues are declared with ``x-queue-leader-locator=balanced``
#: (RabbitMQ >= 3.10): each new queue's leader goes to the node with the fewest
#: leaders, so a ladder's queues spread over a cluster instead of all leading on the
#: node the first declaring process happened to be connected to (``client-local``).
LEADER_LOCATOR = "x-queue-leader-locator"
# Arguments added by hopsched 0.2; a queue declared before lacks them (see `upgrade`).
_ADDED_IN_0_2 = frozenset({"x-delivery-limit", "x-dead-letter-exchange"})
#: ``upgrade`` holds a queue's messages in ``{queue}.upgrade`` while it declares the
#: queue anew; one left on the broker is an interrupted upgrade (run it again).
HOLDING_SUFFIX = ".upgrade"

#: Every step TTL any ladder can have, ms (powers of two up to ``MAX_STEP_MS``): the step
#: queues ``check_ladder``, ``status`` and ``teardown`` look for, whatever the ladder.
ANY_STEP_MS = tuple(1 << k for k in range(MAX_STEP_MS.bit_length()))
#: A ladder may lack one step queue the prefix has not (an operator deleted it: F27; it
#: is declared again), not more: one more step is one more queue, not a lost message.
TOLERATED_MISSING_STEPS = 1

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


@dataclass(frozen=True, slots=True)
class Permissions:
    """A user's RabbitMQ permissions in one vhost: three regexes matched against
    exchange and queue names (https://www.rabbitmq.com/docs/access-control)."""

    configure: str
    write: str
    read: str

    def command(self, user: str, vhost: str = "/") -> str:
        """The ``rabbitmqctl set_permissions`` command line that grants them."""
        return shlex.join(
            [
                "rabbitmqctl",
                "set_permissions",
                "-p",
                vhost,
                user,
                self.configure,
                self.write,
                self.read,
            ]
        )


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """A queue's ready messages and consumers, as its ``queue.declare-ok`` reports them."""

    messages: int
    consumers: int


@dataclass
class Teardown:
    """What ``Topology.teardown`` did.

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


def ladder_mismatch(
    prefix: str, ladder: Ladder, found: Iterable[int]
) -> LadderMismatchError | None:
    """The error for a process with ``ladder`` on a declared prefix whose step queues
    have the TTLs ``found`` (ms), or None if it may run there.

    It may not if the steps found are another ladder's (``ladder_of``) that lacks more
    than ``TOLERATED_MISSING_STEPS`` of its own: its
    hops would go into queues the prefix's relays never declared (the prefix is another
    ladder's: another ``step_ratio``, a larger ``min_step_ms``), which a Scheduler
    without configure permission cannot publish into and a relay would declare anew
    behind the operator's back. No step at all (a prefix declared by hopsched < 0.2),
    or steps with holes (queues an operator or a policy deleted) are no other ladder:
    the missing ones are declared again, as for one (F27). Steps found that ``ladder``
    lacks are fine for it (a Scheduler on a sub-range, tests/broker/test_field_cases.py F02b;
    ``check_ladder`` logs them).
    """
    present = set(found)
    missing = [step for step in ladder.steps if step not in present]
    if len(missing) <= TOLERATED_MISSING_STEPS or ladder_of(present) is None:
        return None  # none at all, or holes (queues deleted): declared again, F27
    return LadderMismatchError(
        prefix,
        ladder.description,
        describe_steps(present),
        [f"{prefix}.step.{step}" for step in missing],
    )


def teardown_refusal(
    depths: Mapping[str, QueueDepth | None],
    records: Iterable[str] = (),
    holding: Iterable[str] = (),
) -> str | None:
    """Why a prefix's queues must not be deleted without ``force``: the queues that hold
    messages or have consumers (a running relay would declare them again), or None.
    ``records`` names the streams (cancellations, journal), whose records are no
    messages to lose; ``holding`` the holding queues of an interrupted ``upgrade``."""
    holding, records = set(holding), set(records)
    busy = [
        f"{name} ({depth.messages} message(s), {depth.consumers} consumer(s)"
        + ("; an interrupted upgrade: run `hopsched upgrade` again" if name in holding else "")
        + ")"
        for name, depth in depths.items()
        if depth is not None and ((depth.messages and name not in records) or depth.consumers)
    ]
    if not busy:
        return None
    return (
        f"not removed: {len(busy)} queue(s) in use: {', '.join(busy)}. Stop the relays and "
        "let the messages be delivered (or replay or drop the parked ones), or use --force "
        "to delete them with their messages. A cancelled message stays in its step until "
        "its due time (up to 49.7 days in the top step) and counts here: `hopsched "
        "pending` lists what is still to be delivered"
    )


@dataclass(frozen=True, slots=True)
class Topology:
    """Names and arguments of the ladder's queues and exchange for one prefix.

    * step queues ``{prefix}.step.{ttl_ms}``: durable, ``x-message-ttl``, dead-lettered
      to ``{prefix}.expired`` with routing key ``expired``; no ``x-expires``, no length
      limit;
    * direct exchange ``{prefix}.expired`` bound to queue ``{prefix}.relay``, which
      dead-letters what it cannot keep (``RELAY_DELIVERY_LIMIT`` exceeded, or handed
      back by a relay that could not even park it) to ``{prefix}.parked``;
    * queue ``{prefix}.parked`` for what the relay cannot deliver.

    Quorum queues that dead-letter get ``x-dead-letter-strategy=at-least-once`` and
    ``x-overflow=reject-publish`` (required by that strategy,
    https://www.rabbitmq.com/docs/quorum-queues#dead-lettering; RabbitMQ >= 3.10).
    """

    prefix: str
    ladder: Ladder
    queue_type: QueueType

    @classmethod
    def from_settings(cls, settings: Settings) -> Topology:
        return cls(settings.prefix, settings.ladder, settings.queue_type)

    @property
    def expired_exchange(self) -> str:
        return f"{self.prefix}.expired"

    @property
    def relay_queue(self) -> str:
        return f"{self.prefix}.relay"

    @property
    def parked_queue(self) -> str:
        return f"{self.prefix}.parked"

    @property
    def cancel_stream(self) -> str:
        return f"{self.prefix}.cancelled"

    @property
    def journal_stream(self) -> str:
        """``{prefix}.journal``: what happened to each schedule (``hopsched.journal.records``)."""
        return f"{self.prefix}.journal"

    @property
    def ingress_queue(self) -> str:
        """``{prefix}.ingress``: what producers publish with ``x-delay`` to an ingress
        exchange (``hopsched.core.ingress``), until a relay schedules it."""
        return f"{self.prefix}.ingress"

    @property
    def ingress_registry(self) -> str:
        """``{prefix}.ingresses``: the stream of ingress declarations and removals."""
        return f"{self.prefix}.ingresses"

    def due_exchange(self, exchange: str) -> str:
        """Where ingress ``exchange``'s messages go when due: ``{prefix}.due.{exchange}``."""
        return f"{self.prefix}.due.{exchange}"

    @property
    def streams(self) -> tuple[str, str]:
        """The ladder's streams: records, no messages to deliver."""
        return (self.cancel_stream, self.journal_stream)

    def step_queue(self, step_ms: int) -> str:
        return f"{self.prefix}.step.{step_ms}"

    @property
    def step_queues(self) -> tuple[str, ...]:
        return tuple(self.step_queue(step) for step in self.ladder.steps)

    @property
    def other_step_queues(self) -> tuple[str, ...]:
        """The step queues another ladder could have on this prefix and this one does not
        (``ANY_STEP_MS``): ``inspect`` and ``teardown`` include those that exist."""
        own = set(self.ladder.steps)
        return tuple(self.step_queue(step) for step in ANY_STEP_MS if step not in own)

    async def found_steps(self, connection: aio_pika.abc.AbstractConnection) -> frozenset[int]:
        """The TTLs (ms) of the step queues of any ladder that exist on this prefix
        (passive declares: no permission needed, nothing created)."""
        found = set()
        for step in ANY_STEP_MS:
            if await _passive_depth(connection, self.step_queue(step)) is not None:
                found.add(step)
        return frozenset(found)

    async def check_ladder(self, connection: aio_pika.abc.AbstractConnection) -> None:
        """Refuse this ladder on a prefix declared with another (``ladder_mismatch``);
        log a warning for step queues another ladder uses. Nothing to check on a prefix
        without its relay queue (never declared, or being declared: the relay queue is
        declared after every step).

        Raises:
            LadderMismatchError: steps of this ladder are missing on a declared prefix.
        """
        if await _passive_depth(connection, self.relay_queue) is None:
            return
        found = await self.found_steps(connection)
        error = ladder_mismatch(self.prefix, self.ladder, found)
        if error is not None:
            raise error
        extra = sorted(found - set(self.ladder.steps))
        if extra:
            log.warning(
                "prefix %s has step queues this ladder (%s) does not use: %s; a Scheduler "
                "or relay with another ladder uses them, or they are left from one (they "
                "cost the broker a queue each: `hopsched status` lists them, `hopsched "
                "teardown` removes them with the prefix)",
                self.prefix,
                self.ladder.description,
                ", ".join(self.step_queue(step) for step in extra),
            )

    @property
    def holding_queues(self) -> tuple[str, ...]:
        """Where ``upgrade`` holds the messages of ``{prefix}.relay`` and ``{prefix}.parked``
        while it declares them anew (``HOLDING_SUFFIX``); none exists but during one."""
        return tuple(f"{name}{HOLDING_SUFFIX}" for name in (self.relay_queue, self.parked_queue))

    def permissions(
        self,
        role: Role,
        target_exchanges: Iterable[str] = (),
        ingress_exchanges: Iterable[str] = (),
    ) -> Permissions:
        """The narrowest grant RabbitMQ can express for ``role`` on this prefix (see
        https://www.rabbitmq.com/docs/access-control for what each operation needs).

        * ``"producer"`` (``schedule()``, ``cancel()``, ``reschedule()``): write on
          ``amq.default`` (first hops into the steps, records into the cancel stream) and
          on ``{prefix}.expired`` (a message due at once); no configure and no read: it
          can neither delete nor read a queue of the prefix (a Scheduler on it declares
          nothing; ``Scheduler(declare=True)`` needs the operator's grant).
        * ``"relay"``: configure on the prefix's objects (it declares them, and again any
          deleted at runtime); write on ``amq.default`` (hops, parking, markers, targets
          on the default exchange), ``{prefix}.expired`` (a step queue's dead-letter
          exchange), ``{prefix}.relay`` (its binding) and ``target_exchanges`` ("" is the
          default exchange); read on the steps (a queue with a dead-letter exchange needs
          read on itself, https://www.rabbitmq.com/docs/dlx#security), the relay queue,
          the streams (the journal: to restore a cancel stream declared anew) and
          ``{prefix}.expired`` (the binding): not on the parking queue.
        * ``"operator"`` (declare, status, teardown, upgrade, parked list and replay,
          cancel and reschedule): configure and read on every object of the prefix and
          on ``upgrade``'s holding queues; write on ``amq.default``, ``{prefix}.expired``
          and the relay and holding queues (bindings).

        With ``ingress_exchanges`` (``hopsched.core.ingress``): a producer may write on those
        exchanges and nothing else (it publishes with ``x-delay`` as to the plugin); the
        operator may also configure and read them (``hopsched ingress declare`` binds
        them to ``{prefix}.ingress``). The relay reads ``{prefix}.ingress`` and writes on
        the due exchanges ``{prefix}.due.*`` whatever the ingresses.

        Write on ``amq.default`` reaches every queue of the vhost by name, and RabbitMQ
        cannot limit it by routing key (topic permissions apply to topic exchanges only,
        https://www.rabbitmq.com/docs/access-control#topic-authorisation): limit final
        targets with ``Settings.allowed_targets`` and authenticate what reaches the
        prefix's queues with ``Settings.signing_keys`` (docs/security.md).

        Raises:
            ValueError: ``role`` is not one of ``ROLES``.
        """
        prefix = re.escape(self.prefix) + r"\."
        own = r"step\.[0-9]+|expired|relay|ingress|ingresses|parked|cancelled|journal"
        holds = "|".join(
            re.escape(name.removeprefix(self.prefix + ".")) for name in self.holding_queues
        )
        ingresses = sorted({re.escape(name) for name in ingress_exchanges})
        if role == "producer":
            if ingresses:
                return Permissions(configure="^$", write=f"^({'|'.join(ingresses)})$", read="^$")
            return Permissions(
                configure="^$", write=rf"^(amq\.default|{prefix}expired)$", read="^$"
            )
        if role == "relay":
            targets = sorted({re.escape(name) for name in target_exchanges if name})
            write = "|".join([r"amq\.default", rf"{prefix}(expired|relay|due\..+)", *targets])
            return Permissions(
                configure=rf"^{prefix}({own})$",
                write=f"^({write})$",
                read=rf"^{prefix}(step\.[0-9]+|expired|relay|ingress|cancelled|journal)$",
            )
        if role == "operator":
            every = "|".join([rf"{prefix}({own}|due\..+|{holds})", *ingresses])
            write = rf"^(amq\.default|{prefix}(expired|relay|ingress|ingresses|due\..+|{holds}))$"
            return Permissions(configure=f"^({every})$", write=write, read=f"^({every})$")
        raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")

    def _queue_arguments(self) -> dict[str, Any]:
        return {"x-queue-type": self.queue_type}

    def _dead_lettering(self, exchange: str, routing_key: str) -> dict[str, Any]:
        arguments = {
            "x-dead-letter-exchange": exchange,
            "x-dead-letter-routing-key": routing_key,
        }
        if self.queue_type == "quorum":
            arguments["x-dead-letter-strategy"] = "at-least-once"
            arguments["x-overflow"] = "reject-publish"
            arguments[LEADER_LOCATOR] = "balanced"
        return arguments

    def step_arguments(self, step_ms: int) -> dict[str, Any]:
        """Arguments of the step queue whose TTL is ``step_ms`` ms."""
        return {
            **self._queue_arguments(),
            "x-message-ttl": step_ms,
            **self._dead_lettering(self.expired_exchange, DEAD_LETTER_ROUTING_KEY),
        }

    def relay_arguments(self) -> dict[str, Any]:
        """Arguments of ``{prefix}.relay``: dead-lettered to the parking queue (through the
        default exchange), and for quorum an explicit delivery limit."""
        arguments = {**self._queue_arguments(), **self._dead_lettering("", self.parked_queue)}
        if self.queue_type == "quorum":
            arguments["x-delivery-limit"] = RELAY_DELIVERY_LIMIT
        return arguments

    def parked_arguments(self) -> dict[str, Any]:
        arguments = self._queue_arguments()
        if self.queue_type == "quorum":
            arguments["x-delivery-limit"] = PARKED_DELIVERY_LIMIT
        return arguments

    def queues(self) -> dict[str, dict[str, Any]]:
        """The ladder's queues, names and declare arguments: steps, relay, parked, the
        cancellation and journal streams (``all_queues`` adds the ingress's)."""
        queues = {self.step_queue(s): self.step_arguments(s) for s in self.ladder.steps}
        queues[self.relay_queue] = self.relay_arguments()
        queues[self.parked_queue] = self.parked_arguments()
        queues[self.cancel_stream] = {
            "x-queue-type": "stream",
            "x-max-age": f"{CANCEL_RETENTION_US // 1_000_000}s",
        }
        queues[self.journal_stream] = {
            "x-queue-type": "stream",
            "x-max-age": f"{JOURNAL_RETENTION_US // 1_000_000}s",
            "x-max-length-bytes": JOURNAL_MAX_BYTES,
            "x-stream-max-segment-size-bytes": JOURNAL_SEGMENT_BYTES,
        }
        return queues

    def ingress_queues(self) -> dict[str, dict[str, Any]]:
        """The queues of the x-delay ingress (``hopsched.core.ingress``), declared by every
        relay: ``{prefix}.ingress``, like the relay queue (a delivery limit, dead-lettered
        into parking), and the stream ``{prefix}.ingresses`` (a few records, kept). Not
        in ``queues()``: the policy checks (``hopsched.broker.policies``) cover the ladder's."""
        return {
            self.ingress_queue: self.relay_arguments(),
            self.ingress_registry: {"x-queue-type": "stream"},
        }

    def all_queues(self) -> dict[str, dict[str, Any]]:
        """``queues()`` and ``ingress_queues()``: what ``declare``, ``inspect`` and
        ``teardown`` handle."""
        return {**self.queues(), **self.ingress_queues()}

    @property
    def records(self) -> tuple[str, ...]:
        """Every stream of the prefix: records, no messages to lose in a teardown."""
        return (*self.streams, self.ingress_registry)

    def queues_but_stream(self) -> list[str]:
        """The queues a scheduler needs to schedule: all but the streams (it declares
        each before its first write to it)."""
        return [name for name in self.queues() if name not in self.streams]

    async def declare(
        self, connection: aio_pika.abc.AbstractConnection, names: Iterable[str] | None = None
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
        if wanted is None or set(self.step_queues) <= wanted:  # a start, not one queue again
            await self.check_ladder(connection)
        declaring = self.expired_exchange
        channel = await connection.channel(publisher_confirms=False)
        try:
            try:
                await channel.declare_exchange(
                    self.expired_exchange, aio_pika.ExchangeType.DIRECT, durable=True
                )
                for name, arguments in self.all_queues().items():
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
                    if name == self.relay_queue:
                        await queue.bind(self.expired_exchange, routing_key=DEAD_LETTER_ROUTING_KEY)
            except aiormq.exceptions.ChannelPreconditionFailed as error:
                raise await self._explain(connection, declaring, error) from None
            except aiormq.exceptions.ChannelAccessRefused as error:
                raise AccessRefusedError(
                    f"declaring {declaring!r}: {error.args[0] if error.args else error}. "
                    "Declaring the prefix's queues and exchange (a relay, `hopsched "
                    "declare`) needs configure permission on them, and read and write for "
                    "their dead-lettering: give this user the relay's or the operator's grant "
                    f"(hopsched permissions --prefix {self.prefix} --role relay|operator); "
                    "a producer's grant declares nothing"
                ) from None
            except (aiormq.exceptions.AMQPError, ConnectionError) as error:
                # e.g. 404 "home node ... is down or inaccessible" while a restarted node
                # recovers its queues: worth trying again, as for a broker not answering
                reason = f"declaring {declaring!r}: {error.args[0] if error.args else error!r}"
                if declaring == self.cancel_stream:
                    reason += (
                        ". Relays wait for this stream: they deliver nothing before they "
                        "have read the cancels. If it stays down after a crash of a "
                        "RabbitMQ 3.10 node, see 'A stream down after a crash' in "
                        "docs/operations.md"
                    )
                raise BrokerUnavailableError(reason) from None
        finally:
            if not channel.is_closed:
                await channel.close()

    async def upgrade(
        self, connection: aio_pika.abc.AbstractConnection, *, progress: Progress | None = None
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
        depths = await self.inspect(connection, check_arguments=False)
        if all(depth is None for depth in depths.values()) and not await self._exchange_exists(
            connection
        ):
            raise self._nothing_here("nothing to upgrade")
        report = progress or _quiet
        done = []
        for name, hold in zip(
            (self.relay_queue, self.parked_queue), self.holding_queues, strict=True
        ):
            held = depths.get(hold) is not None  # an earlier run was interrupted
            existed = depths[name] is not None
            old = existed and await self._declared_before_0_2(connection, name)
            if old:
                await self._hold(connection, name, hold, report)
                held = True
            await self.declare(connection, [name])
            report(f"declared {name}", 0)
            moved = await self._unhold(connection, name, hold, report) if held else 0
            if old:
                done.append(
                    f"{name}: re-declared with this version's arguments, {moved} messages kept"
                )
            elif held:
                done.append(
                    f"{name}: finished an interrupted upgrade: {moved} messages moved back "
                    f"from {hold}"
                )
            elif not existed:
                done.append(f"{name}: did not exist; declared")
            else:
                done.append(f"{name}: up to date")
        return done

    async def _declared_before_0_2(
        self, connection: aio_pika.abc.AbstractConnection, name: str
    ) -> bool:
        """Whether the existing queue ``name`` lacks the arguments of hopsched 0.2 (it is
        declared again, a no-op, if it does not)."""
        try:
            await self.declare(connection, [name])
        except TopologyMismatchError as error:
            if error.argument not in _ADDED_IN_0_2:
                raise
            return True
        return False

    async def _hold(
        self, connection: aio_pika.abc.AbstractConnection, name: str, hold: str, report: Progress
    ) -> None:
        """Move every message of ``name`` into ``hold`` and delete ``name``."""
        async with connection.channel() as channel:
            current = await channel.declare_queue(name, passive=True)
            consumers = current.declaration_result.consumer_count or 0
            if consumers:
                raise HopschedError(
                    f"{consumers} consumer(s) on {name!r}: stop every relay of prefix "
                    f"{self.prefix!r} before `hopsched upgrade`"
                )
            holding = await channel.declare_queue(
                hold, durable=True, arguments=self._queue_arguments()
            )
            if name == self.relay_queue:  # hops expiring meanwhile wait in the holding queue
                await holding.bind(self.expired_exchange, DEAD_LETTER_ROUTING_KEY)
                await current.unbind(self.expired_exchange, DEAD_LETTER_ROUTING_KEY)
            await _move_all(channel, name, hold, report)
        report(f"removed {name}", 0)

    async def _unhold(
        self, connection: aio_pika.abc.AbstractConnection, name: str, hold: str, report: Progress
    ) -> int:
        """Move every message of ``hold`` back into ``name`` (declared anew) and delete
        ``hold``; returns how many moved."""
        async with connection.channel() as channel:
            holding = await channel.declare_queue(hold, passive=True)
            if (
                name == self.relay_queue
            ):  # bound anew by declare(): a hop expiring now may arrive twice
                await holding.unbind(self.expired_exchange, DEAD_LETTER_ROUTING_KEY)
            moved = await _move_all(channel, hold, name, report)
        report(f"removed {hold}", 0)
        return moved

    def _nothing_here(self, what: str) -> PrefixNotDeclaredError:
        return PrefixNotDeclaredError(
            f"nothing of prefix {self.prefix!r} exists (no queue {self.prefix}.relay, "
            f"{self.prefix}.parked, {self.prefix}.step.*, no exchange {self.expired_exchange}): "
            f"{what}; check --prefix (HOPSCHED_PREFIX)",
            prefix=self.prefix,
            queue=self.relay_queue,
        )

    async def inspect(
        self, connection: aio_pika.abc.AbstractConnection, *, check_arguments: bool = True
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
        for name, arguments in self.all_queues().items():
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
                    raise await self._explain(connection, name, error) from None
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
        for name in (*self.other_step_queues, *self.holding_queues):
            if (depth := await _passive_depth(connection, name)) is not None:
                depths[name] = depth
        return depths

    async def teardown(
        self,
        connection: aio_pika.abc.AbstractConnection,
        *,
        force: bool = False,
        count_held: HeldCounter | None = None,
        progress: Progress | None = None,
    ) -> Teardown:
        """Delete every queue of ``queues()`` (and a holding queue of an interrupted
        ``upgrade``, and the step queues of another ladder on the prefix), then the
        exchange; report missing ones.

        Without ``force`` nothing is deleted while a queue holds messages or has
        consumers (``teardown_refusal``). A message published between that check and
        the delete is lost with its queue, and counted in ``Teardown.lost``. With
        ``force``, the deliveries consumers (a running relay) hold unacknowledged are
        not in that count: ``queue.delete-ok`` counts ready messages only (measured on
        RabbitMQ 3.10.8 and 4.0.5, classic and quorum); ``count_held`` counts them.
        Interrupted at any instant, run it again: it deletes what is left.

        Raises:
            PrefixNotDeclaredError: nothing of the prefix exists; nothing was deleted.
            HopschedError: without ``force``, a queue is in use; names them all.
            AccessRefusedError: the user may not delete them (AMQP 403).
        """
        depths = await self.inspect(connection, check_arguments=False)
        refusal = teardown_refusal(depths, self.records, self.holding_queues)
        if refusal is not None and not force:
            raise HopschedError(refusal)
        exchange_exists = await self._exchange_exists(connection)
        if not exchange_exists and all(depth is None for depth in depths.values()):
            raise self._nothing_here("nothing removed")
        done = Teardown()
        done.consumers = {
            name: depth.consumers for name, depth in depths.items() if depth and depth.consumers
        }
        if done.consumers:
            counted = "not counted" if count_held is None else await count_held(done.consumers)
            if isinstance(counted, str):
                done.held_unknown = counted
            else:
                done.held = {name: counted.get(name, 0) for name in done.consumers}
        report = progress or _quiet
        channel = await connection.channel(publisher_confirms=False)
        underlay = await channel.get_underlay_channel()
        try:
            # The cancel stream first: a running relay (this version) takes its deletion
            # for a teardown and stops, where it would declare a deleted queue again.
            order = sorted(depths.items(), key=lambda item: item[0] != self.cancel_stream)
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
                await underlay.exchange_delete(self.expired_exchange)
                done.removed.append(self.expired_exchange)
                report(f"removed {self.expired_exchange}", 0)
            else:
                done.missing.append(self.expired_exchange)
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise AccessRefusedError(
                f"deleting {self.prefix}'s objects: {error.args[0] if error.args else error}"
            ) from None
        finally:
            if not channel.is_closed:
                await channel.close()
        return done

    async def _exchange_exists(self, connection: aio_pika.abc.AbstractConnection) -> bool:
        return await exists(
            connection,
            lambda channel: channel.declare_exchange(self.expired_exchange, passive=True),
        )

    async def _explain(
        self,
        connection: aio_pika.abc.AbstractConnection,
        queue: str,
        error: aiormq.exceptions.ChannelPreconditionFailed,
    ) -> TopologyMismatchError:
        """The mismatch, named by its root cause where that is the queue type.

        RabbitMQ names only the first argument that differs, which for a quorum/classic
        mix is a quorum-only one (x-dead-letter-strategy, x-overflow). Redeclaring with
        the other type's arguments, a no-op if they match, tells the real difference.
        """
        text = str(error.args[0] if error.args else error)
        if queue not in self.all_queues():
            return _mismatch(text)
        if queue in (self.relay_queue, self.parked_queue):
            mismatch = _mismatch(text)
            if mismatch.argument in _ADDED_IN_0_2:
                return _mismatch(
                    text,
                    fix=(
                        f"the queue was declared by hopsched < 0.2, without the delivery limit "
                        f"and dead-lettering this version declares: stop every relay of the "
                        f"prefix and run `hopsched upgrade --prefix {self.prefix}` (it keeps "
                        f"every message)"
                    ),
                )
        other: QueueType = "classic" if self.queue_type == "quorum" else "quorum"
        try:
            async with connection.channel(publisher_confirms=False) as channel:
                arguments = Topology(self.prefix, self.ladder, other).all_queues()[queue]
                await channel.declare_queue(queue, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed:
            return _mismatch(text)
        return TopologyMismatchError(queue, "x-queue-type", self.queue_type, other, text)


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
    connection: aio_pika.abc.AbstractConnection,
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


async def _passive_depth(
    connection: aio_pika.abc.AbstractConnection, name: str
) -> QueueDepth | None:
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
        if existing and await _passive_depth(connection, topology.relay_queue) is None:
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
        await topology.declare(connection, names)
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
