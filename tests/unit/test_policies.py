"""What the policies in force do to a prefix's queues (``hopsched.broker.policies.assess``), from
tables of what the management API reports: no broker.

``applied`` stands in for the broker: it gives each queue the definition of a policy
only where RabbitMQ would apply it (every key supported by the queue type: RabbitMQ
3.10.8 / 4.0.5 ``unsupported_policies``), merged with an operator policy as
``rabbit_policy:merge_operator_definitions`` does (the lower value of a limit; 3.13+:
the operator's ``overflow``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.broker.policies import (
    PROTECT_PRIORITY,
    Finding,
    PolicyDefinition,
    PolicyReport,
    QueueView,
    Risk,
    applying,
    assess,
    excluding,
    protective_policies,
    set_policy_command,
    touch_interval_ms,
)
from hopsched.core.ladder import Ladder
from hopsched.topology import Topology

QUORUM = Topology("p", Ladder(), "quorum")
CLASSIC = Topology("p", Ladder(), "classic")
STEPS = len(Ladder().steps)  # 29
UNSUPPORTED = {
    "quorum": {"max-age", "queue-mode", "ha-mode", "stream-max-segment-size-bytes"},
    "classic": {
        "max-age",
        "delivery-limit",
        "dead-letter-strategy",
        "stream-max-segment-size-bytes",
    },
    "stream": {
        "expires",
        "message-ttl",
        "max-length",
        "overflow",
        "delivery-limit",
        "dead-letter-exchange",
        "queue-mode",
        "ha-mode",
    },
}
_MIN_KEYS = {"expires", "message-ttl", "max-length", "max-length-bytes", "delivery-limit"}


def applied(
    topology: Topology,
    policy: Mapping[str, Any] | None = None,
    operator: Mapping[str, Any] | None = None,
    *,
    policy_name: str = "blanket",
) -> dict[str, QueueView | None]:
    """Every queue of ``topology`` as the management API shows it with ``policy`` (a user
    policy matching all of them) and ``operator`` (an operator policy) in force."""
    views: dict[str, QueueView | None] = {}
    for name, arguments in topology.all_queues().items():
        qtype = arguments["x-queue-type"]
        user = policy if policy and not set(policy) & UNSUPPORTED[qtype] else None
        op = operator if operator and not set(operator) & UNSUPPORTED[qtype] else None
        merged = dict(user or {})
        for key, value in (op or {}).items():
            merged[key] = min(merged[key], value) if key in _MIN_KEYS and key in merged else value
        views[name] = QueueView(
            name,
            qtype,
            arguments,
            policy_name if user else None,
            "op" if op else None,
            merged,
        )
    return views


def declared(topology: Topology) -> dict[str, QueueView | None]:
    """Every queue of ``topology`` as the management API lists it before it reports
    policies: name, type and arguments."""
    return {
        name: QueueView(name, arguments["x-queue-type"], arguments, None, None, None)
        for name, arguments in topology.all_queues().items()
    }


def summary(report: PolicyReport) -> set[tuple[str, str, int]]:
    """(risk, key, number of queues) of each finding."""
    return {(f.risk.value, f.key, len(f.queues)) for f in report.findings}


def roles(finding: Finding, topology: Topology = QUORUM) -> set[str]:
    named = {topology.relay_queue: "relay", topology.parked_queue: "parked"}
    named[topology.ingress_queue] = "relay"  # consumed by relays as the relay queue
    named[topology.cancel_stream] = "stream"
    return {named.get(queue, "step") for queue in finding.queues}


@pytest.mark.parametrize(
    ("topology", "definition", "expected"),
    [
        # F28: a blanket expires deletes every queue nothing consumes (not the stream:
        # a policy with expires does not apply to streams); the relay and ingress queues,
        # consumed by relays, as one finding of 2 (so throughout: the relays' queues)
        (QUORUM, {"expires": 8000}, {("loss", "expires", STEPS + 1), ("loss", "expires", 2)}),
        (CLASSIC, {"expires": 8000}, {("loss", "expires", STEPS + 1), ("loss", "expires", 2)}),
        # F28: max-length 1 + drop-head: quorum steps push messages out, at-most-once
        (
            QUORUM,
            {"max-length": 1, "overflow": "drop-head"},
            {("loss", "max-length", STEPS), ("loss", "max-length", 2), ("loss", "max-length", 1)},
        ),
        (
            CLASSIC,
            {"max-length": 1, "overflow": "drop-head"},
            {("stall", "max-length", STEPS), ("stall", "max-length", 2), ("loss", "max-length", 1)},
        ),
        # quorum queues read reject-publish-dlx as drop-head
        (
            QUORUM,
            {"max-length": 10, "overflow": "reject-publish-dlx"},
            {("loss", "max-length", STEPS), ("loss", "max-length", 2), ("loss", "max-length", 1)},
        ),
        # a length limit alone: quorum keeps its x-overflow=reject-publish; the parking
        # queue, which has none, drops
        (
            QUORUM,
            {"max-length-bytes": 10**6},
            {
                ("stall", "max-length-bytes", STEPS),
                ("stall", "max-length-bytes", 2),  # the relay and ingress queues
                ("loss", "max-length-bytes", 1),  # parked
                ("loss", "max-length-bytes", 1),  # the stream: cancels deleted
            },
        ),
        # F28: message-ttl 5 s: steps above 5 s cost hops; parked messages are dropped
        (
            QUORUM,
            {"message-ttl": 5000},
            {("hops", "message-ttl", 20), ("stall", "message-ttl", 2), ("loss", "message-ttl", 1)},
        ),
        # ... below the storm floor every step above it stalls
        (
            QUORUM,
            {"message-ttl": 500},
            {("stall", "message-ttl", 24), ("stall", "message-ttl", 2), ("loss", "message-ttl", 1)},
        ),
        (
            QUORUM,
            {"delivery-limit": 5},
            {("stall", "delivery-limit", 2), ("loss", "delivery-limit", 1)},
        ),
        (QUORUM, {"delivery-limit": 2_000_000}, set()),  # above both arguments: theirs wins
        # the queue's own arguments win: dead-letter target, strategy
        (
            QUORUM,
            {"dead-letter-exchange": "elsewhere", "dead-letter-strategy": "at-most-once"},
            set(),
        ),
        (CLASSIC, {"dead-letter-exchange": "elsewhere"}, set()),
        (QUORUM, {"overflow": "drop-head"}, set()),  # no limit: nothing to drop
        (CLASSIC, {"queue-mode": "lazy"}, set()),
        (CLASSIC, {"queue-version": 2}, set()),
        (CLASSIC, {"ha-mode": "all", "ha-sync-mode": "automatic"}, set()),
        (QUORUM, {"queue-leader-locator": "balanced"}, set()),
        (QUORUM, {"expires": 8000, "queue-mode": "lazy"}, set()),  # applies to no quorum queue
        # the cancellation stream
        (QUORUM, {"max-age": "1h"}, {("loss", "max-age", 1)}),
        (QUORUM, {"max-age": "10Y"}, set()),
        (QUORUM, {"stream-max-segment-size-bytes": 1000}, set()),
    ],
)
@pytest.mark.parametrize("source", ["reported", "worked out"])
def test_what_a_user_policy_on_every_queue_does(
    topology: Topology, definition: dict[str, Any], expected: set[tuple[str, str, int]], source: str
) -> None:
    if source == "reported":  # what the management API says of each queue
        report = assess(topology, applied(topology, definition), version="3.10.8")
    else:  # from the vhost's policies, as the broker matches them
        blanket = PolicyDefinition("blanket", ".*", "queues", 0, definition)
        report = assess(topology, declared(topology), [blanket], version="3.10.8")

    assert summary(report) == expected
    assert report.at_risk == any(risk in ("loss", "stall") for risk, _, _ in expected)
    for finding in report.findings:
        assert (finding.policy, finding.operator) == ("blanket", False)
        assert "hopsched policies protect --prefix p" in finding.fix
        assert "rabbitmqctl set_policy -p / --priority 1000 --apply-to queues" in finding.fix


def test_a_finding_names_the_policy_the_key_the_queues_and_the_fix() -> None:
    report = assess(QUORUM, applied(QUORUM, {"expires": 8000}), version="3.10.8")
    relay = next(f for f in report.findings if roles(f) == {"relay"})

    assert relay.line() == (
        "loss possible: policy 'blanket' sets expires=8000 on 2 queue(s) (p.relay, p.ingress): the "
        "broker deletes a queue, with its messages, once no relay has consumed it for "
        "8000 ms (while a relay runs it keeps the queues in use). Fix: keep it off "
        "hopsched's queues with the protective policies: hopsched policies protect --prefix "
        "p (or rabbitmqctl set_policy -p / --priority 1000 --apply-to queues "
        "hopsched-protect.p '^p\\.(step\\.[0-9]+|relay|ingress|parked)$' "
        '\'{"overflow":"reject-publish"}\' and rabbitmqctl set_policy -p / --priority 1000 '
        "--apply-to queues "
        "hopsched-protect-stream.p '^p\\.cancelled$' '{\"max-age\":\"4381367s\"}')"
    )
    touched = [*QUORUM.queues_but_stream(), QUORUM.ingress_queue]
    assert report.expires_ms == dict.fromkeys(touched, 8000)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        # 3.10: min(-1, 100): every return dead-letters (parks) or drops
        ("3.10.8", {("stall", "delivery-limit", 2), ("loss", "delivery-limit", 1)}),
        ("4.0.5", set()),  # 4.0: "unlimited" (negative) loses to the queue's own limit
    ],
)
def test_an_unlimited_delivery_limit_by_version(
    version: str, expected: set[tuple[str, str, int]]
) -> None:
    report = assess(QUORUM, applied(QUORUM, {"delivery-limit": -1}), version=version)

    assert summary(report) == expected


def protected(
    topology: Topology, operator: Mapping[str, Any] | None = None
) -> dict[str, QueueView | None]:
    """The queues with the protective policies applied (and ``operator``)."""
    queues_policy, stream_policy = protective_policies(topology)
    views = applied(topology, queues_policy.definition, operator, policy_name=queues_policy.name)
    stream = applied(topology, stream_policy.definition, operator, policy_name=stream_policy.name)
    views[topology.cancel_stream] = stream[topology.cancel_stream]
    return views


@pytest.mark.parametrize("topology", [QUORUM, CLASSIC])
def test_the_protective_policies_change_nothing_hopsched_declared(topology: Topology) -> None:
    report = assess(topology, protected(topology), list(protective_policies(topology)))

    assert report.findings == ()
    assert report.protected
    assert report.expires_ms == {}


def test_blanket_policies_the_protection_keeps_off_are_named() -> None:
    blanket = PolicyDefinition("hygiene", ".*", "queues", 0, {"expires": 8000})
    on_exchanges = PolicyDefinition("ae", ".*", "exchanges", 0, {"alternate-exchange": "x"})
    elsewhere = PolicyDefinition("other", "^orders\\.", "queues", 0, {"max-length": 1})
    policies = [*protective_policies(QUORUM), blanket, on_exchanges, elsewhere]

    report = assess(QUORUM, protected(QUORUM), policies)

    assert report.masked == ("hygiene (expires)",)


@pytest.mark.parametrize(
    ("operator", "version", "expected"),
    [
        # 3.10 operator policies may not set overflow: with the protection a length limit
        # refuses instead of dropping
        (
            {"max-length": 10},
            "3.10.8",
            {
                ("stall", "max-length", STEPS),
                ("stall", "max-length", 2),  # the relay and ingress queues
                ("stall", "max-length", 1),
            },
        ),
        # 4.x (3.13+) ones may, and theirs wins over any user policy
        (
            {"max-length": 10, "overflow": "drop-head"},
            "4.0.5",
            {("loss", "max-length", STEPS), ("loss", "max-length", 2), ("loss", "max-length", 1)},
        ),
        (
            {"expires": 8000},
            "4.0.5",
            {("loss", "expires", STEPS + 1), ("loss", "expires", 2)},
        ),
        (
            {"max-length-bytes": 10**9},
            "4.0.5",
            {
                ("stall", "max-length-bytes", STEPS),
                ("stall", "max-length-bytes", 2),
                ("stall", "max-length-bytes", 1),
                ("loss", "max-length-bytes", 1),  # the stream
            },
        ),
    ],
)
def test_an_operator_policy_cannot_be_masked_and_its_fix_excludes_the_prefix(
    operator: dict[str, Any], version: str, expected: set[tuple[str, str, int]]
) -> None:
    op = PolicyDefinition("op", ".*", "queues", 5, operator, operator=True)
    policies = [*protective_policies(QUORUM), op]

    report = assess(QUORUM, protected(QUORUM, operator), policies, version=version)

    assert summary(report) == expected
    for finding in report.findings:
        assert (finding.policy, finding.operator) == ("op", True)
        assert finding.line().startswith(f"{finding.risk.value} possible: operator policy 'op'")
        assert finding.fix.endswith(set_policy_command(excluding(op, QUORUM), "/"))
        assert (
            "rabbitmqctl set_operator_policy -p / --priority 5 --apply-to queues op" in finding.fix
        )


def test_an_operator_policy_not_listed_is_still_named() -> None:
    report = assess(QUORUM, applied(QUORUM, None, {"expires": 8000}))

    assert {f.policy for f in report.findings} == {"op"}
    assert all("ask the broker's operator to exclude" in f.fix for f in report.findings)


def test_a_user_policy_above_the_protection_is_fixed_by_a_higher_priority() -> None:
    above = PolicyDefinition("above", ".*", "queues", 5000, {"expires": 8000})

    report = assess(QUORUM, applied(QUORUM, above.definition, policy_name="above"), [above])

    assert report.findings
    assert all(
        "hopsched policies protect --prefix p --priority 5001" in f.fix for f in report.findings
    )
    assert not report.protected


@pytest.mark.parametrize(
    ("policies", "applies"),
    [
        # the highest priority wins, whatever the order
        ([("low", 0, {"expires": 1}), ("high", 5, {"max-length": 1})], "high"),
        ([("high", 5, {"max-length": 1}), ("low", 0, {"expires": 1})], "high"),
        # one with a key quorum queues do not support does not apply to them at all
        ([("low", 0, {"expires": 1}), ("high", 5, {"queue-mode": "lazy"})], "low"),
        # a tie: the first by name (RabbitMQ does not say)
        ([("b", 1, {"expires": 1}), ("a", 1, {"max-length": 1})], "a"),
    ],
)
def test_one_user_policy_applies_to_a_queue(
    policies: list[tuple[str, int, dict[str, Any]]], applies: str
) -> None:
    listed = [PolicyDefinition(name, ".*", "queues", prio, d) for name, prio, d in policies]
    view = declared(QUORUM)[QUORUM.relay_queue]
    assert view is not None

    assert applying(view, listed).policy == applies


@pytest.mark.parametrize(
    ("apply_to", "version", "applies"),
    [
        ("queues", "3.10.8", True),
        ("all", "3.10.8", True),
        ("exchanges", "3.10.8", False),
        ("quorum_queues", "4.0.5", True),
        ("classic_queues", "4.0.5", False),
        ("streams", "4.0.5", False),
    ],
)
def test_apply_to_decides_which_queues_a_policy_may_apply_to(
    apply_to: str, version: str, applies: bool
) -> None:
    policy = PolicyDefinition("p", ".*", apply_to, 0, {"expires": 1})
    view = declared(QUORUM)[QUORUM.relay_queue]
    assert view is not None

    assert (applying(view, [policy], version).policy == "p") == applies


@pytest.mark.parametrize(
    ("user", "operator", "version", "merged"),
    [
        ({"expires": 9000}, {"expires": 8000}, "3.10.8", {"expires": 8000}),
        ({"expires": 7000}, {"expires": 8000}, "3.10.8", {"expires": 7000}),
        (
            {"overflow": "reject-publish"},
            {"overflow": "drop-head"},
            "4.0.5",
            {"overflow": "drop-head"},
        ),
        ({"delivery-limit": -1}, {"delivery-limit": 50}, "4.0.5", {"delivery-limit": 50}),
        ({"delivery-limit": -1}, {"delivery-limit": 50}, "3.10.8", {"delivery-limit": -1}),
        (
            {"overflow": "reject-publish"},
            {"max-length": 5},
            "3.10.8",
            {"overflow": "reject-publish", "max-length": 5},
        ),
    ],
)
def test_a_user_and_an_operator_policy_merge_as_the_broker_merges_them(
    user: dict[str, Any], operator: dict[str, Any], version: str, merged: dict[str, Any]
) -> None:
    policies = [
        PolicyDefinition("user", ".*", "queues", 0, user),
        PolicyDefinition("op", ".*", "queues", 0, operator, operator=True),
    ]
    view = declared(QUORUM)[QUORUM.relay_queue]
    assert view is not None

    found = applying(view, policies, version)

    assert (found.policy, found.operator_policy, found.effective) == ("user", "op", merged)


def test_queues_not_reported_yet_or_missing_are_listed() -> None:
    views = applied(QUORUM, {"expires": 8000})
    views[QUORUM.relay_queue] = None
    step = QUORUM.step_queue(16)
    views[step] = QueueView(step, "quorum", {}, None, None, None)

    report = assess(QUORUM, views)

    assert report.missing == (QUORUM.relay_queue,)
    assert report.pending == (step,)
    assert not report.protected
    assert len(report.expires_ms) == STEPS + 1  # the other steps, parked and ingress


@pytest.mark.parametrize(
    ("expires_ms", "every_ms"), [(8000, 2666), (1, 100), (3_600_000, 1_200_000)]
)
def test_a_queue_under_an_expires_is_used_three_times_per_lease(
    expires_ms: int, every_ms: int
) -> None:
    assert touch_interval_ms(expires_ms) == every_ms


_BENIGN = {
    "queue-mode": st.sampled_from(["lazy", "default"]),
    "queue-version": st.sampled_from([1, 2]),
    "queue-leader-locator": st.sampled_from(["balanced", "client-local"]),
    "dead-letter-exchange": st.text(max_size=10),
    "dead-letter-routing-key": st.text(max_size=10),
    "dead-letter-strategy": st.sampled_from(["at-most-once", "at-least-once"]),
    "overflow": st.sampled_from(["drop-head", "reject-publish", "reject-publish-dlx"]),
    "ha-mode": st.just("all"),
    "max-in-memory-length": st.integers(0, 10**6),
    "stream-max-segment-size-bytes": st.integers(1, 10**9),
    "alternate-exchange": st.text(max_size=10),
}


@given(
    definition=st.dictionaries(st.sampled_from(sorted(_BENIGN)), st.just(None), min_size=1).flatmap(
        lambda keys: st.fixed_dictionaries({key: _BENIGN[key] for key in keys})
    ),
    classic=st.booleans(),
)
def test_keys_that_neither_limit_nor_expire_are_never_a_risk(
    definition: dict[str, Any], classic: bool
) -> None:
    topology = CLASSIC if classic else QUORUM

    report = assess(topology, applied(topology, definition), version="4.0.5")

    assert report.findings == ()


@given(
    limit=st.integers(1, 10**9),
    key=st.sampled_from(["max-length", "max-length-bytes", "message-ttl", "expires"]),
    classic=st.booleans(),
)
def test_a_limit_or_expiry_on_the_parking_queue_is_always_a_loss(
    limit: int, key: str, classic: bool
) -> None:
    topology = CLASSIC if classic else QUORUM

    report = assess(topology, applied(topology, {key: limit}))

    parked = [f for f in report.findings if topology.parked_queue in f.queues]
    assert [f.risk for f in parked] == [Risk.LOSS]


_NAME = st.text("abcdefghij.-_0123456789", min_size=1, max_size=30)


@given(
    pattern=st.sampled_from([".*", "^p\\.", "step", "relay$", "^(p|q)\\.", "^$", "x"]), name=_NAME
)
def test_the_exclusion_matches_what_the_policy_did_but_the_prefix_s_queues(
    pattern: str, name: str
) -> None:
    policy = PolicyDefinition("op", pattern, "queues", 0, {"expires": 1}, operator=True)
    excluded = re.compile(excluding(policy, QUORUM).pattern)
    ours = set(QUORUM.queues())

    for candidate in [name, *ours]:
        expected = candidate not in ours and re.search(pattern, candidate) is not None
        assert (excluded.search(candidate) is not None) == expected


def test_the_protective_policies_have_the_priority_asked_for() -> None:
    queues, stream = protective_policies(QUORUM, 7)

    assert (queues.priority, stream.priority) == (7, 7)
    assert PROTECT_PRIORITY == 1000
    assert re.fullmatch(queues.pattern, QUORUM.step_queue(16))
    assert not re.fullmatch(queues.pattern, "p.step.16.other")
    assert re.fullmatch(stream.pattern, QUORUM.cancel_stream)
