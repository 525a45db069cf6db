"""Every broker object's name and arguments for one prefix, built in one place (pure:
the I/O that declares, inspects, upgrades and removes them is ``hopsched.broker.objects``)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hopsched.core.ladder import MAX_STEP_MS, Ladder, describe_steps, ladder_of, retention_bound_us
from hopsched.errors import LadderMismatchError
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
    "Permissions",
    "QueueDepth",
    "Topology",
    "ladder_mismatch",
    "stream_down_hint",
    "teardown_refusal",
]

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
#: ``upgrade`` holds a queue's messages in ``{queue}.upgrade`` while it declares the
#: queue anew; one left on the broker is an interrupted upgrade (run it again).
HOLDING_SUFFIX = ".upgrade"

#: Every step TTL any ladder can have, ms (powers of two up to ``MAX_STEP_MS``): the step
#: queues ``check_ladder``, ``status`` and ``teardown`` look for, whatever the ladder.
ANY_STEP_MS = tuple(1 << k for k in range(MAX_STEP_MS.bit_length()))
#: A ladder may lack one step queue the prefix has not (an operator deleted it: F27; it
#: is declared again), not more: one more step is one more queue, not a lost message.
TOLERATED_MISSING_STEPS = 1


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


def stream_down_hint(stream: str) -> str:
    """What to do when the cancel stream ``stream`` cannot be read after a node crash
    (RabbitMQ 3.10, and 4.x within a shorter window, can restart a node killed soon after
    the stream's declaration without its stream coordinator: docs/operations.md)."""
    return (
        f"Relays wait for {stream}: they deliver nothing before they have read the "
        "cancels, and lose nothing meanwhile. If it stays down after a crash of the node "
        "(RabbitMQ 3.10, or 4.x killed just after the stream was declared), see 'A stream "
        "down after a crash' in docs/operations.md"
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
        f"not removed: {len(busy)} queue(s) in use: {', '.join(busy)}. Let the relays "
        "deliver the messages (those waiting in the ingress too: a relay takes them in), "
        "replay or drop the parked ones, then stop the relays; or use --force to delete "
        "the queues with their messages. A cancelled message stays in its step until "
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
    def lookups(self) -> str:
        """``{prefix}.lookups``: the exchange and queue of look-ups that relays answer
        (``hopsched.journal.lookups``), auto-delete: they exist while one does."""
        return f"{self.prefix}.lookups"

    @property
    def ingress_queue(self) -> str:
        """``{prefix}.ingress``: what producers publish with ``x-delay`` to an ingress
        exchange (``hopsched.core.ingress``), until a relay schedules it."""
        return f"{self.prefix}.ingress"

    def via_ingress(self, exchange: str) -> bool:
        """Whether a delivery to the relay published to ``exchange`` came through an
        ingress exchange (so from ``ingress_queue``), not a hop's expiry or the default
        exchange (``relay_queue``)."""
        return exchange not in ("", self.expired_exchange)

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
          ``{prefix}.expired`` (the binding): not on the parking queue. Configure, write
          and read on ``{prefix}.lookups`` (exchange and queue: answering look-ups,
          ``Settings.lookups``).
        * ``"operator"`` (declare, status, teardown, upgrade, parked list and replay,
          cancel and reschedule, get and pending): configure and read on every object of
          the prefix and on ``upgrade``'s holding queues; write on ``amq.default``,
          ``{prefix}.expired``, the relay and holding queues (bindings) and
          ``{prefix}.lookups`` (asking a relay; a producer may not: it may not read the
          journal either).

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
        own = r"step\.[0-9]+|expired|relay|ingress|ingresses|parked|cancelled|journal|lookups"
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
            write = "|".join(
                [r"amq\.default", rf"{prefix}(expired|relay|due\..+|lookups)", *targets]
            )
            return Permissions(
                configure=rf"^{prefix}({own})$",
                write=f"^({write})$",
                read=rf"^{prefix}(step\.[0-9]+|expired|relay|ingress|cancelled|journal|lookups)$",
            )
        if role == "operator":
            every = "|".join([rf"{prefix}({own}|due\..+|{holds})", *ingresses])
            own_written = rf"expired|relay|ingress|ingresses|lookups|due\..+|{holds}"
            write = rf"^(amq\.default|{prefix}({own_written}))$"
            return Permissions(configure=f"^({every})$", write=write, read=f"^({every})$")
        raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")

    def queue_arguments(self) -> dict[str, Any]:
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
            **self.queue_arguments(),
            "x-message-ttl": step_ms,
            **self._dead_lettering(self.expired_exchange, DEAD_LETTER_ROUTING_KEY),
        }

    def relay_arguments(self) -> dict[str, Any]:
        """Arguments of ``{prefix}.relay``: dead-lettered to the parking queue (through the
        default exchange), and for quorum an explicit delivery limit."""
        arguments = {**self.queue_arguments(), **self._dead_lettering("", self.parked_queue)}
        if self.queue_type == "quorum":
            arguments["x-delivery-limit"] = RELAY_DELIVERY_LIMIT
        return arguments

    def parked_arguments(self) -> dict[str, Any]:
        arguments = self.queue_arguments()
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
