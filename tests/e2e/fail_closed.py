"""containerd 2.3.4 made to require the plugin, as packaging/containerd's fail-closed drop-in
does it (imported as shipped; only the instance's own paths are put in)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.containerd import Containerd

REPO = Path(__file__).resolve().parents[2]
DROP_IN = REPO / "packaging/containerd/nri-containerd-2.2-fail-closed.toml"
NRI = "io.containerd.nri.v1.nri"


def install_fail_closed(ctrd: Containerd) -> None:
    """The drop-in into the instance's conf.d, imported by its main config; only absolute
    paths change (the socket and plugin directories of this instance)."""
    conf_d = ctrd.dir / "conf.d"
    conf_d.mkdir(parents=True)
    text = DROP_IN.read_text()
    for shipped, private in (
        ("/var/run/nri/nri.sock", ctrd.nri_socket),
        ("/opt/nri/plugins", ctrd.plugin_path),
        ("/etc/nri/conf.d", ctrd.plugin_config_path),
    ):
        assert text.count(json.dumps(shipped)) == 1, shipped
        text = text.replace(json.dumps(shipped), json.dumps(str(private)))
    (conf_d / "nri-cpuplugin.toml").write_text(text)
    config = ctrd.config()
    del config["plugins"][NRI]  # the drop-in does it all
    config["imports"] = [str(conf_d / "*.toml")]
    ctrd.config = lambda: config  # what start() writes as the main config
