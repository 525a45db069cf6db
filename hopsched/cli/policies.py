"""``hopsched policies check|protect|unprotect``: the broker's policies on a prefix."""

from __future__ import annotations

import dataclasses
import json

import click

from hopsched.broker.policies import PROTECT_PRIORITY
from hopsched.broker.policy_watch import PolicyCheck, check_policies, protect, unprotect
from hopsched.cli.common import (
    Failure,
    connection_options,
    run,
    settings_from_env,
)
from hopsched.errors import (
    HopschedError,
)
from hopsched.settings import Settings


def check_policies_or_fail(settings: Settings, management_url: str | None) -> PolicyCheck:
    if management_url:
        settings = dataclasses.replace(settings, management_url=management_url)
    checked: PolicyCheck = run(check_policies(settings))
    return checked


def echo_policies(checked: PolicyCheck) -> None:
    for line in checked.lines():
        click.echo(line)


def policy_risk(checked: PolicyCheck) -> str | None:
    """Why ``checked`` makes a command exit 1: a policy in force can lose or stall
    messages; else None."""
    report = checked.report
    if report is None or not report.at_risk:
        return None
    return (
        f"{len(report.findings)} finding(s) on the policies in force: messages can be lost "
        f"or stalled; the worst: {report.findings[0].line()}"
    )


async def unprotect_quietly(settings: Settings) -> list[str]:
    """Remove the protective policies after a teardown, if the API lets us."""
    try:
        return await unprotect(settings)
    except HopschedError:
        return []


MANAGEMENT_URL = click.option(
    "--management-url",
    help="Management API base URL(s), comma-separated [HOPSCHED_MANAGEMENT_URL; default "
    "http://HOST:15672/ per URL].",
)


@click.group()
def policies() -> None:
    """The broker's policies on the prefix's queues: check them, keep user policies off.

    \b
    A user policy (rabbitmqctl set_policy) or an operator policy matching the prefix's
    queues can delete them (expires), drop their messages (max-length, message-ttl on
    the parking queue) or turn off at-least-once dead-lettering (overflow drop-head).
    `protect` sets hopsched's own policies, of higher priority, that keep every other
    user policy off them; an operator policy cannot be masked: `check` prints the
    rabbitmqctl command that excludes the prefix from it (docs/operations.md, "Policies").
    """


@policies.command("check")
@connection_options
@MANAGEMENT_URL
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def policies_check(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    management_url: str | None,
    as_json: bool,
) -> None:
    """What the policies in force do to the prefix's queues, each with its fix. Exits 1
    if one can lose or stall messages, or if the management API cannot tell."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    checked = check_policies_or_fail(settings, management_url)
    if as_json:
        click.echo(json.dumps(checked.as_json(), indent=2))
    else:
        echo_policies(checked)
    if checked.report is None:
        raise Failure(f"cannot read the policies in force: {checked.unavailable}")
    if (risk := policy_risk(checked)) is not None:
        raise Failure(risk)


@policies.command("protect")
@connection_options
@MANAGEMENT_URL
@click.option(
    "--priority",
    type=int,
    default=PROTECT_PRIORITY,
    show_default=True,
    help="Priority of the protective policies: above every user policy matching the "
    "prefix's queues.",
)
def policies_protect(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    management_url: str | None,
    priority: int,
) -> None:
    """Set hopsched's protective policies on the prefix's queues (the user needs the tag
    policymaker); without the right, print the rabbitmqctl commands and exit 1."""
    settings = settings_from_env(
        url=url, prefix=prefix, queue_type=queue_type, management_url=management_url
    )
    done = run(protect(settings, priority))
    if done.error is not None:
        click.echo("run these where you may set policies:")
        for command in done.commands:
            click.echo(f"  {command}")
        raise Failure(f"the protective policies were not set: {done.error}")
    for policy in done.policies:
        click.echo(
            f"set policy {policy.name} (priority {policy.priority}) on {policy.pattern}: "
            f"{json.dumps(dict(policy.definition))}"
        )


@policies.command("unprotect")
@connection_options
@MANAGEMENT_URL
def policies_unprotect(
    url: str | None, prefix: str | None, queue_type: str | None, management_url: str | None
) -> None:
    """Remove hopsched's protective policies from the prefix."""
    settings = settings_from_env(
        url=url, prefix=prefix, queue_type=queue_type, management_url=management_url
    )
    removed = run(unprotect(settings))
    for name in removed:
        click.echo(f"removed policy {name}")
    if not removed:
        click.echo(f"no protective policy on prefix {settings.prefix}")
