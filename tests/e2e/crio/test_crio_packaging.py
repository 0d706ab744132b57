"""packaging/crio/ against real CRI-O 1.36.3: each drop-in goes into CRI-O's ``--config-dir``
(``/etc/crio/crio.conf.d`` on a node) above a main configuration that has NRI off and no
hooks directory of ours, so the drop-in is what makes the difference; only absolute paths are
moved into the test's private instance.

* NRI mode: ``10-nri-cpuplugin-nri.conf`` turns NRI on with the packaged paths, and the
  runtime-launched install (``packaging/nri/10-cpuplugin`` + ``10-cpuplugin.conf``) placed in
  them pins a Guaranteed pod.
* Hook mode: ``10-nri-cpuplugin-hooks.conf`` names the packaged and the admin hooks
  directories; ``hooks/*.json`` in the packaged one pin a pod, and a same-named file in the
  admin directory masks it (CRI-O's precedence, as the drop-in's comment says).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from harness.crio import Crio
from harness.k8s import ContainerSpec
from harness.runc import hook_program

from e2e.crio.hooksd import hook_files
from e2e.daemon import REPO, settled_state, wait_for

PACKAGING = REPO / "packaging"
NRI_DROP_IN = PACKAGING / "crio/10-nri-cpuplugin-nri.conf"
HOOKS_DROP_IN = PACKAGING / "crio/10-nri-cpuplugin-hooks.conf"
LAUNCHER = PACKAGING / "nri/10-cpuplugin"
LAUNCHED_CONF = PACKAGING / "nri/10-cpuplugin.conf"
PROGRAM = Path(sys.executable).parent / "nri-cpuplugin"  # this venv's console script
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected {old!r} exactly once"
    return text.replace(old, new)


def quoted(value: str | Path) -> str:
    return json.dumps(str(value))  # a TOML basic string


def test_nri_drop_in_and_the_runtime_launched_install(
    make_crio: Callable[..., Crio], tmp_path: Path
) -> None:
    instance = make_crio(start=False, nri=False)  # the main config has NRI off
    text = NRI_DROP_IN.read_text()
    for old, new in (
        ("/var/run/nri/nri.sock", instance.nri_socket),
        ("/opt/nri/plugins", instance.plugin_path),
        ("/etc/nri/conf.d", instance.plugin_config_path),
    ):
        text = replace_once(text, quoted(old), quoted(new))
    instance.config_dir.mkdir(parents=True)
    (instance.config_dir / "10-nri-cpuplugin.conf").write_text(text)
    instance.plugin_path.mkdir(parents=True)
    launcher = instance.plugin_path / LAUNCHER.name
    launcher.write_text(
        replace_once(
            LAUNCHER.read_text(), "/usr/local/bin/nri-cpuplugin", shlex.quote(str(PROGRAM))
        )
    )
    launcher.chmod(LAUNCHER.stat().st_mode & 0o7777)  # as shipped
    instance.plugin_config_path.mkdir(parents=True)
    state_dir = tmp_path / "state"
    (instance.plugin_config_path / LAUNCHED_CONF.name).write_text(
        replace_once(LAUNCHED_CONF.read_text(), quoted("/var/lib/nri-cpuplugin"), quoted(state_dir))
    )
    instance.nri = True  # the drop-in turned it on: wait for its socket too
    instance.start()
    assert instance.nri_socket.is_socket()
    cri = instance.cri()
    pod = cri.run("pinned", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
    assert cri.wait_logs(pod["p"], 1) == ["Cpus_allowed_list:\t1"]  # CPU 0 reserved
    state = settled_state(state_dir)
    assert list(state["assignments"]) == [pod["p"]]
    assert (state_dir / "daemon.lock").read_text().strip().isdigit()


def test_hooks_drop_in_names_both_directories_and_the_admin_one_wins(
    make_crio: Callable[..., Crio], tmp_path: Path
) -> None:
    instance = make_crio(start=False, nri=False)
    packaged, admin = tmp_path / "usr-share-hooks.d", tmp_path / "etc-hooks.d"
    packaged.mkdir()
    admin.mkdir()
    text = HOOKS_DROP_IN.read_text()
    text = replace_once(text, quoted("/usr/share/containers/oci/hooks.d"), quoted(packaged))
    text = replace_once(text, quoted("/etc/containers/oci/hooks.d"), quoted(admin))
    instance.config_dir.mkdir(parents=True)
    (instance.config_dir / "10-nri-cpuplugin.conf").write_text(text)
    files = hook_files(hook_program(tmp_path / "bin"), tmp_path / "state")
    for name, doc in files.items():
        (packaged / name).write_text(json.dumps(doc))
    instance.start()
    cri = instance.cri()
    pod = cri.run("pinned", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
    assert cri.wait_logs(pod["p"], 1) == ["Cpus_allowed_list:\t1"]

    # The admin directory masks a packaged file of the same name; CRI-O reloads it live.
    since = instance.log_size()
    name = next(n for n in files if "createruntime" in n)
    masked = {**files[name], "when": {"annotations": {"^never$": "^never$"}}}
    tmp = admin / f".{name}.tmp"
    tmp.write_text(json.dumps(masked))
    tmp.rename(admin / name)
    wait_for("CRI-O to reload its hooks", lambda: instance.log_size() > since)
    instance.wait_log(name, since=since)
    other = cri.run("unpinned", [ContainerSpec.guaranteed("u", 1, command=FIRST_LINE)])
    assert cri.wait_logs(other["u"], 1) == ["Cpus_allowed_list:\t0-1"]
    assert not cri.inspect(other["u"]).spec.get("hooks", {}).get("createRuntime")
