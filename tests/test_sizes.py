"""Memory sizes as flags and configs write them (profiler.sizes)."""

import pytest

from graphfit.profiler.sizes import SizeError, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("300MiB", 300 * 2**20), ("1.5GiB", 3 << 29),
    ("1.5GB", 1_500_000_000), ("4096", 4096), ("10 KiB", 10240), ("3kb", 3000), (123, 123),
    ("0.5GiB", 1 << 29)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "2 parsecs", "-1GiB", "GiB", "1.2.3MB", -1])
def test_parse_bytes_rejects(text):
    with pytest.raises(SizeError, match="memory size"):
        parse_bytes(text)
