"""What the relay does with each delivery, and with a final publish the target refused.
Pure: no I/O; the clock comes in as ``now_us``.

``Decider.decide`` turns a delivery's headers into ``Park(reason)``, ``Cancel`` (its
schedule was cancelled), ``Route(envelope, plan)``, the plan being the ladder's
``Hop(step)`` or ``Hold(wait)`` (a reschedule has moved the envelope's due time), or
``Wait``: a step returned it early (``returned_early``: a policy's length limit pushed it
out, a short ``message-ttl``, a consumer rejecting it), so hopping it again at once
would bring it straight back, again and again (a hop storm); it waits until its hop
would have ended (at most ``WAIT_MAX_US``), then is routed anew. It checks the
envelope's signature first (``hopsched.core.signing``) and parks a message whose target lies
in hopsched's own namespace: the relay publishes into its own queues and stream only
through its own code paths. It parks an envelope naming a feature this version does
not know (``x-hopsched-features``: a newer scheduler wrote it), and a due time before
2001 (``hopsched.core.plausible``: seconds or milliseconds written where µs belong), which
would be delivered at once.
``Decider.after_refusal`` answers a negative confirm on the final publish (a full
target with ``x-overflow=reject-publish``) with a back-off hop, or parks the message
once the refusals have lasted ``retry_for_us``.
``Decider.link`` answers a recurring occurrence that is due (``hopsched.core.recurring``): the
occurrence to deliver (or none, when missed) and the next one to schedule (or none, the
chain ended), each signed anew with the key of the schedule. A reschedule does not apply
to a recurring occurrence: moved, each later one would be moved again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hopsched.core.cancel import CANCEL, LINEAGE, Cancellations, Record, lineage_generation
from hopsched.core.envelope import (
    FEATURES,
    HEADER_FEATURES,
    HEADER_HOP_CLOCK,
    HEADER_HOP_EXPIRES,
    RELAY_CLOCK,
    Envelope,
)
from hopsched.core.ladder import US_PER_MS, Hold, Hop, Ladder
from hopsched.core.plausible import implausible_due
from hopsched.core.recurring import Rule, plan_link
from hopsched.core.signing import Refusal, Signatures
from hopsched.core.targets import TargetPolicy
from hopsched.core.validate import check_expiration
from hopsched.errors import EnvelopeError, InvalidScheduleError
from hopsched.version import __version__

__all__ = [
    "EARLY_TOLERANCE_US",
    "NOTICED",
    "RETRY_FIRST_MS",
    "RETRY_MAX_MS",
    "STORM_FLOOR_US",
    "WAIT_MAX_US",
    "Cancel",
    "Decider",
    "Linked",
    "Park",
    "ParkKind",
    "Route",
    "Wait",
    "returned_early",
    "unsupported",
]

#: The first wait before a refused final publish is tried again, ms; it doubles with
#: each refusal up to ``RETRY_MAX_MS``.
RETRY_FIRST_MS = 1024
RETRY_MAX_MS = 32_768
#: A hop arriving more than this (µs) before the end of its step's TTL came back early.
EARLY_TOLERANCE_US = 100_000
#: A hop that expired early but spent at least this long (µs) in its step is not a storm
#: (a policy's ``message-ttl`` shorter than the step: it costs a hop per that TTL).
STORM_FLOOR_US = 1_000_000
#: The longest a delivery that came back early waits before it is routed again, µs:
#: far below RabbitMQ's consumer_timeout (30 min by default).
WAIT_MAX_US = 30_000_000


class ParkKind(StrEnum):
    """Why a message was parked, as a small closed set for counting (the metric label
    ``kind`` of ``hopsched_parked_total``); the free-text reason goes in its header."""

    MALFORMED = "malformed"  # its envelope headers are missing or invalid
    USER_ID = "user_id"  # its user_id is not the relay's login
    NOT_ALLOWED = "not_allowed"  # its target is not in the allow list
    INVALID = "invalid"  # the broker would refuse the final publish (e.g. expiration)
    RETRIES_EXHAUSTED = "retries_exhausted"  # its target refused it for target_retry_s
    UNROUTABLE = "unroutable"  # no queue is bound to its target
    REFUSED = "refused"  # the broker refused a publish (missing exchange, access, ...)
    TOO_LARGE = "too_large"  # its properties cannot be re-published (frame size, type)
    UNDECODABLE = "undecodable"  # its properties cannot be decoded
    INTERNAL_TARGET = "internal_target"  # its target is one of hopsched's own objects
    UNSIGNED = "unsigned"  # no signature, and the relay requires one
    BAD_SIGNATURE = "bad_signature"  # its signature does not verify (forged, altered, unknown key)
    RETURNED_EARLY = "returned_early"  # a step kept returning it early, the relay was full
    IMPLAUSIBLE_DUE = "implausible_due"  # its due time is before 2001: seconds or ms, not µs
    UNSUPPORTED_FEATURE = "unsupported_feature"  # it needs a feature this relay lacks


#: Parked kinds a relay notes in the cancel stream for ``hopsched status`` (a forgery,
#: or a target inside hopsched's own namespace).
NOTICED = frozenset({ParkKind.INTERNAL_TARGET, ParkKind.UNSIGNED, ParkKind.BAD_SIGNATURE})


@dataclass(frozen=True, slots=True)
class Park:
    """Move the message to ``{prefix}.parked`` with ``reason``; ``kind`` classes the
    cause for counting; ``recorded_as``: what the journal records it as when its headers
    hold no envelope (an ingress message that could not be scheduled, known by its id)."""

    reason: str
    kind: ParkKind
    recorded_as: Envelope | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    """Its schedule was cancelled (or, ``superseded``, it is a recurring occurrence of a
    lineage a relay replaced, docs/recurring.md): ack it, publish nothing."""

    envelope: Envelope
    superseded: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    """Follow ``plan`` (a hop, or a hold until due; ``Hold(0)`` delivers now)."""

    envelope: Envelope
    plan: Hop | Hold


@dataclass(frozen=True, slots=True)
class Wait:
    """A step returned it early: route it anew after ``wait_us`` µs (``decide`` with
    ``rerouted=True``), not at once. ``queue`` is the step, ``reason`` says what came
    back and why, for the log; ``kept_alive``: the step's delivery limit returned it,
    which the relay's own keep-alive gets reach (expected, not an operator's problem)."""

    envelope: Envelope
    wait_us: int
    queue: str
    reason: str
    kept_alive: bool = False


@dataclass(frozen=True, slots=True)
class Linked:
    """A due recurring occurrence: deliver ``deliver`` (None: nothing, it was missed),
    then schedule ``next`` (None: the chain ends) by ``plan``. Neither carries the rule
    any more but ``next``: a retry or a replay of ``deliver`` must not chain again.
    ``catch_up``: the rule's policy (a ``CatchUp`` value); ``skipped`` and ``ended_by``:
    as ``recurring.Link``'s (for the relay's counters)."""

    deliver: Envelope | None
    next: Envelope | None
    plan: Hop | Hold | None
    catch_up: str = "latest"
    skipped: int = 0
    ended_by: str | None = None


def unsupported(envelope: Envelope) -> str | None:
    """Why this relay cannot handle ``envelope``: the features its ``x-hopsched-features``
    names that this version does not know (a newer scheduler wrote it); None if it knows
    them all."""
    lacking = sorted(envelope.required_features - FEATURES)
    if not lacking:
        return None
    return (
        f"it needs feature(s) {', '.join(lacking)} (header {HEADER_FEATURES!r}), which this "
        f"relay (hopsched {__version__}, features: {', '.join(sorted(FEATURES))}) lacks: "
        "upgrade the relay (every relay of the prefix) to the version that scheduled it, "
        "then replay it"
    )


def returned_early(headers: Mapping[str, Any], now_us: int) -> tuple[str, str, int] | None:
    """Whether a hop came back from its step early enough to come straight back if hopped
    there again: ``(queue, x-death reason, µs early)``, or None.

    Early: it arrived more than ``EARLY_TOLERANCE_US`` before the end of its step's TTL
    (``x-hopsched-hop-expires``). Not every early return is a storm: the broker
    dead-lettered it (its first ``x-death`` entry, https://www.rabbitmq.com/docs/dlx) for
    a length limit (``maxlen``), a consumer's reject or a delivery limit, or it expired
    (``expired``, a policy's shorter ``message-ttl``) less than ``STORM_FLOOR_US`` after
    the relay published it. An expiry is judged only on the relay's own stamps: a
    producer's clock may be off.
    """
    expires = headers.get(HEADER_HOP_EXPIRES)
    if type(expires) is not int or expires - now_us <= EARLY_TOLERANCE_US:
        return None  # on time, as nearly every hop is: its x-death is not even decoded
    early_us = expires - now_us
    deaths = headers.get("x-death")
    if not isinstance(deaths, list) or not deaths or not isinstance(deaths[0], Mapping):
        return None
    death = deaths[0]
    queue, reason = str(death.get("queue", "?")), str(death.get("reason", "?"))
    if reason == "expired":
        if headers.get(HEADER_HOP_CLOCK) != RELAY_CLOCK:
            return None
        step = queue.rpartition(".")[2]
        if not step.isdigit():
            return None
        spent_us = now_us - (expires - int(step) * US_PER_MS)
        if spent_us >= STORM_FLOOR_US:
            return None
    return queue, reason, early_us


@dataclass(frozen=True, slots=True)
class Decider:
    """The relay's rules, for one ladder, login and allow list.

    Args:
        ladder: steps, hold window and configured hop margin.
        login: the user the relay logs in as; RabbitMQ refuses to publish a message
            whose ``user_id`` is another (https://www.rabbitmq.com/docs/validated-user-id).
        targets: the allow list (``Settings.allowed_targets``).
        retry_for_us: how long a target may refuse a message before it is parked, µs.
        signatures: the keys envelopes are verified with, and whether one is required.
    """

    ladder: Ladder
    login: str
    targets: TargetPolicy
    retry_for_us: int
    signatures: Signatures

    def decide(
        self,
        headers: Mapping[str, Any] | None,
        user_id: str | None,
        now_us: int,
        *,
        crowded: bool,
        margin_ms: int,
        body: bytes,
        cancellations: Cancellations | None = None,
        rerouted: bool = False,
        avoid: Collection[int] = (),
    ) -> Park | Cancel | Route | Wait:
        """Park, hop or hold a delivery arriving at ``now_us`` (µs since the epoch).

        Args:
            headers: the delivery's headers.
            user_id: its ``user_id`` property.
            body: its body (a signature covers its SHA-256).
            crowded: the relay holds as many messages as it should: hop whatever a step
                fits, with the configured margin, so its prefetch frees up for deliveries
                due now (a learnt margin grows with the relay's own backlog and would keep
                them held).
            margin_ms: the hop margin learnt from recent overshoot (``OvershootTracker``).
            cancellations: the cancels and reschedules read so far.
            rerouted: the relay routes it anew (after a ``Wait``, a nacked hop, a
                reschedule): an early return was dealt with already.
            avoid: steps (ms) whose queues nacked a hop lately (``AvoidedSteps``): a hop
                goes by a smaller step instead (``Ladder.plan``), never early.
        """
        try:
            envelope = Envelope.from_headers(headers)
        except EnvelopeError as error:
            return Park(f"malformed envelope: {error.reason}", ParkKind.MALFORMED)
        if lacking := unsupported(envelope):
            return Park(lacking, ParkKind.UNSUPPORTED_FEATURE)
        # A hop only moves a message along hopsched's own ladder: the MAC is checked
        # before the relay acts on the content (holds it for delivery, signs it anew),
        # the rest of the signature (present if required, of a key held) at every visit.
        checked = self.signatures.check_envelope(envelope, body, verify_mac=False)
        if isinstance(checked, Refusal):
            return Park(checked.reason, ParkKind(checked.kind))
        envelope = checked
        verified = False
        if refusal := self.targets.internal(envelope.exchange, envelope.routing_key):
            return Park(refusal, ParkKind.INTERNAL_TARGET)
        if user_id is not None and user_id != self.login:
            return Park(
                f"user_id {user_id!r} is not this relay's login {self.login!r}: RabbitMQ "
                "refuses to publish it (https://www.rabbitmq.com/docs/validated-user-id); "
                "run the relay as that user",
                ParkKind.USER_ID,
            )
        if cancellations is not None:
            verdict = self.verdict(cancellations, envelope)
            if verdict == CANCEL:
                return Cancel(envelope)
            if envelope.rule is not None and cancellations.superseded(
                envelope.schedule_id,
                envelope.owner,
                envelope.due_us,
                envelope.lineage,
                envelope.user,
            ):
                return Cancel(envelope, superseded=True)
            if isinstance(verdict, int):
                if forged := self._forged(envelope, body):
                    return forged
                verified = True
                moved = dataclasses.replace(envelope, due_us=verdict)
                envelope = self.signatures.resigned(moved, body)
        if implausible := implausible_due(envelope.due_us):  # read as µs: delivered early
            return Park(implausible, ParkKind.IMPLAUSIBLE_DUE)
        if refusal := self.targets.refusal(envelope.exchange, envelope.routing_key):
            return Park(refusal, ParkKind.NOT_ALLOWED)
        if envelope.expiration is not None:
            try:
                check_expiration(envelope.expiration)
            except InvalidScheduleError as error:
                return Park(f"the broker would refuse the final publish: {error}", ParkKind.INVALID)
        if crowded:
            plan = self.ladder.plan(
                now_us=now_us, due_us=envelope.due_us, hold_window_ms=0, avoid=avoid
            )
        else:
            plan = self.ladder.plan(
                now_us=now_us, due_us=envelope.due_us, hop_margin_ms=margin_ms, avoid=avoid
            )
        if isinstance(plan, Hold) and not verified and (forged := self._forged(envelope, body)):
            return forged
        early = None
        if isinstance(plan, Hop) and not rerouted:
            early = returned_early(headers or {}, now_us)
        if early is not None:
            queue, reason, early_us = early
            came = f"{queue} returned it {early_us / 1_000_000:.1f} s early (x-death {reason})"
            if reason == "delivery_limit":  # RabbitMQ 4.x counts a relay's keep-alive gets
                came += (
                    ": a relay's basic.get that keeps the step in use (no management API, or "
                    "an expires policy) counts as a delivery, and quorum queues allow 20 "
                    "by default; it waits, then hops on (docs/operations.md, Policies)"
                )
            if crowded:
                return Park(
                    f"{came} and the relay holds all it can: a policy in force keeps the "
                    "ladder from holding messages (`hopsched status` names it); replay "
                    "it once that is fixed",
                    ParkKind.RETURNED_EARLY,
                )
            return Wait(
                envelope, min(early_us, WAIT_MAX_US), queue, came, reason == "delivery_limit"
            )
        return Route(envelope, plan)

    def verdict(self, cancellations: Cancellations, envelope: Envelope) -> str | int | None:
        """``Cancellations.verdict`` for an envelope: ``CANCEL``, a new due time, or None.
        A recurring occurrence keeps the created time of its schedule, so a cancel ends
        the chain; a reschedule does not apply to one (None)."""
        verdict = cancellations.verdict(
            envelope.schedule_id,
            envelope.created_us,
            envelope.due_us,
            envelope.owner,
            envelope.user,
        )
        if isinstance(verdict, int) and envelope.rule is not None:
            return None
        return verdict

    def link(
        self, envelope: Envelope, body: bytes, now_us: int, cancellations: Cancellations
    ) -> Linked | Cancel | Park:
        """A recurring occurrence (``envelope.rule`` set, its MAC verified) reached for
        delivery at ``now_us``: what to deliver and what to schedule next
        (``recurring.plan_link``); Cancel if a lineage claim superseded it; Park if its
        rule does not decode."""
        assert envelope.rule is not None
        if cancellations.superseded(
            envelope.schedule_id, envelope.owner, envelope.due_us, envelope.lineage, envelope.user
        ):
            return Cancel(envelope, superseded=True)
        try:
            rule = Rule.decode(envelope.rule)
        except InvalidScheduleError as error:
            return Park(f"malformed envelope: {error}", ParkKind.MALFORMED)
        occurrence = max(envelope.occurrence, 1)
        plan = plan_link(rule, envelope.due_us, occurrence - 1, now_us)
        signatures = self.signatures
        deliver = None
        if plan.deliver_us is not None:
            deliver = signatures.resigned(
                dataclasses.replace(
                    envelope, rule=None, due_us=plan.deliver_us, occurrence=occurrence
                ),
                body,
            )
        policy = rule.catch_up.value
        if plan.next_us is None:
            return Linked(deliver, None, None, policy, plan.skipped, plan.ended_by)
        following = dataclasses.replace(
            envelope,
            due_us=plan.next_us,
            occurrence=occurrence + (deliver is not None),
            hops=0,
            retries=0,
            retry_since_us=None,
        )
        hop = self.ladder.plan(now_us=now_us, due_us=plan.next_us)
        if isinstance(hop, Hop):
            following = dataclasses.replace(following, hops=1)
        following = signatures.resigned(following, body)
        return Linked(deliver, following, hop, policy, plan.skipped)

    def claim(
        self,
        headers: Mapping[str, Any] | None,
        body: bytes,
        now_us: int,
        nonce: str,
        cancellations: Cancellations,
    ) -> tuple[Record, Envelope] | Cancel | None:
        """A recurring occurrence delivered to the relay again (``redelivered``: a relay
        died or lost its connection holding it, maybe after it scheduled the successor):
        the lineage claim to write first (signed with the schedule's key) and the envelope
        to go on with, of the next generation (``GEN.NONCE``). Cancel if it is a copy
        another lineage replaced already. None if it is no recurring occurrence or does
        not verify (``decide`` then parks it)."""
        try:
            envelope = Envelope.from_headers(headers)
        except EnvelopeError:
            return None
        if envelope.rule is None or unsupported(envelope):
            return None
        checked = self.signatures.check_envelope(envelope, body)
        if isinstance(checked, Refusal):
            return None
        if cancellations.superseded(
            checked.schedule_id, checked.owner, checked.due_us, checked.lineage, checked.user
        ):
            return Cancel(checked, superseded=True)
        lineage = f"{lineage_generation(checked.lineage) + 1}.{nonce}"
        claimed = self.signatures.resigned(dataclasses.replace(checked, lineage=lineage), body)
        # Unsigned, written for the schedule's user (this relay's login is trusted to):
        # the claim reaches the schedule's scope, not the relay's own messages.
        own = None if checked.owner is not None else checked.user or ""
        record = Record(
            LINEAGE,
            checked.schedule_id,
            now_us,
            checked.due_us,
            kind=lineage,
            own=own,
            user=self.login,
        )
        return self.signatures.sign_as(record, checked.owner), claimed

    def _forged(self, envelope: Envelope, body: bytes) -> Park | None:
        """A Park if the envelope's MAC does not verify (None: it does, or is unsigned)."""
        checked = self.signatures.check_envelope(envelope, body)
        return (
            Park(checked.reason, ParkKind(checked.kind)) if isinstance(checked, Refusal) else None
        )

    def after_refusal(self, envelope: Envelope, now_us: int, refusal: str) -> Park | Hop:
        """The target refused the final publish at ``now_us``: wait a hop, or park.

        The wait doubles from ``RETRY_FIRST_MS`` to ``RETRY_MAX_MS`` (as ladder steps).
        """
        since_us = envelope.retry_since_us if envelope.retry_since_us is not None else now_us
        attempts = envelope.retries + 1
        if now_us - since_us >= self.retry_for_us:
            return Park(
                f"{refusal}; refused {attempts} times over {(now_us - since_us) / 1_000_000:.0f} s",
                ParkKind.RETRIES_EXHAUSTED,
            )
        wait_ms = min(RETRY_FIRST_MS << min(envelope.retries, 16), RETRY_MAX_MS)
        left_ms = (since_us + self.retry_for_us - now_us) // US_PER_MS
        wait_ms = max(min(wait_ms, left_ms), self.ladder.min_step_ms)
        return Hop(self.ladder.step_at_most(wait_ms))
