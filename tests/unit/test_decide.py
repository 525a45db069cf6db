"""The relay's per-delivery decision and its answer to a refused final publish, from
tables: no broker, the clock passed in."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hopsched
from hopsched.core.cancel import CANCEL, RESCHEDULE, Cancellations, Record
from hopsched.core.clock import MAX_DUE_US, us_to_datetime
from hopsched.core.decide import (
    EARLY_TOLERANCE_US,
    RETRY_FIRST_MS,
    RETRY_MAX_MS,
    STORM_FLOOR_US,
    WAIT_MAX_US,
    Cancel,
    Decider,
    Park,
    Route,
    Wait,
)
from hopsched.core.envelope import (
    HEADER_CREATED,
    HEADER_DUE,
    HEADER_EXPIRATION,
    HEADER_FEATURES,
    HEADER_HOP_CLOCK,
    HEADER_HOP_EXPIRES,
    HEADER_VERSION,
    RELAY_CLOCK,
    Envelope,
)
from hopsched.core.ladder import Hold, Hop, Ladder
from hopsched.core.plausible import EARLIEST_DUE_US
from hopsched.core.signing import Signatures, SigningKey
from hopsched.core.targets import TargetPolicy

NOW = 1_800_000_000_000_000  # µs since the epoch
S = 1_000_000  # µs in a second
DECIDER = Decider(
    Ladder(), "guest", TargetPolicy(()), retry_for_us=300 * S, signatures=Signatures()
)


def headers(due_in_us: int = 10 * S, **changes: Any) -> dict[str, Any]:
    values = Envelope("id-1", NOW + due_in_us, "orders", "timeout", hops=1).to_headers()
    values.update(changes)
    return values


def decide(
    values: dict[str, Any] | None,
    *,
    user_id: str | None = None,
    crowded: bool = False,
    margin_ms: int = 20,
    decider: Decider = DECIDER,
    body: bytes = b"",
    cancellations: Cancellations | None = None,
    rerouted: bool = False,
    avoid: frozenset[int] = frozenset(),
) -> Park | Cancel | Route | Wait:
    return decider.decide(
        values,
        user_id,
        NOW,
        crowded=crowded,
        margin_ms=margin_ms,
        body=body,
        cancellations=cancellations,
        rerouted=rerouted,
        avoid=avoid,
    )


@pytest.mark.parametrize(
    ("values", "user_id", "kind", "says"),
    [
        (None, None, "malformed", "'x-hopsched-version' is missing"),
        (headers(**{HEADER_DUE: "soon"}), None, "malformed", "must be int"),
        (headers(**{HEADER_VERSION: 2}), None, "malformed", "reads version 1"),
        (headers(), "mallory", "user_id", "run the relay as that user"),
        (headers(**{HEADER_EXPIRATION: "-5"}), None, "invalid", "expiration"),
        (headers(**{HEADER_EXPIRATION: "soon"}), None, "invalid", "expiration"),
    ],
)
def test_what_cannot_be_delivered_is_parked_with_its_reason(
    values: dict[str, Any] | None, user_id: str | None, kind: str, says: str
) -> None:
    decision = decide(values, user_id=user_id)

    assert isinstance(decision, Park)
    assert decision.kind == kind
    assert says in decision.reason


def test_a_target_outside_the_allow_list_is_parked() -> None:
    strict = Decider(Ladder(), "guest", TargetPolicy(["orders/payment.*"]), 300 * S, Signatures())

    decision = decide(headers(), decider=strict)

    assert isinstance(decision, Park)
    assert decision.kind == "not_allowed"
    assert "'orders/payment.*'" in decision.reason


def test_the_login_user_id_and_a_valid_expiration_are_routed() -> None:
    decision = decide(headers(**{HEADER_EXPIRATION: "60000"}), user_id="guest")

    assert isinstance(decision, Route)
    assert decision.envelope.expiration == "60000"


@pytest.mark.parametrize(
    ("due_in_us", "crowded", "margin_ms", "plan"),
    [
        # the default hold window is 4 s, and a hop lands at least 2 s before due
        (10 * S, False, 20, Hop(4096)),  # 10 s - 2 s: 8 s, the largest step 4.096 s
        (6_096_000, False, 20, Hop(4096)),  # exactly step + 2 s
        (6_095_999, False, 20, Hop(2048)),  # a µs short of it
        (10 * S, False, 3000, Hop(4096)),  # a learnt margin of 3 s: 7 s left, 4.096 fits
        (7 * S, False, 3000, Hop(2048)),  # ... but not within 7 s
        (4 * S, False, 20, Hold(4 * S)),  # the hold window's edge
        (1 * S, False, 20, Hold(1 * S)),  # inside the hold window: wait
        (500_000, False, 20, Hold(500_000)),
        (0, False, 20, Hold(0)),  # due now
        (-5 * S, False, 20, Hold(0)),  # overdue: deliver at once
        # crowded: hop whatever a step fits, with the configured margin (20 ms)
        (1 * S, True, 1000, Hop(512)),
        (500_000, True, 1000, Hop(256)),
        (30_000, True, 1000, Hold(30_000)),  # 30 ms - 20 ms leaves 10: no step fits
    ],
)
def test_the_plan_for_each_remaining_time(
    due_in_us: int, crowded: bool, margin_ms: int, plan: Hop | Hold
) -> None:
    decision = decide(headers(due_in_us), crowded=crowded, margin_ms=margin_ms)

    assert isinstance(decision, Route)
    assert decision.plan == plan


@given(
    due_in_us=st.integers(-(10**12), 10**12), crowded=st.booleans(), margin_ms=st.integers(0, 1000)
)
def test_a_route_never_leaves_the_message_past_its_due_time(
    due_in_us: int, crowded: bool, margin_ms: int
) -> None:
    decision = decide(headers(max(due_in_us, -NOW)), crowded=crowded, margin_ms=margin_ms)

    assert isinstance(decision, Route)
    remaining = decision.envelope.due_us - NOW
    if isinstance(decision.plan, Hop):
        assert decision.plan.step_ms * 1000 <= remaining
    else:
        assert decision.plan.wait_us == max(0, remaining)


@given(
    due_in_us=st.integers(-(10**12), 10**12),
    crowded=st.booleans(),
    margin_ms=st.integers(0, 1000),
    avoid=st.sets(st.sampled_from(Ladder().steps), max_size=8),
)
def test_a_hop_around_steps_that_nacked_is_a_smaller_step_never_early(
    due_in_us: int, crowded: bool, margin_ms: int, avoid: set[int]
) -> None:
    values = headers(max(due_in_us, -NOW))
    plain = decide(values, crowded=crowded, margin_ms=margin_ms)
    around = decide(values, crowded=crowded, margin_ms=margin_ms, avoid=frozenset(avoid))

    assert isinstance(plain, Route)
    assert isinstance(around, Route)
    if isinstance(plain.plan, Hold):
        assert around.plan == plain.plan
        return
    assert isinstance(around.plan, Hop)
    assert around.plan.step_ms <= plain.plan.step_ms
    assert around.plan.step_ms * 1000 <= around.envelope.due_us - NOW
    if any(step <= plain.plan.step_ms and step not in avoid for step in Ladder().steps):
        assert around.plan.step_ms not in avoid


# --- a target that refuses the final publish ----------------------------------------------


def refused(retries: int, since_s: float | None) -> Envelope:
    since = None if since_s is None else NOW - int(since_s * S)
    return Envelope("id-1", NOW - S, "", "full", retries=retries, retry_since_us=since)


@pytest.mark.parametrize(
    ("retries", "since_s", "step"),
    [
        (0, None, 1024),
        (1, 1, 2048),
        (2, 3, 4096),
        (4, 15, 16384),
        (5, 31, 32768),
        (9, 200, 32768),  # capped
        (9, 290, 8192),  # never past the retry budget: 10 s left
    ],
)
def test_a_refused_publish_waits_a_doubling_hop(
    retries: int, since_s: float | None, step: int
) -> None:
    decision = DECIDER.after_refusal(refused(retries, since_s), NOW, "full")

    assert decision == Hop(step)


def test_the_waits_double_from_the_first_to_the_cap() -> None:
    assert RETRY_FIRST_MS == 1024
    assert RETRY_MAX_MS == 32768


@pytest.mark.parametrize("since_s", [300, 301, 10_000])
def test_refusals_lasting_the_retry_budget_park_the_message(since_s: float) -> None:
    decision = DECIDER.after_refusal(refused(12, since_s), NOW, "the queue is full")

    assert isinstance(decision, Park)
    assert decision.kind == "retries_exhausted"
    assert decision.reason.startswith("the queue is full; refused 13 times over")


# --- a hop that comes back early (a policy limits its step) ---------------------------------

STEP = 4_194_304  # ms: the step a message due in 2 h hops into


def returned(
    early_us: int,
    reason: str = "maxlen",
    *,
    step_ms: int = STEP,
    clock: str = RELAY_CLOCK,
    due_in_us: int = 7200 * S,
) -> dict[str, Any]:
    """A hop of ``step_ms`` back ``early_us`` before its TTL's end, dead-lettered for
    ``reason`` (the broker's x-death entry)."""
    death = {"queue": f"p.step.{step_ms}", "reason": reason, "count": 1, "exchange": ""}
    return headers(
        due_in_us,
        **{HEADER_HOP_EXPIRES: NOW + early_us, HEADER_HOP_CLOCK: clock, "x-death": [death]},
    )


@pytest.mark.parametrize(
    ("values", "wait_us"),
    [
        # pushed out of a full step (max-length + drop-head): straight back if hopped again
        (returned(10 * S), 10 * S),  # waits until its hop would have ended
        (returned(3600 * S), WAIT_MAX_US),  # ... at most WAIT_MAX_US
        (returned(10 * S, clock="host/42"), 10 * S),  # maxlen needs no clock: a producer's
        (returned(10 * S, "rejected"), 10 * S),  # a consumer rejecting step messages
        (returned(10 * S, "delivery_limit"), 10 * S),
        # expired a few ms after the relay published it: a tiny message-ttl policy
        (returned(STEP * 1000 - 5_000, "expired"), WAIT_MAX_US),
        (returned(STEP * 1000 - STORM_FLOOR_US, "expired"), None),  # spent 1 s: hops only
        # a policy's message-ttl of 5 s on a 70-min step: a hop per 5 s, not a storm
        (returned(STEP * 1000 - 5 * S, "expired"), None),
        (returned(STEP * 1000 - 5_000, "expired", clock="host/42"), None),  # a producer's clock
        (returned(EARLY_TOLERANCE_US), None),  # within the tolerance: on time
        (returned(-3 * S, "expired"), None),  # late, as hops are
        (returned(-3 * S), None),
        (headers(7200 * S, **{HEADER_HOP_EXPIRES: NOW + 10 * S}), None),  # no x-death
    ],
)
def test_a_hop_that_came_back_early_waits_instead_of_hopping_at_once(
    values: dict[str, Any], wait_us: int | None
) -> None:
    decision = decide(values)

    if wait_us is None:
        assert isinstance(decision, Route)
        assert isinstance(decision.plan, Hop)
    else:
        assert isinstance(decision, Wait)
        assert decision.wait_us == wait_us
        assert decision.queue == f"p.step.{STEP}"
        assert "early (x-death" in decision.reason


def test_an_early_hop_is_routed_normally_once_it_waited() -> None:
    decision = decide(returned(10 * S), rerouted=True)

    assert isinstance(decision, Route)
    assert decision.plan == Hop(STEP)


def test_an_early_hop_due_within_the_hold_window_is_held_not_made_to_wait() -> None:
    decision = decide(returned(1 * S, due_in_us=3 * S))

    assert isinstance(decision, Route)
    assert decision.plan == Hold(3 * S)


def test_an_early_hop_is_parked_when_the_relay_holds_all_it_can() -> None:
    decision = decide(returned(10 * S), crowded=True)

    assert isinstance(decision, Park)
    assert decision.kind == "returned_early"
    assert f"p.step.{STEP} returned it 10.0 s early (x-death maxlen)" in decision.reason
    assert "hopsched status" in decision.reason


@given(
    early_us=st.integers(-(10**10), 10**11),
    spent_us=st.integers(0, 10**10),
    reason=st.sampled_from(["expired", "maxlen", "rejected", "delivery_limit"]),
    due_in_us=st.integers(0, 10**11),
)
def test_a_wait_never_outlasts_the_hop_nor_the_cap_and_always_ends(
    early_us: int, spent_us: int, reason: str, due_in_us: int
) -> None:
    values = returned(
        early_us, reason, step_ms=max(16, (early_us + spent_us) // 1000), due_in_us=due_in_us
    )
    decision = decide(values)

    if isinstance(decision, Wait):
        assert 0 < decision.wait_us <= min(early_us, WAIT_MAX_US)
        assert decision.kept_alive == (reason == "delivery_limit")  # logged at INFO
    again = decide(values, rerouted=True)
    assert isinstance(again, Route)  # after its wait it moves on: no loop of waits


# --- hopsched's own namespace and signatures (issue 19, F30) --------------------------------

OWN = TargetPolicy((), "app")
KEY, FOREIGN = SigningKey("alice", b"a" * 32), SigningKey("mallory", b"m" * 32)


def decider(keys: tuple[SigningKey, ...] = (), *, required: bool = False) -> Decider:
    return Decider(Ladder(), "guest", OWN, 300 * S, Signatures(keys, "app", required=required))


@pytest.mark.parametrize(
    ("exchange", "routing_key"),
    [
        ("", "app.relay"),
        ("", "app.step.16"),
        ("", "app.parked"),
        ("", "app.cancelled"),
        ("", "app.anything-later"),
        ("app.expired", "expired"),
        ("app.expired", ""),
    ],
)
def test_F30_a_target_in_the_prefixs_namespace_is_parked(exchange: str, routing_key: str) -> None:
    values = Envelope("id-1", NOW + S, exchange, routing_key).to_headers()

    decision = decide(values, decider=decider())

    assert isinstance(decision, Park)
    assert decision.kind == "internal_target"
    assert f"target exchange {exchange!r} routing key {routing_key!r}" in decision.reason


@pytest.mark.parametrize(
    ("exchange", "routing_key"),
    [("", "app"), ("", "apps.relay"), ("", "other.app.relay"), ("application", "app.relay")],
)
def test_names_outside_the_namespace_are_targets(exchange: str, routing_key: str) -> None:
    values = Envelope("id-1", NOW + S, exchange, routing_key).to_headers()

    assert isinstance(decide(values, decider=decider()), Route)


def signed(envelope: Envelope, body: bytes, key: SigningKey = KEY) -> dict[str, Any]:
    return Signatures((key,), "app").sign_envelope(envelope, body).to_headers()


def test_F30_a_relay_that_requires_signatures_parks_unsigned_and_forged_envelopes() -> None:
    strict = decider((KEY,), required=True)
    envelope = Envelope("id-1", NOW + 10 * S, "orders", "timeout", created_us=NOW - S)

    unsigned = decide(envelope.to_headers(), decider=strict, body=b"b")
    by_stranger = decide(signed(envelope, b"b", FOREIGN), decider=strict, body=b"b")
    good = decide(signed(envelope, b"b"), decider=strict, body=b"b")

    assert isinstance(unsigned, Park)
    assert unsigned.kind == "unsigned"
    assert isinstance(by_stranger, Park)
    assert by_stranger.kind == "bad_signature"
    assert "'mallory'" in by_stranger.reason
    assert isinstance(good, Route)
    assert good.envelope.owner == "alice"


def test_F30_a_forged_mac_is_parked_before_the_relay_acts_on_the_content() -> None:
    """A hop only moves a message along the ladder: the MAC is checked once the relay
    would hold it for delivery, or sign it anew after a reschedule."""
    strict = decider((KEY,), required=True)
    envelope = Envelope("id-1", NOW + 10 * S, "orders", "timeout", created_us=NOW - S)
    forged = signed(envelope, b"the body alice signed")

    hop = decide(forged, decider=strict, body=b"another body")
    assert isinstance(hop, Route)
    assert isinstance(hop.plan, Hop)
    near = signed(dataclasses.replace(envelope, due_us=NOW + S), b"the body alice signed")
    held = decide(near, decider=strict, body=b"another body")
    assert isinstance(held, Park)
    assert held.kind == "bad_signature"
    assert "does not match its content" in held.reason
    cancellations = Cancellations(50 * 86_400 * S)
    cancellations.apply(Record(RESCHEDULE, "id-1", NOW, NOW + 3600 * S, key_id="alice"))
    moved = decide(forged, decider=strict, body=b"another body", cancellations=cancellations)
    assert isinstance(moved, Park)  # never signed anew by the relay
    assert moved.kind == "bad_signature"
    # not required: the unsigned one is relayed, as its own owner's (nobody's)
    lenient = decide(envelope.to_headers(), decider=decider((KEY,)), body=b"b")
    assert isinstance(lenient, Route)
    assert lenient.envelope.owner is None


def test_F30_only_the_owners_records_cancel_or_move_a_signed_message() -> None:
    envelope = Envelope("victim", NOW + 10 * S, "orders", "timeout", created_us=NOW - S)
    values, body = signed(envelope, b"b"), b"b"
    cancellations = Cancellations(50 * 86_400 * S)
    cancellations.apply(Record(CANCEL, "victim", NOW))  # unsigned
    cancellations.apply(Record(CANCEL, "victim", NOW, key_id="mallory"))
    relay = decider((KEY, FOREIGN))

    kept = decide(values, decider=relay, body=body, cancellations=cancellations)
    assert isinstance(kept, Route)
    assert kept.envelope.due_us == envelope.due_us

    cancellations.apply(Record(RESCHEDULE, "victim", NOW, NOW + 3600 * S, key_id="alice"))
    moved = decide(values, decider=relay, body=body, cancellations=cancellations)
    assert isinstance(moved, Route)
    assert moved.envelope.due_us == NOW + 3600 * S
    # signed again, by the owner's key, for its new due time: the next hop verifies
    assert moved.envelope.owner == "alice"
    assert moved.envelope.signature != values["x-hopsched-signature"]
    again = decide(moved.envelope.to_headers(), decider=relay, body=body)
    assert isinstance(again, Route)
    assert again.envelope.due_us == NOW + 3600 * S

    cancellations.apply(Record(CANCEL, "victim", NOW + S, key_id="alice"))
    assert isinstance(decide(values, decider=relay, body=body, cancellations=cancellations), Cancel)


# --- implausible due times (F43) ----------------------------------------------------------

CREATED = 1_733_300_000_000_000  # 2024-12-04T08:13:20Z, µs


@pytest.mark.parametrize(
    ("due", "says"),
    [
        # Python's int(time.time()): seconds
        (
            1_733_300_000,
            "x-hopsched-due 1733300000 looks like seconds since the epoch "
            "(2024-12-04T08:13:20Z); it must be microseconds (1733300000000000)",
        ),
        # JavaScript's Date.now(): milliseconds
        (
            1_733_300_000_123,
            "x-hopsched-due 1733300000123 looks like milliseconds since the epoch "
            "(2024-12-04T08:13:20Z); it must be microseconds (1733300000123000)",
        ),
        (0, "x-hopsched-due 0 is 1970-01-01T00:00:00Z, before 2001-01-01"),
        (5 * 10**14, "is 1985-11-05T00:53:20Z, before 2001-01-01"),  # µs, but 1985
        (978_307_199_999_999, "is 2000-12-31T23:59:59Z, before 2001-01-01"),  # a µs short
    ],
)
def test_F43_a_due_time_before_2001_is_parked_naming_the_unit_it_looks_like(
    due: int, says: str
) -> None:
    values = headers(**{HEADER_DUE: due, HEADER_CREATED: CREATED})

    decision = decide(values)

    assert isinstance(decision, Park)
    assert decision.kind == "implausible_due"
    assert says in decision.reason
    assert "fix the producer" in decision.reason


def test_F43_nanoseconds_are_malformed_and_said_to_be_nanoseconds() -> None:
    decision = decide(headers(**{HEADER_DUE: CREATED * 1000}))

    assert isinstance(decision, Park)
    assert decision.kind == "malformed"
    assert "it looks like nanoseconds, it must be microseconds" in decision.reason


@pytest.mark.parametrize(
    "due",
    [
        978_307_200_000_000,  # 2001-01-01T00:00:00Z exactly
        CREATED - 3600 * S,  # an hour before it was created: schedule(at=an hour ago)
    ],
)
def test_F43_a_past_due_time_from_2001_on_is_delivered_at_once(due: int) -> None:
    decision = decide(headers(**{HEADER_DUE: due, HEADER_CREATED: CREATED}))

    assert isinstance(decision, Route)
    assert decision.plan == Hold(0)


def test_F43_a_reschedule_moves_an_implausible_due_time_to_a_plausible_one() -> None:
    cancellations = Cancellations(50 * 86_400 * S)
    cancellations.apply(Record(RESCHEDULE, "id-1", NOW, NOW + 60 * S))
    values = headers(**{HEADER_DUE: 1_733_300_000, HEADER_CREATED: NOW - S})

    decision = decide(values, cancellations=cancellations)

    assert isinstance(decision, Route)
    assert decision.envelope.due_us == NOW + 60 * S


@given(due=st.integers(0, EARLIEST_DUE_US - 1), crowded=st.booleans())
def test_F43_a_due_time_before_2001_is_never_routed(due: int, crowded: bool) -> None:
    decision = decide(headers(**{HEADER_DUE: due}), crowded=crowded)

    assert isinstance(decision, Park)
    assert decision.kind == "implausible_due"
    assert str(due) in decision.reason


@given(seconds=st.integers(EARLIEST_DUE_US // S, MAX_DUE_US // S))
def test_F43_any_date_from_2001_on_in_seconds_or_milliseconds_is_named_so(seconds: int) -> None:
    as_seconds = decide(headers(**{HEADER_DUE: seconds}))
    as_ms = decide(headers(**{HEADER_DUE: seconds * 1000 + 999}))

    assert isinstance(as_seconds, Park)
    assert f"looks like seconds since the epoch ({us_to_datetime(seconds * S):%Y-%m-%d}T" in (
        as_seconds.reason
    )
    assert f"it must be microseconds ({seconds * S})" in as_seconds.reason
    assert isinstance(as_ms, Park)
    assert "looks like milliseconds" in as_ms.reason
    assert f"({seconds * S + 999_000})" in as_ms.reason


@given(due=st.integers(EARLIEST_DUE_US, MAX_DUE_US))
def test_F43_a_due_time_from_2001_to_9999_is_routed_never_early(due: int) -> None:
    decision = decide(headers(**{HEADER_DUE: due}))

    assert isinstance(decision, Route)
    if isinstance(decision.plan, Hop):
        assert decision.plan.step_ms * 1000 <= due - NOW
    else:
        assert decision.plan.wait_us == max(0, due - NOW)


# --- features a relay must understand ---------------------------------------------------


@pytest.mark.parametrize(
    ("named", "lacking"),
    [
        ("teleport", "teleport"),
        ("recurring,teleport", "teleport"),
        (" warp , teleport ,", "teleport, warp"),
    ],
)
def test_an_envelope_naming_a_feature_this_relay_lacks_is_parked(named: str, lacking: str) -> None:
    decision = decide(headers(**{HEADER_FEATURES: named}))

    assert isinstance(decision, Park)
    assert decision.kind == "unsupported_feature"
    assert decision.reason.startswith(
        f"it needs feature(s) {lacking} (header 'x-hopsched-features'), which this relay "
        f"(hopsched {hopsched.__version__}, features: recurring) lacks: upgrade the relay"
    )


@pytest.mark.parametrize("named", [None, "", "recurring"])
def test_an_envelope_naming_only_known_features_or_none_is_routed(named: str | None) -> None:
    values = headers()
    if named is not None:
        values[HEADER_FEATURES] = named

    assert isinstance(decide(values), Route)
