"""Run one function of the tests' code in the guest: ``python3 -m harness.guest_call
module:function`` with the keyword arguments as JSON on stdin; the JSON result is printed
after a marker line, so whatever the function prints itself does not get in the way.

The host side is ``Guest.call`` (guest.py), which sets the guest python's path to the
checkout, its ``tests`` directory and the host's site-packages (all shared at the same paths).
A failure exits 1 with the traceback on stderr.
"""

from __future__ import annotations

import importlib
import json
import sys

# Kept in step with guest.py's CALL_MARKER (that module is not imported here: it pulls in the
# host side of the harness).
MARKER = "@@nri-guest-call-result@@"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python3 -m harness.guest_call module:function < kwargs.json", file=sys.stderr)
        return 2
    module_name, _, function_name = argv[0].partition(":")
    kwargs = json.loads(sys.stdin.read() or "{}")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(**kwargs)
    sys.stdout.flush()
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
