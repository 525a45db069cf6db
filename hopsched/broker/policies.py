"""What the broker's policies do to a prefix's queues, and how to keep them off. Pure.

RabbitMQ applies to each queue at most one *user policy* (of those whose pattern matches
its name, whose ``apply-to`` covers it and whose every key its type supports, the one
with the highest priority) and one *operator policy* chosen the same way; where both set
a key, the lower value wins for the numeric limits and, from RabbitMQ 3.13, the operator
policy's ``overflow`` (https://www.rabbitmq.com/docs/policies#combining-policy-definitions;
``rabbit_policy:merge_operator_definitions``, ``rabbit_policies:merge_policy_value``).
The result is the queue's *effective policy definition*, which the management API
reports per queue. The queue type then resolves each key against the queue's own
arguments (``rabbit_quorum_queue:gather_policy_config``,
``rabbit_amqqueue_process:process_args_policy``, ``rabbit_stream_queue``):

========================  =======================  ======================  ===============
key                       quorum                   classic                 stream
========================  =======================  ======================  ===============
``expires``               policy (min from 4.0)    min                     not applicable
``message-ttl``           min                      min                     not applicable
``max-length``            min                      min                     not applicable
``max-length-bytes``      min                      min                     policy
``overflow``              **policy**               argument                not applicable
``delivery-limit``        min (4.0: see below)     not applicable          not applicable
``dead-letter-*``         argument                 argument                not applicable
``max-age``               not applicable           not applicable          **policy**
========================  =======================  ======================  ===============

"Not applicable": a policy holding such a key does not apply to that queue type at all
(``unsupported_policies``). From RabbitMQ 4.0 a negative ``delivery-limit`` ("unlimited")
loses to a positive argument. hopsched declares no ``x-expires`` and no length limit, so
those come from a policy alone; a policy's ``overflow`` replaces a quorum queue's
``x-overflow=reject-publish``, and with ``drop-head`` the broker falls back to
at-most-once dead-lettering.

``assess`` turns what the management API says of each queue into ``Finding``s: the
policy, the key, the queues, what the broker will do (``Risk``) and the fix: for a user
policy, hopsched's *protective policies* (``protective_policies``: one per prefix, of
higher priority, whose keys change nothing hopsched declared, so no other user policy
applies to its queues), for an operator policy (which nothing can mask) the
``rabbitmqctl`` command that excludes the prefix from it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hopsched.topology import (
    CANCEL_RETENTION_US,
    PARKED_DELIVERY_LIMIT,
    RELAY_DELIVERY_LIMIT,
    Topology,
)

__all__ = [
    "PROTECT_PRIORITY",
    "STORM_FLOOR_MS",
    "Finding",
    "PolicyDefinition",
    "PolicyReport",
    "QueueView",
    "Risk",
    "applying",
    "assess",
    "excluding",
    "protective_policies",
    "protective_policy_names",
    "set_policy_command",
    "touch_interval_ms",
]

#: The priority of hopsched's protective policies unless told otherwise: above the
#: blanket policies people set (0 by default; a few levels at most).
PROTECT_PRIORITY = 1000
#: A hop that comes back sooner than this after it was published, and earlier than its
#: step's TTL, is taken for a policy that keeps the step from holding messages (the
#: relay waits instead of hopping it again at once: ``hopsched.core.decide``). A step whose
#: TTL a policy cuts below it is reported as a stall, above it as extra hops.
STORM_FLOOR_MS = 1000


class Risk(StrEnum):
    """What a policy in force can do to messages: the class of a ``Finding``."""

    LOSS = "loss"  # messages (or cancel records) can be deleted or dropped by the broker
    STALL = "stall"  # messages can be refused, parked or held back until someone acts
    HOPS = "hops"  # messages hop more often than the ladder plans (broker and relay load)


@dataclass(frozen=True, slots=True)
class PolicyDefinition:
    """A user or operator policy (``GET /api/policies/VHOST``, ``/api/operator-policies``).

    Attributes:
        apply_to: ``queues``, ``exchanges``, ``all`` (or, from RabbitMQ 3.12,
            ``classic_queues``, ``quorum_queues``, ``streams``).
        operator: an operator policy (``rabbitmqctl set_operator_policy``).
    """

    name: str
    pattern: str
    apply_to: str
    priority: int
    definition: Mapping[str, Any]
    operator: bool = False

    @classmethod
    def from_api(cls, item: Mapping[str, Any], *, operator: bool = False) -> PolicyDefinition:
        return cls(
            name=str(item.get("name", "")),
            pattern=str(item.get("pattern", "")),
            apply_to=str(item.get("apply-to", "all")),
            priority=int(item.get("priority", 0) or 0),
            definition=dict(item.get("definition") or {}),
            operator=operator,
        )


@dataclass(frozen=True, slots=True)
class QueueView:
    """One queue as the management API reports it (``GET /api/queues/VHOST``).

    Attributes:
        type: ``quorum``, ``classic`` or ``stream``.
        arguments: its declare arguments.
        policy, operator_policy: the names of the policies applied, None for none.
        effective: the merged effective policy definition; None while the API has not
            reported it yet (a few seconds after a queue is declared or a policy set).
    """

    name: str
    type: str
    arguments: Mapping[str, Any]
    policy: str | None
    operator_policy: str | None
    effective: Mapping[str, Any] | None

    @classmethod
    def from_api(cls, item: Mapping[str, Any]) -> QueueView:
        reported = "effective_policy_definition" in item
        return cls(
            name=str(item["name"]),
            type=str(item.get("type", "classic")),
            arguments=dict(item.get("arguments") or {}),
            policy=item.get("policy") or None,
            operator_policy=item.get("operator_policy") or None,
            effective=dict(item.get("effective_policy_definition") or {}) if reported else None,
        )


@dataclass(frozen=True, slots=True)
class Finding:
    """One policy key that changes what the broker does to some of the prefix's queues.

    Attributes:
        risk: what it can do to messages.
        key, value: the policy key and its effective value.
        policy: the policy it comes from; ``operator``: an operator policy.
        queues: the queues it applies to.
        effect: what the broker will do, in a sentence.
        fix: what to do about it, with the command.
    """

    risk: Risk
    key: str
    value: Any
    policy: str
    operator: bool
    queues: tuple[str, ...]
    effect: str
    fix: str

    def line(self) -> str:
        """One line for logs and ``status``."""
        kind = "operator policy" if self.operator else "policy"
        shown = ", ".join(self.queues[:3]) + (", ..." if len(self.queues) > 3 else "")
        return (
            f"{self.risk.value} possible: {kind} {self.policy!r} sets {self.key}="
            f"{json.dumps(self.value)} on {len(self.queues)} queue(s) ({shown}): "
            f"{self.effect}. Fix: {self.fix}"
        )


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """What the policies in force do to one prefix's queues.

    Attributes:
        findings: every risk, worst first.
        protected: hopsched's protective policies apply to every queue of the prefix.
        masked: user policies that match the prefix's queues but that the protective
            policies keep off them (``name: keys``).
        pending: queues whose policies the management API has not reported yet.
        missing: queues that do not exist.
        expires_ms: the effective ``expires`` of each queue that has one (the relay keeps
            those in use).
    """

    findings: tuple[Finding, ...] = ()
    protected: bool = False
    masked: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    expires_ms: Mapping[str, int] = field(default_factory=dict)

    def risks(self) -> dict[Risk, int]:
        """How many findings of each risk (every risk present, 0 for none)."""
        counts = dict.fromkeys(Risk, 0)
        for finding in self.findings:
            counts[finding.risk] += 1
        return counts

    @property
    def at_risk(self) -> bool:
        """A finding can lose or stall messages (``status`` exits 1)."""
        return any(finding.risk in (Risk.LOSS, Risk.STALL) for finding in self.findings)


# --- the protective policies ------------------------------------------------------------


def protective_policy_names(topology: Topology) -> tuple[str, str]:
    """The names of hopsched's two protective policies for ``topology``'s prefix: the
    queues' and the cancellation stream's."""
    return (f"hopsched-protect.{topology.prefix}", f"hopsched-protect-stream.{topology.prefix}")


def protective_policies(
    topology: Topology, priority: int = PROTECT_PRIORITY
) -> tuple[PolicyDefinition, PolicyDefinition]:
    """hopsched's protective user policies for ``topology``'s prefix.

    Two, because a policy applies to a queue only if the queue type supports every key:

    * step, relay, ingress and parked queues: ``{"overflow": "reject-publish"}``, what hopsched
      declares on quorum queues anyway; a length limit an operator policy adds then
      refuses publishes instead of dropping messages;
    * the cancellation stream: ``{"max-age": "<its retention>s"}``, its own ``x-max-age``.
    """
    queues_name, stream_name = protective_policy_names(topology)
    prefix = re.escape(topology.prefix) + r"\."
    return (
        PolicyDefinition(
            queues_name,
            rf"^{prefix}(step\.[0-9]+|relay|ingress|parked)$",
            "queues",
            priority,
            {"overflow": "reject-publish"},
        ),
        PolicyDefinition(
            stream_name,
            rf"^{prefix}cancelled$",
            "queues",
            priority,
            {"max-age": f"{CANCEL_RETENTION_US // 1_000_000}s"},
        ),
    )


def set_policy_command(policy: PolicyDefinition, vhost: str) -> str:
    """The ``rabbitmqctl`` command that sets ``policy`` (user or operator) as it is."""
    verb = "set_operator_policy" if policy.operator else "set_policy"
    return shlex.join(
        [
            "rabbitmqctl",
            verb,
            "-p",
            vhost,
            "--priority",
            str(policy.priority),
            "--apply-to",
            policy.apply_to,
            policy.name,
            policy.pattern,
            json.dumps(dict(policy.definition), sort_keys=True, separators=(",", ":")),
        ]
    )


def _own_names(topology: Topology) -> str:
    own = r"step\.[0-9]+|relay|ingress|parked|cancelled|journal|ingresses"
    return rf"{re.escape(topology.prefix)}\.({own})$"


def excluding(policy: PolicyDefinition, topology: Topology) -> PolicyDefinition:
    """``policy`` with a pattern that matches what it matched but the prefix's queues."""
    pattern = rf"^(?!{_own_names(topology)}).*(?:{policy.pattern})"
    return PolicyDefinition(
        policy.name, pattern, policy.apply_to, policy.priority, policy.definition, policy.operator
    )


# --- assessing --------------------------------------------------------------------------


def assess(
    topology: Topology,
    queues: Mapping[str, QueueView | None],
    policies: Sequence[PolicyDefinition] | None = None,
    *,
    version: str = "",
    vhost: str = "/",
) -> PolicyReport:
    """What the policies in force do to ``topology``'s queues.

    Args:
        queues: each queue of the prefix by name, None if it does not exist.
        policies: the vhost's user and operator policies. Given, each queue's policies
            are worked out from them as the broker does (``applying``): at once, while
            the management API reports a new policy on a queue only with its next
            statistics, 5 to 10 s later, by when an ``expires`` may have deleted it. None:
            what the API reports per queue (``QueueView.effective``).
        version: the broker's version, e.g. ``"3.10.8"`` (``GET /api/overview``).
        vhost: the vhost, for the commands in the fixes.
    """
    by_name = {(p.operator, p.name): p for p in policies or ()}
    protect = protective_policy_names(topology)
    four = _version(version) >= (4, 0)
    if policies is not None:
        queues = {
            name: None if view is None else applying(view, policies, version)
            for name, view in queues.items()
        }
    found: dict[tuple[Risk, str, str, bool, str], list[str]] = {}
    values: dict[tuple[Risk, str, str, bool, str], Any] = {}
    pending, missing, expires = [], [], {}
    protected = True
    for name, view in queues.items():
        if view is None:
            missing.append(name)
            continue
        if view.effective is None:
            pending.append(name)
            protected = False
            continue
        role = _role(topology, name)
        if view.policy not in protect and role[0] != "journal":  # lookups only: unprotected
            protected = False
        effective = _effective(view, four)
        if isinstance(effective.get("expires"), int) and view.type != "stream":
            expires[name] = effective["expires"]
        for risk, key, effect in _effects(role, view.type, effective, topology):
            policy, operator = _source(view, key, by_name)
            entry = (risk, key, policy, operator, effect)
            found.setdefault(entry, []).append(name)
            values[entry] = effective.get(key)
    findings = [
        Finding(
            risk,
            key,
            values[entry],
            policy,
            operator,
            tuple(names),
            effect,
            _fix(topology, policy, operator, by_name, vhost),
        )
        for entry, names in found.items()
        for risk, key, policy, operator, effect in [entry]
    ]
    order = list(Risk)
    findings.sort(key=lambda f: (order.index(f.risk), f.policy, f.key))
    return PolicyReport(
        findings=tuple(findings),
        protected=protected and not missing,
        masked=_masked(topology, queues, policies or (), version),
        pending=tuple(pending),
        missing=tuple(missing),
        expires_ms=expires,
    )


def touch_interval_ms(expires_ms: int) -> int:
    """How often to use a queue whose effective ``expires`` is ``expires_ms`` so that the
    broker never finds it unused for that long: a third of it (at least 100 ms)."""
    return max(expires_ms // 3, 100)


def _version(version: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", version)[:3]
    return tuple(int(part) for part in parts) if parts else (0,)


# ("step", ttl ms) | ("relay", 0) | ("parked", 0) | ("stream", 0) | ("journal", 0)
_Role = tuple[str, int]


def _role(topology: Topology, name: str) -> _Role:
    if name in (topology.relay_queue, topology.ingress_queue):  # relays consume both alike
        return ("relay", 0)
    if name == topology.parked_queue:
        return ("parked", 0)
    if name == topology.cancel_stream:
        return ("stream", 0)
    if name in (topology.journal_stream, topology.ingress_registry):  # look-ups only
        return ("journal", 0)
    return ("step", int(name.rsplit(".", 1)[1]))


# How each queue type resolves a policy value against its own argument ("min" or
# "policy"); ``overflow`` apart (``_overflow``); keys not listed change nothing hopsched
# relies on.
_RESOLVE: dict[str, dict[str, str]] = {
    "quorum": {
        "expires": "min",
        "message-ttl": "min",
        "max-length": "min",
        "max-length-bytes": "min",
        "delivery-limit": "min",
    },
    "classic": {
        "expires": "min",
        "message-ttl": "min",
        "max-length": "min",
        "max-length-bytes": "min",
    },
    "stream": {"max-length-bytes": "policy", "max-age": "policy"},
}


def _effective(view: QueueView, four: bool) -> dict[str, Any]:
    """The keys the queue's type will act on that differ from its own arguments, with
    the values it resolves them to; and its ``overflow``."""
    effective: dict[str, Any] = {}
    for key, how in _RESOLVE.get(view.type, {}).items():
        policy = (view.effective or {}).get(key)
        argument = view.arguments.get(f"x-{key}")
        if policy is None:
            continue  # the queue's own argument: what hopsched declared
        if how == "min" and argument is not None:
            if key == "delivery-limit" and four and (policy < 0 or argument < 0):
                policy = max(policy, argument)  # 4.0: "unlimited" loses to a limit
            else:
                policy = min(policy, argument)
            if policy == argument:
                continue
        effective[key] = policy
    effective["overflow"] = _overflow(view)
    return effective


def _overflow(view: QueueView) -> str:
    """What a full queue does: a quorum queue takes the policy's ``overflow`` over its
    argument (and reads ``reject-publish-dlx`` as its default, ``drop-head``); a classic
    queue its argument over the policy's."""
    policy = (view.effective or {}).get("overflow")
    argument = view.arguments.get("x-overflow")
    if view.type == "quorum":
        chosen = policy or argument or "drop-head"
        return "drop-head" if chosen == "reject-publish-dlx" else str(chosen)
    return str(argument or policy or "drop-head")


_Effect = tuple[Risk, str, str]


def _effects(
    role: _Role, qtype: str, effective: Mapping[str, Any], topology: Topology
) -> list[_Effect]:
    kind, step_ms = role
    effects: list[_Effect] = []
    overflow = effective.get("overflow")
    if kind == "stream":
        return _stream_effects(effective)
    if kind == "journal":  # lookups only: no policy on it can lose or stall a message
        return effects
    if (expires := effective.get("expires")) is not None:
        who = "no relay has consumed it" if kind == "relay" else "nothing has used it"
        effects.append(
            (
                Risk.LOSS,
                "expires",
                f"the broker deletes a queue, with its messages, once {who} for "
                f"{_ms(expires)} (while a relay runs it keeps the queues in use)",
            )
        )
    if (ttl := effective.get("message-ttl")) is not None:
        effects += _ttl_effects(kind, step_ms, ttl, topology)
    for key in ("max-length", "max-length-bytes"):
        if (limit := effective.get(key)) is not None:
            effects.append(_limit_effect(kind, qtype, key, limit, overflow, topology))
    limit = effective.get("delivery-limit")
    if limit is not None and qtype == "quorum":
        if kind == "relay" and limit < RELAY_DELIVERY_LIMIT:
            effects.append(
                (
                    Risk.STALL,
                    "delivery-limit",
                    f"a delivery returned to it more often than {limit} times (relays "
                    "that crashed or lost their connection while holding it) is parked "
                    f"in {topology.parked_queue}",
                )
            )
        elif kind == "parked" and limit < PARKED_DELIVERY_LIMIT:
            effects.append(
                (
                    Risk.LOSS,
                    "delivery-limit",
                    f"a parked message returned to it more often than {limit} times "
                    "(each `hopsched parked list` returns it) is dropped",
                )
            )
    return effects


def _ttl_effects(kind: str, step_ms: int, ttl: int, topology: Topology) -> list[_Effect]:
    if kind == "step":
        if ttl >= step_ms:
            return []
        if ttl < STORM_FLOOR_MS:
            return [
                (
                    Risk.STALL,
                    "message-ttl",
                    f"steps longer than {_ms(ttl)} return every message after {_ms(ttl)}: "
                    "the relay holds them in memory instead of hopping them again at "
                    "once, and parks what it cannot hold",
                )
            ]
        return [
            (
                Risk.HOPS,
                "message-ttl",
                f"steps longer than {_ms(ttl)} return every message after {_ms(ttl)}: "
                "each pending message hops that often",
            )
        ]
    if kind == "relay":
        return [
            (
                Risk.STALL,
                "message-ttl",
                f"messages waiting in it longer than {_ms(ttl)} (a backlog, no relay "
                f"running) are dead-lettered to {topology.parked_queue}",
            )
        ]
    return [(Risk.LOSS, "message-ttl", f"parked messages are dropped after {_ms(ttl)}")]


_REFUSES = (
    "it refuses publishes {full}: schedule() raises PublishRejectedError and the relay "
    "parks its hops after a back-off"
)
_DROPS_PARKED = "it drops its oldest parked message {full}"
# What a length limit does once reached, by (queue, a quorum queue?, refuses publishes?):
# the risk and the broker's doing.
_LIMIT_EFFECTS: dict[tuple[str, bool, bool], tuple[Risk, str]] = {
    ("step", True, True): (Risk.STALL, _REFUSES),
    ("step", False, True): (Risk.STALL, _REFUSES),
    ("step", True, False): (
        Risk.LOSS,
        "it pushes its oldest message out early {full}, and dead-letters at-most-once (the "
        "broker logs 'Falling back to dead-letter-strategy at-most-once')",
    ),
    ("step", False, False): (
        Risk.STALL,
        "it pushes its oldest message out early {full}: the relay holds such messages in "
        "memory and parks what it cannot hold",
    ),
    ("relay", True, True): (
        Risk.STALL,
        "it refuses dead-lettered hops {full}: they wait in their step queue and come late",
    ),
    ("relay", False, True): (Risk.LOSS, "the steps' at-most-once dead-lettering drops hops {full}"),
    ("relay", True, False): (
        Risk.LOSS,
        "it dead-letters its oldest message to {parked} {full} at-most-once",
    ),
    ("relay", False, False): (Risk.STALL, "it dead-letters its oldest message to {parked} {full}"),
    ("parked", True, True): (
        Risk.STALL,
        "it refuses parking {full}: such messages wait in {relay} until there is room",
    ),
    ("parked", False, True): (Risk.LOSS, "parking is refused {full} and the message dropped"),
    ("parked", True, False): (Risk.LOSS, _DROPS_PARKED),
    ("parked", False, False): (Risk.LOSS, _DROPS_PARKED),
}


def _limit_effect(
    kind: str, qtype: str, key: str, limit: int, overflow: Any, topology: Topology
) -> _Effect:
    unit = " bytes" if key == "max-length-bytes" else " message(s)"
    refuses = overflow in ("reject-publish", "reject-publish-dlx")
    risk, effect = _LIMIT_EFFECTS[(kind, qtype == "quorum", refuses)]
    return (
        risk,
        key,
        effect.format(
            full=f"once it holds {limit}{unit}",
            parked=topology.parked_queue,
            relay=topology.relay_queue,
        ),
    )


def _stream_effects(effective: Mapping[str, Any]) -> list[_Effect]:
    effects: list[_Effect] = []
    retention_s = CANCEL_RETENTION_US // 1_000_000
    age = effective.get("max-age")
    if age is not None and (seconds := _age_s(age)) is not None and seconds < retention_s:
        effects.append(
            (
                Risk.LOSS,
                "max-age",
                f"cancel and reschedule records are deleted after {age} (not "
                f"{retention_s} s): a message due later than that after its cancel may "
                "be delivered",
            )
        )
    if (size := effective.get("max-length-bytes")) is not None:
        effects.append(
            (
                Risk.LOSS,
                "max-length-bytes",
                f"the oldest cancel and reschedule records are deleted once the stream "
                f"holds {size} bytes: a message they cancelled may be delivered",
            )
        )
    return effects


_AGE_UNITS_S = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}


def _age_s(age: Any) -> int | None:
    """A stream ``max-age`` (``7D``, ``4381367s``; ``rabbit_amqqueue:check_max_age``) in s."""
    match = re.fullmatch(r"([0-9]+)([YMDhms])", str(age))
    return int(match[1]) * _AGE_UNITS_S[match[2]] if match else None


def _ms(value: int) -> str:
    return f"{value} ms" if value < 10_000 else f"{value / 1000:g} s"


def _source(
    view: QueueView, key: str, by_name: Mapping[tuple[bool, str], PolicyDefinition]
) -> tuple[str, bool]:
    """Which policy a key of ``view``'s effective definition comes from: (name, operator).
    With both applied and neither definition known, the operator policy (the one hopsched
    cannot mask)."""
    if view.operator_policy and view.policy:
        operator = by_name.get((True, view.operator_policy))
        user = by_name.get((False, view.policy))
        if (operator is None or key not in operator.definition) and (
            user is not None and key in user.definition
        ):
            return view.policy, False
        return view.operator_policy, True
    if view.operator_policy:
        return view.operator_policy, True
    return view.policy or "?", False


def _fix(
    topology: Topology,
    policy: str,
    operator: bool,
    by_name: Mapping[tuple[bool, str], PolicyDefinition],
    vhost: str,
) -> str:
    if operator:
        known = by_name.get((True, policy))
        if known is None:
            return (
                f"ask the broker's operator to exclude the queues of prefix "
                f"{topology.prefix!r} from operator policy {policy!r} (hopsched cannot "
                "mask an operator policy)"
            )
        return (
            "exclude the prefix's queues from it (hopsched cannot mask an operator "
            f"policy): {set_policy_command(excluding(known, topology), vhost)}"
        )
    protect = protective_policy_names(topology)
    if policy in protect:
        return f"set the protective policy {policy!r} again: hopsched policies protect"
    known = by_name.get((False, policy))
    priority = PROTECT_PRIORITY
    if known is not None and known.priority >= PROTECT_PRIORITY:
        priority = known.priority + 1
    option = "" if priority == PROTECT_PRIORITY else f" --priority {priority}"
    return (
        f"keep it off hopsched's queues with the protective policies: hopsched policies "
        f"protect --prefix {shlex.quote(topology.prefix)}{option} (or "
        f"{set_policy_command(protective_policies(topology, priority)[0], vhost)} and "
        f"{set_policy_command(protective_policies(topology, priority)[1], vhost)})"
    )


def _masked(
    topology: Topology,
    queues: Mapping[str, QueueView | None],
    policies: Iterable[PolicyDefinition],
    version: str,
) -> tuple[str, ...]:
    """User policies that would apply to some of the prefix's queues but do not because
    a protective policy does, as ``name (keys)``."""
    protect = protective_policy_names(topology)
    masked = []
    for policy in policies:
        if policy.operator or policy.name in protect:
            continue
        if any(
            view is not None
            and view.policy in protect
            and _applies(policy, view.name, view.type, _version(version))
            for view in queues.values()
        ):
            masked.append(f"{policy.name} ({', '.join(sorted(policy.definition))})")
    return tuple(masked)


# Policy keys each queue type does not support: a policy holding one does not apply to a
# queue of that type at all (``unsupported_policies`` of rabbit_quorum_queue,
# rabbit_classic_queue, rabbit_stream_queue; RabbitMQ 3.10.8 and 4.0.5).
_MIRRORING = frozenset(
    {"ha-mode", "ha-params", "ha-sync-mode", "ha-promote-on-shutdown", "ha-promote-on-failure"}
)
_STREAM_KEYS = frozenset({"max-age", "stream-max-segment-size-bytes", "initial-cluster-size"})
_UNSUPPORTED: dict[str, frozenset[str]] = {
    "quorum": _STREAM_KEYS
    | _MIRRORING
    | {"max-priority", "queue-mode", "single-active-consumer", "queue-master-locator"},
    "classic": _STREAM_KEYS | {"delivery-limit", "dead-letter-strategy"},
    "stream": _MIRRORING
    | {
        "expires",
        "message-ttl",
        "dead-letter-exchange",
        "dead-letter-routing-key",
        "max-length",
        "max-in-memory-length",
        "max-in-memory-bytes",
        "max-priority",
        "overflow",
        "queue-mode",
        "single-active-consumer",
        "delivery-limit",
        "queue-master-locator",
        "dead-letter-strategy",
    },
}
# ... and what 4.x changed: classic queues took queue-leader-locator, dropped the
# in-memory limits; the target-group-size key is quorum-only.
_UNSUPPORTED_BEFORE_4 = {"classic": frozenset({"queue-leader-locator"})}
_UNSUPPORTED_FROM_4 = {
    "classic": frozenset({"max-in-memory-length", "max-in-memory-bytes", "target-group-size"}),
    "stream": frozenset({"target-group-size"}),
}
_APPLY_TO_TYPE = {"classic": "classic_queues", "quorum": "quorum_queues", "stream": "streams"}
# Merged as the lower of a user and an operator policy's values
# (``rabbit_policies:merge_policy_value``); for other keys the operator's value wins.
_LOWER_WINS = frozenset(
    {
        "expires",
        "message-ttl",
        "max-length",
        "max-length-bytes",
        "max-in-memory-length",
        "max-in-memory-bytes",
        "delivery-limit",
    }
)


def _applies(policy: PolicyDefinition, name: str, qtype: str, version: tuple[int, ...]) -> bool:
    """Whether the broker would consider ``policy`` for queue ``name`` of type ``qtype``
    (``rabbit_policy:matches``: apply-to, every key supported, the pattern)."""
    if policy.apply_to not in ("queues", "all", _APPLY_TO_TYPE.get(qtype)):
        return False
    extra = (_UNSUPPORTED_FROM_4 if version >= (4, 0) else _UNSUPPORTED_BEFORE_4).get(qtype)
    unsupported = _UNSUPPORTED.get(qtype, frozenset()) | (extra or frozenset())
    if unsupported & set(policy.definition):
        return False
    return _matcher(policy.pattern)(name)


def applying(view: QueueView, policies: Sequence[PolicyDefinition], version: str = "") -> QueueView:
    """``view`` with the user and operator policy the broker applies to it, and their
    merged definition, worked out from ``policies`` (``rabbit_policy:match`` and
    ``merge_operator_definitions``). Of several matching policies of one kind the one
    with the highest priority applies; where two share it RabbitMQ does not say which,
    and this takes the one the management API reports, else the first by name."""
    numbers = _version(version)
    chosen: dict[bool, PolicyDefinition | None] = {}
    for operator in (False, True):
        reported = view.operator_policy if operator else view.policy
        candidates = [
            p
            for p in policies
            if p.operator == operator and _applies(p, view.name, view.type, numbers)
        ]
        if not candidates:
            chosen[operator] = None
            continue
        top = max(p.priority for p in candidates)
        tied = sorted((p for p in candidates if p.priority == top), key=lambda p: p.name)
        chosen[operator] = next((p for p in tied if p.name == reported), tied[0])
    user, operator_policy = chosen[False], chosen[True]
    merged = dict(user.definition) if user is not None else {}
    for key, value in (operator_policy.definition if operator_policy is not None else {}).items():
        if key in merged and key in _LOWER_WINS:
            merged[key] = _lower(key, merged[key], value, numbers >= (4, 0))
        else:
            merged[key] = value
    return QueueView(
        view.name,
        view.type,
        view.arguments,
        user.name if user is not None else None,
        operator_policy.name if operator_policy is not None else None,
        merged,
    )


def _lower(key: str, value: Any, operator_value: Any, four: bool) -> Any:
    """A user and an operator policy's values merged: the lower; from 4.0 a negative
    (unlimited) delivery-limit loses to a limit."""
    if key == "delivery-limit" and four and min(value, operator_value) < 0:
        return max(value, operator_value)
    return min(value, operator_value)


def _matcher(pattern: str) -> Callable[[str], bool]:
    """RabbitMQ matches policy patterns as Erlang (PCRE) regexes, unanchored; Python's
    ``re`` reads the common ones alike (one it cannot read matches nothing)."""
    try:
        compiled = re.compile(pattern)
    except re.error:
        return lambda _: False
    return lambda name: compiled.search(name) is not None
