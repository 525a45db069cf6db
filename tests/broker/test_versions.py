"""Versions that mix safely: a relay parks an envelope naming a feature it does not know
(``x-hopsched-features``, written by a newer scheduler) and delivers the rest, old
envelopes without the header included (docs/operations.md, "Upgrading")."""

from __future__ import annotations

import aio_pika
from support import HEADER_PARKED_REASON, Targets, publish_raw

import hopsched
from hopsched.core.clock import now_us


async def test_an_envelope_naming_a_feature_the_relay_lacks_is_parked_the_rest_delivered(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    target = await targets.queue()
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    due = now_us() + 500_000
    await publish_raw(amqp, settings, "newer", due, target.name, **{"x-hopsched-features": "warp"})
    await publish_raw(amqp, settings, "older", due, target.name)  # no header: as before 0.2
    await publish_raw(amqp, settings, "known", due, target.name, **{"x-hopsched-features": ""})

    (copy,) = await parked.wait_for(1, within=15)
    await target.wait_for_ids(["older", "known"], within=15)
    await target.settle(0.5)

    assert target.counts() == {"older": 1, "known": 1}
    target.assert_never_early()
    assert copy.schedule_id == "newer"
    assert copy.headers["x-hopsched-parked-kind"] == "unsupported_feature"
    assert copy.headers[HEADER_PARKED_REASON].startswith(
        "it needs feature(s) warp (header 'x-hopsched-features'), which this relay "
        f"(hopsched {hopsched.__version__}, features: recurring) lacks: upgrade the relay"
    )
    assert copy.headers["x-hopsched-features"] == "warp"  # kept for the replay
    assert relay.totals.parked_by_kind[hopsched.ParkKind.UNSUPPORTED_FEATURE] == 1
