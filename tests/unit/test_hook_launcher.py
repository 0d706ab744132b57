"""`nri-cpuplugin install-hook`: the launcher hooks/*.json runs (nri_cpuplugin/hook_launcher.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.shortpaths import interpreter

from nri_cpuplugin.cli import main as cli_main
from nri_cpuplugin.hook import launcher as hook_launcher


@pytest.fixture
def python() -> str:
    """This interpreter under a name a shebang can hold: ``sys.executable`` lives in the
    checkout, whose path may be long or have spaces (which the launcher rightly refuses)."""
    return str(interpreter(sys.executable))


def run(program: Path, *args: str, env: dict[str, str] | None = None, stdin: bytes = b""):
    return subprocess.run(
        [str(program), *args], input=stdin, capture_output=True, env=env or {}, cwd="/"
    )


def test_the_launcher_runs_the_hook_with_no_environment_at_all(tmp_path, capsys, python):
    path = tmp_path / "nri-cpuplugin-hook"
    assert cli_main(["install-hook", "--path", str(path), "--python", python]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert path.stat().st_mode & 0o777 == 0o755
    assert path.read_text().startswith(f"#!{python} -IS\n")
    result = run(path, "--help")
    assert result.returncode == 0 and result.stdout.startswith(b"usage: nri-cpuplugin-hook")
    # Exit status and the one-line reason survive the launcher's fast exit (streams flushed).
    result = run(path, "--lock-timeout", "soon", "createRuntime")
    assert result.returncode == 2
    assert result.stderr.decode().splitlines()[-1] == (
        "nri-cpuplugin: --lock-timeout 'soon': expected a number of seconds >= 0"
    )


def test_the_launcher_ignores_pythonpath(tmp_path, python):
    """-I: a PYTHONPATH (or any PYTHON* variable) in the hook's environment changes nothing."""
    poison = tmp_path / "poison" / "nri_cpuplugin"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("")
    (poison / "hook.py").write_text("def launch():\n    print('poisoned')\n")
    path = tmp_path / "hook"
    hook_launcher.install(str(path), python)
    result = run(path, "--help", env={"PYTHONPATH": str(poison.parent), "PYTHONINSPECT": "1"})
    assert result.returncode == 0 and b"poisoned" not in result.stdout, result.stdout


def test_install_replaces_the_console_script_link_in_one_rename(tmp_path, python):
    target = tmp_path / "console-script"
    target.write_text("#!/bin/sh\necho old\n")
    path = tmp_path / "nri-cpuplugin-hook"
    path.symlink_to(target)
    hook_launcher.install(str(path), python)
    assert not path.is_symlink() and target.read_text() == "#!/bin/sh\necho old\n"
    assert run(path, "--help").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["console-script", "nri-cpuplugin-hook"]


@pytest.mark.parametrize(
    "path, interpreter_path, message",
    [
        ("relative/hook", "{python}", "must be absolute"),
        ("{tmp}/missing/hook", "{python}", "does not exist"),
        ("{tmp}", "{python}", "is a directory"),
        ("{tmp}/hook", "python3", "absolute path without spaces"),
        ("{tmp}/hook", "/opt/my venv/bin/python3", "absolute path without spaces"),
        ("{tmp}/hook", "/" + "d" * 130 + "/python3", "too long for a shebang"),
        # A launcher naming these would fail every container start: refused, not written.
        ("{tmp}/hook", "/nonexistent/python", "interpreter /nonexistent/python does not exist"),
        ("{tmp}/hook", "/etc", "interpreter /etc is not an executable file"),
        ("{tmp}/hook", "/bin/true", "interpreter /bin/true cannot run the hook"),
    ],
)
def test_impossible_installs_are_refused_with_the_reason(
    tmp_path, capsys, python, path, interpreter_path, message
):
    path = path.format(tmp=tmp_path)
    interpreter_path = interpreter_path.format(python=python)
    assert cli_main(["install-hook", "--path", path, "--python", interpreter_path]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == []  # nothing written, no temp file left
