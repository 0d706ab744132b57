"""Prometheus metrics scraped from the daemon while it serves real containerd."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from harness.k8s import ContainerSpec, PodSpec
from prometheus_client.parser import text_string_to_metric_families

from e2e.daemon import Daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_metrics_follow_the_decisions(containerd, cri, tmp_path):
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    daemon = Daemon(containerd.nri_socket, tmp_path / "state", config=config).start()
    try:
        before = scrape(port)
        assert before["nri_cpuplugin_runtime_connected"] == 1
        assert before["nri_cpuplugin_shared_pool_size_millicores"] == 2000
        assert before["nri_cpuplugin_exclusive_cpu_allocation_count"] == 0
        pod = cri.run("db", [ContainerSpec.guaranteed("pg", 1)])
        cri.run("web", [ContainerSpec("nginx", cpu_request_milli=100)])
        refused = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
        with pytest.raises(Exception, match="exclusive"):
            cri.create_container(refused, ContainerSpec.guaranteed("x", 1))
        during = scrape(port)
        assert during["nri_cpuplugin_pinning_requests_total"] == 2
        assert during["nri_cpuplugin_pinning_errors_total"] == 1
        assert during["nri_cpuplugin_shared_pool_size_millicores"] == 1000
        assert during["nri_cpuplugin_exclusive_cpu_allocation_count"] == 1
        assert during["nri_cpuplugin_allocation_per_numa{numa_node=0}"] == 1
        key = "nri_cpuplugin_nri_handler_duration_seconds_count{event=CreateContainer}"
        assert during[key] == 3
        assert during["nri_cpuplugin_state_commit_duration_seconds_count"] >= 2
        cri.stop(pod["pg"])
        after = scrape(port)
        assert after["nri_cpuplugin_exclusive_cpu_allocation_count"] == 0
        assert after["nri_cpuplugin_shared_pool_size_millicores"] == 2000
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    finally:
        daemon.stop()
