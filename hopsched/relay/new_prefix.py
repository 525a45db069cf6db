"""What a relay says when it finds no prefix where it was told to serve one and declares
it anew: most often a mistyped ``--prefix``, whose relay then serves an empty ladder
while the schedulers' messages wait on another. Pure: text only."""

from __future__ import annotations

from hopsched.topology import Topology

__all__ = ["new_prefix_warning"]


def new_prefix_warning(topology: Topology, url: str) -> str:
    """The WARNING for a prefix without a relay queue at ``url`` (password masked) that a
    relay has just declared: the prefix, every object declared, the likely cause and the
    way back."""
    prefix, steps = topology.prefix, topology.step_queues
    return (
        f"prefix {prefix!r} did not exist at {url}; this relay declared it: exchange "
        f"{topology.expired_exchange}, queues {topology.relay_queue}, "
        f"{topology.ingress_queue} and {topology.parked_queue}, {len(steps)} step queues "
        f"{steps[0]} to {steps[-1]}, streams {topology.cancel_stream}, "
        f"{topology.journal_stream} and {topology.ingress_registry}. If the "
        "schedulers use an existing prefix, a mistyped --prefix (HOPSCHED_PREFIX) is a "
        "common cause: their messages wait there, unrelayed. Then stop this relay, run "
        f"`hopsched teardown --prefix {prefix}` to remove what it declared, and start it "
        "with the schedulers' prefix"
    )
