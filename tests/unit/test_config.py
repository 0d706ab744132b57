"""Configuration: every key, every refusal names the key and the expected form."""

from __future__ import annotations

import pytest

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.ops.config import ConfigError, Settings, load_file, merge, parse_toml


def test_all_keys_parse():
    text = """
reserved_cpus = "0-1"
state_dir = "/var/lib/x"
policy_options = ["full-pcpus-only", "strict-cpu-reservation"]
cfs_quota = "keep"
sysfs = "/srv/sys"
log_level = "debug"
[nri]
socket = "/run/nri.sock"
name = "cpu.plugin"
index = "10"
request_budget = 0.8
[metrics]
listen = "127.0.0.1:9100"
"""
    settings = merge(Settings(), parse_toml(text, "t.toml"))
    assert settings.reserved_cpus == CPUSet([0, 1])
    assert settings.policy_options == ("full-pcpus-only", "strict-cpu-reservation")
    assert (settings.nri_socket, settings.nri_name, settings.nri_index) == (
        "/run/nri.sock",
        "cpu.plugin",
        "10",
    )
    assert settings.metrics_listen == "127.0.0.1:9100" and settings.cfs_quota == "keep"
    assert settings.nri_request_budget == 0.8
    assert parse_toml("[nri]\nrequest_budget = 2", "t")["nri_request_budget"] == 2.0
    assert Settings().nri_request_budget == 1.5  # below the runtimes' 2 s request timeout
    more = parse_toml("[health]\ninterval = 2\n[kubelet]\ncpu_manager_state = ''", "t")
    assert more == {"health_interval": 2.0, "kubelet_cpu_manager_state": ""}


def test_reserved_cpus_as_a_list_and_default_count():
    assert parse_toml("reserved_cpus = [0, 2]", "t")["reserved_cpus"] == CPUSet([0, 2])
    assert Settings().effective_reserved_count == 1
    assert Settings(reserved_cpus=CPUSet([3])).effective_reserved_count is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("reserve_cpus = 1", "t.toml: unknown key 'reserve_cpus'; known keys:"),
        ("[nri]\nport = 1", "unknown key 'nri.port'"),
        ("reserved_cpus = '3-1'", "reserved_cpus: invalid cpulist '3-1'"),
        ("reserved_cpus = ''", "reserved_cpus is empty"),
        ("reserved_cpus = [0, -1]", "expected a cpulist string"),
        ("reserved_cpu_count = 0", "reserved_cpu_count = 0: expected a whole number"),
        ("reserved_cpu_count = '2'", "expected a whole number"),
        ("policy_options = ['fast']", "unknown policy option(s) fast"),
        (
            "policy_options = ['full-pcpus-only', 'distribute-cpus-across-cores']",
            "cannot be used together",
        ),
        ("policy_options = 'full-pcpus-only'", "expected a list of option names"),
        ("cfs_quota = 'off'", "cfs_quota = 'off': expected one of unlimited, keep"),
        ("nic_read_ahead = 'yes'", "nic_read_ahead = 'yes': expected true or false"),
        ("nic_read_ahead = 1", "nic_read_ahead = 1: expected true or false"),
        ("log_level = 'loud'", "expected one of debug, info, warning, error"),
        ("[nri]\nindex = 5", "expected two digits as a string"),
        ("[nri]\nname = 'cpu plugin'", "letters, digits and _.+- only"),
        ("[nri]\nrequest_budget = 0", "nri.request_budget = 0: expected seconds, a number"),
        ("[nri]\nrequest_budget = -1.5", "expected seconds"),
        ("[nri]\nrequest_budget = 61", "at most 60"),
        ("[nri]\nrequest_budget = nan", "expected seconds"),
        ("[nri]\nrequest_budget = true", "expected seconds"),
        ("[nri]\nrequest_budget = '1.5'", "expected seconds"),
        ("nri = 1", "[nri] must be a table"),
        ("state_dir = ''", "expected a non-empty string"),
        ("reserved_cpus = ", "not valid TOML"),
        ("[health]\ninterval = 0", "health.interval = 0: expected seconds, a number from 0.05"),
        ("[health]\ninterval = 301", "to 300"),
        ("[health]\ninterval = nan", "expected seconds"),
        ("[health]\ninterval = true", "expected seconds"),
        ("[kubelet]\ncpu_manager_state = 'state'", 'expected an absolute path, or "" for none'),
        ("[kubelet]\ncpu_manager_state = 1", "expected an absolute path"),
    ],
)
def test_bad_config_is_refused_with_key_and_expected_form(text, message):
    with pytest.raises(ConfigError) as err:
        parse_toml(text, "t.toml")
    assert message in str(err.value)


def test_list_and_count_together_are_refused():
    with pytest.raises(ConfigError, match="both set; keep one"):
        merge(Settings(), {"reserved_cpus": CPUSet([0])}, {"reserved_cpu_count": 2})


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_file(tmp_path / "missing.toml")


# -- metrics.listen: checked when the config is read, not when the daemon binds ----------------


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("127.0.0.1:9464", "127.0.0.1", 9464),
        ("0.0.0.0:1", "0.0.0.0", 1),
        ("[::1]:9100", "::1", 9100),
        ("[::]:65535", "::", 65535),
        ("[fe80::1%eth0]:9100", "fe80::1%eth0", 9100),
        ("localhost:9100", "localhost", 9100),
        ("node-7.example.com:9100", "node-7.example.com", 9100),
        ("metrics.:9100", "metrics.", 9100),
        (":9464", "", 9464),  # every address, as before
    ],
)
def test_metrics_listen_accepted(listen, host, port):
    from nri_cpuplugin.ops.config import parse_listen  # the split the metrics server binds with

    assert parse_toml(f'[metrics]\nlisten = "{listen}"', "t.toml") == {"metrics_listen": listen}
    assert parse_listen(listen) == (host, port)


@pytest.mark.parametrize(
    ("listen", "reason"),
    [
        (":notaport", "port 'notaport' is not a number"),
        ("127.0.0.1:99999", "port 99999 is out of range"),
        ("127.0.0.1:0", "port 0"),
        ("127.0.0.1:-1", "port '-1' is not a number"),
        ("127.0.0.1:9 100", "port '9 100' is not a number"),
        ("127.0.0.1:", "no port"),
        ("127.0.0.1", "no port"),
        ("999.1.1.1:9100", "'999.1.1.1' is not an IPv4 address"),
        ("10.1.1:9100", "'10.1.1' is not an IPv4 address"),
        ("::1:9100", "IPv6 addresses go in brackets"),
        ("[::1]9100", "no port"),
        ("[not:v6]:9100", "'not:v6' is not an IPv6 address"),
        ("[127.0.0.1]:9100", "'127.0.0.1' is not an IPv6 address"),
        ("-bad-.example:9100", "'-bad-.example' is not an IP address or a host name"),
        ("under_score:9100", "is not an IP address or a host name"),
        ("a..b:9100", "is not an IP address or a host name"),
        ("host.123:9100", "is not an IP address or a host name"),
        ("http://127.0.0.1:9100", "is not an IP address or a host name"),
        ("", "no port"),
    ],
)
def test_metrics_listen_refused_naming_the_key_and_the_accepted_forms(listen, reason):
    with pytest.raises(ConfigError) as err:
        parse_toml(f'[metrics]\nlisten = "{listen}"', "t.toml")
    message = str(err.value)
    assert message.startswith(f"t.toml: metrics.listen = {listen!r}: "), message
    assert reason in message
    assert "HOST:PORT" in message and "1-65535" in message and "[::1]:9464" in message


@pytest.mark.parametrize("value", ["9100", "[1, 2]", "{ host = 'a' }"])
def test_metrics_listen_must_be_a_string(value):
    with pytest.raises(ConfigError, match=r"metrics\.listen = .*: expected HOST:PORT"):
        parse_toml(f"[metrics]\nlisten = {value}", "t.toml")
