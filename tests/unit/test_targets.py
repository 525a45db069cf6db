"""The allow list of targets (pure) and its settings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hopsched
from hopsched.core.targets import TargetPattern, TargetPolicy

names = st.text(st.characters(blacklist_characters="*?[]/"), max_size=20)


@given(exchange=names, routing_key=names)
def test_an_empty_policy_allows_everything(exchange: str, routing_key: str) -> None:
    assert TargetPolicy(()).refusal(exchange, routing_key) is None


@given(exchange=names, routing_key=names, other=names)
def test_a_literal_pattern_allows_exactly_its_target(
    exchange: str, routing_key: str, other: str
) -> None:
    policy = TargetPolicy([f"{exchange}/{routing_key}"])
    assert policy.allows(exchange, routing_key)
    assert policy.allows(exchange, other) == (other == routing_key)
    refusal = policy.refusal(other, routing_key)
    assert (refusal is None) == (other == exchange)


@pytest.mark.parametrize(
    ("pattern", "exchange", "routing_key", "allowed"),
    [
        ("/reminders", "", "reminders", True),
        ("/reminders", "", "reminders.x", False),
        ("/reminders", "amq.direct", "reminders", False),
        ("orders/timeout.*", "orders", "timeout.42", True),
        ("orders/timeout.*", "orders", "cancel.42", False),
        ("orders.*/*", "orders.eu", "a/b", True),  # only the first '/' splits
        ("*/*", "anything", "", True),
        ("Orders/*", "orders", "x", False),  # case-sensitive, like RabbitMQ names
    ],
)
def test_patterns(pattern: str, exchange: str, routing_key: str, allowed: bool) -> None:
    assert TargetPattern.parse(pattern).matches(exchange, routing_key) == allowed


def test_a_pattern_without_slash_is_refused_with_the_fix() -> None:
    with pytest.raises(hopsched.InvalidSettingsError, match=r"EXCHANGE/ROUTING-KEY.*'/reminders'"):
        hopsched.Settings(allowed_targets=("reminders",))
    with pytest.raises(hopsched.InvalidSettingsError, match="tuple of patterns"):
        hopsched.Settings(allowed_targets="/reminders")  # type: ignore[arg-type]


def test_allowed_targets_from_the_environment() -> None:
    settings = hopsched.Settings.from_env({"HOPSCHED_ALLOWED_TARGETS": "/a, orders/* ,"})
    assert settings.allowed_targets == ("/a", "orders/*")
    assert hopsched.Settings(allowed_targets=["/a"]).allowed_targets == ("/a",)  # type: ignore[arg-type]


# --- hopsched's own namespace (issue 19, F30) -------------------------------------------------


@given(exchange=names, routing_key=names)
def test_F30_the_namespace_is_refused_whatever_the_allow_list(
    exchange: str, routing_key: str
) -> None:
    for policy in (TargetPolicy((), "app"), TargetPolicy(["*/*"], "app")):
        own_exchange = f"app.{exchange}"
        assert policy.internal(own_exchange, routing_key) is not None
        assert policy.refusal(own_exchange, routing_key) is not None
        assert policy.refusal("", f"app.{routing_key}") is not None
        inside = exchange.startswith("app.") or (exchange == "" and routing_key.startswith("app."))
        assert (policy.internal(exchange, routing_key) is not None) == inside


def test_F30_settings_give_the_policy_their_prefix() -> None:
    refusal = hopsched.Settings(prefix="orders-sched").target_policy.refusal(
        "", "orders-sched.cancelled"
    )
    assert refusal is not None
    assert "'orders-sched.cancelled'" in refusal
    assert "hopsched's own namespace orders-sched.*" in refusal
