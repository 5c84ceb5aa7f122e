"""The cluster layer without workers: cluster specs, probes, the worker binary's warning and
flags, the train binary's cluster flags, and the private network namespace."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from graphfit.baechi import netns
from graphfit.baechi.cluster import (Cluster, ClusterError, Task, exposure_warning,
                                      parse_cluster_spec, probe)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cluster_spec_text_file_and_tf_config_forms(tmp_path):
    assert parse_cluster_spec("worker=h1:2222,h2:2223") == {"worker": ["h1:2222", "h2:2223"]}
    assert parse_cluster_spec("worker=a:1;ps=b:2") == {"worker": ["a:1"], "ps": ["b:2"]}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"worker": ["h1:1", "h2:2"]}))
    assert parse_cluster_spec(str(path)) == {"worker": ["h1:1", "h2:2"]}
    path.write_text(json.dumps({"cluster": {"worker": ["h1:1"]}, "task": {"index": 0}}))
    assert parse_cluster_spec(str(path)) == {"worker": ["h1:1"]}


@pytest.mark.parametrize("spec,message", [
    ("h1:2222", "expected job=host:port"),
    ("worker=h1", "not host:port"),
    ("worker=h1:0", "not host:port"),
    ("worker=h1:99999", "not host:port"),
    ("worker=", "at least one task"),
    ("worker=h1:1,h1:1", "listed more than once"),
])
def test_bad_cluster_spec_names_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster_spec(spec)


def test_bad_cluster_spec_file_names_the_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cluster spec file .*spec.json"):
        parse_cluster_spec(str(path))
    path.write_text(json.dumps({"worker": "h1:1"}))
    with pytest.raises(ValueError, match=r"expected \{job: \[host:port"):
        parse_cluster_spec(str(path))


def test_probe_of_a_closed_port_says_nothing_listens():
    began = time.monotonic()
    assert "is not listening" in probe(f"127.0.0.1:{_free_port()}", 5.0)
    assert time.monotonic() - began < 5.0


def test_probe_of_a_silent_listener_times_out():
    """A port that accepts connections but never answers (as a SIGSTOPped worker's kernel
    does) is reported within the probe's timeout."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        began = time.monotonic()
        fault = probe(f"127.0.0.1:{server.getsockname()[1]}", 1.0)
    assert "does not answer within 1 s" in fault
    assert time.monotonic() - began < 4.0


def test_missing_worker_is_a_cluster_error_naming_it():
    port = _free_port()
    with pytest.raises(ClusterError, match=rf"worker /job:worker/task:0 at 127.0.0.1:{port} is "
                                           "not listening.*run again"):
        Cluster(f"worker=127.0.0.1:{port}").__enter__()
    assert str(Task("worker", 1, "h:1")) == "worker /job:worker/task:1 at h:1"


def test_exposure_warning_says_interface_port_lifetime_and_what_to_do():
    text = exposure_warning("2222", 600, 1234, isolated=False)
    for phrase in ("0.0.0.0:2222", "no authentication", "after 600 s", "process 1234 exits",
                   "trusted network", "firewall", "--isolated_network"):
        assert phrase in text
    assert "only interface is loopback" in exposure_warning("2222", 600, None, isolated=True)


def _run(module, *flags, timeout=120):
    return subprocess.run([sys.executable, "-m", module, *flags], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_worker_binary_refuses_a_task_outside_the_spec():
    result = _run("graphfit.tools.worker", "--cluster_spec=worker=127.0.0.1:1", "--task=3")
    assert result.returncode != 0
    assert "--task=3 is not in the cluster spec" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_refuses_cluster_spec_with_num_devices_and_a_missing_worker(tmp_path):
    result = _run("graphfit.tools.train", "--model_name=mlp", "--preset=tiny",
                  "--cluster_spec=worker=127.0.0.1:1", "--num_devices=2",
                  f"--report_path={tmp_path}/r.json")
    assert result.returncode != 0 and "leave out --num_devices" in result.stderr
    port = _free_port()
    result = _run("graphfit.tools.train", "--model_name=mlp", "--preset=tiny",
                  f"--cluster_spec=worker=127.0.0.1:{port}", f"--report_path={tmp_path}/r.json")
    assert result.returncode == 1, result.stderr[-2000:]
    assert (f"cluster error: worker /job:worker/task:0 at 127.0.0.1:{port} is not listening"
            in result.stderr)
    assert "Traceback" not in result.stderr and not (tmp_path / "r.json").exists()


def test_isolated_network_has_only_loopback_or_says_why_not(tmp_path):
    """The script re-executes itself in the namespace and finds only ``lo``, up; where
    namespaces are refused the reason is given (one of the two must hold on any machine)."""
    script = tmp_path / "isolated.py"
    script.write_text(
        "import socket, sys\n"
        "from graphfit.baechi import netns\n"
        "netns.enter_isolated_network([sys.executable, __file__])\n"
        "server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen()\n"
        "socket.create_connection(server.getsockname(), timeout=5)\n"
        "print(netns.network_interfaces(), 'loopback up')\n")
    result = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True,
                            text=True, timeout=60)
    reason = netns.unavailable_reason()
    if reason is None:
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "['lo'] loopback up"
    else:
        assert result.returncode != 0 and "cannot isolate" in result.stderr
