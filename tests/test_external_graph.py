"""The external-graph format and the ``tools/place.py`` binary: what a file says is what the
placer sees (persistent outputs counted once, fetched outputs held to the end, free device
names, huge limits), malformed files fail with the entry named, and the binary writes its three
outputs."""

import json
import os
import subprocess
import sys

import pytest

from graphfit.baechi.external_graph import (FORMAT, ExternalGraphError, load_external_graph,
                                            parse_external_graph)
from graphfit.baechi.grouping import tf_colocation_groups
from graphfit.baechi.place import place

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "tools", "examples", "two_towers.json")
MIB = 1 << 20


def _chain(**extra_w):
    """w (a 4 MiB weight that IS its output) -> mm -> loss (fetched) on devices 'a', 'b'."""
    return {"format": FORMAT,
            "ops": [{"name": "w", "persistent_outputs": [0], "variable": True, **extra_w},
                    {"name": "mm", "compute_us": 100},
                    {"name": "loss", "compute_us": 10, "fetched_outputs": [0]}],
            "edges": [{"src": "w", "dst": "mm", "bytes": 4 * MIB},
                      {"src": "mm", "dst": "loss", "bytes": MIB}],
            "devices": [{"name": "a", "memory": "64MiB"}, {"name": "b", "memory": 2 ** 64 - 1}]}


def _with_loss_output(data, nbytes=4):
    data["ops"][2]["output_bytes"] = [nbytes]
    return data


def test_persistent_output_is_counted_once_and_fetched_output_is_held():
    data = _with_loss_output(_chain())
    loaded = parse_external_graph(data)
    g = loaded.graph
    assert g.tensor_persistent.tolist() == [True, False, False]
    assert g.tensor_fetched.tolist() == [False, False, True]
    one = loaded.devices.with_memory([64 * MIB, 64 * MIB])
    p = place(g, one.with_link_model("parallel"), method="m_topo")
    on_a = p.device_index == p.device_index[0]
    assert on_a.all()  # everything fits on the first device
    # w's 4 MiB once (persistent), mm's 1 MiB output while loss runs, loss's 4 B to the end
    assert int(p.peak_bytes[p.device_index[0]]) == 4 * MIB + MIB + 4


def test_fetched_output_is_held_until_the_step_ends():
    data = _with_loss_output(_chain(), nbytes=MIB)
    data["ops"].append({"name": "after", "compute_us": 50, "output_bytes": [3 * MIB]})
    data["edges"].append({"src": "mm", "dst": "after", "control": True})
    data["devices"] = data["devices"][:1]

    def peak():
        loaded = parse_external_graph(data)
        return int(place(loaded.graph, loaded.devices, method="m_topo").peak_bytes[0])

    held = peak()
    data["ops"][2].pop("fetched_outputs")
    # 'after' (3 MiB, unread, so alive while it runs) runs last: the held loss output adds to it
    assert held == 4 * MIB + 3 * MIB + MIB and peak() == held - MIB


def test_variables_do_not_pin_their_readers_unless_colocated():
    g = parse_external_graph(_with_loss_output(_chain())).graph
    assert len(set(tf_colocation_groups(g).tolist())) == 3
    g = parse_external_graph(_with_loss_output(_chain())
                             | {"ops": [{"name": "w", "persistent_outputs": [0]},
                                        {"name": "mm", "colocate_with": "w"},
                                        {"name": "loss", "output_bytes": [4]}]}).graph
    groups = tf_colocation_groups(g).tolist()
    assert groups[g.index["w"]] == groups[g.index["mm"]] != groups[g.index["loss"]]


def test_huge_limits_and_any_device_names_place():
    data = _with_loss_output(_chain())
    data["devices"] = [{"name": f"tpu core {i}", "memory": 2 ** 62} for i in range(4)]
    loaded = parse_external_graph(data)
    for method in ("m_topo", "m_etf", "m_sct"):
        p = place(loaded.graph, loaded.devices, method=method)
        assert set(p.op_devices().values()) <= set(loaded.devices.names)
    data["devices"] = [{"name": "x", "memory": 2 ** 64 - 1}] * 1
    assert parse_external_graph(data).devices.memory_bytes[0] == 2 ** 63 - 1


def test_transfers_by_tensor_name():
    data = _with_loss_output(_chain())
    data["ops"][1]["colocate_with"] = "pin_mm"
    data["ops"][2]["colocate_with"] = "pin_loss"
    loaded = parse_external_graph(data)
    p = place(loaded.graph, loaded.devices, method="m_etf")
    moved = {t["tensor"]: t for t in p.transfers()}
    crossing = [(n, d) for n, d in [("w:0", ("w", "mm")), ("mm:0", ("mm", "loss"))]
                if p.op_devices()[d[0]] != p.op_devices()[d[1]]]
    assert sorted(moved) == sorted(n for n, _ in crossing)
    for t in moved.values():
        assert t["end_us"] > t["start_us"] and t["src"] != t["dst"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="v0"), "'format' must be"),
    (lambda d: d["ops"][1].update(compute=3), r"ops\[1\] has unknown key\(s\) \['compute'\]"),
    (lambda d: d["ops"][1].update(compute_us=-1), r"ops\[1\] \('mm'\): 'compute_us'=-1: "
                                                   "must be a finite number >= 0"),
    (lambda d: d["edges"].append({"src": "mm", "dst": "nope"}), "dst 'nope' is not an op"),
    (lambda d: d["edges"].append({"src": "w", "dst": "loss", "bytes": 7}),
     "has 7 bytes, but it was given 4194304"),
    (lambda d: d["ops"][2].pop("output_bytes"), r"size of output\(s\) \[0\] is not given"),
    (lambda d: d["edges"].append({"src": "loss", "dst": "w", "bytes": 4}), "cycle"),
    (lambda d: d["devices"][0].update(memory="lots"), "cannot parse memory size"),
    (lambda d: d.update(links={"link_model": "psychic"}), "unknown link model"),
    (lambda d: d.update(devices=[]), "'devices' must be a non-empty list"),
])
def test_malformed_files_name_the_problem(edit, message):
    data = _with_loss_output(_chain())
    edit(data)
    with pytest.raises(ExternalGraphError, match=message):
        parse_external_graph(data)


def test_load_reports_unreadable_files(tmp_path):
    with pytest.raises(ExternalGraphError, match="cannot read"):
        load_external_graph(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ExternalGraphError, match="not valid JSON"):
        load_external_graph(str(tmp_path / "bad.json"))


def _place_tool(*flags):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-m", "graphfit.tools.place", *flags], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_place_binary_writes_placement_trace_and_plot(tmp_path):
    result = _place_tool(f"--graph={EXAMPLE}", f"--out_dir={tmp_path}", "--method=m_etf")
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads((tmp_path / "placement.json").read_text())
    graph = load_external_graph(EXAMPLE)
    assert set(out["placement"]) == set(graph.graph.names)
    assert set(out["placement"].values()) <= {"accelerator-a", "accelerator-b"}
    assert out["summary"]["link_model"] == "contention"
    assert max(s["finish_us"] for s in out["schedule"]) == pytest.approx(
        out["summary"]["makespan_us"])
    for peak, limit in zip(out["summary"]["peak_bytes"], out["summary"]["memory_bytes"]):
        assert peak <= limit
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert sum(e.get("cat") == "compute" for e in events) == graph.graph.num_ops
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"
    assert "bytes" not in result.stdout and "iB of " in result.stdout  # sizes a person reads


def test_place_binary_reports_bad_input_without_traceback(tmp_path):
    data = json.loads(open(EXAMPLE).read())
    data["devices"] = [{"name": d["name"], "memory": "1MiB"} for d in data["devices"]]
    small = tmp_path / "small.json"
    small.write_text(json.dumps(data))
    result = _place_tool(f"--graph={small}", f"--out_dir={tmp_path}/out")
    assert result.returncode == 2 and "bytes" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    result = _place_tool(f"--graph={tmp_path}/none.json", f"--out_dir={tmp_path}/out")
    assert result.returncode == 2 and "cannot read" in result.stderr
