"""The audit trail in a real systemd-journald (private mount namespace), read back with
``journalctl -o json``: "who got which CPUs when" is one query."""

from __future__ import annotations

import pytest
from harness.journald import PrivateJournal
from harness.k8s import ContainerSpec, PodSpec

from e2e.daemon import Daemon, wait_for
from nri_cpuplugin.ops.audit import JournalSink, encode_journal_entry


@pytest.fixture
def journal():
    with PrivateJournal() as j:
        yield j


def test_daemon_decisions_are_journal_entries(containerd, cri, journal, tmp_path):
    daemon = Daemon(containerd.nri_socket, tmp_path / "state", journal=journal.socket_path)
    daemon.start(wait=False)
    try:
        wait_for(
            "the daemon's synchronize entry",
            lambda: journal.entries("ACTION=synchronize"),
            timeout=15,
        )
        pod = cri.run("db", [ContainerSpec.guaranteed("postgres", 1)])
        [allocate] = journal.wait_entries("ACTION=allocate")
        assert allocate["SYSLOG_IDENTIFIER"] == "nri-cpuplugin"
        assert allocate["CPUS"] == "1" and allocate["MEMS"] == "0"
        assert allocate["CONTAINER_ID"] == pod["postgres"]
        assert (allocate["POD_NAME"], allocate["POD_NAMESPACE"]) == ("db", "default")
        assert allocate["CONTAINER_NAME"] == "postgres" and allocate["POD_UID"]
        assert allocate["PRIORITY"] == "6" and allocate["RUNTIME"].startswith("containerd")
        assert "got exclusive CPUs 1" in allocate["MESSAGE"]
        assert int(allocate["_PID"]) == daemon.proc.pid  # the journal vouches for the sender
        [resize] = journal.wait_entries("ACTION=shared-resize")
        assert (resize["OLD_SHARED_CPUS"], resize["SHARED_CPUS"]) == ("0-1", "0")
        refused_pod = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
        with pytest.raises(Exception, match="exclusive"):
            cri.create_container(refused_pod, ContainerSpec.guaranteed("two", 1))
        [refuse] = journal.wait_entries("ACTION=refuse")
        assert refuse["PRIORITY"] == "3" and "free for exclusive use: none" in refuse["REASON"]
        cri.stop(pod["postgres"])
        [release] = journal.wait_entries("ACTION=release")
        assert release["CPUS"] == "1"
        actions = {e["ACTION"] for e in journal.entries()}
        assert {"state-new", "config", "connect", "synchronize"} <= actions
    finally:
        daemon.stop()
    assert journal.wait_entries("ACTION=shutdown")
    assert not journal.entries("ACTION=disconnect")  # a clean stop is not a lost connection


def test_native_protocol_edge_cases_reach_the_journal(journal):
    sink = JournalSink(journal.socket_path)
    sink(
        {
            "SYSLOG_IDENTIFIER": "nri-cpuplugin",
            "MESSAGE": "two\nlines",
            "ACTION": "probe",
            "BIG": "x" * 300_000,
        }
    )  # over a datagram's size: goes through a sealed memfd
    [entry] = journal.wait_entries("ACTION=probe")
    assert entry["MESSAGE"] == "two\nlines" and len(entry["BIG"]) == 300_000
    with pytest.raises(ValueError, match="invalid journal field name"):
        encode_journal_entry({"lower": "x"})


def test_hook_decisions_are_journal_entries(journal):
    """The OCI hook (the real program, as a runtime runs it) audits into the same journal."""
    from harness.runc import pod, sandbox

    with sandbox() as box:
        env = {"NRI_CPUPLUGIN_JOURNAL_SOCKET": journal.socket_path}
        web = box.add(pod("web", "burstable"), "web", millicores=250)
        assert box.hook(web, env=env).returncode == 0
        db = box.add(pod("db"), "db", millicores=1000, limit=1000)
        result = box.hook(db, env=env)
        assert result.returncode == 0, result.stderr
        [allocate] = journal.wait_entries("ACTION=allocate")
        assert allocate["CONTAINER_ID"] == db.id and allocate["CPUS"] == "1"
        assert allocate["POD_NAME"] == "db" and allocate["SYSLOG_IDENTIFIER"] == "nri-cpuplugin"
        greedy = box.add(pod("greedy"), "greedy", millicores=1000, limit=1000)
        assert box.hook(greedy, env=env).returncode == 1
        [refuse] = journal.wait_entries("ACTION=refuse")
        assert refuse["CONTAINER_ID"] == greedy.id and refuse["PRIORITY"] == "3"
        box.stop(db)  # poststop comes once the container's processes are gone
        assert box.hook(db, stage="poststop", env=env).returncode == 0
        [release] = journal.wait_entries("ACTION=release")
        assert release["CPUS"] == "1"
