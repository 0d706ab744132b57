"""The command-line contracts of README.md, run as a user would run them (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from topologies import build

from nri_cpuplugin.core.cpuset import CPUSet

CLI = [sys.executable, "-m", "nri_cpuplugin.cli"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False, timeout=60)


@pytest.fixture(scope="module")
def epyc(tmp_path_factory):
    return build("epyc-1s-4numa", tmp_path_factory.mktemp("sysfs"))


@pytest.fixture(scope="module")
def snc(tmp_path_factory):
    return build("snc-2s-2numa", tmp_path_factory.mktemp("sysfs"))


def test_topology_json_schema(epyc):
    root, _ = epyc
    result = cli("topology", "--sysfs", str(root), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert list(doc) == ["cpus"]
    assert len(doc["cpus"]) == 128
    assert set(doc["cpus"][0]) == {
        "id",
        "socket",
        "die",
        "numa",
        "l3",
        "core",
        "online",
        "isolated",
    }
    # one core id per physical core, unique machine-wide
    assert len({c["core"] for c in doc["cpus"]}) == 64
    assert len({c["l3"] for c in doc["cpus"]}) == 8
    assert len({c["numa"] for c in doc["cpus"]}) == 4


def test_topology_json_is_accepted_back_by_allocate(epyc, tmp_path):
    root, _ = epyc
    dumped = tmp_path / "topo.json"
    dumped.write_text(cli("topology", "--sysfs", str(root), "--json").stdout)
    from_file = cli("allocate", "--topology", str(dumped), "--available", "0-127", "--count", "16")
    from_sysfs = cli("allocate", "--sysfs", str(root), "--available", "0-127", "--count", "16")
    assert from_file.returncode == from_sysfs.returncode == 0
    assert from_file.stdout == from_sysfs.stdout == "0-7,64-71\n"


def test_offline_cpus_round_trip_through_json(tmp_path):
    root, _ = build("offline-isolcpus", tmp_path)
    doc = json.loads(cli("topology", "--sysfs", str(root), "--json").stdout)
    offline = [c for c in doc["cpus"] if not c["online"]]
    assert [c["id"] for c in offline] == [5, 13] and offline[0]["core"] is None
    assert [c["id"] for c in doc["cpus"] if c["isolated"]] == [2, 3, 10, 11]
    dumped = tmp_path / "t.json"
    dumped.write_text(json.dumps(doc))
    result = cli(
        "allocate",
        "--topology",
        str(dumped),
        "--available",
        "0-4,6-12,14-15",
        "--reserved",
        "0,8",
        "--count",
        "2",
    )
    assert result.returncode == 0 and result.stdout == "1,9\n"


@pytest.mark.parametrize(
    ("args", "code", "stderr"),
    [
        (["--available", "0-127", "--count", "200"], 1, "cannot allocate 200 CPUs: only 128"),
        (
            ["--available", "0-127", "--count", "3", "--option", "full-pcpus-only"],
            1,
            "multiple of 2",
        ),
        (["--available", "0-127", "--count", "1", "--option", "nope"], 2, "unknown policy option"),
        (["--available", "0-200", "--count", "1"], 2, "not online"),
        (["--available", "3-1", "--count", "1"], 2, "'3-1'"),
        (
            [
                "--available",
                "0-127",
                "--count",
                "1",
                "--option",
                "full-pcpus-only",
                "--option",
                "distribute-cpus-across-cores",
            ],
            2,
            "cannot be used together",
        ),
    ],
)
def test_allocate_errors_are_one_line_with_exit_code(epyc, args, code, stderr):
    root, _ = epyc
    result = cli("allocate", "--sysfs", str(root), *args)
    assert result.returncode == code
    assert stderr in result.stderr
    assert result.stdout == ""
    if code == 1:
        assert result.stderr.count("\n") == 1  # one-line reason


def test_allocate_zero_prints_an_empty_line(epyc):
    # kubelet's allocator returns the empty set for 0; so do we, even with nothing free.
    root, _ = epyc
    for available in ("0-127", "0-1"):
        result = cli(
            "allocate", "--sysfs", str(root), "--available", available, "--reserved", "0-1",
            "--count", "0",
        )  # fmt: skip
        assert (result.returncode, result.stdout, result.stderr) == (0, "\n", "")


@pytest.mark.parametrize("option", [[], ["--option", "prefer-align-cpus-by-uncorecache"]])
@pytest.mark.parametrize(("count", "expected"), [(5, "9-10,40-42\n"), (4, "9-10,41-42\n")])
def test_allocate_takes_whole_cores_before_other_containers_threads(snc, option, count, expected):
    # Dual-socket SNC node, siblings N and N+32.  Other containers hold 0-8 and 32-33: NUMA 0
    # keeps only single threads (34-39) beside theirs and is the tighter fit; NUMA 1 has whole
    # free cores 9-15 and 40, the free half of core 8.  Whole cores win (3 cores for 5 CPUs,
    # one shared), as kubelet would choose, not 5 single threads on 5 shared cores.
    root, _ = snc
    result = cli(
        "allocate", "--sysfs", str(root), "--available", "9-31,34-63", "--count", str(count),
        *option,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, expected), result.stderr


def test_reserved_cpus_are_never_chosen(epyc):
    root, _ = epyc
    result = cli(
        "allocate",
        "--sysfs",
        str(root),
        "--available",
        "0-127",
        "--reserved",
        "0,64",
        "--count",
        "2",
    )
    assert result.stdout == "1,65\n"


def test_bad_topology_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text('{"cpus": [{"id": "zero"}]}')
    result = cli("allocate", "--topology", str(bad), "--available", "0", "--count", "1")
    assert result.returncode == 2 and "cpus[0]" in result.stderr
    missing = cli(
        "allocate", "--topology", str(tmp_path / "nope.json"), "--available", "0", "--count", "1"
    )
    assert missing.returncode == 2 and "cannot read topology file" in missing.stderr
    not_sysfs = cli("topology", "--sysfs", str(tmp_path))
    assert not_sysfs.returncode == 2 and "sysfs root" in not_sysfs.stderr


def test_real_machine_topology():
    """This machine's own sysfs.  The system tests take a CPU offline for a moment: a run of
    them beside this one may change the online set between the two reads, so the answer is
    judged on a read that the online set did not change around."""
    online_file = Path("/sys/devices/system/cpu/online")
    for _ in range(5):
        before = online_file.read_text().strip()
        result = cli("topology", "--json")
        assert result.returncode == 0, result.stderr
        if online_file.read_text().strip() == before:
            break
    doc = json.loads(result.stdout)
    assert str(CPUSet(c["id"] for c in doc["cpus"] if c["online"])) == before


# --- exit statuses and messages, in process (README.md, "Commands") ---------------------------


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``nri-cpuplugin ARGS`` in this process: (exit status, stdout, stderr)."""
    from nri_cpuplugin.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("count", "message"),
    [
        ("-1", "argument --count: -1 is negative; expected 0 or more CPUs"),
        ("two", "argument --count: 'two' is not a whole number"),
        ("1.5", "argument --count: '1.5' is not a whole number"),
    ],
)
def test_allocate_bad_count_is_bad_input(epyc, capsys, count, message):
    root, _ = epyc
    args = ("allocate", "--sysfs", str(root), "--available", "0-127", "--count", count)
    code, out, err = run_main(capsys, *args)
    assert (code, out) == (2, "") and message in err


def test_allocate_that_cannot_be_met_exits_1_with_one_line(epyc, capsys):
    root, _ = epyc
    args = ("allocate", "--sysfs", str(root), "--available", "0-3", "--count", "5")
    code, out, err = run_main(capsys, *args)
    assert (code, out) == (1, "")
    assert err == "nri-cpuplugin: cannot allocate 5 CPUs: only 4 available (0-3)\n"


def test_status_without_a_state_file_names_it_once_on_stderr(tmp_path, capsys):
    """README promises errors on stderr with the prefix; status printed this one on stdout."""
    code, out, err = run_main(capsys, "status", "--state-dir", str(tmp_path))
    path = tmp_path / "state.json"
    assert code == 1
    assert err == f"nri-cpuplugin: no state file at {path} (first start, or it was removed)\n"
    assert (out + err).count(str(path)) == 1 and "OCI hook mode" in out


def test_status_of_a_missing_state_directory_exits_1(tmp_path, capsys):
    code, out, _ = run_main(capsys, "status", "--state-dir", str(tmp_path / "none"), "--json")
    report = json.loads(out)
    assert code == 1 and report["state"] == "missing"


def test_topology_of_a_directory_that_is_no_sysfs_is_bad_input(tmp_path, capsys):
    code, out, err = run_main(capsys, "topology", "--sysfs", str(tmp_path))
    assert (code, out) == (2, "") and "a sysfs root?" in err


def test_install_hook_where_it_cannot_write_is_bad_input(tmp_path, capsys):
    code, out, err = run_main(
        capsys, "install-hook", "--path", str(tmp_path / "no-such-dir" / "hook")
    )
    assert (code, out) == (2, "") and err.startswith("nri-cpuplugin: ") and err.count("\n") == 1


def test_every_option_of_every_command_has_help_text():
    import argparse

    from nri_cpuplugin.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if action.option_strings and not action.help
    ]
    assert missing == []
    # and each command says its exit statuses (README.md, "Commands", says the same)
    helped = {name for name, sub in commands.choices.items() if "Exit status" in (sub.epilog or "")}
    assert helped == set(commands.choices) - {"hook"}  # hook --help is the hook's own (USAGE)


# --- versions -----------------------------------------------------------------------


def test_version_flag_and_command_print_the_one_version(capsys):
    import tomllib

    from nri_cpuplugin import __version__

    assert run_main(capsys, "--version") == (0, f"nri-cpuplugin {__version__}\n", "")
    assert run_main(capsys, "version") == (0, f"nri-cpuplugin {__version__}\n", "")
    # pyproject.toml says the same: the package metadata and the image carry that one.
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert project["project"]["version"] == __version__


# --- run refuses what it cannot work with, in one line, exit 2 ---------------------------------


def run_refused(tmp_path: Path, *args: str, env: dict | None = None) -> str:
    """``nri-cpuplugin run ARGS``, which must refuse at once: its one line of stderr."""
    import os

    result = subprocess.run(
        [*CLI, "run", "--socket", str(tmp_path / "no-runtime.sock"), *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nri-cpuplugin: "), result.stderr
    return lines[0]


def test_run_with_a_bad_nri_plugin_socket_is_one_line_not_a_traceback(tmp_path, epyc):
    root, _ = epyc
    state = str(tmp_path / "state")
    args = ("--state-dir", state, "--sysfs", str(root))
    line = run_refused(tmp_path, *args, env={"NRI_PLUGIN_SOCKET": "x"})
    assert "NRI_PLUGIN_SOCKET='x' is not a file descriptor number" in line
    assert "unset it to run as a daemon" in line


def test_run_creates_the_state_directory_but_never_its_parents(tmp_path, epyc):
    root, _ = epyc
    state = tmp_path / "a" / "b" / "state"
    line = run_refused(tmp_path, "--state-dir", str(state), "--sysfs", str(root))
    assert f"cannot create state directory {state}: its parent {state.parent} does not" in line
    assert not (tmp_path / "a").exists()


def test_run_refuses_a_node_whose_kubelet_runs_the_static_policy(tmp_path, epyc):
    root, _ = epyc
    checkpoint = tmp_path / "cpu_manager_state"
    checkpoint.write_text('{"policyName":"static","defaultCpuSet":"0-127","checksum":1}')
    config = tmp_path / "c.toml"
    config.write_text(f'[kubelet]\ncpu_manager_state = "{checkpoint}"\n')
    args = ("--config", str(config), "--state-dir", str(tmp_path / "s"), "--sysfs", str(root))
    line = run_refused(tmp_path, *args)
    assert "kubelet's static CPU manager policy owns this node's CPUs" in line
    assert not (tmp_path / "s").exists()  # refused before touching anything


# --- install-hook says why it cannot write -----------------------------------------------------


def test_install_hook_into_proc_gives_the_real_reason(capsys):
    code, out, err = run_main(capsys, "install-hook", "--path", "/proc/hook")
    assert (code, out) == (2, "")
    assert err == "nri-cpuplugin: cannot write /proc/hook: No such file or directory\n"
