"""Device sets: coefficient parsing, the communication JSON, device names."""

import json

import pytest

from graphfit.baechi.devices import (Device, DeviceError, DeviceSet, LinkCost, default_device_names,
                            parse_comm_coeffs)

NAMES = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0",
         "/job:worker/task:2/device:CPU:0"]


def test_parse_comm_coeffs_allows_fractions_and_exponents():
    assert parse_comm_coeffs("0.0001754,134") == LinkCost(0.0001754, 134.0)
    assert parse_comm_coeffs(" 1e-4 , 2.5 ") == LinkCost(1e-4, 2.5)
    assert parse_comm_coeffs("0.0001754,134").transfer_us(10_000) == pytest.approx(135.754)


@pytest.mark.parametrize("text", ["1", "1,2,3", "a,b", "-1,3"])
def test_parse_comm_coeffs_rejects(text):
    with pytest.raises(DeviceError, match="comm_cost_coeffs"):
        parse_comm_coeffs(text)


def test_device_names_are_validated():
    DeviceSet.uniform(["/GPU:0", "/device:CPU:1", NAMES[0],
                       "/job:worker/replica:0/task:3/device:GPU:1"], "1GiB", "0,1")
    with pytest.raises(DeviceError, match="not a TF device name"):
        DeviceSet.uniform(["gpu0"], "1GiB", "0,1")
    with pytest.raises(DeviceError, match="duplicate"):
        DeviceSet.uniform(["/GPU:0", "/GPU:0"], "1GiB", "0,1")


def test_default_device_names_prefers_gpus():
    assert default_device_names(2) == ["/device:CPU:0", "/device:CPU:1"]
    assert default_device_names(2, ["/physical_device:GPU:0"]) == ["/device:CPU:0",
                                                                   "/device:CPU:1"]
    assert default_device_names(2, ["g0", "g1", "g2"]) == ["/GPU:0", "/GPU:1"]


def test_from_json_per_link_costs(tmp_path):
    path = tmp_path / "comm.json"
    path.write_text(json.dumps({
        "default": {"a_us_per_byte": 0.001, "b_us": 100},
        "links": [{"src": NAMES[0], "dst": NAMES[1], "a_us_per_byte": 0.01, "b_us": 5},
                  {"src": NAMES[1], "dst": NAMES[0], "a_us_per_byte": 0.02, "b_us": 6},
                  {"src": NAMES[0], "dst": NAMES[2], "a_us_per_byte": 0.03, "b_us": 7},
                  {"src": "/GPU:7", "dst": NAMES[2], "a_us_per_byte": 9, "b_us": 9}],
        "measurements": [1, 2, 3]}))
    devs = DeviceSet.from_json(NAMES, ["1GiB", "2GiB", 1000], str(path))
    assert devs.memory_bytes.tolist() == [1 << 30, 2 << 30, 1000]
    assert devs.transfer_us(0, 1, 100) == pytest.approx(6)
    assert devs.transfer_us(1, 0, 100) == pytest.approx(8)
    assert devs.transfer_us(2, 0, 100) == pytest.approx(10)   # reverse of a listed link
    assert devs.transfer_us(1, 2, 100) == pytest.approx(100.1)  # default
    assert devs.transfer_us(2, 2, 10**9) == 0
    again = DeviceSet.from_json(NAMES, "1GiB", devs.to_json())
    assert again.a_us_per_byte == devs.a_us_per_byte and again.b_us == devs.b_us


def test_from_json_without_default_uses_mean_link():
    data = {"links": [{"src": NAMES[0], "dst": NAMES[1], "a_us_per_byte": 0.0, "b_us": 10},
                      {"src": NAMES[1], "dst": NAMES[0], "a_us_per_byte": 0.0, "b_us": 30}]}
    devs = DeviceSet.from_json(NAMES, "1GiB", data)
    assert devs.transfer_us(0, 2, 1) == pytest.approx(20)
    with pytest.raises(DeviceError, match="neither"):
        DeviceSet.from_json(NAMES, "1GiB", {})
    with pytest.raises(DeviceError, match=r"links\[0\] needs device names"):
        DeviceSet.from_json(NAMES, "1GiB", {"links": [{"src": NAMES[0]}]})


def test_with_memory_keeps_links():
    devs = DeviceSet([Device("/GPU:0", 10), Device("/GPU:1", 10)], LinkCost(1.0, 2.0))
    tighter = devs.with_memory(5)
    assert tighter.memory_bytes.tolist() == [5, 5] and devs.memory_bytes.tolist() == [10, 10]
    assert tighter.transfer_us(0, 1, 3) == 5.0
