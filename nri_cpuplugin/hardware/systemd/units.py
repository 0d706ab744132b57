"""A container's cpuset as systemd keeps it: ``AllowedCPUs``/``AllowedMemoryNodes`` of its scope,
what is asked of systemd for it, and what systemd's answers mean.

With the systemd cgroup driver a container's cgroup is a transient systemd unit
(``cri-containerd-<id>.scope``), and systemd writes the unit's cpuset properties back into
the cgroup whenever it re-applies them (``daemon-reload``, ``daemon-reexec``, a
``set-property`` of the unit): a cpuset written only to cgroupfs is lost then.  So every cpuset
change to such a container is also made on the unit, as runc does: one
``org.freedesktop.systemd1.Manager.SetUnitProperties(name, runtime=true, [AllowedCPUs,
AllowedMemoryNodes])`` call per unit (docs/cgroups-and-hooks.md §21 has the facts and their
sources).  systemd applies it to the cgroup before it answers and keeps it as a drop-in under
``/run/systemd/transient``; the caller still writes the cgroup files as before.  The same call
with both sets empty *releases* the unit: systemd then holds no cpuset for it and never writes
one into its cgroup again (``masks``; the daemon's hand-over, daemon/units.py).

Unit names come from the runtime (a container's cgroupsPath) and are checked against systemd's
unit name rules before they go on the bus.  Each unit's call ends in a ``UnitResult``: set, or
why not and what to do.

The calls are made on one pipelined connection (conversation.py, sans I/O) by the
blocking client (client.py: the OCI hook, the daemon's worker thread).
"""

from __future__ import annotations

import os

from ...base.errors import PluginError
from . import wire
from .message import Message, method_call

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Iterable

SYSTEM_BUS = "/run/dbus/system_bus_socket"
# systemd's own socket (PID 1 only, root only, peer to peer: no dbus-daemon in the way, no Hello)
SYSTEMD_PRIVATE = "/run/systemd/private"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
MAX_UNIT_NAME = 255  # systemd's UNIT_NAME_MAX (256) counts the NUL
_UNIT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_.\\")
MAX_CPU = 1 << 16  # a bitmask byte per 8 CPUs: a bound on what one call can carry

# outcomes of one unit's call
SET = "set"  # systemd applied it (cgroup written, drop-in kept)
GONE = "gone"  # no such unit: the container went away meanwhile
DENIED = "denied"  # systemd or the bus refused us
TIMEOUT = "timeout"  # not sent, or no answer, within the deadline (nothing to wait for)
PENDING = "pending"  # sent on a working connection, unanswered yet: systemd applies its calls
# in order, so it will be set (a late failure comes back through the client's ``take_late``)
UNREACHABLE = "unreachable"  # no connection to systemd (socket, authentication, Hello)
FAILED = "failed"  # any other error answer

_GONE_ERRORS = frozenset({"org.freedesktop.systemd1.NoSuchUnit"})
_DENIED_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.AccessDenied",
        "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired",
        "org.freedesktop.DBus.Error.AuthFailed",
    }
)
_ABSENT_ERRORS = frozenset(
    {"org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner"}
)
PERMISSION_HINT = (
    "setting a unit's properties needs uid 0 (or polkit's org.freedesktop.systemd1.manage-units "
    "action), and the system bus's policy lets only root send to org.freedesktop.systemd1 "
    "(/usr/share/dbus-1/system.d/org.freedesktop.systemd1.conf): run nri-cpuplugin as root"
)


class SystemdError(PluginError):
    """A unit name that cannot be used, or systemd that could not be reached or refused."""

    code = "systemd"


# --- unit names and masks -------------------------------------------------------------------


def check_unit_name(name: str) -> str:
    """``name`` if systemd accepts it as a plain scope or slice name, else SystemdError.

    systemd's rules (src/basic/unit-name.c, ``unit_name_is_valid``): at most 255 characters,
    ASCII letters, digits and ``:-_.\\`` before the type suffix, a non-empty name; ``@``
    (templates) is refused here, as are types other than scopes and slices, which no container
    runtime makes."""
    if not isinstance(name, str):
        raise SystemdError(f"unit name {name!r} is not a string", "unit-name")
    stem, dot, suffix = name.rpartition(".")
    if (
        not 0 < len(name) <= MAX_UNIT_NAME
        or not dot
        or not stem
        or suffix not in ("scope", "slice")
        or not _UNIT_CHARS.issuperset(stem)
    ):
        raise SystemdError(
            f"{name[:300]!r} is not a systemd scope or slice name (at most 255 characters of "
            "A-Z a-z 0-9 : - _ . \\ ending in .scope or .slice)",
            "unit-name",
        )
    return name


def unit_name(cgroups_path: str) -> str | None:
    """The systemd unit of a container whose OCI ``linux.cgroupsPath`` is ``cgroups_path``, or
    None when the path is not in the systemd driver's ``slice:prefix:name`` notation (the
    cgroupfs driver's absolute paths).

    As runc derives it (libcontainer/specconv ``CreateCgroupConfig``, cgroups/systemd
    ``getUnitName``): ``<prefix>-<name>.scope``, or ``name`` itself when it ends in ``.slice``
    (the prefix is then unused).  A name already ending in ``.scope`` gets ``.scope`` appended
    all the same, as runc does."""
    if not cgroups_path or cgroups_path.startswith("/") or ":" not in cgroups_path:
        return None
    parts = cgroups_path.split(":")
    if len(parts) != 3:
        raise SystemdError(
            f"cgroupsPath {cgroups_path[:300]!r} is neither an absolute path nor slice:prefix:name",
            "unit-name",
        )
    _slice, prefix, name = parts
    if name.endswith(".slice"):
        return check_unit_name(name)
    return check_unit_name(f"{prefix}-{name}.scope")


def cpu_mask(cpus: Iterable[int]) -> bytes:
    """``cpus`` as systemd's ``ay`` bitmask: CPU ``n`` is bit ``n % 8`` (least significant
    first) of byte ``n // 8``, as few bytes as the highest CPU needs.  (runc's ``RangeToBits``;
    systemd's ``cpu_set_from_dbus`` reads it back the same way.)  An empty set is refused:
    systemd takes it as "no restriction" and leaves the old ``cpuset.cpus`` in place."""
    ids = cpus if isinstance(cpus, (set, frozenset)) else set(cpus)
    if not ids:
        raise SystemdError("an empty CPU set would lift the unit's restriction", "cpu-mask")
    try:
        low, high = min(ids), max(ids)
        if not (isinstance(low, int) and isinstance(high, int) and low >= 0 and high < MAX_CPU):
            raise TypeError
        bits = 0
        for cpu in ids:  # (a large int as the bit array: one shift and or per CPU)
            bits |= 1 << cpu
    except (TypeError, ValueError):
        raise SystemdError(
            f"{sorted(map(repr, ids))[:8]} are not CPU or memory node numbers (0 to {MAX_CPU - 1})",
            "cpu-mask",
        ) from None
    return bits.to_bytes(high // 8 + 1, "little")


def masks(cpus: Iterable[int], mems: Iterable[int] | None) -> tuple[bytes, bytes | None]:
    """A call's ``ay`` masks (``cpu_mask``; mems None: not sent) - or, for a *release* (both
    sets given and empty), two empty arrays: systemd then holds no cpuset for the unit, and
    writes none into its cgroup again (docs/cgroups-and-hooks.md §21, "Units without a
    cpuset"); the cgroup files keep what was last written to them."""
    cpu_ids = set(cpus)
    mem_ids = None if mems is None else set(mems)
    if mem_ids is not None and not cpu_ids and not mem_ids:
        return b"", b""
    return cpu_mask(cpu_ids), None if mem_ids is None else cpu_mask(mem_ids)


def set_allowed_call(serial: int, unit: str, cpus: bytes, mems: bytes | None) -> bytes:
    """The SetUnitProperties call runc makes for a cpuset: runtime (not persistent) properties,
    AllowedCPUs and, when given, AllowedMemoryNodes, each an ``ay`` bitmask (``cpu_mask``) in a
    variant.  ``unit`` must have passed ``check_unit_name``."""
    properties = [("AllowedCPUs", wire.Variant("ay", cpus))]
    if mems is not None:
        properties.append(("AllowedMemoryNodes", wire.Variant("ay", mems)))
    return method_call(
        serial,
        SYSTEMD,
        MANAGER_PATH,
        MANAGER,
        "SetUnitProperties",
        "sba(sv)",
        (unit, True, properties),
    )


def bus_path(setting: str) -> str | None:
    """The socket to reach systemd on for ``[systemd] bus``: "auto" (systemd's own private
    socket when systemd is PID 1 and we are root - no bus daemon in between - else the system
    bus, if there is one), "off", or a path.  None: nothing is changed through systemd."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    if os.geteuid() == 0 and os.path.exists(SYSTEMD_PRIVATE):
        return SYSTEMD_PRIVATE
    return SYSTEM_BUS if os.path.exists(SYSTEM_BUS) else None


# --- results --------------------------------------------------------------------------------


class UnitResult:
    """What became of one unit's call: ``outcome`` (SET, PENDING, GONE, DENIED, TIMEOUT,
    UNREACHABLE, FAILED) and, unless it was set, ``error`` saying what went wrong and what to do."""

    __slots__ = ("error", "outcome", "unit")

    def __init__(self, unit: str, outcome: str, error: SystemdError | None = None) -> None:
        self.unit = unit
        self.outcome = outcome
        self.error = error

    @property
    def ok(self) -> bool:
        """Nothing to do for the caller: set, on its way (pending), or the unit is gone (a
        container removed while its cpuset changed is no error)."""
        return self.outcome in (SET, PENDING, GONE)

    def __repr__(self) -> str:
        return f"UnitResult({self.unit!r}, {self.outcome!r}, {self.error!s})"


def classify(unit: str, reply: Message) -> UnitResult:
    """A unit's result from systemd's (or the bus's) answer to its call."""
    if reply.type == wire.METHOD_RETURN:
        return UnitResult(unit, SET)
    name = reply.error_name or ""
    text = reply.error_text()
    said = f"{name}: {text}" if text else name
    if name in _GONE_ERRORS:
        return UnitResult(unit, GONE, SystemdError(f"{unit}: no such unit ({said})", "gone"))
    if name in _DENIED_ERRORS:
        message = f"systemd refused to set AllowedCPUs of {unit} ({said}): {PERMISSION_HINT}"
        return UnitResult(unit, DENIED, SystemdError(message, "denied"))
    if name in _ABSENT_ERRORS:
        message = (
            f"cannot set AllowedCPUs of {unit}: nothing owns {SYSTEMD} on this bus ({said}); "
            "systemd is not the init system here, so the systemd cgroup driver cannot be in use"
        )
        return UnitResult(unit, UNREACHABLE, SystemdError(message, "unreachable"))
    if name in (
        "org.freedesktop.DBus.Error.PropertyReadOnly",
        "org.freedesktop.DBus.Error.UnknownMethod",
    ):
        message = (
            f"systemd cannot set AllowedCPUs of {unit} ({said}): AllowedCPUs and "
            "AllowedMemoryNodes need systemd 244 or later"
        )
        return UnitResult(unit, FAILED, SystemdError(message, "unsupported"))
    return UnitResult(unit, FAILED, SystemdError(f"setting AllowedCPUs of {unit}: {said}"))


def connect_error(path: str, error: OSError) -> SystemdError:
    """Why systemd at ``path`` cannot be reached, and what to do, from the socket's error."""
    if isinstance(error, FileNotFoundError):
        owner = "dbus" if path == SYSTEM_BUS else "systemd (as PID 1)"
        what = f"no socket at {path}: is {owner} running?"
    elif isinstance(error, PermissionError):
        what = f"{path} is not open to this user: {PERMISSION_HINT}"
    elif isinstance(error, ConnectionRefusedError):
        what = f"nothing listens on {path}"
    elif isinstance(error, TimeoutError):
        what = f"connecting to {path} took too long"
    else:
        what = f"{path}: {error}"
    return SystemdError(f"cannot reach systemd's D-Bus API: {what}", "unreachable")


def timeout_error(timeout: float) -> SystemdError:
    """What a unit's call unanswered within ``timeout`` seconds means."""
    return SystemdError(
        f"systemd did not answer SetUnitProperties within {timeout:g} s (it may be busy with "
        "a daemon-reload, or hung); the cgroup files were still written",
        "timeout",
    )
