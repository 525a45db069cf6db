"""Field case F28: a blanket policy (``.*``, apply-to queues) set while hopsched runs, on
a private node with the management plugin (and, for expires, one without it).

The input of F28, per variant: 10 messages parked before the policy, 40 due at +20 s
and 40 at +45 s, then the policy. On main (before): ``expires`` 8 s delivered 0 of 80
and the broker deleted 30 of the 33 queues with their messages, the parked ones too;
``max-length`` 1 + ``drop-head`` delivered 80 but kept 1 of 10 parked and made 214,899
hops in 52 s (each hop pushed the step's previous message straight back into the relay,
which hopped it into the same step); ``message-ttl`` 5 s was fine.

Each test asserts the outcome exactly: every schedule id delivered once, never early;
the parked messages kept; hops bounded; the relay's ERROR line and metric; ``hopsched
status``'s exit status and text; and that the fix it names works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aio_pika
import pytest
from support import Cleanup, Collector, Relays, Targets, hopsched_cli, schedule_all
from support.private_nodes import PrivateBroker

import hopsched
from hopsched.broker.management import ManagementClient
from hopsched.broker.objects import declare_topology
from hopsched.broker.parked import list_parked
from hopsched.broker.policies import PolicyDefinition, PolicyReport, QueueView, applying, assess
from hopsched.broker.policy_watch import CHECK_INTERVAL_S
from hopsched.testing.localbroker import free_port

pytestmark = pytest.mark.slow

StartBroker = Callable[..., Awaitable[PrivateBroker]]
EXPIRES = {"expires": 8000}
DROP_HEAD = {"max-length": 1, "overflow": "drop-head"}
MESSAGE_TTL = {"message-ttl": 5000}


@dataclass
class Managed:
    """A private node (with the management plugin unless ``management`` is False), and
    settings for one prefix on it."""

    node: PrivateBroker
    management_url: str  # nothing listens there without the plugin
    settings: hopsched.Settings

    @property
    def env(self) -> dict[str, str]:
        return {"HOPSCHED_MANAGEMENT_URL": self.management_url}


@pytest.fixture
def management() -> bool:
    """Override with ``@pytest.mark.parametrize("management", [False])``."""
    return True


@pytest.fixture
async def managed(start_private_broker: StartBroker, queue_type: str, management: bool) -> Managed:
    node = await start_private_broker(management=management)
    url = node.management_url or f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    if management:
        for _ in range(100):  # the plugin listens a moment after AMQP
            try:
                overview = await asyncio.to_thread(_scrape, url + "api/overview", login=True)
                break
            except OSError:
                await asyncio.sleep(0.2)
        print(f"\nRabbitMQ {json.loads(overview)['rabbitmq_version']}")
    settings = hopsched.Settings(
        url=node.url,
        prefix=f"f28{uuid.uuid4().hex[:6]}",
        management_url=url,
        queue_type=queue_type,  # type: ignore[arg-type]
        metrics_port=free_port(),
        log_interval_s=5.0,
    )
    return Managed(node, url, settings)


@pytest.fixture
async def node_targets(managed: Managed) -> AsyncIterator[Targets]:
    connection = await aio_pika.connect(managed.node.url)
    yield Targets(connection, Cleanup(managed.node.url))
    await connection.close()


@dataclass
class Outcome:
    """What F28's input came to."""

    scheduled: list[hopsched.Scheduled]
    target: Collector
    parked_ids: set[str]
    policy_set_at: float  # time.time()
    relay: hopsched.Relay
    metrics: str  # the relay's /metrics once the policy had been seen


async def run_f28(
    managed: Managed,
    relays: Relays,
    targets: Targets,
    definition: dict[str, object],
    *,
    operator: bool = False,
    protected: bool = False,
) -> Outcome:
    """F28's input: relay, 10 parked, 40 due at +20 s and 40 at +45 s, then the policy
    ``blanket`` (``.*``); waits for the 80 (up to 90 s)."""
    settings = managed.settings
    await declare_topology(settings)
    if protected:
        status, out, err = await hopsched_cli(
            "policies", "protect", settings=settings, env=managed.env
        )
        assert status == 0, (out, err)
    relay = await relays.start(settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings) as scheduler:
        parked = await schedule_all(  # no queue is bound to these: the relay parks them
            scheduler,
            [{"message": b"p", "delay": 0, "routing_key": f"nowhere{i}"} for i in range(10)],
        )
        await _until(lambda: relay.stats.parked == 10, 30, "10 messages parked")
        calls = [
            {"message": b"m", "delay": delay, "routing_key": target.name}
            for delay in [20.0] * 40 + [45.0] * 40
        ]
        scheduled = await schedule_all(scheduler, calls)
    verb = "set_operator_policy" if operator else "set_policy"
    await managed.node.rabbitmqctl(
        verb, "blanket", ".*", json.dumps(definition), "--apply-to", "queues"
    )
    policy_set_at = time.time()
    await asyncio.sleep(CHECK_INTERVAL_S * 2 + 1)
    metrics = await asyncio.to_thread(_scrape, f"http://127.0.0.1:{settings.metrics_port}/metrics")
    await target.wait_for_ids({s.schedule_id for s in scheduled}, within=90)
    await target.settle(2.0)
    return Outcome(
        scheduled, target, {s.schedule_id for s in parked}, policy_set_at, relay, metrics
    )


async def _until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} within {within} s")
        await asyncio.sleep(0.1)


def _scrape(url: str, *, login: bool = False) -> str:
    """GET ``url`` (the management API's needs a login)."""
    request = urllib.request.Request(url)
    if login:
        request.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
    with urllib.request.urlopen(request, timeout=5) as response:
        text: str = response.read().decode()
    return text


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


async def queues_left(managed: Managed) -> list[str]:
    """The prefix's queues that exist (passive declare each)."""
    topology = hopsched.Topology.from_settings(managed.settings)
    left = []
    connection = await aio_pika.connect(managed.node.url)
    async with connection:
        for name in topology.all_queues():
            try:
                async with connection.channel() as channel:
                    await channel.declare_queue(name, passive=True)
                left.append(name)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                pass
    return left


async def parked_after(managed: Managed, relays: Relays, outcome: Outcome) -> set[str]:
    """Clear the policy, stop the relay, and return the schedule ids still parked."""
    for verb in ("clear_policy", "clear_operator_policy"):
        with contextlib.suppress(hopsched.HopschedError):  # the other kind
            await managed.node.rabbitmqctl(verb, "blanket")
    await relays.stop(outcome.relay)
    listing = await list_parked(managed.settings)
    assert listing.total == len(listing.messages)
    return {m.schedule_id for m in listing.messages if m.schedule_id is not None}


def errors_of(caplog: pytest.LogCaptureFixture, since: float) -> list[logging.LogRecord]:
    """The policy watch's ERROR lines, logged at least ``since`` (time.time())."""
    return [
        r
        for r in caplog.records
        if r.name == "hopsched.policies" and r.levelno == logging.ERROR and r.created >= since
    ]


def report_line(
    variant: str, outcome: Outcome, kept: set[str], errors: list[logging.LogRecord]
) -> None:
    """Print what the variant came to (for docs/guarantees.md)."""
    first = f"{errors[0].created - outcome.policy_set_at:.1f} s" if errors else "none"
    stats = outcome.relay.stats
    print(
        f"\nF28 {variant}: delivered {len(outcome.target.counts())}/80, parked kept "
        f"{len(kept & outcome.parked_ids)}/10, relay hops {stats.hops}, returned early "
        f"{stats.returned_early}, first ERROR after the policy: {first}"
    )


def assert_delivered_once(outcome: Outcome) -> None:
    outcome.target.assert_never_early()
    assert outcome.target.counts() == {s.schedule_id: 1 for s in outcome.scheduled}


# --- expires -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operator", "queue_type"),
    [(False, "quorum"), (True, "quorum"), (False, "classic")],
    ids=["policy", "operator-policy", "policy-classic"],
)
async def test_F28_a_blanket_expires_deletes_nothing_while_a_relay_runs(
    managed: Managed,
    relays: Relays,
    node_targets: Targets,
    caplog: pytest.LogCaptureFixture,
    operator: bool,
) -> None:
    """Before: 0 of 80 delivered, 30 of 33 queues deleted with their messages. Now the
    relay keeps every queue in use (a quorum queue's lease is renewed only by a consumer
    or a basic.get), says at once that the policy can lose messages (they would go with
    no relay running), with the fix; the fix clears it."""
    caplog.set_level(logging.INFO, logger="hopsched")
    started = time.time()
    outcome = await run_f28(managed, relays, node_targets, EXPIRES, operator=operator)

    assert_delivered_once(outcome)
    assert await queues_left(managed) == list(
        hopsched.Topology.from_settings(managed.settings).all_queues()
    )
    kind = "operator policy" if operator else "policy"
    errors = errors_of(caplog, started)
    assert errors, "the relay said nothing"
    first = errors[0]
    assert first.created - outcome.policy_set_at < CHECK_INTERVAL_S + 3  # at once
    text = first.getMessage()
    assert text.startswith(f"loss possible: {kind} 'blanket' sets expires=8000 on ")
    if operator:
        assert (
            "rabbitmqctl set_operator_policy -p / --priority 0 --apply-to queues blanket '^(?!"
            in text
        )
    else:
        assert f"hopsched policies protect --prefix {managed.settings.prefix}" in text
    assert metric(outcome.metrics, 'hopsched_policy_risks{risk="loss"}') == 2  # queues, relay
    assert metric(outcome.metrics, "hopsched_policy_unchecked") == 0
    async with hopsched.Scheduler(managed.settings) as scheduler:  # a producer is told too
        await _until(lambda: scheduler.policy_report is not None, 10, "a report")
        assert scheduler.policy_report is not None
        assert scheduler.policy_report.at_risk
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith(f"scheduling on prefix {managed.settings.prefix}: loss possible: {kind}")
        for m in warned
    )

    status, out, err = await hopsched_cli("status", settings=managed.settings, env=managed.env)
    assert status == 1, (out, err)
    assert f"policies: loss possible: {kind} 'blanket' sets expires=8000" in out
    assert "can be lost or stalled" in err
    # the fix the line names, as printed
    fix = text.split("Fix: ", 1)[1]
    if operator:
        command = shlex.split(fix.split(": ", 1)[1])
        assert command[0] == "rabbitmqctl"
        await managed.node.rabbitmqctl(*command[1:])
    else:
        status, out, err = await hopsched_cli(
            "policies",
            "protect",
            "--prefix",
            managed.settings.prefix,
            settings=managed.settings,
            env=managed.env,
        )
        assert status == 0, (out, err)
    await asyncio.sleep(CHECK_INTERVAL_S * 2 + 1)
    status, out, err = await hopsched_cli("status", settings=managed.settings, env=managed.env)
    assert status == 0, (out, err)
    assert "policies: no policy in force can lose or stall messages" in out
    assert any(
        r.getMessage().startswith("no longer in force: loss possible") for r in caplog.records
    )
    kept = await parked_after(managed, relays, outcome)
    report_line(f"expires ({kind}, {managed.settings.queue_type})", outcome, kept, errors)
    assert kept == outcome.parked_ids


@pytest.mark.parametrize(
    ("management", "queue_type"), [(False, "quorum"), (False, "classic")], ids=["quorum", "classic"]
)
async def test_F28_without_the_management_api_a_blanket_expires_deletes_nothing_while_a_relay_runs(
    managed: Managed, relays: Relays, node_targets: Targets, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 0 of 80 delivered, the parked messages gone, after one WARNING at start
    (the default install of Debian, every private node: no management plugin). Now the
    relay, not knowing the lease, keeps every queue an expires could delete in use
    every UNCHECKED_TOUCH_INTERVAL_S, and says so in that WARNING."""
    caplog.set_level(logging.INFO, logger="hopsched")
    started = time.time()
    outcome = await run_f28(managed, relays, node_targets, EXPIRES)

    assert_delivered_once(outcome)
    assert await queues_left(managed) == list(
        hopsched.Topology.from_settings(managed.settings).all_queues()
    )
    assert metric(outcome.metrics, "hopsched_policy_unchecked") == 1
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "hopsched.policies" and r.levelno >= logging.WARNING
    ]
    assert len(said) == 1, said  # no touch failed
    assert said[0].startswith(
        f"cannot read the policies in force on prefix {managed.settings.prefix}'s queues ("
    )
    assert "meanwhile the relay keeps every queue in use, against an expires" in said[0]
    kept = await parked_after(managed, relays, outcome)
    report_line(
        f"expires, no management API ({managed.settings.queue_type})",
        outcome,
        kept,
        errors_of(caplog, started),
    )
    assert kept == outcome.parked_ids


# --- max-length + drop-head -----------------------------------------------------------


async def test_F28_a_blanket_drop_head_limit_is_kept_off_by_the_protective_policies(
    managed: Managed, relays: Relays, node_targets: Targets, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 1 of 10 parked kept, 214,899 hops in 52 s, at-most-once dead-lettering.
    With `hopsched policies protect` (a user policy of priority 1000 on the prefix's
    queues) the blanket policy applies to none of them: nothing changes."""
    caplog.set_level(logging.INFO, logger="hopsched")
    started = time.time()
    outcome = await run_f28(managed, relays, node_targets, DROP_HEAD, protected=True)

    assert_delivered_once(outcome)
    assert outcome.relay.stats.hops <= 4 * 80  # a hop or two each: no storm
    assert outcome.relay.stats.returned_early == 0
    assert errors_of(caplog, started) == []
    assert metric(outcome.metrics, 'hopsched_policy_risks{risk="loss"}') == 0
    status, out, err = await hopsched_cli("status", settings=managed.settings, env=managed.env)
    assert status == 0, (out, err)
    assert (
        "policies: masked by hopsched's protective policies: blanket (max-length, overflow)" in out
    )
    assert "Falling back to dead-letter-strategy at-most-once" not in managed.node.log()
    kept = await parked_after(managed, relays, outcome)
    report_line("drop-head, protected", outcome, kept, errors_of(caplog, started))
    assert kept == outcome.parked_ids


async def test_F28_a_blanket_drop_head_limit_on_unprotected_queues_makes_no_hop_storm(
    managed: Managed, relays: Relays, node_targets: Targets, caplog: pytest.LogCaptureFixture
) -> None:
    """Unprotected, the broker drops 9 of the 10 parked messages the moment the policy is
    set (nothing hopsched can do then: hence `protect`), and every step pushes its
    previous message out at each hop. A hop pushed out early now waits until its hop
    would have ended instead of being hopped straight back: all 80 delivered, hops
    bounded; the relay says at once that messages can be lost, with the fix."""
    caplog.set_level(logging.INFO, logger="hopsched")
    started = time.time()
    outcome = await run_f28(managed, relays, node_targets, DROP_HEAD)

    assert_delivered_once(outcome)
    stats = outcome.relay.stats
    assert stats.hops <= 1000  # before: 214,899 in 52 s
    assert stats.returned_early > 0
    lines = [r.getMessage() for r in errors_of(caplog, started)]
    assert any(
        line.startswith("loss possible: policy 'blanket' sets max-length=1 on 1 queue(s) (")
        and "parked): it drops its oldest parked message once it holds 1 message" in line
        and f"hopsched policies protect --prefix {managed.settings.prefix}" in line
        for line in lines
    ), lines
    assert (
        metric(outcome.metrics, 'hopsched_policy_risks{risk="loss"}') == 3
    )  # steps, relay, parked
    status, out, err = await hopsched_cli("status", settings=managed.settings, env=managed.env)
    assert status == 1, (out, err)
    assert "policies: loss possible: policy 'blanket' sets max-length=1" in out
    kept = await parked_after(managed, relays, outcome)
    report_line("drop-head, unprotected", outcome, kept, errors_of(caplog, started))
    assert kept <= outcome.parked_ids  # the broker dropped the others as the policy came


# --- message-ttl -----------------------------------------------------------------------


async def test_F28_a_blanket_message_ttl_costs_hops_and_is_reported_for_the_parking_queue(
    managed: Managed, relays: Relays, node_targets: Targets, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: fine (nothing lost), and nothing said. A 5 s message-ttl cuts every step
    above 5 s to 5 s (a hop every 5 s per message), and drops what is parked into an
    empty parking queue after 5 s: the relay says so (an ERROR for the parking queue and
    the relay queue, a WARNING for the hops), status exits 1."""
    caplog.set_level(logging.INFO, logger="hopsched")
    started = time.time()
    outcome = await run_f28(managed, relays, node_targets, MESSAGE_TTL)

    assert_delivered_once(outcome)
    assert outcome.relay.stats.hops <= 80 * 12  # a hop per 5 s at most
    lines = [r.getMessage() for r in errors_of(caplog, started)]
    parked_queue = f"{managed.settings.prefix}.parked"
    assert any(
        line.startswith(
            f"loss possible: policy 'blanket' sets message-ttl=5000 on 1 queue(s) ({parked_queue})"
        )
        and "parked messages are dropped after 5000 ms" in line
        for line in lines
    ), lines
    assert any(
        r.levelno == logging.WARNING
        and r.getMessage().startswith("hops possible: policy 'blanket' sets message-ttl")
        for r in caplog.records
    )
    assert metric(outcome.metrics, 'hopsched_policy_risks{risk="loss"}') == 1
    assert metric(outcome.metrics, 'hopsched_policy_risks{risk="stall"}') == 1
    assert metric(outcome.metrics, 'hopsched_policy_risks{risk="hops"}') == 1
    status, out, err = await hopsched_cli("status", settings=managed.settings, env=managed.env)
    assert status == 1, (out, err)
    kept = await parked_after(managed, relays, outcome)
    report_line("message-ttl", outcome, kept, errors_of(caplog, started))
    assert kept == outcome.parked_ids  # parked before the policy: they keep no TTL


# --- the other keys, priorities, operator policies: as the broker applies them -----------

VARIANTS = [
    # (kind, name, pattern, priority, apply-to, definition, findings: {(risk, key, queues)})
    (
        "policy",
        "bytes",
        ".*",
        0,
        "queues",
        {"max-length-bytes": 10**6},
        {
            ("stall", "max-length-bytes", 29),
            ("stall", "max-length-bytes", 2),  # the relays' queues: relay and ingress
            ("loss", "max-length-bytes", 1),
            ("loss", "max-length-bytes", 1),
        },
    ),
    (
        "policy",
        "dlx",
        ".*",
        0,
        "queues",
        {"max-length": 10, "overflow": "reject-publish-dlx"},
        {
            ("loss", "max-length", 29),
            ("loss", "max-length", 2),
            ("loss", "max-length", 1),
        },
    ),
    ("policy", "elsewhere", ".*", 0, "queues", {"dead-letter-exchange": "elsewhere"}, set()),
    (
        "policy",
        "limit",
        ".*",
        0,
        "queues",
        {"delivery-limit": 5},
        {
            ("stall", "delivery-limit", 2),
            ("loss", "delivery-limit", 1),
        },
    ),
    ("policy", "lazy", ".*", 0, "queues", {"queue-mode": "lazy", "expires": 8000}, set()),
    ("policy", "stream-expires", "cancelled$", 0, "queues", {"expires": 8000}, set()),
    (
        "policy",
        "stream-age",
        "cancelled$",
        0,
        "queues",
        {"max-age": "1h"},
        {("loss", "max-age", 1)},
    ),
    ("policy", "exchanges", ".*", 0, "exchanges", {"alternate-exchange": "ae"}, set()),
]


async def management_views(
    managed: Managed,
) -> tuple[dict[str, QueueView | None], list[PolicyDefinition], str]:
    """The prefix's queues as the management API reports them, the vhost's policies and
    the broker's version."""
    client = ManagementClient(managed.settings)
    topology = hopsched.Topology.from_settings(managed.settings)
    found = await client.get(
        "queues/%2F?columns=name,type,arguments,policy,operator_policy,effective_policy_definition"
    )
    views: dict[str, QueueView | None] = dict.fromkeys(topology.all_queues())
    for item in found:
        if item["name"] in views:
            views[item["name"]] = QueueView.from_api(item)
    policies = [PolicyDefinition.from_api(p) for p in await client.get("policies/%2F")]
    policies += [
        PolicyDefinition.from_api(p, operator=True)
        for p in await client.get("operator-policies/%2F")
    ]
    overview = await client.get("overview")
    return views, policies, str(overview["rabbitmq_version"])


async def agreed(managed: Managed, within: float = 40) -> PolicyReport:
    """Wait until what hopsched works out from the policies is what the broker reports
    for every queue (its statistics lag a few seconds); return the report."""
    deadline = time.monotonic() + within
    while True:
        views, policies, version = await management_views(managed)
        worked_out = {
            name: None if view is None else applying(view, policies, version)
            for name, view in views.items()
        }
        different = {
            name: (view, worked_out[name])
            for name, view in views.items()
            if view is not None and view != worked_out[name]
        }
        if not different:
            topology = hopsched.Topology.from_settings(managed.settings)
            return assess(topology, views, policies, version=version)
        if time.monotonic() > deadline:
            pytest.fail(f"the broker applies other policies than hopsched works out: {different}")
        await asyncio.sleep(1)


async def test_F28_each_key_priority_and_policy_kind_as_the_broker_applies_it(
    managed: Managed,
) -> None:
    """Every variant: what hopsched works out from the vhost's policies (at once) is what
    the broker then reports for each queue, and the findings are the expected ones."""
    settings = managed.settings
    await declare_topology(settings)
    ctl = managed.node.rabbitmqctl
    await ctl("set_policy", "irrelevant", "^other\\.", '{"expires": 1000}', "--apply-to", "queues")
    version = (await management_views(managed))[2]
    for kind, name, pattern, priority, apply_to, definition, expected in VARIANTS:
        verb = "set_operator_policy" if kind == "operator" else "set_policy"
        await ctl(
            verb,
            name,
            pattern,
            json.dumps(definition),
            "--priority",
            str(priority),
            "--apply-to",
            apply_to,
        )
        report = await agreed(managed)
        got = {(f.risk.value, f.key, len(f.queues)) for f in report.findings}
        assert got == expected, (name, report.findings)
        assert all(f.policy == name for f in report.findings)
        await ctl("clear_operator_policy" if kind == "operator" else "clear_policy", name)

    # priorities: the higher applies to the steps, the lower to the rest (a long expires:
    # no relay keeps the queues in use here)
    await ctl(
        "set_policy", "low", ".*", '{"expires": 3600000}', "--priority", "0", "--apply-to", "queues"
    )
    await ctl(
        "set_policy",
        "high",
        "step",
        '{"max-length": 100}',
        "--priority",
        "5",
        "--apply-to",
        "queues",
    )
    report = await agreed(managed)
    assert {(f.policy, f.key, len(f.queues)) for f in report.findings} == {
        ("high", "max-length", 29),
        ("low", "expires", 2),  # the relays' queues: relay and ingress
        ("low", "expires", 1),  # parked
    }
    # protected: both masked; one above the protection is not, and its fix says how high
    status, out, err = await hopsched_cli("policies", "protect", settings=settings, env=managed.env)
    assert status == 0, (out, err)
    report = await agreed(managed)
    assert (report.findings, report.protected) == ((), True), (report.missing, report.pending)
    assert set(report.masked) == {"low (expires)", "high (max-length)"}
    await ctl(
        "set_policy",
        "above",
        ".*",
        '{"max-length": 5}',
        "--priority",
        "2000",
        "--apply-to",
        "queues",
    )
    report = await agreed(managed)
    assert {f.policy for f in report.findings} == {"above"}
    assert all("--priority 2001" in f.fix for f in report.findings)
    await ctl("clear_policy", "above")
    # an operator policy cannot be masked: 3.10 may not set overflow, and the protection
    # turns its length limit into refusals; 3.13+ may, and its drop-head wins
    four = version.startswith("4.")
    limit = {"max-length": 10, **({"overflow": "drop-head"} if four else {})}
    await ctl("set_operator_policy", "op", ".*", json.dumps(limit), "--apply-to", "queues")
    report = await agreed(managed)
    risk = "loss" if four else "stall"
    assert {(f.risk.value, f.policy, f.operator, len(f.queues)) for f in report.findings} == {
        (risk, "op", True, 29),
        (risk, "op", True, 2),  # the relays' queues: relay and ingress
        (risk, "op", True, 1),
    }
    # its fix, run as printed, takes the prefix out of it
    (command, *_) = {f.fix.split(": ", 1)[1] for f in report.findings}
    await ctl(*shlex.split(command)[1:])
    report = await agreed(managed)
    assert report.findings == ()
    status, out, err = await hopsched_cli("policies", "check", settings=settings, env=managed.env)
    assert status == 0, (out, err)
