"""Bad OVAL settings fail early with a ValueError that names the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from oval_edge import OvalConfig, format_bytes, parse_bytes
from oval_edge.sparse.selection import slots_per_step


def test_defaults_are_valid_and_round_trip():
    config = OvalConfig()
    assert (config.page_size, config.top_k, config.sink_pages, config.scorer, config.rank, config.record) == (
        32, 4, 1, "oval", 8, "int4")
    assert OvalConfig.from_dict(config.to_dict()) == config
    assert config.token_budget == slots_per_step(config) == (1 + 4) * 32 + 64
    # The window slots also hold the open page, so a window shorter than a page still costs a page of slots.
    small = OvalConfig(page_size=64, top_k=2, window_min=8, window_max=16)
    assert small.token_budget == slots_per_step(small) == (1 + 2) * 64 + 64


@pytest.mark.parametrize(
    "value, message",
    [
        (24, r"page_size=24 is not a power of two; use one of 16, 32, 64, 128, 256"),
        (8, r"page_size=8 is out of range: allowed \[16, 256\]"),
        (512, r"page_size=512 is out of range: allowed \[16, 256\]"),
        (32.0, r"page_size=32.0 must be an integer in \[16, 256\]"),
        (True, r"page_size=True must be an integer"),
    ],
)
def test_page_size(value, message):
    with pytest.raises(ValueError, match=message):
        OvalConfig(page_size=value)


def test_top_k():
    with pytest.raises(ValueError, match=r"top_k=-1 is out of range: allowed \[0, 4096\] pages per KV head"):
        OvalConfig(top_k=-1)
    with pytest.raises(ValueError, match=r"top_k='4' must be an integer"):
        OvalConfig(top_k="4")
    assert OvalConfig(top_k=0).top_k == 0  # window + sink only is a valid (if poor) policy


def test_sink_pages():
    with pytest.raises(ValueError, match=r"sink_pages=-1 is out of range: allowed \[0, 64\]"):
        OvalConfig(sink_pages=-1)
    with pytest.raises(ValueError, match=r"sink_pages=65 is out of range"):
        OvalConfig(sink_pages=65)


def test_window_bounds():
    with pytest.raises(ValueError, match=r"window_min=2 is out of range: allowed \[3, 65536\].*fewer than 3"):
        OvalConfig(window_min=2, window_max=64)
    with pytest.raises(ValueError, match=r"window_max=2 is out of range: allowed \[3, 65536\]"):
        OvalConfig(window_min=3, window_max=2)
    with pytest.raises(ValueError, match=r"window_max=16 is below window_min=32; window_max must be >= window_min"):
        OvalConfig(window_min=32, window_max=16)


def test_dense_layers():
    with pytest.raises(ValueError, match=r"dense_layers=-2 is out of range: allowed \[0, 1024\]"):
        OvalConfig(dense_layers=-2)
    with pytest.raises(ValueError, match=r"dense_layers=None must be an integer"):
        OvalConfig(dense_layers=None)


def test_scorer():
    with pytest.raises(ValueError, match=r"scorer='oracle' is unknown; allowed: oval, quest"):
        OvalConfig(scorer="oracle")


def test_rank():
    with pytest.raises(ValueError, match=r"rank=0 is out of range: allowed \[1, 256\].*oval basis rank"):
        OvalConfig(rank=0)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.5", True])
def test_eta(value):
    with pytest.raises(ValueError, match=r"eta=.* is out of range: allowed \[0.0, 1.0\]"):
        OvalConfig(eta=value)


def test_kv_dtype():
    with pytest.raises(ValueError, match=r"kv_dtype='fp8' is unknown; allowed: auto, float32, bfloat16, float16, int8"):
        OvalConfig(kv_dtype="fp8")
    assert OvalConfig(kv_dtype="int8").kv_int8 and not OvalConfig().kv_int8


@pytest.mark.parametrize(
    "text, expected",
    [("1.5GiB", 1610612736), ("800MB", 800 * 10**6), ("4G", 4 * 2**30), (" 512 KiB ", 512 * 1024), (123456, 123456)],
)
def test_memory_budget_parses_sizes(text, expected):
    assert OvalConfig(memory_budget=text).memory_budget == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("lots", r"memory_budget='lots' is not a size; use a number with an optional unit"),
        ("1.5 parsecs", r"memory_budget='1.5 parsecs' is not a size"),
        ("-1GiB", r"memory_budget='-1GiB' is not a size"),
        ("0MB", r"memory_budget='0MB' must be > 0 bytes"),
        (0, r"memory_budget=0 must be > 0 bytes"),
        ("0.1B", r"memory_budget='0.1B' is less than one byte"),
        (float("inf"), r"memory_budget=inf is not a finite number of bytes"),
        (float("nan"), r"memory_budget=nan is not a finite number of bytes"),
        (True, r"memory_budget=True is not a size"),
        ([1], r"memory_budget=\[1\] is not a size"),
    ],
)
def test_memory_budget_rejects_garbage(value, message):
    with pytest.raises(ValueError, match=message):
        OvalConfig(memory_budget=value)


def test_byte_helpers_round_trip():
    assert parse_bytes("2GiB") == 2 * 2**30 and format_bytes(2 * 2**30) == "2.00 GiB"
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"


@pytest.mark.parametrize("value", [0.0, 1.5, -0.2, float("nan"), "0.9"])
def test_reuse_tau(value):
    with pytest.raises(ValueError, match=r"reuse_tau=.* is out of range: allowed \(0.0, 1.0\], or None"):
        OvalConfig(reuse_tau=value)


def test_from_dict_rejects_unknown_keys_and_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown OVAL setting\(s\) \['pagesize'\]; known: \[.*'page_size'"):
        OvalConfig.from_dict({"pagesize": 32})
    with pytest.raises(ValueError, match=r"page_size=48 is not a power of two"):
        OvalConfig.from_dict({"page_size": 48})  # known keys are validated like the constructor
