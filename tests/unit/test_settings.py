"""Settings: defaults, the environment, validation, and the password never shown."""

from __future__ import annotations

import dataclasses
from urllib.parse import quote, urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import hopsched_cli

from hopsched.core.ladder import Ladder
from hopsched.errors import HopschedError, InvalidSettingsError
from hopsched.settings import Settings
from hopsched.urls import mask_url

# --- defaults and from_env ----------------------------------------------------------------


def test_defaults() -> None:
    settings = Settings()

    assert settings.url == "amqp://guest:guest@localhost:5672/"
    assert settings.prefix == "hopsched"
    assert settings.queue_type == "quorum"
    assert settings.prefetch == 20_000
    assert settings.hold_memory_mb == 256
    assert settings.publish_timeout_s == 30.0
    assert settings.target_retry_s == 300.0
    assert settings.log_interval_s == 60.0
    assert (settings.metrics_port, settings.metrics_address) == (0, "127.0.0.1")  # off
    assert settings.ladder == Ladder(
        min_step_ms=16, max_step_ms=2**32, hold_window_ms=4000, hop_margin_ms=20
    )
    assert settings.masked_url == "amqp://guest:***@localhost:5672/"


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().prefix = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param({}, id="empty"),
        pytest.param({"PATH": "/usr/bin", "HOPSCHED_UNKNOWN": "x"}, id="unrelated"),
        pytest.param({"hopsched_prefix": "lower"}, id="lower-case-ignored"),
    ],
)
def test_from_env_without_hopsched_variables_gives_defaults(environ: dict[str, str]) -> None:
    assert Settings.from_env(environ) == Settings()


def test_from_env_reads_each_variable_as_its_fields_type() -> None:
    environ = {
        "HOPSCHED_URL": "amqps://svc:s3cret@broker.internal:5671/prod?heartbeat=30",
        "HOPSCHED_PREFIX": "billing.delays",
        "HOPSCHED_QUEUE_TYPE": "classic",
        "HOPSCHED_PREFETCH": "250",
        "HOPSCHED_MIN_STEP_MS": "32",
        "HOPSCHED_MAX_STEP_MS": "1048576",
        "HOPSCHED_HOLD_WINDOW_MS": "80",
        "HOPSCHED_HOP_MARGIN_MS": "10",
        "HOPSCHED_LOG_INTERVAL_S": "2.5",
        "HOPSCHED_METRICS_PORT": "9464",
        "HOPSCHED_METRICS_ADDRESS": "0.0.0.0",
    }

    settings = Settings.from_env(environ)

    assert settings == Settings(
        url="amqps://svc:s3cret@broker.internal:5671/prod?heartbeat=30",
        prefix="billing.delays",
        queue_type="classic",
        prefetch=250,
        min_step_ms=32,
        max_step_ms=2**20,
        hold_window_ms=80,
        hop_margin_ms=10,
        log_interval_s=2.5,
        metrics_port=9464,
        metrics_address="0.0.0.0",
    )
    assert type(settings.prefetch) is int
    assert type(settings.log_interval_s) is float
    assert settings.ladder.steps[0] == 32


def test_overrides_win_over_the_environment_and_none_is_no_override() -> None:
    environ = {"HOPSCHED_PREFIX": "from-env", "HOPSCHED_PREFETCH": "10"}

    settings = Settings.from_env(environ, prefix="from-cli", prefetch=None, min_step_ms=64)

    assert settings.prefix == "from-cli"
    assert settings.prefetch == 10
    assert settings.min_step_ms == 64


def test_from_env_reads_os_environ_when_given_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPSCHED_PREFIX", "from-os-environ")
    monkeypatch.setenv("HOPSCHED_PREFETCH", "7")

    settings = Settings.from_env()

    assert settings.prefix == "from-os-environ"
    assert settings.prefetch == 7


# --- bad values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param({"HOPSCHED_PREFETCH": "many"}, ["HOPSCHED_PREFETCH", "'many'", "int"],
                     id="prefetch-not-int"),
        pytest.param({"HOPSCHED_PREFETCH": "1e3"}, ["HOPSCHED_PREFETCH", "int"],
                     id="prefetch-float-syntax"),
        pytest.param({"HOPSCHED_PREFETCH": "0"}, ["prefetch", "65535"], id="prefetch-zero"),
        pytest.param({"HOPSCHED_PREFETCH": "65536"}, ["prefetch", "65535"],
                     id="prefetch-above-16-bits"),
        pytest.param({"HOPSCHED_MIN_STEP_MS": "16.0"}, ["HOPSCHED_MIN_STEP_MS", "int"],
                     id="min-step-float"),
        pytest.param({"HOPSCHED_MIN_STEP_MS": "15"}, ["min_step_ms", "power"],
                     id="min-step-not-power-of-two"),
        pytest.param({"HOPSCHED_MIN_STEP_MS": "8192", "HOPSCHED_MAX_STEP_MS": "4096"},
                     ["min_step_ms", "max_step_ms"], id="min-above-max"),
        pytest.param({"HOPSCHED_STEP_RATIO": "3"}, ["HOPSCHED_STEP_RATIO", "step_ratio=3",
                     "use 2", "or 4"], id="step-ratio-3"),
        pytest.param({"HOPSCHED_STEP_RATIO": "4", "HOPSCHED_MIN_STEP_MS": "32"},
                     ["HOPSCHED_STEP_RATIO", "HOPSCHED_MIN_STEP_MS", "powers of four",
                      "16 or 64"], id="step-ratio-4-min-32"),
        pytest.param({"HOPSCHED_HOLD_WINDOW_MS": "-1"}, ["hold_window_ms", ">= 0"],
                     id="negative-hold-window"),
        pytest.param({"HOPSCHED_QUEUE_TYPE": "mirrored"}, ["'mirrored'", "quorum", "classic"],
                     id="queue-type"),
        pytest.param({"HOPSCHED_QUEUE_TYPE": "Quorum"}, ["'Quorum'", "quorum"],
                     id="queue-type-case"),
        pytest.param({"HOPSCHED_PREFIX": "has space"}, ["prefix", "'has space'"],
                     id="prefix-space"),
        pytest.param({"HOPSCHED_PREFIX": ""}, ["prefix"], id="prefix-empty"),
        pytest.param({"HOPSCHED_PREFIX": "p" * 101}, ["prefix", "1-100"], id="prefix-too-long"),
        pytest.param({"HOPSCHED_URL": "http://localhost:15672/"}, ["amqp://", "amqps://"],
                     id="url-scheme"),
        pytest.param({"HOPSCHED_URL": "localhost"}, ["amqp://"], id="url-no-scheme"),
        pytest.param({"HOPSCHED_LOG_INTERVAL_S": "0"}, ["log_interval_s", "> 0"],
                     id="log-interval-zero"),
        pytest.param({"HOPSCHED_METRICS_PORT": "65536"}, ["metrics_port", "0 for no endpoint"],
                     id="metrics-port-above-16-bits"),
        pytest.param({"HOPSCHED_METRICS_PORT": "-1"}, ["metrics_port"], id="metrics-port-neg"),
        pytest.param({"HOPSCHED_METRICS_PORT": "http"}, ["HOPSCHED_METRICS_PORT", "int"],
                     id="metrics-port-not-int"),
        pytest.param({"HOPSCHED_METRICS_ADDRESS": " "}, ["metrics_address"],
                     id="metrics-address-empty"),
        pytest.param({"HOPSCHED_LOG_INTERVAL_S": "soon"}, ["HOPSCHED_LOG_INTERVAL_S", "float"],
                     id="log-interval-not-float"),
    ],
)  # fmt: skip
def test_bad_value_raises_invalid_settings_error_saying_what_is_wrong(
    environ: dict[str, str], expected: list[str]
) -> None:
    with pytest.raises(InvalidSettingsError) as caught:
        Settings.from_env(environ)

    for text in expected:
        assert text in str(caught.value)
    for variable in environ:  # a trial found only the type errors named theirs
        assert variable in str(caught.value)
    assert isinstance(caught.value, HopschedError)
    assert isinstance(caught.value, ValueError)


def test_a_refused_value_names_the_variable_it_came_from_only() -> None:
    environ = {"HOPSCHED_PREFETCH": "0", "HOPSCHED_PREFIX": "ok"}

    with pytest.raises(InvalidSettingsError) as caught:
        Settings.from_env(environ, prefix="from-cli")
    assert str(caught.value).startswith("HOPSCHED_PREFETCH: prefetch 0: must be 1..65535")
    with pytest.raises(InvalidSettingsError) as caught:  # an override's: no variable
        Settings.from_env(environ, prefix="has space")
    assert str(caught.value).startswith("prefix 'has space':")
    assert Settings.from_env(environ, prefetch=5).prefetch == 5  # overridden: not read


def test_nan_log_interval_is_rejected() -> None:
    with pytest.raises(InvalidSettingsError, match="log_interval_s"):
        Settings.from_env({"HOPSCHED_LOG_INTERVAL_S": "nan"})


@pytest.mark.parametrize(
    "prefix",
    ["a", "hopsched", "team-a.delays_v2:blue", "P" * 100],
    ids=["1", "default", "mix", "100"],
)
def test_valid_prefixes_are_accepted(prefix: str) -> None:
    assert Settings(prefix=prefix).prefix == prefix


# --- the password is never shown ----------------------------------------------------------

UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"


@given(
    scheme=st.sampled_from(["amqp", "amqps"]),
    user=st.text(UNRESERVED, max_size=12),
    password=st.text(UNRESERVED, min_size=1, max_size=40),
    port=st.none() | st.integers(1, 65535),
    vhost=st.sampled_from(["", "/", "/%2F", "/prod", "/prod?heartbeat=30"]),
)
def test_mask_url_replaces_a_url_safe_password(
    scheme: str, user: str, password: str, port: int | None, vhost: str
) -> None:
    host = "broker.internal" if port is None else f"broker.internal:{port}"

    masked = mask_url(f"{scheme}://{user}:{password}@{host}{vhost}")

    assert masked == f"{scheme}://{user}:***@{host}{vhost}"


@given(password=st.text(min_size=1, max_size=40), user=st.text(max_size=12))
def test_mask_url_replaces_a_percent_encoded_password(password: str, user: str) -> None:
    encoded = quote(password, safe="")
    encoded_user = quote(user, safe="")

    masked = mask_url(f"amqps://{encoded_user}:{encoded}@broker.internal:5671/%2F")

    assert masked == f"amqps://{encoded_user}:***@broker.internal:5671/%2F"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param("amqp://u:s3cret@[::1]:5672/v", "amqp://u:***@[::1]:5672/v", id="ipv6"),
        pytest.param("amqp://u:s3cret@[::1]/", "amqp://u:***@[::1]/", id="ipv6-no-port"),
        pytest.param("amqp://u:s3cret@[fe80::1%25eth0]:5672/",
                     "amqp://u:***@[fe80::1%25eth0]:5672/", id="ipv6-zone"),
        pytest.param("amqps://u:p%40ss%3Aw%2Frd@h:5671/", "amqps://u:***@h:5671/",
                     id="amqps-percent-encoded"),
        pytest.param("amqp://u:pa:ss@h/", "amqp://u:***@h/", id="colon-in-password"),
        pytest.param("amqp://u:p@ss@h/", "amqp://u:***@h/", id="raw-at-in-password"),
        pytest.param("amqp://:s3cret@h/", "amqp://:***@h/", id="no-user"),
        pytest.param("amqp://u:@h/", "amqp://u:***@h/", id="empty-password"),
        pytest.param("amqp://u@h:5672/v", "amqp://u@h:5672/v", id="no-password"),
        pytest.param("amqp://h/", "amqp://h/", id="no-credentials"),
        pytest.param("amqp://u:s3cret@h/?heartbeat=30#frag", "amqp://u:***@h/?heartbeat=30#frag",
                     id="query-and-fragment"),
    ],
)  # fmt: skip
def test_mask_url(url: str, expected: str) -> None:
    assert mask_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("amqp://u:s3cret@[::1/", id="unclosed-ipv6"),
        pytest.param("amqp://u:s3cret@host:99999/", id="port-out-of-range"),
        pytest.param("amqp://u:s3cret@host:port/", id="port-not-a-number"),
    ],
)
def test_mask_url_of_an_unparsable_url_hides_everything(url: str) -> None:
    assert "s3cret" not in mask_url(url)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("amqp://u:pa/ss3cret@h/", id="slash"),
        pytest.param("amqp://u:5672/ss3cret@h/", id="digits-then-slash-parse-as-a-port"),
        pytest.param("amqp://u:pa#ss3cret@h/", id="hash"),
        pytest.param("amqp://u:pa?ss3cret@h/", id="question-mark"),
    ],
)
def test_mask_url_hides_a_password_with_unencoded_reserved_characters(url: str) -> None:
    assert "ss3cret" not in mask_url(url)


def test_masked_url_of_settings_hides_the_password() -> None:
    settings = Settings(url="amqps://svc:hunter2@broker:5671/prod")

    assert settings.masked_url == "amqps://svc:***@broker:5671/prod"


def test_settings_repr_hides_the_password() -> None:
    settings = Settings(url="amqps://svc:hunter2@broker:5671/prod")

    assert "hunter2" not in repr(settings)
    assert "hunter2" not in str(settings)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://svc:s3cret@broker/", id="wrong-scheme"),
        pytest.param("amqp://svc:s3cret@[::1/", id="unclosed-ipv6"),
        pytest.param("amqp://svc:s3cret@broker:99999/", id="port-out-of-range"),
        pytest.param("amqp://svc:s3cret@broker:port/", id="port-not-a-number"),
    ],
)
def test_bad_url_is_rejected_without_showing_the_password(url: str) -> None:
    with pytest.raises(InvalidSettingsError) as caught:
        Settings.from_env({"HOPSCHED_URL": url})

    assert "s3cret" not in str(caught.value)
    assert "s3cret" not in repr(caught.value)


@pytest.mark.parametrize("password", ["pa/ss#w?rd", "S3cret/PW", "5671/s3cret"])
def test_a_password_with_reserved_characters_asks_for_percent_encoding(password: str) -> None:
    with pytest.raises(InvalidSettingsError, match="percent-encode") as caught:
        Settings(url=f"amqp://someone:{password}@127.0.0.1:5672/")

    for piece in password.replace("#", "/").replace("?", "/").split("/"):
        assert f":{piece}" not in str(caught.value)
        assert f"'{piece}'" not in str(caught.value)


@pytest.mark.parametrize(
    "prefix", ["amq.mine", ".", "-x", "_x", "has space", "hopsched.", "billing..delays"]
)
def test_a_prefix_rabbitmq_would_refuse_or_that_reads_oddly_is_rejected(prefix: str) -> None:
    with pytest.raises(InvalidSettingsError, match="prefix"):
        Settings(prefix=prefix)


@pytest.mark.parametrize(
    "url", ["u:hunter2@127.0.0.1", "amqp:/u:hunter2@host", "amqp//u:hunter2@host"]
)
def test_a_malformed_url_never_shows_its_password(url: str) -> None:
    assert "hunter2" not in mask_url(url)
    with pytest.raises(InvalidSettingsError) as raised:
        Settings(url=url)
    assert "hunter2" not in str(raised.value)


# --- the URL's vhost ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "vhost"),
    [
        pytest.param("amqp://u:p@h", "/", id="no-path"),
        pytest.param("amqp://u:p@h/", "/", id="slash"),
        pytest.param("amqp://u:p@h/%2F", "/", id="encoded-slash"),
        pytest.param("amqp://u:p@h:5672/prod?heartbeat=30", "prod", id="query"),
        pytest.param("amqp://u:p@h/team%2Fa%20b%231%25%C3%A9", "team/a b#1%é", id="F24"),
    ],
)
def test_vhost_is_the_urls_path_percent_decoded(url: str, vhost: str) -> None:
    assert Settings(url=url).vhost == vhost


def test_several_urls_from_a_sequence_or_commas_each_masked() -> None:
    urls = ["amqp://u:p1,x@h1:5672/v", "amqp://u:p2@h2:5673/v"]
    from_list = Settings(url=urls)
    from_text = Settings.from_env({"HOPSCHED_URL": " , ".join(urls)})
    assert from_list.urls == from_text.urls == tuple(urls)  # the comma in p1,x stays
    assert from_list.masked_url == "amqp://u:***@h1:5672/v,amqp://u:***@h2:5673/v"
    assert "p1" not in repr(from_list)
    assert "p2" not in repr(from_list)


def test_several_urls_must_share_user_and_vhost() -> None:
    with pytest.raises(InvalidSettingsError, match="same user and vhost") as caught:
        Settings(url="amqp://u:s3cret@h1/v,amqp://w:s3cret@h2/v")
    assert "s3cret" not in str(caught.value)


# --- URL query options (F33) --------------------------------------------------------------

BASE = "amqp://u:s3cret@h/"
TLS_BASE = "amqps://u:s3cret@h/"


@pytest.mark.parametrize(
    ("query", "says"),
    [
        pytest.param("heartbeat=abc", "heartbeat='abc' is not whole seconds", id="F33-abc"),
        pytest.param("heartbeat=1.5", "heartbeat='1.5' is not whole seconds", id="F33-1.5"),
        pytest.param("heartbeat=-5", "heartbeat='-5' is not whole seconds", id="F33-negative"),
        pytest.param("heartbeat=99999", "heartbeat='99999' is not whole", id="F33-99999"),
        pytest.param("heartbeat=65535", "from 0 to 65534", id="heartbeat-65535"),
        pytest.param("heartbeat=", "heartbeat='' is not whole seconds", id="heartbeat-empty"),
        pytest.param("heartbeat=5&heartbeat=10", "given twice", id="heartbeat-twice"),
        pytest.param("heartbeats=30", "is not one hopsched reads", id="typo"),
        pytest.param("frame_max=4096", "is not one hopsched reads", id="frame_max-ignored"),
        pytest.param("auth=kerberos", "is not plain or external", id="auth"),
        pytest.param("auth=external", "give certfile", id="external-without-tls"),
        pytest.param("name=", "option name='' is empty", id="name-empty"),
        pytest.param("cafile=/etc/ca.pem", "use amqps://", id="tls-option-on-amqp"),
        pytest.param("no_verify_ssl=1", "use amqps://", id="no-verify-on-amqp"),
    ],
)
def test_F33_a_url_option_out_of_range_is_refused_naming_it(query: str, says: str) -> None:
    with pytest.raises(InvalidSettingsError) as refused:
        Settings(url=f"{BASE}?{query}")

    text = str(refused.value)
    assert says in text
    assert "s3cret" not in text
    key = query.split("=")[0]
    assert f"option {key}=" in text


@pytest.mark.parametrize(
    ("query", "says"),
    [
        pytest.param("cafile=/nonexistent/ca.pem", "names no file", id="cafile-missing"),
        pytest.param("capath=/nonexistent", "names no directory", id="capath-missing"),
        pytest.param("keyfile=/etc/hostname", "needs certfile", id="key-without-cert"),
        pytest.param("cadata=%%%", "is not base64", id="cadata"),
        pytest.param("no_verify_ssl=false", "is not 0 or 1", id="no_verify_ssl-false"),
        pytest.param("auth=external", "give certfile", id="external-without-certfile"),
    ],
)
def test_tls_options_are_checked_on_amqps(query: str, says: str) -> None:
    with pytest.raises(InvalidSettingsError, match=says):
        Settings(url=f"{TLS_BASE}?{query}")


@pytest.mark.parametrize(
    "query",
    ["heartbeat=0", "heartbeat=30", "heartbeat=65534", "auth=PLAIN", "name=orders-sched"],
)
def test_url_options_in_range_are_accepted(query: str) -> None:
    assert Settings(url=f"{BASE}?{query}").masked_url == f"amqp://u:***@h/?{query}"


def test_tls_options_that_name_real_files_are_accepted() -> None:
    url = f"{TLS_BASE}?cafile=/etc/hostname&certfile=/etc/hostname&keyfile=/etc/hostname"
    assert Settings(url=f"{url}&auth=external&no_verify_ssl=0&capath=/etc").url.startswith(url)


@given(st.text(max_size=8))
def test_any_heartbeat_is_accepted_only_as_whole_seconds_in_range(value: str) -> None:
    url = f"{BASE}?{urlencode({'heartbeat': value})}"
    valid = value.isascii() and value.isdigit() and int(value) <= 65534
    if valid:
        Settings(url=url)
    else:
        with pytest.raises(InvalidSettingsError, match="option heartbeat="):
            Settings(url=url)


@pytest.mark.parametrize("value", ["abc", "1.5", "-5", "99999"])
async def test_F33_the_cli_says_it_in_one_line_and_exits_2(value: str) -> None:
    status, out, err = await hopsched_cli("status", "--url", f"{BASE}?heartbeat={value}")

    assert status == 2, (out, err)
    assert err.count("\n") == 1, err
    assert err.startswith("Error: ")
    assert f"heartbeat={value!r}" in err
    assert "Traceback" not in err


def test_step_ratio_4_from_the_environment_gives_the_15_step_ladder() -> None:
    settings = Settings.from_env({"HOPSCHED_STEP_RATIO": "4"})
    assert settings.step_ratio == 4
    assert settings.ladder.steps == tuple(4**k for k in range(2, 17))
    assert Settings().ladder.steps == tuple(2**k for k in range(4, 33))  # the default, as ever
