"""Settings: defaults, then the TOML file, then the runtime's Configure string, then flags.

The same keys are accepted in the file (``--config``) and in the config string the runtime
sends a runtime-launched plugin (from ``/etc/nri/conf.d/NN-name.conf``).  Anything unknown or
malformed is refused with a message naming the key, where it came from, and the expected form:
a typo must not silently run the node with defaults.
"""

from __future__ import annotations

import os

from ..base.errors import PluginError
from ..base.value import Value
from ..core.allocator import OptionError, validate_options
from ..core.cpuset import CPUSet

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

    from ..core.engine import Engine
    from ..core.topology import Topology

    # A key's check: (value as read, "where: key" for the message) -> the value Settings holds.
    Check = Callable[[Any, str], Any]

DEFAULT_STATE_DIR = "/var/lib/nri-cpuplugin"
LOG_LEVELS = ("debug", "info", "warning", "error")
CFS_QUOTA_MODES = ("unlimited", "keep")
PIN_AT = ("create", "start")
# An NRI plugin name: letters, digits and _.+- (a set, not a regular expression: importing re
# costs every OCI hook start more than a millisecond).
_PLUGIN_NAME = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-")
# The runtime's request timeout can be raised (containerd's plugin_request_timeout), so the
# budget may be too; beyond a minute a "budget" would only hide a stuck daemon.
MAX_REQUEST_BUDGET = 60.0
# Heartbeats (health.interval): below 50 ms they would cost the node; above 5 minutes a stuck
# daemon would go unnoticed for a quarter of an hour.
MIN_INTERVAL, MAX_INTERVAL = 0.05, 300.0
# A host name label (RFC 1123): letters, digits and inner hyphens, at most 63 characters.
# A DNS label; re is imported where it is used: only a config that sets metrics.listen needs it.
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
LISTEN_FORM = (
    "expected HOST:PORT with HOST an IPv4 address, an IPv6 address in brackets, a host name or "
    'localhost (empty: every address) and PORT a number 1-65535, like "127.0.0.1:9464" or '
    '"[::1]:9464"'
)


class ConfigError(PluginError, ValueError):
    """Invalid configuration; the message names the key and the expected form."""

    code = "config"


class Settings(Value):
    reserved_cpus: CPUSet | None = None
    reserved_cpu_count: int | None = None
    state_dir: str = DEFAULT_STATE_DIR
    policy_options: tuple[str, ...] = ()
    cfs_quota: str = "unlimited"
    sysfs: str = "/sys"
    log_level: str = "info"
    nri_socket: str = "/var/run/nri/nri.sock"
    nri_name: str = "cpuplugin"
    nri_index: str = "50"
    # Seconds within which every NRI request is answered, decided or not (daemon/deadline.py).
    nri_request_budget: float = 1.5
    # When the daemon decides a container: at CreateContainer, or at StartContainer (never
    # consulted at creation; under the systemd cgroup driver only while systemd is reachable,
    # systemd_bus) - docs/architecture.md, "Pinning at start".
    nri_pin_at: str = "create"
    metrics_listen: str | None = None
    # Read Guaranteed pods' interfaces when their sandbox starts (daemon/pod_nics.py).
    nic_read_ahead: bool = True
    # Earmark CPUs for a Guaranteed pod's exclusive containers when its sandbox starts.
    earmark_pods: bool = True
    # Where the daemon reaches systemd to change the cpusets of systemd-driver containers as
    # systemd keeps them (daemon/units.py): "auto", "off", or a socket path.
    systemd_bus: str = "auto"
    # The host's root as the daemon sees it, where systemd's unit files are read (None: the
    # directory above ``sysfs``, "/" for "/sys").
    systemd_unit_root: str | None = None
    # Keep device interrupts off every exclusive container's CPUs (core/irq.py); pods may ask
    # for it one by one with irq-free.nri-cpuplugin.io: "true" either way.
    irq_keep_off_exclusive: bool = False
    # Seconds between the daemon's heartbeats: its health file, systemd's watchdog (ops/health.py).
    health_interval: float = 10.0
    # kubelet's CPU manager checkpoint: the daemon refuses to start while it says "static"
    # (ops/kubelet.py); "" skips the check.
    kubelet_cpu_manager_state: str = "/var/lib/kubelet/cpu_manager_state"

    @property
    def effective_reserved_count(self) -> int | None:
        """kubelet's static policy needs a reservation; one CPU unless told otherwise."""
        if self.reserved_cpus is None and self.reserved_cpu_count is None:
            return 1
        return self.reserved_cpu_count

    @property
    def unit_files_root(self) -> str:
        """Where systemd's unit files are read (hardware/systemd/unit_config.py): as configured,
        else the directory above sysfs (a generated sysfs in tests has its own beside it)."""
        return self.systemd_unit_root or os.path.dirname(self.sysfs.rstrip("/")) or "/"

    def engine(self, topology: Topology) -> Engine:
        """The engine these settings make on ``topology``: the one build of both front ends."""
        from ..core.engine import Engine
        from ..core.policy import StaticPolicy

        policy = StaticPolicy.from_config(
            topology,
            self.reserved_cpus,
            self.effective_reserved_count,
            self.policy_options,
            self.irq_keep_off_exclusive,
        )
        return Engine(policy, self.cfs_quota)


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """Validated overrides (Settings field -> value) from TOML text."""
    import tomllib  # here: most runs (the OCI hook's) have no config text to parse

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: not valid TOML: {err}") from None
    overrides: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            items = [(f"{key}.{sub}", sub_value) for sub, sub_value in value.items()]
        elif "." not in key:  # (a quoted "nri.socket" is no key of the [nri] table)
            items = [(key, value)]
        else:
            raise _unknown(source, key)
        for name, item in items:
            if name not in _KEYS:
                raise _unknown(source, name)
            field, check = _KEYS[name]
            overrides[field] = check(item, f"{source}: {name}")
    return overrides


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    return parse_toml(text, str(path))


def base_settings(config_file: str | None) -> Settings:
    """The defaults, then the TOML file when one is given."""
    return merge(Settings(), load_file(config_file)) if config_file else Settings()


def flag_overrides(**values: Any) -> dict[str, Any]:
    """Command-line overrides (Settings field -> value; None: not given), applied last.  A
    reserved CPU list given on the command line replaces a configured count."""
    flags = {field: value for field, value in values.items() if value is not None}
    if "reserved_cpus" in flags:
        flags["reserved_cpu_count"] = None
    return flags


def merge(base: Settings, *layers: Mapping[str, Any]) -> Settings:
    """Apply override layers in order; the result is checked as a whole."""
    settings = base
    for layer in layers:
        settings = settings.evolve(**layer)
    if settings.reserved_cpus is not None and settings.reserved_cpu_count is not None:
        raise ConfigError(
            "reserved_cpus and reserved_cpu_count are both set; keep one "
            f"(reserved_cpus={settings.reserved_cpus}, reserved_cpu_count="
            f"{settings.reserved_cpu_count})"
        )
    return settings


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host without brackets, "" for every address; port 0-65535).

    Checked here, when the configuration is read, so that a typo is refused at start with the
    key named instead of surfacing later as a bind error.  Host names are only checked for
    their form: resolving them would make reading the config depend on DNS.  ValueError says
    what is wrong."""
    bracketed = value.startswith("[")
    host, port = _split_ipv6(value) if bracketed else _split_host(value)
    number = _port(port)
    if not bracketed and host:
        _check_host(host)
    return host, number


def _split_ipv6(value: str) -> tuple[str, str]:
    """``[ADDRESS]:PORT`` -> (address, port text)."""
    import ipaddress  # here: only a config that sets metrics.listen needs it

    host, bracket, rest = value[1:].partition("]")
    if not bracket:
        raise ValueError("no closing ] after the IPv6 address")
    if not rest.startswith(":"):
        raise ValueError("no port after the IPv6 address")
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IPv6 address") from None
    return host, rest[1:]


def _split_host(value: str) -> tuple[str, str]:
    """``HOST:PORT`` without brackets -> (host, port text)."""
    import ipaddress

    host, colon, port = value.rpartition(":")
    if not colon:
        raise ValueError("no port")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address or a host name") from None
        raise ValueError("IPv6 addresses go in brackets, like [::1]:9464")
    return host, port


def _port(port: str) -> int:
    if not port:
        raise ValueError("no port")
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"port {port!r} is not a number")
    number = int(port) if len(port) <= 5 else 65536  # int() of a huge string is slow
    if number > 65535:
        raise ValueError(f"port {port} is out of range")
    return number


def _check_host(host: str) -> None:
    """An IPv4 address or a host name, by its form."""
    import ipaddress
    import re

    if all(c.isdigit() or c == "." for c in host):  # meant as an IPv4 address
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
        return
    name = host.removesuffix(".")  # a trailing dot: fully qualified
    labels = name.split(".")
    if (
        len(name) > 253
        or not name.isascii()
        or not all(re.fullmatch(_HOST_LABEL, label) for label in labels)
        or labels[-1].isdigit()  # a numeric top-level label is a mistyped address, not a name
    ):
        raise ValueError(f"{host!r} is not an IP address or a host name")


def _unknown(source: str, key: str) -> ConfigError:
    return ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(KNOWN_KEYS)}")


# --- one check per key: the value as Settings holds it, or a ConfigError naming the key ----


def _reserved_cpus(value: Any, where: str) -> CPUSet:
    if isinstance(value, str):
        try:
            cpus = CPUSet.parse(value)
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None
    elif isinstance(value, list) and all(type(v) is int and v >= 0 for v in value):
        cpus = CPUSet(value)
    else:
        raise ConfigError(
            f'{where} = {value!r}: expected a cpulist string like "0-1" or a '
            "list of CPU ids like [0, 1]"
        )
    if not cpus:
        raise ConfigError(f"{where} is empty: reserve at least one CPU")
    return cpus


def _reserved_cpu_count(value: Any, where: str) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{where} = {value!r}: expected a whole number of CPUs, at least 1")
    return value


def _policy_options(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} = {value!r}: expected a list of option names")
    try:
        validate_options(value)
    except OptionError as err:
        raise ConfigError(f"{where}: {err}") from None
    return tuple(value)


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any, where: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where} = {value!r}: expected one of {', '.join(choices)}")
        return str(value)

    return check


def _boolean(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise ConfigError(f"{where} = {value!r}: expected true or false")
    return value


def _nri_index(value: Any, where: str) -> str:
    if not (isinstance(value, str) and len(value) == 2 and value.isdigit()):
        raise ConfigError(f'{where} = {value!r}: expected two digits as a string, like "50"')
    return value


def _request_budget(value: Any, where: str) -> float:
    # bool is an int to Python, but `true` is no number of seconds.
    if type(value) not in (int, float) or not 0 < value <= MAX_REQUEST_BUDGET:
        raise ConfigError(
            f"{where} = {value!r}: expected seconds, a number above 0 and at most "
            f"{MAX_REQUEST_BUDGET:g} (like 1.5); it must stay below the runtime's request "
            "timeout (2 s by default)"
        )
    return float(value)


def _interval(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not MIN_INTERVAL <= value <= MAX_INTERVAL:
        raise ConfigError(
            f"{where} = {value!r}: expected seconds, a number from {MIN_INTERVAL:g} to "
            f"{MAX_INTERVAL:g} (like 10)"
        )
    return float(value)


def _optional_path(value: Any, where: str) -> str:
    if not isinstance(value, str) or (value and not value.startswith("/")):
        raise ConfigError(f'{where} = {value!r}: expected an absolute path, or "" for none')
    return value


def _plugin_name(value: Any, where: str) -> str:
    if not (isinstance(value, str) and value and _PLUGIN_NAME.issuperset(value)):
        raise ConfigError(f"{where} = {value!r}: expected letters, digits and _.+- only")
    return value


def _listen(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} = {value!r}: {LISTEN_FORM}")
    try:
        _, port = parse_listen(value)
    except ValueError as err:
        raise ConfigError(f"{where} = {value!r}: {err}; {LISTEN_FORM}") from None
    if port == 0:
        # The kernel would pick a port nobody knows to scrape.
        raise ConfigError(f"{where} = {value!r}: port 0 picks a random port; {LISTEN_FORM}")
    return value


def _bus(value: Any, where: str) -> str:
    if value in ("auto", "off") or (isinstance(value, str) and value.startswith("/")):
        return str(value)
    raise ConfigError(
        f'{where} = {value!r}: expected "auto", "off" or the absolute path of a D-Bus socket'
    )


def _absolute(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f'{where} = {value!r}: expected an absolute path, like "/host"')
    return value


def _path(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} = {value!r}: expected a non-empty string")
    return value


# Every key of the TOML file and the runtime's config string: top-level keys, plus the [nri],
# [metrics], [systemd], [irq], [health] and [kubelet] tables ("table.key"), with the Settings
# field each sets and its check.
_KEYS: dict[str, tuple[str, Check]] = {
    "reserved_cpus": ("reserved_cpus", _reserved_cpus),
    "reserved_cpu_count": ("reserved_cpu_count", _reserved_cpu_count),
    "state_dir": ("state_dir", _path),
    "policy_options": ("policy_options", _policy_options),
    "cfs_quota": ("cfs_quota", _one_of(CFS_QUOTA_MODES)),
    "sysfs": ("sysfs", _path),
    "log_level": ("log_level", _one_of(LOG_LEVELS)),
    "nic_read_ahead": ("nic_read_ahead", _boolean),
    "earmark_pods": ("earmark_pods", _boolean),
    "nri.socket": ("nri_socket", _path),
    "nri.name": ("nri_name", _plugin_name),
    "nri.index": ("nri_index", _nri_index),
    "nri.request_budget": ("nri_request_budget", _request_budget),
    "nri.pin_at": ("nri_pin_at", _one_of(PIN_AT)),
    "metrics.listen": ("metrics_listen", _listen),
    "systemd.bus": ("systemd_bus", _bus),
    "systemd.unit_root": ("systemd_unit_root", _absolute),
    "irq.keep_off_exclusive": ("irq_keep_off_exclusive", _boolean),
    "health.interval": ("health_interval", _interval),
    "kubelet.cpu_manager_state": ("kubelet_cpu_manager_state", _optional_path),
}
_TABLES = frozenset(key.partition(".")[0] for key in _KEYS if "." in key)
KNOWN_KEYS = sorted(_KEYS)
