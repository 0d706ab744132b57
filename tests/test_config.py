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
        ("log_level = 'loud'", "expected one of debug, info, warning, error"),
        ("[nri]\nindex = 5", "expected two digits as a string"),
        ("[nri]\nname = 'cpu plugin'", "letters, digits and _.+- only"),
        ("nri = 1", "[nri] must be a table"),
        ("state_dir = ''", "expected a non-empty string"),
        ("reserved_cpus = ", "not valid TOML"),
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
