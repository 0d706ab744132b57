"""Whether systemd holds a cpuset for a unit, read from the unit's configuration files.

systemd writes a unit's ``AllowedCPUs``/``AllowedMemoryNodes`` into its cgroup whenever it
re-applies the unit (``daemon-reload``, ``daemon-reexec``, a ``set-property``) - but only while
one of them is set: a unit with neither keeps whatever was written to its cgroup files
(docs/cgroups-and-hooks.md §21).  For a transient unit, as runc's scopes are, the properties
live in files under ``/run/systemd/transient`` (the unit as created, then one drop-in per
property changed since, ``<unit>.d/50-AllowedCPUs.conf``), and under the ``system.control``
directories for properties set through D-Bus on other units (systemd.unit(5), "Unit File Load
Path").  Reading them costs a few small files and no call to a systemd that may be busy.

Only these places are read: drop-ins an administrator puts under ``/etc/systemd/system`` for
a container's scope, or top-level ``scope.d`` drop-ins, are not looked for.  A unit without any
file there cannot be told about: every transient unit has its file while it exists, so either
the files are not to be seen from here (the host's ``/run`` not mounted where the daemon looks)
or the unit is gone - the caller asks systemd, which knows.
"""

from __future__ import annotations

import os

# Where systemd keeps what was set at run time through its D-Bus API, by precedence.
TRANSIENT = "run/systemd/transient"
CONTROL = ("etc/systemd/system.control", "run/systemd/system.control")
PROPERTIES = ("AllowedCPUs", "AllowedMemoryNodes")
MAX_FILE = 1 << 20  # unit files of runc's scopes are a few hundred bytes


def holds_cpuset(unit: str, root: str = "/") -> bool | None:
    """Whether the last assignment of ``AllowedCPUs`` or ``AllowedMemoryNodes`` in the unit's
    transient file and its drop-ins (in name order, as systemd reads them) is not empty; None
    when that cannot be told (then the caller must assume it does): a file there cannot be
    read, or the unit has no file at all - runc's scopes are transient units, each with its
    file for as long as it exists, so none means systemd's files are not seen here (or the
    unit is gone: systemd says so when asked).  ``unit`` must be a checked unit name
    (units.check_unit_name): it becomes a path."""
    files = [os.path.join(root, TRANSIENT, unit)]
    dropins: dict[str, str] = {}
    for base in (*CONTROL, TRANSIENT):  # by precedence: the first file of a name wins
        directory = os.path.join(root, base, unit + ".d")
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        for name in names:
            if name.endswith(".conf"):
                dropins.setdefault(name, os.path.join(directory, name))
    files += [dropins[name] for name in sorted(dropins)]
    held = dict.fromkeys(PROPERTIES, False)
    found = False
    for path in files:
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_FILE).decode("utf-8", "replace")
        except FileNotFoundError:
            continue
        except OSError:
            return None
        found = True
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key.strip() in held:
                held[key.strip()] = bool(value.strip())
    return any(held.values()) if found else None


def unseen(root: str = "/") -> str | None:
    """Why systemd's transient unit files cannot be seen below ``root`` (the host's root not
    mounted there, say), or None when their directory can be listed."""
    directory = os.path.join(root, TRANSIENT)
    try:
        os.listdir(directory)
    except OSError as err:
        return f"{directory}: {err.strerror or err}"
    return None
