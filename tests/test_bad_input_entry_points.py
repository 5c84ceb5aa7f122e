"""Hostile input to the newer entry points (issue 32): ``tools/place.py`` and its external graph,
``--report_dir``, ``tools/worker.py``, the communication benchmark and the Keras entry. Each
case ends in a clear error (one paragraph naming the field and what to do, no traceback, no
file left behind) or in a correct result. Beside ``test_bad_input.py``, which covers the older
entry points; the gRPC faults are in ``test_cluster_faults.py``.
"""

import errno
import json
import os
import subprocess
import sys
import warnings

import pytest

from graphfit.baechi.external_graph import (FORMAT, ExternalGraphError, load_external_graph,
                                            parse_external_graph)
from graphfit.errors import OutputError
from graphfit.profiler.cost_graph import CostGraph, CostGraphError, OpSpec
from graphfit.profiler.profile import write_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "tools", "examples", "two_towers.json")


def _run_binary(module, *args):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-m", f"graphfit.tools.{module}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def _one_paragraph(result, binary):
    """The binary's one error line; it exited with status 2 and printed no traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if f"{binary}: error: " in line]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def _two_ops(**edits):
    """A valid two-op external graph; ``edits`` update its single edge and its ops."""
    data = {"format": FORMAT,
            "ops": [{"name": "a"}, {"name": "b", "output_bytes": [4], "fetched_outputs": [0]}],
            "edges": [{"src": "a", "dst": "b", "bytes": 8}],
            "devices": [{"name": "d", "memory": "1GiB"}]}
    data["edges"][0].update(edits.pop("edge", {}))
    for k, op_edits in edits.pop("ops", {}).items():
        data["ops"][k].update(op_edits)
    assert not edits
    return data


# -- ports: a file of 200 bytes must not allocate a billion of them -----------------------------

_CHILD = """
import json, sys, time
from graphfit.baechi.external_graph import ExternalGraphError, load_external_graph
began = time.monotonic()
messages = []
for path in sys.argv[1:]:
    try:
        load_external_graph(path)
        messages.append(None)
    except ExternalGraphError as error:
        messages.append(str(error))
# VmHWM: the peak RSS of this process image; ru_maxrss would carry over the forking test
# process's (300 MiB with TensorFlow loaded by earlier tests).
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status")
                if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.monotonic() - began, "messages": messages,
                  "peak_rss_mib": peak_kib / 1024}))
"""


def test_a_port_of_a_billion_fails_at_once_with_bounded_memory(tmp_path):
    """Issue 32: one edge with ``"output": 1000000000`` grew to 22 GiB in about 200 s."""
    import resource

    paths = []
    for name, data in [("edge", _two_ops(edge={"output": 10**9})),
                       ("fetched", _two_ops(ops={1: {"fetched_outputs": [10**9],
                                                     "output_bytes": [4]}})),
                       ("fetched_only", _two_ops(ops={0: {"fetched_outputs": [10**9]}}))]:
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
        assert len(paths[-1].read_bytes()) < 300

    def cap_memory():  # a regression fails with MemoryError here instead of eating the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    child = subprocess.run([sys.executable, "-c", _CHILD, *map(str, paths)], cwd=REPO,
                           capture_output=True, text=True, timeout=120, preexec_fn=cap_memory,
                           env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout)
    print(f"three 1e9-port files refused in {result['seconds']:.3f} s, peak RSS "
          f"{result['peak_rss_mib']:.0f} MiB")
    assert result["seconds"] < 1.0
    assert result["peak_rss_mib"] < 300  # numpy and networkx imported: about 60 MiB
    edge, fetched, fetched_only = result["messages"]
    assert edge.startswith("op 'a': the size of output(s) [0, 1, 2, 3, 4] and 999999995 more "
                           "is not given (ports are numbered from 0, and edges[0] ('a' -> 'b') "
                           "uses port 1000000000): add 'bytes' to an edge")
    assert "ops[1] ('b') 'fetched_outputs' uses port 1000000000" in fetched
    assert "ops[0] ('a') 'fetched_outputs' uses port 1000000000" in fetched_only


def test_place_binary_refuses_a_billion_ports_in_one_paragraph(tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps(_two_ops(edge={"output": 10**9})))
    line = _one_paragraph(_run_binary("place", f"--graph={graph}", f"--out_dir={tmp_path}/out"),
                          "place")
    assert "edges[0] ('a' -> 'b') uses port 1000000000" in line
    assert not (tmp_path / "out").exists()


def test_ports_given_in_full_still_load():
    data = _two_ops(edge={"output": 2}, ops={0: {"output_bytes": [1, 2, 8]}})
    assert parse_external_graph(data).graph.num_tensors == 4


# -- sizes: nothing wraps in an int64 cast --------------------------------------------------------

@pytest.mark.parametrize("edits, message", [
    (dict(edge={"bytes": 2**70}), "edges[0] ('a' -> 'b'): 'bytes'=1180591620717411303424: must "
                                  "be an integer >= 0 and <= 9.22337e+18"),
    (dict(edge={"bytes": 2**63}), "'bytes'=9223372036854775808: must be an integer"),
    (dict(ops={0: {"temp_bytes": 10**30}}), "ops[0] ('a'): 'temp_bytes'=1000000000000000000000"),
    (dict(ops={0: {"temp_bytes": 1e30}}), "ops[0] ('a'): 'temp_bytes'=1e+30: must be an "
                                          "integer"),
    (dict(ops={0: {"persistent_bytes": 10**400}}), "'persistent_bytes'=1000000000000000000"),
    (dict(ops={1: {"output_bytes": [2**64]}}), "op 'b': output_bytes = 18446744073709551616 is "
                                               "not a whole, non-negative number of bytes below "
                                               "2^63"),
    (dict(ops={0: {"compute_us": 10**400}}), "op 'a': compute_us = 1000000000000000000000"),
    (dict(ops={0: {"temp_bytes": 2**62}, 1: {"temp_bytes": 2**62}}),
     "add up to 9.22e+18 bytes, more than the 2^62"),
])
def test_sizes_beyond_what_the_ir_holds_are_refused(edits, message):
    """Issue 32: an edge of 2^70 bytes wrapped in an int64 cast and the graph "fitted"."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning was the only sign
        with pytest.raises(ExternalGraphError) as error:
            parse_external_graph(_two_ops(**edits))
    assert message in str(error.value), str(error.value)
    assert len(str(error.value)) < 400


def test_the_ir_itself_refuses_sizes_beyond_int64():
    with pytest.raises(CostGraphError, match=r"op 'x': temp_bytes = 9223372036854775808 is not "
                                             r"a whole, non-negative number of bytes below 2\^63"):
        CostGraph.from_ops([OpSpec("x", "Placeholder", output_bytes=[4], temp_bytes=2**63)])
    biggest = CostGraph.from_ops([OpSpec("x", "Placeholder", output_bytes=[2**61])])
    assert int(biggest.tensor_bytes[0]) == 2**61


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not valid JSON ('utf-8' codec can't decode"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than the parser can follow"),
    (b'{"format": "graphfit.external_graph/1", "ops": [{"name": "a", "fetched_outputs": '
     + b"[" * 500 + b"]" * 500 + b"}]}", "'fetched_outputs' must be a list of output ports"),
])
def test_binary_or_deeply_nested_files_are_refused(tmp_path, content, message):
    path = tmp_path / "g.json"
    path.write_bytes(content)
    with pytest.raises(ExternalGraphError) as error:
        load_external_graph(str(path))
    assert message in str(error.value)
    assert len(str(error.value)) < 400


# -- where place writes: checked before work, all three files or none ---------------------------

@pytest.mark.parametrize("out_dir, message", [
    ("{tmp}/a_file", "a_file is a file, not a directory"),
    ("{tmp}/a_file/sub", "a_file is a file, not a directory"),
    ("/proc/graphfit", "cannot write in /proc"),
])
def test_place_binary_refuses_an_out_dir_it_cannot_write(tmp_path, out_dir, message):
    (tmp_path / "a_file").write_text("x")
    line = _one_paragraph(_run_binary("place", f"--graph={EXAMPLE}",
                                      f"--out_dir={out_dir.format(tmp=tmp_path)}"), "place")
    assert message in line and "--out_dir" in line
    assert (tmp_path / "a_file").read_text() == "x"


def test_write_files_on_a_full_disk_changes_nothing(tmp_path):
    (tmp_path / "placement.json").write_text("the previous run")

    def full(path):
        with open(path, "w") as f:
            f.write("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match=r"cannot write trace.json into .* \(No space left on "
                                          r"device\); nothing was written: free some space"):
        write_files(str(tmp_path), {"placement.json": lambda p: open(p, "w").close(),
                                    "trace.json": full}, owned=["placement.json", "trace.json"])
    assert os.listdir(tmp_path) == ["placement.json"]
    assert (tmp_path / "placement.json").read_text() == "the previous run"


def test_write_files_leaves_one_runs_files_and_the_users_own(tmp_path):
    for name in ("a", "b", "notes.txt"):
        (tmp_path / name).write_text("old")
    written = write_files(str(tmp_path), {"a": lambda p: open(p, "w").write("new")},
                          owned=["a", "b"])
    assert written == [str(tmp_path / "a")]
    assert sorted(os.listdir(tmp_path)) == ["a", "notes.txt"]
    assert (tmp_path / "a").read_text() == "new"


# -- a report directory holds one run's files -----------------------------------------------------

def test_a_second_report_into_one_directory_leaves_only_its_own_files(tmp_path):
    """Issue 32: a one-device run after a placed one kept the first run's Gantt chart and trace
    while its summary said they were not written."""
    from graphfit.baechi.devices import DeviceSet
    from graphfit.pipeline.meta_optimizer import OptimizeResult
    from graphfit.baechi.place import place
    from graphfit.pipeline.report import REPORT_FILES
    from graphfit.profiler.synthetic import training_like

    graph = training_like(30, seed=1)
    devices = DeviceSet.uniform(["/device:CPU:0", "/device:CPU:1"], "1GiB", "0.0001754,134")
    placed = OptimizeResult(None, None, None, [], schedule=place(graph, devices).schedule)
    first = placed.save(str(tmp_path))
    assert sorted(os.path.basename(p) for p in first) == sorted(REPORT_FILES)

    one_device = OptimizeResult(None, None, None, [])
    second = one_device.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in second)
    assert "placement_gantt.png" not in os.listdir(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "not written (the step was not placed): placement_gantt.png, schedule_trace.json" \
        in summary


# -- tools/worker.py and the cluster spec ---------------------------------------------------------

@pytest.mark.parametrize("lifetime", ["nan", "inf", "1e30", "0.5"])
def test_worker_refuses_a_lifetime_that_is_not_bounded(lifetime):
    line = _one_paragraph(_run_binary("worker", "--cluster_spec=worker=127.0.0.1:2222",
                                      "--task=0", f"--lifetime_s={lifetime}"), "worker")
    assert f"--lifetime_s={float(lifetime)!r}: must be a finite number >= 1 and <= 604800" \
        in line


@pytest.mark.parametrize("port", ["1000000", "9" * 10**6])
def test_a_port_out_of_range_is_named_in_a_short_message(port):
    from graphfit.baechi.cluster import parse_cluster_spec

    with pytest.raises(ValueError, match=r"is not host:port \(a port in 1\.\.65535\)") as error:
        parse_cluster_spec(f"worker=127.0.0.1:{port}")
    assert len(str(error.value)) < 300


def test_local_workers_say_they_listen_on_every_interface():
    """Issue 32: ``communication_benchmark --transport=grpc`` started exposed workers silently."""
    from graphfit.baechi.cluster import LocalCluster

    cluster = LocalCluster(2, lifetime_s=600)
    cluster._set_spec({"worker": ["127.0.0.1:40001", "127.0.0.1:40002"]})  # as start() does
    text = cluster.exposure_warning()
    assert text.startswith("WARNING: the 2 gRPC workers started here listen on port(s) 40001, "
                           "40002 of every network interface")
    assert "without authentication" in text and "at the latest after 600 s" in text
