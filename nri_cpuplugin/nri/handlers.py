"""The handlers a plugin may define, and checks on them: the event table, the subscription a
plugin's handlers imply, how a Configure handler may narrow it, which events the runtime's NRI
version accepts, and misspelt handler names (an error at start-up, not a silently missing
subscription).

Event numbers and bits are NRI's (docs/nri-wire.md); handler names are ours, in the Go stub's
spirit (``create_container`` for its ``CreateContainer``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import NamedTuple

from ..base.errors import PluginError

# Event number -> handler name.  Events up to REMOVE_CONTAINER (bits within 0x7FF) are valid on
# every NRI version; the pod-update events only from NRI 0.10 on (docs/nri-wire.md §7).
EVENT_HANDLERS = {
    1: "run_pod_sandbox",
    2: "stop_pod_sandbox",
    3: "remove_pod_sandbox",
    4: "create_container",
    5: "post_create_container",
    6: "start_container",
    7: "post_start_container",
    8: "update_container",
    9: "post_update_container",
    10: "stop_container",
    11: "remove_container",
    12: "update_pod_sandbox",
    13: "post_update_pod_sandbox",
}
# The runtime refuses a mask with a bit outside its valid events and drops the plugin: the stub
# sends only what the runtime's NRI version knows.
VALID_EVENTS_BEFORE_0_10 = 0x7FF
VALID_EVENTS_SINCE_0_10 = 0x3FFF
EVENT_BITS = {name: 1 << (event - 1) for event, name in EVENT_HANDLERS.items()}
# An event the Go stub has but this one never subscribes to: a validator's failure fails every
# container creation, and a zero mask would subscribe to it (docs/nri-wire.md §7.3).  A plugin
# defining it would wait for calls that never come: named in errors, never served.
UNSERVED_EVENTS = {14: "validate_container_adjustment"}
# Every name the stub calls on a plugin.
LIFECYCLE_HANDLERS = ("configure", "synchronize", "shutdown", "connection_lost")
KNOWN_HANDLERS = frozenset(EVENT_HANDLERS.values()) | frozenset(LIFECYCLE_HANDLERS)
# Public names in the shape of a handler (the NRI objects, or an on_ callback prefix).  Narrow on
# purpose: a plugin's other public methods (start_metrics, cpu_events, ...) must pass.
HANDLER_SHAPED = re.compile(r"^on_|_(?:container|containers|sandbox|pod)$")
# difflib ratio above which a public name counts as a misspelling of a handler: catches
# synchronise, shutdwon, stop_contianer, post_stop_container; not start_metrics or stop_hotplug.
MISSPELLING_CUTOFF = 0.8
# Handlers called with the pod alone (update_pod_sandbox gets the resources too: own method).
POD_EVENTS = {
    "run_pod_sandbox",
    "stop_pod_sandbox",
    "remove_pod_sandbox",
    "post_update_pod_sandbox",
}
# NRI >= 0.12 calls these directly, falling back to StateChange when we answer UNIMPLEMENTED
# (docs/nri-wire.md §9.5).
PER_EVENT_METHODS = {
    "RunPodSandbox": "run_pod_sandbox",
    "StopPodSandbox": "stop_pod_sandbox",
    "RemovePodSandbox": "remove_pod_sandbox",
    "PostCreateContainer": "post_create_container",
    "StartContainer": "start_container",
    "PostStartContainer": "post_start_container",
    "PostUpdateContainer": "post_update_container",
    "RemoveContainer": "remove_container",
    "PostUpdatePodSandbox": "post_update_pod_sandbox",
}
# The oldest runtime releases with NRI >= 0.10, for runtimes that do not say their NRI version
# (all before NRI 0.12): containerd 2.2.0 carries 0.10.0, CRI-O 1.34.0 too (§13.1).
NRI_0_10_SINCE = {"containerd": (2, 2), "cri-o": (1, 34)}


class NRIVersion(NamedTuple):
    """What the stub knows of the runtime's NRI: ``version`` as the runtime said it (NRI >=
    0.12) or as inferred from the runtime's own version ("" when neither worked), and whether
    it accepts the events of NRI 0.10 and later."""

    version: str
    since_0_10: bool
    inferred: bool

    @property
    def valid_events(self) -> int:
        return VALID_EVENTS_SINCE_0_10 if self.since_0_10 else VALID_EVENTS_BEFORE_0_10


def _leading_numbers(text: str) -> tuple[int, ...]:
    """(2, 3, 4) from "v2.3.4", "2.1.9+unknown", "1.7.24~ds1", "v0.12.0-rc.1"; () if none."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    return tuple(int(g) for g in match.groups() if g is not None) if match else ()


def runtime_nri(nri_version: str, runtime_name: str, runtime_version: str) -> NRIVersion:
    """The runtime's NRI, from Configure: NRI 0.12 sends its version; older runtimes are known
    by name and release.  An unknown runtime counts as old: subscribing to an event it does not
    know would get the plugin dropped, missing an optional event costs nothing."""
    said = _leading_numbers(nri_version)
    if len(said) >= 2 and said[:2] != (0, 0):  # "0.0.0-unknown": a build without module data
        return NRIVersion(nri_version.strip(), said[:2] >= (0, 10), inferred=False)
    since = NRI_0_10_SINCE.get(runtime_name.strip().lower())
    release = _leading_numbers(runtime_version)
    if since is None or len(release) < 2:
        return NRIVersion("", since_0_10=False, inferred=True)
    newer = release[:2] >= since
    return NRIVersion(">= 0.10" if newer else "< 0.10", newer, inferred=True)


class SubscriptionError(PluginError, ValueError):
    """A Configure handler asked for events the plugin cannot serve."""

    code = "subscription"


_MISSING = object()


def event_mask(plugin: object) -> int:
    """The events a plugin subscribes to: exactly those it has handlers for."""
    mask = 0
    for event, name in EVENT_HANDLERS.items():
        if callable(getattr(plugin, name, None)):
            mask |= 1 << (event - 1)
    return mask


def _normalized(name: str) -> str:
    return name.replace("_", "").lower()


_BY_NORMALIZED = {_normalized(name): name for name in KNOWN_HANDLERS}


def _closest_handler(name: str) -> str | None:
    """The handler ``name`` was probably meant to be: same letters in another case (Go's
    CreateContainer), else the nearest by difflib; None if nothing is near."""
    name = name.removeprefix("on_")  # on_create_container was meant as create_container
    exact = _BY_NORMALIZED.get(_normalized(name))
    if exact is not None:
        return exact
    close = difflib.get_close_matches(name, sorted(KNOWN_HANDLERS), n=1, cutoff=0.5)
    return close[0] if close else None


_UNSERVED_NORMALIZED = {_normalized(name) for name in UNSERVED_EVENTS.values()}


def _looks_like_handler(name: str) -> bool:
    if name.startswith("_") or name in KNOWN_HANDLERS:
        return False
    return (
        HANDLER_SHAPED.search(name.lower()) is not None
        or _normalized(name) in _BY_NORMALIZED
        or _normalized(name) in _UNSERVED_NORMALIZED
        or bool(difflib.get_close_matches(name, KNOWN_HANDLERS, n=1, cutoff=MISSPELLING_CUTOFF))
    )


def check_handlers(plugin: object) -> None:
    """Refuse a plugin whose handlers the stub would silently miss.

    TypeError when a handler name is bound to something not callable (a flag named
    ``shutdown``, say); ValueError naming each public callable that looks like a handler but is
    none the stub calls, with the closest real one.  Checked at start-up because the runtime
    never tells a plugin about an event it did not subscribe to.
    """
    for name in sorted(KNOWN_HANDLERS):
        value = getattr(plugin, name, _MISSING)
        if value is not _MISSING and not callable(value):
            raise TypeError(
                f"plugin attribute {name!r} is an NRI handler name but holds a "
                f"{type(value).__name__}, not a callable; rename the attribute, or narrow the "
                "subscription in configure() to switch an inherited handler off"
            )
    problems = []
    for name in dir(plugin):
        # Only names in the shape of a handler are fetched: getattr may run properties.
        if not _looks_like_handler(name) or not callable(getattr(plugin, name, None)):
            continue
        if _normalized(name) in _UNSERVED_NORMALIZED:
            problems.append(
                f"{name}: would handle an NRI >= 0.10 event this stub does not subscribe to"
            )
            continue
        closest = _closest_handler(name)
        hint = f"did you mean {closest!r}?" if closest else "it matches no handler"
        problems.append(f"{name}: looks like an NRI handler but is none; {hint}")
    if problems:
        raise ValueError(
            "plugin methods the stub would never call:\n  "
            + "\n  ".join(problems)
            + f"\nHandlers are: {', '.join(sorted(KNOWN_HANDLERS))}.\nA helper with such a "
            "name needs a leading underscore."
        )


def describe_events(mask: int) -> str:
    """``start_container (event 6), event 20`` for the bits set in ``mask``."""
    names = []
    for bit in range(mask.bit_length()):
        if mask & (1 << bit):
            event = bit + 1
            name = EVENT_HANDLERS.get(event) or UNSERVED_EVENTS.get(event)
            names.append(f"{name} (event {event})" if name else f"event {event}")
    return ", ".join(names)


def narrowed_events(handled: int, wanted: object) -> int:
    """The subscription for a connection, given the mask of the plugin's handlers and what its
    ``configure`` returned (see the module docstring)."""
    if wanted is None:
        return handled
    if isinstance(wanted, (bool, str, bytes)):
        # A bare string would iterate as letters; True would read as event 1.
        raise TypeError(
            f"configure() returned {wanted!r}; return None, a list of event handler names "
            "or an int event mask"
        )
    if isinstance(wanted, int):
        if wanted == 0:  # the Go stub's "no narrowing"; on the wire 0 would mean every event
            return handled
        if not 0 < wanted < 1 << 31:  # ConfigureResponse.events is an int32
            raise SubscriptionError(f"configure() returned {wanted:#x}, not an event mask")
        mask = wanted
    elif isinstance(wanted, Iterable):
        mask = _mask_of_names(list(wanted))
    else:
        raise TypeError(
            f"configure() returned a {type(wanted).__name__}; return None, a list of event "
            "handler names or an int event mask"
        )
    extra = mask & ~handled
    if extra:
        raise SubscriptionError(
            "configure() asked for events the plugin has no handlers for: "
            f"{describe_events(extra)} (it handles {describe_events(handled)})"
        )
    return mask


def _mask_of_names(names: list[object]) -> int:
    """The event mask of handler names; SubscriptionError for unknown names (with the closest
    known one) and for none at all."""
    unknown = [n for n in names if n not in EVENT_BITS]
    if unknown:
        hints = [
            f"{n!r} (did you mean {c!r}?)" if (c := _closest_event(n)) else repr(n) for n in unknown
        ]
        raise SubscriptionError(
            f"configure() asked for unknown events {', '.join(hints)}; event handler "
            f"names are: {', '.join(EVENT_BITS)}"
        )
    if not names:
        # Not expressible: a zero mask on the wire subscribes to everything.
        raise SubscriptionError(
            "configure() returned no events; return None to keep every handler's event"
        )
    mask = 0
    for name in names:
        mask |= EVENT_BITS[name]  # type: ignore[index]  # (checked above: a known name)
    return mask


def _closest_event(name: object) -> str | None:
    if not isinstance(name, str):
        return None
    close = difflib.get_close_matches(name, list(EVENT_BITS), n=1, cutoff=0.5)
    return close[0] if close else None
