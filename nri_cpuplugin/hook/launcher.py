"""The OCI hook's launcher: the program hooks/*.json names, written by ``nri-cpuplugin
install-hook``.

The runtime starts the hook once per container start and waits for it, so its start-up time
is added to every container's.  pip's ``nri-cpuplugin-hook`` console script works, but the
interpreter it starts first scans site-packages (``.pth`` files, sitecustomize), and pip's
script imports ``re`` before our code runs.  The launcher starts the same interpreter with
``-I -S`` - no site-packages scan (``.pth`` files, sitecustomize), no ``PYTHON*`` variables,
no user site - and appends the directory holding this package to ``sys.path``, after the
standard library as ``site`` would: the hook needs nothing else (tests/system/test_hook_imports.py).
It also skips garbage collection and the interpreter's teardown, which a process that lives a
few milliseconds does not need (``hook.launch``).  Together a fifth of the hook's time
(docs/benchmarks.md compares the launcher with the console script).

A shebang can hold one argument and no quoting, and older kernels read only its first 127
bytes, so interpreter paths that would not survive that are refused with the reason.
"""

from __future__ import annotations

import os
import sys

from ..base import files
from ..base.errors import PluginError

DEFAULT_PATH = "/usr/local/bin/nri-cpuplugin-hook"
SHEBANG_LIMIT = 127  # BINPRM_BUF_SIZE - 1 before Linux 5.1


class LauncherError(PluginError, ValueError):
    """The launcher cannot be written as asked; the message says why and what to do."""

    code = "launcher"


def package_root() -> str:
    """The directory holding the ``nri_cpuplugin`` package (site-packages, or a checkout)."""
    # This file is nri_cpuplugin/hook/launcher.py: three levels below that directory.
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def source(python: str, root: str) -> str:
    """The launcher's text for interpreter ``python`` and package directory ``root``."""
    shebang = f"#!{python} -IS"
    if not os.path.isabs(python) or any(c.isspace() for c in python):
        raise LauncherError(
            f"interpreter {python!r} must be an absolute path without spaces (a shebang "
            "cannot quote); pass --python"
        )
    if len(shebang.encode()) > SHEBANG_LIMIT:
        raise LauncherError(
            f"interpreter path {python!r} is too long for a shebang ({len(shebang)} > "
            f"{SHEBANG_LIMIT} bytes); install into a shorter path or link the interpreter"
        )
    return (
        f"{shebang}\n"
        "# The nri-cpuplugin OCI hook (hooks/*.json), written by `nri-cpuplugin install-hook`.\n"
        "# -I -S: no site-packages scan (.pth files) and no PYTHON* variables; the directory\n"
        "# below comes after the standard library.  See nri_cpuplugin/hook/launcher.py.\n"
        "import gc\n"
        "import sys\n"
        "\n"
        "gc.disable()  # a process of a few milliseconds: collecting would only cost time\n"
        f"sys.path.append({root!r})\n"
        "from nri_cpuplugin.hook.entry import launch\n"
        "\n"
        "launch()\n"
    )


# What check_interpreter's probe prints when the interpreter can run the hook.
_PROBE_OK = "nri-cpuplugin hook importable"


def check_interpreter(python: str, root: str) -> None:
    """Refuse an interpreter the launcher could not run the hook with: a launcher naming it
    would fail every container start.  Runs it once as the launcher will (``-I -S``, the
    package directory appended) and has it import the hook."""
    import subprocess

    # (Execute bits, not access(2): to root that says yes to a file with none.)
    if not os.path.isfile(python) or not os.stat(python).st_mode & 0o111:
        what = "is not an executable file" if os.path.exists(python) else "does not exist"
        raise LauncherError(
            f"interpreter {python} {what}; pass --python with the path of a Python >= 3.11 "
            "(a launcher naming it would fail every container start)"
        )
    probe = f"import sys; sys.path.append({root!r}); import nri_cpuplugin.hook.entry; "
    probe += f"print({_PROBE_OK!r})"
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LauncherError(f"interpreter {python} cannot be run: {err}") from None
    if done.returncode != 0 or done.stdout.strip() != _PROBE_OK:
        last = (done.stderr.strip().splitlines() or ["it printed nothing we expected"])[-1]
        raise LauncherError(
            f"interpreter {python} cannot run the hook ({last}); pass --python with a "
            f"Python >= 3.11 that can import the package in {root}"
        )


def install(path: str = DEFAULT_PATH, python: str | None = None) -> str:
    """Write the launcher to ``path`` (mode 0755, replacing what is there - a file or the
    symlink to pip's console script - in one rename).  Returns its text."""
    if not os.path.isabs(path):
        raise LauncherError(f"--path {path!r} must be absolute: hooks.d names programs absolutely")
    root = package_root()
    text = source(python or sys.executable, root)
    if python is not None:
        check_interpreter(python, root)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise LauncherError(f"directory {directory} does not exist; create it or pass --path")
    if os.path.isdir(path):
        raise LauncherError(f"{path} is a directory; pass the launcher's file name as --path")
    # Durable: the rename survives a crash, and the runtime must find the program.
    files.write_atomic(directory, os.path.basename(path), text.encode(), mode=0o755)
    return text
