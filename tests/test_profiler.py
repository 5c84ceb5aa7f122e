"""The profiler on real TF runs: coverage, memory against TF's own allocator, the JSON form,
and the import of a profiled graph into the IR."""

import json

import numpy as np
import pytest

from graphfit import models
from graphfit.profiler.profile import Profile, ProfileMismatchError
from graphfit.profiler.tf_import import cost_graph_from_graph
from graphfit.profiler.trace import profile_graph, step_fetches


@pytest.fixture(scope="module")
def profiles():
    """One short profile per model, default presets (activations large enough for the
    allocator's view to be meaningful; tiny tensors go to oneDNN's small-size allocator,
    which TF's memory stats do not see)."""
    result = {}
    for name in ("mlp", "cifarnet", "resnet", "transformer"):
        item = models.build(name, preset="default")
        result[name] = (item, profile_graph(item, steps=2, warmup=1, trace_every=1,
                                            progress=None))
    return result


@pytest.mark.parametrize("name", ["mlp", "cifarnet", "resnet"])
def test_profiles_measure_at_least_95_percent_of_step_ops(profiles, name):
    item, profile = profiles[name]
    assert profile.coverage >= 0.95, profile.unmeasured_ops
    assert profile.num_graph_ops < len(item.graph.get_operations())   # initialisers excluded
    assert all(cost.compute_us >= 0 for cost in profile.ops.values())


@pytest.mark.parametrize("name", ["mlp", "cifarnet", "resnet", "transformer"])
def test_profiled_peak_agrees_with_tf_allocator(profiles, name):
    _, profile = profiles[name]
    if not profile.metadata["allocator_peak_bytes"]:
        pytest.skip("TF's CPU allocator keeps no statistics in this process (oneDNN off): "
                    "run with TF_ENABLE_ONEDNN_OPTS=1 or TF_CPU_ALLOCATOR_USE_BFC=true")
    tf_peak = max(profile.metadata["allocator_peak_bytes"])
    assert tf_peak > 0
    # The allocator's samples at op ends: within 10% of TF's own peak for the same steps.
    assert abs(profile.allocator_peak_bytes / tf_peak - 1) <= 0.10
    # The replay of allocation records (what splits memory by device) is coarser: it cannot
    # see buffers oneDNN caches or exactly when replaced variable buffers die.
    assert abs(profile.peak_bytes / tf_peak - 1) <= 0.25


def test_timeline_starts_with_resident_bytes_and_reaches_peak(profiles):
    _, profile = profiles["mlp"]
    (device,) = profile.devices.values()
    times = [t for t, _ in device.timeline]
    assert times == sorted(times)
    assert device.timeline[0][1] == device.resident_bytes > 0
    assert max(b for _, b in device.timeline) == device.peak_bytes


def test_save_load_round_trip_and_fingerprint_check(profiles, tmp_path):
    item, profile = profiles["mlp"]
    path = tmp_path / "costs.json"
    profile.save(str(path))
    loaded = Profile.load(str(path), item.graph_def())
    assert loaded.ops.keys() == profile.ops.keys()
    assert loaded.devices.keys() == profile.devices.keys()
    assert loaded.coverage == profile.coverage
    other = models.build("mlp", preset="default", width=256)
    with pytest.raises(ProfileMismatchError, match="profile this graph again"):
        Profile.load(str(path), other.graph_def())


def test_unknown_format_version_is_refused(tmp_path, profiles):
    _, profile = profiles["mlp"]
    data = profile.to_json()
    data["format_version"] = 999
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format version 999"):
        Profile.load(str(path))


def test_cost_graph_takes_measured_costs_and_estimates_the_rest(profiles):
    item, profile = profiles["cifarnet"]
    measured = cost_graph_from_graph(item.graph, step_fetches(item), profile)
    estimated = cost_graph_from_graph(item.graph, step_fetches(item))
    assert measured.names == estimated.names
    assert measured.num_ops == profile.num_graph_ops
    assert measured.measured.mean() == pytest.approx(profile.coverage)
    assert not estimated.measured.any()
    for i in np.flatnonzero(measured.measured):
        name = measured.names[i]
        assert measured.compute_us[i] == profile.ops[name].compute_us
    # cifarnet's missed ops (with oneDNN on) are the ones oneDNN fused into their measured
    # readers (Conv2D into BiasAdd): their time is already counted there.
    missing = np.flatnonzero(~measured.measured)
    assert (measured.compute_us[missing] == 0).all()
    assert all(measured.names[i].endswith(("Conv2D", "BiasAddGrad")) for i in missing)
    # Without a profile every op gets a positive estimate.
    assert (estimated.compute_us > 0).all()
    # Variables carry their buffers as persistent bytes.
    variables = np.flatnonzero(measured.is_variable)
    assert len(variables) and (measured.persistent_bytes[variables] > 0).all()


def test_profile_of_another_graph_is_a_clear_error(profiles):
    item, _ = profiles["resnet"]
    _, mlp_profile = profiles["mlp"]
    with pytest.raises(ProfileMismatchError, match="measured on graph"):
        cost_graph_from_graph(item.graph, step_fetches(item), mlp_profile)


def test_models_import_as_acyclic_cost_graphs():
    item = models.build("gnmt_v2", preset="tiny")
    graph = cost_graph_from_graph(item.graph, step_fetches(item))
    assert graph.num_ops > 1000
    assert all(p < j for j in range(graph.num_ops) for p in graph.predecessors(j))


def test_open_sessions_reuse_one_session_per_graph_and_configuration():
    import tensorflow as tf

    from graphfit.profiler.session import OpenSessions, user_config

    first, second = tf.Graph(), tf.Graph()
    with OpenSessions() as sessions:
        session = sessions.get(first)
        assert sessions.get(first) is session
        assert sessions.get(first, user_config()) is not session
        other = sessions.get(second)
        sessions.keep_only([second])
        assert sessions.get(second) is other and sessions.get(first) is not session


def test_work_beside_the_warm_up_is_waited_for_before_the_first_measured_step():
    """``before_measuring`` runs once, after the warm-up steps and before the first measured
    one: ``remat.measure.measure_step`` builds the user's call beside the session's first
    step and waits there, so that no measured step overlaps it."""
    from graphfit.profiler.session import make_session

    item = models.build("mlp", preset="tiny")
    steps_run, events = [], []

    class CountingSession:
        def __init__(self, graph):
            self.session = make_session(graph)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.session.close()

        def run(self, fetches, *args, **kwargs):
            if isinstance(fetches, list) and item.train_op in fetches:
                steps_run.append(kwargs.get("options") is not None)
            return self.session.run(fetches, *args, **kwargs)

    profile_graph(item, steps=2, warmup=2, trace_every=1, progress=None,
                  session_factory=CountingSession,
                  before_measuring=lambda: events.append(len(steps_run)),
                  on_traced_step=lambda _: events.append("traced"))
    assert events == [2, "traced", "traced"]
    assert steps_run == [False, False, True, True]
