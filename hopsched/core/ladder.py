"""The ladder: power-of-two TTL steps and the hop planner. Pure: no I/O, no clock.

Every time is an integer count of microseconds since the Unix epoch (UTC) or a
duration in microseconds; step TTLs are milliseconds, as RabbitMQ's
``x-message-ttl`` is (https://www.rabbitmq.com/docs/ttl).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = [
    "AVOID_FOR_US",
    "AVOID_SILENT_FOR_US",
    "BROKER_MAX_TTL_MS",
    "MAX_HOLD_MS",
    "MAX_STEP_MS",
    "REFRESH_STEP_MS",
    "STEP_RATIOS",
    "STEP_SILENCE_S",
    "AvoidedSteps",
    "Hold",
    "Hop",
    "Ladder",
    "describe_steps",
    "ladder_of",
    "refresh_step_ms",
    "retention_bound_us",
]

#: The longest a relay may hold a delivery unacked, far below RabbitMQ's
#: ``consumer_timeout`` (30 min by default, https://www.rabbitmq.com/docs/consumers#acknowledgement-timeout).
MAX_HOLD_MS = 60_000

#: RabbitMQ caps ``x-message-ttl`` at 10 years (RabbitMQ >= 3.10.2,
#: https://www.rabbitmq.com/docs/ttl#per-queue-message-ttl).
BROKER_MAX_TTL_MS = 315_360_000_000

#: The largest top step, ms (about 49.7 days): every pending message comes by a relay at
#: least this often, which the cancellation stream's retention relies on
#: (``hopsched.core.cancel``); far below the broker's TTL cap.
MAX_STEP_MS = 2**32

US_PER_MS = 1_000

#: The ratios between neighbouring steps a ladder may have: 2 (the default, every power
#: of two: the fewest hops and the least lateness) or 4 (every power of four: about half
#: the step queues, for brokers where each queue costs, docs/operations.md).
STEP_RATIOS = (2, 4)

#: How long a step queue that nacked a publish is routed around, µs: a quorum queue
#: whose leader's node went down elects a new one within a few seconds (measured in
#: ``tests/faults/test_cluster.py``); every nack in the meantime renews it.
AVOID_FOR_US = 5_000_000
#: How long a publish into a step queue may go unanswered, s, while the broker answers
#: others on its channel, before it is routed around as a nacked one is: a quorum queue
#: whose leader's node is frozen (SIGSTOP, a VM paused) neither confirms nor nacks, and a
#: producer's calls had waited out their whole publish timeout (30 s). Well above a
#: loaded broker's confirm of a quorum publish, which the bound must not take for silence
#: (each one taken costs a second copy of the message, delivered too if the queue wakes).
STEP_SILENCE_S = 10.0
#: How long a step queue found silent is routed around, µs: a frozen node stays frozen
#: for longer than an election takes, and each publish into it waits the silence out.
AVOID_SILENT_FOR_US = 30_000_000


@dataclass(frozen=True, slots=True)
class Hop:
    """Publish into the step queue whose TTL is ``step_ms`` milliseconds."""

    step_ms: int


@dataclass(frozen=True, slots=True)
class Hold:
    """No step fits: wait ``wait_us`` microseconds in-process (0: deliver now)."""

    wait_us: int


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _exponent(value: int) -> int:
    """log2 of a power of two."""
    return value.bit_length() - 1


@dataclass(frozen=True, slots=True)
class Ladder:
    """The steps (TTLs from ``min_step_ms`` to ``max_step_ms``, each ``step_ratio`` times
    the one below) and the planner.

    Args:
        min_step_ms: smallest step TTL in ms, a power of two (with ``step_ratio`` 4, a
            power of four: 16, 64, 256, 1024 ...).
        max_step_ms: largest step TTL in ms, at most ``MAX_STEP_MS`` (2**32); a step of
            the ladder (a power of two; with ``step_ratio`` 4, a power of four). Longer
            delays reuse it as often as needed.
        hold_window_ms: remaining time (ms) at or below which the relay stops hopping
            and waits in-process until the due time (a timer is cheap, a hop costs the
            broker a publish, a dead-lettering and a delivery); hops land at least half
            of it before the due time, so a hop late by less than that is not late.
        hop_margin_ms: time (ms) kept in hand for one hop's overshoot (TTL expiry,
            dead-lettering and delivery to the relay take 2.5-3 ms past the TTL on an
            idle RabbitMQ 3.10 on two cores): a step is chosen only if
            ``step + margin <= remaining``, so a hop returns before the due time.
        step_ratio: each step's TTL over the one below, one of ``STEP_RATIOS``: 2 (the
            default: 29 steps from 16 ms to 2**32 ms) or 4 (15 steps over the same
            range: fewer queues on the broker, for up to three hops per step instead of
            one and so more hops per message; docs/operations.md, "Fewer steps").

    Raises:
        InvalidSettingsError: a step is not a power of two (of four with ``step_ratio``
            4), the steps are out of order, the top step exceeds ``MAX_STEP_MS``, the
            ratio is not one of ``STEP_RATIOS``, or a window is negative.
    """

    min_step_ms: int = 16
    max_step_ms: int = 2**32
    hold_window_ms: int = 4000
    hop_margin_ms: int = 20
    step_ratio: int = 2

    def __post_init__(self) -> None:
        from hopsched.errors import InvalidSettingsError

        for name in ("min_step_ms", "max_step_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not _is_power_of_two(value):
                raise InvalidSettingsError(
                    f"{name}={value!r}: step TTLs must be powers of two in ms (e.g. 16, 1024)"
                )
        ratio = self.step_ratio
        if isinstance(ratio, bool) or ratio not in STEP_RATIOS:
            raise InvalidSettingsError(
                f"step_ratio={ratio!r}: use 2 (the default: every power of two, the most "
                "precise) or 4 (every power of four: about half the step queues, more hops)"
            )
        if ratio == 4:
            for name in ("min_step_ms", "max_step_ms"):
                value = getattr(self, name)
                if _exponent(value) % 2:
                    raise InvalidSettingsError(
                        f"{name}={value}: with step_ratio=4 the steps are powers of four "
                        f"(16, 64, 256, 1024, ... 2**32): use {value // 2} or {value * 2}, "
                        "or step_ratio=2"
                    )
        if self.min_step_ms > self.max_step_ms:
            raise InvalidSettingsError(
                f"min_step_ms={self.min_step_ms} is above max_step_ms={self.max_step_ms}: swap them"
            )
        if self.max_step_ms > MAX_STEP_MS:
            raise InvalidSettingsError(
                f"max_step_ms={self.max_step_ms}: use {MAX_STEP_MS} (2**32, about 49.7 "
                "days) or less; longer delays reuse the top step, and cancellations are "
                "kept for as long as it lasts"
            )
        for name in ("hold_window_ms", "hop_margin_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidSettingsError(f"{name}={value!r}: must be an integer >= 0 ms")
        if self.longest_hold_ms > MAX_HOLD_MS:
            raise InvalidSettingsError(
                f"the relay would hold messages unacked for up to {self.longest_hold_ms} ms "
                f"(max of hold_window_ms and min_step_ms + hop_margin_ms); keep it at most "
                f"{MAX_HOLD_MS} ms, far below RabbitMQ's consumer_timeout"
            )

    @property
    def longest_hold_ms(self) -> int:
        """The longest ``Hold`` the planner returns, in ms: below min step + margin no
        step fits, so the relay waits however large the hold window is set."""
        return max(self.hold_window_ms, self.min_step_ms + self.hop_margin_ms)

    @property
    def steps(self) -> tuple[int, ...]:
        """Every step TTL in ms, smallest first."""
        low, high = _exponent(self.min_step_ms), _exponent(self.max_step_ms)
        return tuple(1 << k for k in range(low, high + 1, _exponent(self.step_ratio)))

    @property
    def description(self) -> str:
        """The ladder's settings as text, e.g. ``step_ratio=4, min_step_ms=16,
        max_step_ms=2**32 (15 steps)``, for errors and logs."""
        return describe_steps(self.steps, self.step_ratio)

    def step_at_most(self, ms: int) -> int:
        """The largest step of at most ``ms`` ms; the smallest step if ``ms`` is below it
        (the caller checks that it fits)."""
        if ms >= self.max_step_ms:
            return self.max_step_ms
        if ms < self.min_step_ms:
            return self.min_step_ms
        shift, low = _exponent(self.step_ratio), _exponent(self.min_step_ms)
        return 1 << (low + (_exponent(ms) - low) // shift * shift)

    def plan(
        self,
        *,
        now_us: int,
        due_us: int,
        hold_window_ms: int | None = None,
        hop_margin_ms: int | None = None,
        avoid: Collection[int] = (),
    ) -> Hop | Hold:
        """Decide what to do with a message due at ``due_us`` when it is ``now_us``.

        Returns ``Hop(step)`` while more than the hold window remains, else
        ``Hold(wait)`` with ``wait = max(0, remaining)``. The step is the largest with
        ``step + max(hop_margin, hold_window / 2) <= remaining``: a hop lands in the hold
        window's second half, so one that comes back late by up to half the window is
        still held until due, not late (a burst of thousands due at one instant comes
        back over seconds as the broker dead-letters them). A hop never outlasts the
        remaining time, so following the plan is never early. Below the top step a hop
        takes at least ``1 / step_ratio`` of the remaining time (the next step up did not
        fit), so the plan terminates: each step is taken at most ``step_ratio - 1``
        times in a row. ``hold_window_ms`` and
        ``hop_margin_ms`` override the ladder's own (the relay passes a hold window of 0
        while it holds as many as it should, and a margin learnt from recent hops).

        ``avoid``: steps (ms) to route around (``AvoidedSteps``: their queues nacked a
        publish, a quorum leader election): the hop goes by ``detour()``, a smaller step,
        which is never early either (it ends sooner) and only costs more hops.
        """
        remaining_us = due_us - now_us
        window_ms = self.hold_window_ms if hold_window_ms is None else hold_window_ms
        if remaining_us <= window_ms * US_PER_MS:
            return Hold(max(0, remaining_us))
        margin_ms = self.hop_margin_ms if hop_margin_ms is None else hop_margin_ms
        budget_ms = (remaining_us - max(margin_ms, window_ms // 2) * US_PER_MS) // US_PER_MS
        if budget_ms < self.min_step_ms:
            return Hold(remaining_us)
        step_ms = self.step_at_most(budget_ms)
        return Hop(self.detour(step_ms, avoid) if avoid else step_ms)

    def detour(self, step_ms: int, avoid: Collection[int]) -> int:
        """The largest step at most ``step_ms`` that is not in ``avoid`` (ms).

        A smaller step than planned is always a valid route: it ends before the planned
        one would, so it is never early, and the next plan covers the rest. If every step
        up to ``step_ms`` is avoided there is nothing shorter to go by: ``step_ms`` itself
        (the caller tries it again after a back-off).
        """
        candidate = step_ms
        while candidate >= self.min_step_ms:
            if candidate not in avoid:
                return candidate
            candidate //= self.step_ratio
        return step_ms

    def route(self, delay_us: int, overshoot_us: int = 0, avoid: Collection[int] = ()) -> list[int]:
        """The steps (ms) a message with ``delay_us`` to go passes through.

        Simulates the relay with every hop returning ``overshoot_us`` after its TTL, the
        steps in ``avoid`` routed around. Used to check a plan without waiting (e.g. for
        delays of years).
        """
        now_us, steps = 0, []
        while isinstance(action := self.plan(now_us=now_us, due_us=delay_us, avoid=avoid), Hop):
            steps.append(action.step_ms)
            now_us += action.step_ms * US_PER_MS + overshoot_us
        return steps

    def max_hops(self, delay_us: int, avoid: Collection[int] = ()) -> int:
        """An upper bound on the hops for ``delay_us``: top-step laps plus one per smaller step.

        With any overshoot below the margin the planner uses each step below the top at
        most ``step_ratio - 1`` times, so this bound is ``ceil(delay / max_step) +
        (step_ratio - 1) x (steps - 1)``; with ratio 2, for delays within the ladder,
        about ``log2(delay / min_step) + 1``.

        With the steps in ``avoid`` routed around, the top is the largest step not
        avoided, and a step ``s`` below it is used at most ``next / s - 1`` times in a
        row, ``next`` being the smallest step above ``s`` not avoided (once if none is
        avoided between them: ``step_ratio - 1`` times); an avoided step below every
        other one (nothing shorter to go by) is used at most ``step_ratio - 1`` times.
        """
        allowed = [step for step in self.steps if step not in avoid]
        if not allowed:
            allowed = list(self.steps)  # nothing to detour by: the plain plan
        top = allowed[-1]
        bound = -(-delay_us // (top * US_PER_MS))
        bound += sum(larger // smaller - 1 for smaller, larger in itertools.pairwise(allowed))
        below = sum(1 for step in self.steps if step < allowed[0])
        return bound + (self.step_ratio - 1) * below


def ladder_of(steps: Collection[int]) -> Ladder | None:
    """The ladder (default windows) whose steps are exactly ``steps`` (ms), or None if
    no valid ladder has them (a gap, a step that is no power of two)."""
    found = sorted(steps)
    if not found:
        return None
    from hopsched.errors import InvalidSettingsError

    for ratio in STEP_RATIOS:
        try:
            ladder = Ladder(min_step_ms=found[0], max_step_ms=found[-1], step_ratio=ratio)
        except InvalidSettingsError:
            continue
        if list(ladder.steps) == found:
            return ladder
    return None


def _ms(value: int) -> str:
    return f"2**{_exponent(value)}" if value > 65536 and _is_power_of_two(value) else str(value)


def describe_steps(steps: Collection[int], ratio: int | None = None) -> str:
    """Step TTLs (ms) as the settings that give them, e.g. ``step_ratio=4,
    min_step_ms=16, max_step_ms=2**32 (15 steps)``; a set that is no ladder as a list.
    ``ratio``: the ratio to name for a single step (a ladder of either ratio)."""
    found = sorted(steps)
    ladder = ladder_of(found)
    if ladder is None:
        return f"steps {', '.join(_ms(step) for step in found)} ms (no ladder hopsched declares)"
    # one step is a ladder of either ratio: ``ratio`` says which (Ladder.description)
    step_ratio = ratio if ratio is not None and len(found) == 1 else ladder.step_ratio
    return (
        f"step_ratio={step_ratio}, min_step_ms={_ms(found[0])}, max_step_ms={_ms(found[-1])}"
        f" ({len(found)} step{'s' if len(found) > 1 else ''})"
    )


@dataclass(slots=True)
class AvoidedSteps:
    """Step queues to route around for a while, with the time they may be used again.

    A quorum step queue nacks (or leaves unconfirmed) every publish while it elects a
    leader, for seconds after its leader's node went down. Noting ``nacked(step, now)``
    keeps ``avoided(now)`` naming that step for ``for_us`` µs (renewed by each nack), so
    the publishes after it go by a smaller step (``Ladder.plan(avoid=...)``) instead of
    waiting for the election. Pure: the clock comes in as ``now_us``.
    """

    for_us: int = AVOID_FOR_US
    _until: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def nacked(self, step_ms: int, now_us: int, for_us: int | None = None) -> None:
        """Step ``step_ms``'s queue refused a publish at ``now_us``: avoid it a while
        (``for_us``, µs; ``self.for_us`` by default)."""
        until = now_us + (self.for_us if for_us is None else for_us)
        self._until[step_ms] = max(self._until.get(step_ms, 0), until)

    def avoided(self, now_us: int) -> frozenset[int]:
        """The steps (ms) to route around at ``now_us``."""
        for step_ms in [s for s, until in self._until.items() if until <= now_us]:
            del self._until[step_ms]
        return frozenset(self._until)


#: A relay writes a message's ``scheduled`` record anew when it hops it on a step of this
#: TTL or more (2^26 ms, about 18.6 h), or on the top step if that is smaller
#: (``refresh_step_ms``): see ``retention_bound_us``. The journal
#: (``hopsched.journal``) and its retention (``hopsched.topology``) follow from these.
REFRESH_STEP_MS = 2**26


def refresh_step_ms(top_step_ms: int) -> int:
    """The smallest step (ms) a relay writes a ``scheduled`` record anew at, for a ladder
    whose top step is ``top_step_ms``."""
    return min(REFRESH_STEP_MS, top_step_ms)


def retention_bound_us(top_step_ms: int) -> int:
    """How old, at most, the newest ``scheduled`` record of a pending message is, µs.

    After its last record (scheduled or refreshed at time *J*), a message takes at most
    one hop of any step (≤ the top step) and then only hops of steps below
    ``refresh_step_ms``: the ladder picks the largest step that fits, so once it picks
    one below that, less than two such steps remain (``Ladder.plan``). The journal's
    ``x-max-age`` must be at least this, so that every pending message can be found.
    """
    return (top_step_ms + 2 * refresh_step_ms(top_step_ms)) * 1000
