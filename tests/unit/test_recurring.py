"""The recurring rule (pure): next occurrences, time zones, catch-up; no broker."""

from __future__ import annotations

import contextlib
import random
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hopsched
from hopsched.core.clock import datetime_to_us, us_to_datetime
from hopsched.core.recurring import MISSED_AFTER_US, CatchUp, Link, Recurrence, Rule, plan_link
from hopsched.errors import InvalidScheduleError

PARIS = ZoneInfo("Europe/Paris")
S = 1_000_000
T0 = datetime_to_us(datetime(2026, 1, 5, 9, 0, tzinfo=UTC))  # a Monday


def paris(rule: Rule, start: datetime, n: int) -> list[str]:
    """The first ``n`` occurrences from ``start``, as Paris wall times."""
    out, at = [], rule.next_after_us(datetime_to_us(start) - 1)
    for _ in range(n):
        assert at is not None
        out.append(us_to_datetime(at).astimezone(PARIS).strftime("%m-%d %H:%M%z"))
        at = rule.next_after_us(at)
    return out


def cron(expr: str, tz: str = "UTC", **kw: object) -> Rule:
    return Rule.make(now_us=0, cron=expr, tz=tz, start=datetime(2026, 1, 1, tzinfo=UTC), **kw)  # type: ignore[arg-type]


# --- time zones: the DST gap and fold (docs/recurring.md) -----------------------------------


def test_a_0230_job_on_the_spring_forward_day_runs_at_0300_once() -> None:
    rule = cron("30 2 * * *", "Europe/Paris")
    assert paris(rule, datetime(2026, 3, 28, tzinfo=PARIS), 3) == [
        "03-28 02:30+0100",
        "03-29 03:00+0200",  # 02:30 does not exist that day: the first instant after the gap
        "03-30 02:30+0200",
    ]


def test_a_0230_job_on_the_fall_back_day_runs_once_at_the_first_0230() -> None:
    rule = cron("30 2 * * *", "Europe/Paris")
    assert paris(rule, datetime(2026, 10, 24, tzinfo=PARIS), 3) == [
        "10-24 02:30+0200",
        "10-25 02:30+0200",  # summer time's 02:30; the second 02:30 (+0100) does not run
        "10-26 02:30+0100",
    ]


def test_from_the_second_pass_of_the_fold_the_next_is_the_next_day() -> None:
    rule = cron("30 2 * * *", "Europe/Paris")
    second_0215 = datetime(2026, 10, 25, 2, 15, fold=1, tzinfo=PARIS)  # after 02:30 +0200 ran
    assert rule.next_after(second_0215) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)


def test_a_real_time_expression_runs_in_the_repeated_hour_and_not_in_the_missing_one() -> None:
    rule = cron("*/30 * * * *", "Europe/Paris")
    assert paris(rule, datetime(2026, 10, 25, 1, 50, tzinfo=PARIS), 5) == [
        "10-25 02:00+0200",
        "10-25 02:30+0200",
        "10-25 02:00+0100",
        "10-25 02:30+0100",
        "10-25 03:00+0100",
    ]
    assert paris(rule, datetime(2026, 3, 29, 1, 50, tzinfo=PARIS), 2) == [
        "03-29 03:00+0200",
        "03-29 03:30+0200",
    ]


def test_weekday_mornings_in_paris() -> None:
    rule = cron("0 9 * * 1-5", "Europe/Paris")
    friday = datetime(2026, 7, 3, 9, 0, tzinfo=PARIS)
    assert rule.next_after(friday) == datetime(2026, 7, 6, 7, 0, tzinfo=UTC)  # Monday, CEST


# --- making a rule: errors name what is wrong ------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"cron": "61 * * * *"}, "'61 * * * *'"),
        ({"cron": "0 9 * *"}, "'0 9 * *'"),
        ({"cron": "0 9 * * *", "tz": "Mars/Olympus"}, "'Mars/Olympus'"),
        ({"cron": "0 9 * * *", "tz": "../etc/passwd"}, "'../etc/passwd'"),
        ({"every": 0.5}, "every=0.5"),
        ({"every": 5, "tz": "Europe/Paris"}, "cron= only"),
        ({}, "exactly one"),
        ({"every": 5, "cron": "* * * * *"}, "exactly one"),
        ({"every": 5, "count": 0}, "count=0"),
        ({"every": 5, "catch_up": "some"}, "catch_up='some'"),
        ({"every": 5, "start": datetime(2026, 1, 1)}, "naive"),
        ({"cron": "0 0 30 2 *"}, "'0 0 30 2 *'"),  # 30 February never comes
    ],
)
def test_invalid_rules_are_refused_naming_the_argument(
    kwargs: dict[str, object], names: str
) -> None:
    with pytest.raises(InvalidScheduleError, match=names.replace("*", r"\*").replace(".", r"\.")):
        Rule.make(now_us=T0, **kwargs)  # type: ignore[arg-type]


def test_until_before_start_is_refused() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    with pytest.raises(InvalidScheduleError, match="before the start"):
        Rule.make(now_us=0, every=60, start=start, until=start - timedelta(seconds=1))


def test_an_interval_starts_one_interval_from_now_by_default() -> None:
    rule = Rule.make(now_us=T0, every=timedelta(seconds=30))
    assert rule.first_us() == T0 + 30 * S


def test_the_header_value_decodes_to_the_same_rule() -> None:
    for rule in (
        Rule.make(now_us=T0, every=2, count=3, catch_up="all"),
        Rule.make(
            now_us=T0,
            cron="0 9 * * 1-5",
            tz="Europe/Paris",
            until=us_to_datetime(T0 + 7 * 86_400 * S),
        ),
    ):
        assert Rule.decode(rule.encode()) == rule
    with pytest.raises(InvalidScheduleError, match="not JSON"):
        Rule.decode("every 5 s")
    with pytest.raises(InvalidScheduleError, match="bad"):
        Rule.decode('{"v":1,"e":10,"s":0}')  # under the 1 s floor: not one make() writes


# --- catch-up --------------------------------------------------------------------------------


def every_2s(**kw: object) -> Rule:
    return Rule.make(now_us=T0, every=2, start=us_to_datetime(T0), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "late_s", "expected"),
    [
        # on time: the same for all three
        ("latest", 0.003, Link(T0, T0 + 2 * S)),
        ("all", 0.003, Link(T0, T0 + 2 * S)),
        ("none", 0.003, Link(T0, T0 + 2 * S)),
        # 3 s late: the next one is due too
        ("latest", 3, Link(T0 + 2 * S, T0 + 4 * S)),
        ("all", 3, Link(T0, T0 + 2 * S)),
        ("none", 3, Link(T0 + 2 * S, T0 + 4 * S)),  # not missed yet: 1 s late
        # 61 s late (a relay outage): 30 occurrences were due
        ("latest", 61, Link(T0 + 60 * S, T0 + 62 * S)),
        ("all", 61, Link(T0, T0 + 2 * S)),
        ("none", 61, Link(T0 + 60 * S, T0 + 62 * S)),  # 60 s due, 1 s late: delivered
    ],
)
def test_catch_up(policy: str, late_s: float, expected: Link) -> None:
    now = T0 + round(late_s * S)
    assert plan_link(every_2s(catch_up=policy), T0, 0, now) == expected


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("latest", Link(T0 + 80 * S, T0 + 100 * S)),
        ("all", Link(T0, T0 + 20 * S)),
        ("none", Link(None, T0 + 100 * S)),  # 80 s was due 15 s ago: missed, skipped
    ],
)
def test_catch_up_of_occurrences_missed_by_more_than_missed_after(
    policy: str, expected: Link
) -> None:
    rule = Rule.make(now_us=T0, every=20, start=us_to_datetime(T0), catch_up=policy)
    assert plan_link(rule, T0, 0, T0 + 95 * S) == expected


def test_count_counts_deliveries_and_until_ends_the_chain() -> None:
    assert plan_link(every_2s(count=3), T0, 2, T0) == Link(T0, None)
    assert plan_link(every_2s(count=3), T0, 1, T0) == Link(T0, T0 + 2 * S)
    every_20s = Rule.make(now_us=T0, every=20, start=us_to_datetime(T0), count=1, catch_up="none")
    skipped = plan_link(every_20s, T0, 0, T0 + 95 * S)
    assert skipped == Link(None, T0 + 100 * S)  # nothing delivered: the one still to come
    until = every_2s(until=us_to_datetime(T0 + 4 * S))
    assert plan_link(until, T0 + 4 * S, 2, T0 + 4 * S) == Link(T0 + 4 * S, None)
    assert plan_link(until, T0, 0, T0 + 100 * S) == Link(T0 + 4 * S, None)


@pytest.mark.parametrize(
    ("policy", "late_s", "skipped"),
    [
        ("latest", 0.003, 0),
        ("latest", 3, 1),  # T0 collapsed into T0 + 2 s
        ("latest", 61, 30),  # T0 .. T0 + 58 s collapsed into T0 + 60 s
        ("all", 61, 0),
        ("none", 61, 30),  # T0 + 60 s is 1 s late: delivered
        ("none", 75, 37),  # T0 + 74 s is 1 s late: delivered; 0 .. 72 s skipped
    ],
)
def test_a_link_counts_the_occurrences_it_skips(policy: str, late_s: float, skipped: int) -> None:
    link = plan_link(every_2s(catch_up=policy), T0, 0, T0 + round(late_s * S))
    assert link.skipped == skipped
    assert link.ended_by is None


def test_a_missed_occurrence_under_none_counts_as_skipped_too() -> None:
    rule = Rule.make(now_us=T0, every=20, start=us_to_datetime(T0), catch_up="none")
    link = plan_link(rule, T0, 0, T0 + 95 * S)  # 0 .. 60 s collapsed, 80 s missed
    assert (link.deliver_us, link.skipped) == (None, 5)


def test_a_cron_catch_up_counts_what_it_skips_up_to_a_thousand() -> None:
    rule = cron("* * * * *")
    due = datetime_to_us(datetime(2026, 2, 1, tzinfo=UTC))
    assert plan_link(rule, due, 0, due + 5 * 60 * S + 30 * S).skipped == 5
    assert plan_link(rule, due, 0, due + 3 * 86_400 * S).skipped == 1000


def test_a_link_says_why_its_chain_ends() -> None:
    assert plan_link(every_2s(count=3), T0, 2, T0).ended_by == "count"
    assert plan_link(every_2s(count=3), T0, 1, T0).ended_by is None
    until = every_2s(until=us_to_datetime(T0 + 4 * S))
    assert plan_link(until, T0 + 4 * S, 2, T0 + 4 * S).ended_by == "until"
    assert plan_link(until, T0 + 2 * S, 1, T0 + 2 * S).ended_by is None


def test_a_cron_catch_up_after_a_long_outage_jumps_to_the_latest() -> None:
    rule = cron("* * * * *")
    due = datetime_to_us(datetime(2026, 2, 1, tzinfo=UTC))
    now = due + 3 * 86_400 * S + 30 * S  # 3 days of minutes missed
    assert plan_link(rule, due, 0, now) == Link(now - 30 * S, now + 30 * S)


# --- properties -------------------------------------------------------------------------------

EXPRESSIONS = ["* * * * *", "*/7 * * * *", "5 */3 * * *", "*/15 * * * 1-5", "0 * 1,15 * *"]
ZONES = ["UTC", "Europe/Paris", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"]
instants = st.integers(min_value=T0, max_value=T0 + 2 * 365 * 86_400 * S)


def matches(expr: str, minute_us: int, tz: str) -> bool:
    """Brute force: a real-time expression's fields against the wall clock of an instant."""
    local = us_to_datetime(minute_us).astimezone(ZoneInfo(tz))
    minute, hour, dom, _, dow = expr.split()

    def field(spec: str, value: int, lo: int, hi: int) -> bool:
        for part in spec.split(","):
            base, _, step = part.partition("/")
            if base == "*":
                first, last = lo, hi
            elif "-" in base:
                first, last = (int(x) for x in base.split("-"))
            else:
                first, last = int(base), hi if step else int(base)
            if value in range(first, last + 1, int(step or 1)):
                return True
        return False

    weekday = local.isoweekday() % 7
    return (
        local.second == 0
        and field(minute, local.minute, 0, 59)
        and field(hour, local.hour, 0, 23)
        and field(dom, local.day, 1, 31)
        and field(dow, weekday, 0, 6)
    )


@settings(max_examples=150, deadline=None)
@given(instants, st.sampled_from(EXPRESSIONS), st.sampled_from(ZONES))
def test_cron_next_is_after_on_the_rule_and_none_is_skipped(at: int, expr: str, tz: str) -> None:
    rule = cron(expr, tz)
    found = rule.next_after_us(at)
    assert found is not None
    assert found > at  # strictly after
    assert matches(expr, found, tz)  # on the rule
    minute = (at // (60 * S) + 1) * 60 * S
    while minute < found:  # never later than the first instant on the rule
        assert not matches(expr, minute, tz), us_to_datetime(minute)
        minute += 60 * S


@settings(max_examples=300, deadline=None)
@given(
    instants,
    st.integers(min_value=1, max_value=86_400 * 40).map(lambda s: s * S),
    st.integers(min_value=-(10**12), max_value=10**12),
)
def test_interval_next_is_the_first_multiple_after(at: int, every_us: int, offset: int) -> None:
    start = at + offset
    rule = Rule(every_us, None, "UTC", start)
    found = rule.next_after_us(at)
    assert found is not None
    assert found > at
    assert found >= start
    assert (found - start) % every_us == 0
    assert found - every_us <= max(at, start - 1)  # the one before it is not after `at`


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["every", *EXPRESSIONS]),
    st.sampled_from(ZONES),
    st.integers(min_value=1, max_value=40),
    st.integers(min_value=1, max_value=400).map(lambda m: m * 60 * S),
    st.sampled_from(list(CatchUp)),
    st.lists(st.integers(min_value=0, max_value=200 * S), min_size=60, max_size=60),
)
def test_a_chain_terminates_moves_forward_and_never_delivers_early(
    kind: str, tz: str, count: int, span_us: int, policy: CatchUp, lateness: list[int]
) -> None:
    start = us_to_datetime(T0)
    what: dict[str, object] = {"every": 90} if kind == "every" else {"cron": kind, "tz": tz}
    common = {"start": start, "catch_up": policy.value, "now_us": T0, **what}
    rules = [Rule.make(count=count, **common)]  # type: ignore[arg-type]
    with contextlib.suppress(InvalidScheduleError):  # none on the rule before until
        rules.append(Rule.make(until=us_to_datetime(T0 + span_us), **common))  # type: ignore[arg-type]
    for rule in rules:
        due, delivered, links = rule.first_us(), 0, 0
        while due is not None:
            now = due + lateness[links % len(lateness)]
            link = plan_link(rule, due, delivered, now)
            if link.deliver_us is not None:
                assert due <= link.deliver_us <= now  # never early, never one not yet due
                delivered += 1
            if link.next_us is not None:
                assert link.next_us > (link.deliver_us or due)  # strictly forward
                assert link.next_us > due
            due, links = link.next_us, links + 1
            assert links <= 10_000
        if rule.count is not None:
            assert delivered <= rule.count
        if rule.until_us is not None:
            assert delivered >= 1 or policy is CatchUp.NONE


def test_missed_after_is_well_above_a_relays_lateness() -> None:
    assert MISSED_AFTER_US >= 10 * S


# --- lineage claims (cancel.py) ----------------------------------------------------------------


def test_lineage_claims_agree_on_one_winner_and_keep_what_they_do_not_know() -> None:
    from hopsched.core.cancel import LINEAGE, Cancellations, Record, decode_records, encode_records

    cancellations = Cancellations(retention_us=100 * S)
    claim = Record(LINEAGE, "chain", T0, due_us=T0 + 10 * S, kind="1.b")
    (read,) = decode_records(encode_records([claim]))
    cancellations.apply(read)
    superseded = cancellations.superseded
    assert superseded("chain", None, T0 + 10 * S, None)  # the first lineage's copy
    assert superseded("chain", None, T0 + 11 * S, None)
    assert not superseded("chain", None, T0 + 10 * S, "1.b")  # the claimed lineage lives
    assert not superseded("chain", None, T0 + 10 * S, "2.x")  # a claim not read yet: kept
    assert not superseded("chain", None, T0 + 9 * S, None)  # before the claim: untouched
    assert not superseded("chain", "k1", T0 + 10 * S, None)  # another signer's schedule
    assert not superseded("other", None, T0 + 10 * S, None)
    # a second crash: the copy of lineage 1.b delivered again, claimed as 2.c
    cancellations.apply(Record(LINEAGE, "chain", T0 - S, due_us=T0 + 10 * S, kind="2.c"))
    assert superseded("chain", None, T0 + 10 * S, "1.b")  # higher generation wins, any clock
    assert not superseded("chain", None, T0 + 10 * S, "2.c")
    # a claim at a later occurrence outranks one at an earlier one, in any reading order
    cancellations.apply(Record(LINEAGE, "chain", T0 + 2 * S, due_us=T0 + 12 * S, kind="1.d"))
    assert superseded("chain", None, T0 + 12 * S, "2.c")
    assert not superseded("chain", None, T0 + 11 * S, "2.c")  # before 1.d's occurrence
    assert not superseded("chain", None, T0 + 12 * S, "1.d")
    assert cancellations.forget(T0 + 100 * S + 1) == 2  # 1.b and 2.c, past retention
    assert not superseded("chain", None, T0 + 12 * S, "2.c")  # forgotten: unknown, kept
    assert superseded("chain", None, T0 + 12 * S, None)


# --- the relay's decisions for a recurring occurrence (decide.py) ----------------------------


def test_link_delivers_without_the_rule_and_chains_the_next_signed_by_the_same_key() -> None:
    from hopsched.core.cancel import Cancellations
    from hopsched.core.decide import Decider, Linked
    from hopsched.core.envelope import Envelope
    from hopsched.core.ladder import Hop, Ladder
    from hopsched.core.signing import Signatures, SigningKey
    from hopsched.core.targets import TargetPolicy

    keys = Signatures((SigningKey("new", b"n" * 32), SigningKey("old", b"o" * 32)), "p")
    decider = Decider(Ladder(), "guest", TargetPolicy(()), 300 * S, keys)
    rule = Rule.make(now_us=T0, every=60, start=us_to_datetime(T0), count=3)
    body = b"tick"
    one = Envelope("s", T0, "", "q", created_us=T0 - S, rule=rule.encode(), occurrence=1)
    signed_old = keys._signed(one, body, keys.keys[1])  # scheduled before a key rotation

    linked = decider.link(signed_old, body, T0 + 5_000, Cancellations(S))

    assert isinstance(linked, Linked)
    assert linked.deliver is not None
    assert linked.next is not None
    assert linked.deliver.rule is None
    assert (linked.deliver.due_us, linked.deliver.occurrence) == (T0, 1)
    assert (linked.next.due_us, linked.next.occurrence) == (T0 + 60 * S, 2)
    assert linked.next.rule == rule.encode()
    assert linked.next.created_us == T0 - S  # a cancel of the schedule reaches it
    assert isinstance(linked.plan, Hop)
    for envelope in (linked.deliver, linked.next):
        assert envelope.owner == "old"  # still its owner's
        assert keys.check_envelope(envelope, body) == envelope  # the MAC verifies
    tampered = Envelope("s", T0, "", "q", created_us=T0 - S, rule=rule.encode(), occurrence=1)
    forged = keys._signed(tampered, body, keys.keys[1])
    swapped = Envelope(
        "s",
        T0,
        "",
        "q",
        created_us=T0 - S,
        rule=Rule.make(now_us=T0, every=1).encode(),
        occurrence=1,
        signature=forged.signature,
    )
    assert keys.check_envelope(swapped, body) != swapped  # the rule is in the MAC
    last = Envelope("s", T0, "", "q", rule=rule.encode(), occurrence=3)
    end = decider.link(last, body, T0, Cancellations(S))
    assert isinstance(end, Linked)
    assert end.next is None  # count reached


def test_claim_takes_the_next_generation_and_drops_a_copy_already_replaced() -> None:
    from hopsched.core.cancel import LINEAGE, Cancellations, Record
    from hopsched.core.decide import Cancel, Decider
    from hopsched.core.envelope import Envelope
    from hopsched.core.ladder import Ladder
    from hopsched.core.signing import Signatures
    from hopsched.core.targets import TargetPolicy

    decider = Decider(Ladder(), "guest", TargetPolicy(()), 300 * S, Signatures())
    rule = Rule.make(now_us=T0, every=60, start=us_to_datetime(T0)).encode()
    headers = Envelope("s", T0, "", "q", rule=rule, occurrence=1, lineage="1.a").to_headers()
    cancellations = Cancellations(100 * S)

    claim = decider.claim(headers, b"", T0, "b", cancellations)

    assert isinstance(claim, tuple)
    record, envelope = claim
    assert envelope.lineage == "2.b"
    assert (record.op, record.schedule_id, record.due_us, record.kind) == (LINEAGE, "s", T0, "2.b")
    cancellations.apply(record)
    cancellations.apply(Record(LINEAGE, "s", T0, T0, kind="1.a"))
    assert isinstance(decider.claim(headers, b"", T0, "c", cancellations), Cancel)
    one_shot = Envelope("t", T0, "", "q").to_headers()
    assert decider.claim(one_shot, b"", T0, "d", cancellations) is None


claims = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=4),  # occurrence (due) of the claim
        st.integers(min_value=1, max_value=3),  # generation
        st.sampled_from("abc"),  # nonce
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(claims, st.randoms(use_true_random=False))
def test_relays_that_read_the_same_claims_in_any_order_keep_the_same_one_lineage(
    made: list[tuple[int, int, str]], rng: random.Random
) -> None:
    from hopsched.core.cancel import LINEAGE, Cancellations, Record

    records = [
        Record(LINEAGE, "s", T0 + i, due_us=T0 + due * S, kind=f"{gen}.{nonce}")
        for i, (due, gen, nonce) in enumerate(made)
    ]
    shuffled = records[:]
    rng.shuffle(shuffled)
    first, second = Cancellations(10**12), Cancellations(10**12)
    for record in records:
        first.apply(record)
    for record in shuffled:
        second.apply(record)
    lineages = [None, *{record.kind for record in records}]
    for due in range(6):
        for lineage in lineages:
            one = first.superseded("s", None, T0 + due * S, lineage)
            assert one == second.superseded("s", None, T0 + due * S, lineage)
    # from the winner's occurrence on, exactly one lineage lives: the winner's
    top = max(records, key=lambda r: (r.due_us, int(r.kind.split(".")[0]), r.kind))  # type: ignore[union-attr]
    assert top.due_us is not None
    for due in range((top.due_us - T0) // S, 6):
        alive = [x for x in lineages if not first.superseded("s", None, T0 + due * S, x)]
        assert alive == [top.kind]


@given(
    every_s=st.integers(1, 10**7),
    count=st.none() | st.integers(1, 1000),
    catch_up=st.sampled_from(["latest", "all", "none"]),
)
def test_a_recurrence_value_makes_the_rule_its_keywords_make(
    every_s: int, count: int | None, catch_up: str
) -> None:
    now = datetime_to_us(datetime(2030, 1, 1, tzinfo=UTC))
    value = Recurrence(every=every_s, count=count, catch_up=catch_up)
    made = Rule.make(now_us=now, every=every_s, count=count, catch_up=catch_up)
    assert value.rule(now) == made


def test_a_recurrence_value_with_cron_reads_its_zone() -> None:
    now = datetime_to_us(datetime(2030, 1, 1, tzinfo=UTC))
    value = Recurrence(cron="0 9 * * 1-5", tz="Europe/Paris")
    assert value.rule(now) == Rule.make(now_us=now, cron="0 9 * * 1-5", tz="Europe/Paris")
    with pytest.raises(InvalidScheduleError, match="every"):
        Recurrence().rule(now)  # neither every nor cron: named, as for the keywords


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"every": 5}, "not both"),
        ({"count": 3}, "not both"),
        ({"recurrence": "every hour"}, "must be a hopsched.Recurrence"),
    ],
)
async def test_a_recurrence_value_and_its_keywords_together_are_refused_before_connecting(
    extra: dict[str, object], words: str
) -> None:
    """Refused by ``schedule()`` itself: the Scheduler never connects (nothing listens
    on port 1)."""
    arguments: dict[str, object] = {"recurrence": Recurrence(every=60)} | extra
    scheduler = hopsched.Scheduler(hopsched.Settings(url="amqp://guest:guest@127.0.0.1:1/"))
    with pytest.raises(InvalidScheduleError, match=words):
        await scheduler.schedule(b"x", routing_key="q", **arguments)  # type: ignore[arg-type]
