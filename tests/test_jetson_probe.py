"""The Orin module table and the device probe, on recorded real files (tests/fixtures/jetson/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from oval_edge.jetson.jtop_info import read_jtop, summarize_jtop
from oval_edge.jetson.l4t import identify_module, parse_nv_tegra_release, read_compatible, read_l4t, read_model
from oval_edge.jetson.meminfo import parse_meminfo, read_meminfo
from oval_edge.jetson.modules import ORIN_MODULES, cpu_host, get_module, module_for_part, module_names
from oval_edge.jetson.probe import is_jetson, probe, probe_cpu, probe_jetson

FIXTURES = Path(__file__).parent / "fixtures" / "jetson"
NANO_ROOT = str(FIXTURES / "orin_nano_8gb_super_r36")
AGX_ROOT = str(FIXTURES / "agx_orin_64gb_r35")
KIB = 1024


# ---- module table ---------------------------------------------------------------------------------------------

def test_table_has_the_seven_orin_modules_with_datasheet_figures():
    by_name = {m.name: m for m in ORIN_MODULES}
    assert list(by_name) == ["orin-nano-4gb", "orin-nano-8gb", "orin-nano-8gb-super", "orin-nx-8gb",
                             "orin-nx-16gb", "agx-orin-32gb", "agx-orin-64gb"]
    bandwidth = {name: m.bandwidth_gbps for name, m in by_name.items()}
    assert bandwidth == {"orin-nano-4gb": 34.0, "orin-nano-8gb": 68.0, "orin-nano-8gb-super": 102.0,
                         "orin-nx-8gb": 102.4, "orin-nx-16gb": 102.4, "agx-orin-32gb": 204.8, "agx-orin-64gb": 204.8}
    assert {m.name: m.gpu_sms for m in ORIN_MODULES} == {"orin-nano-4gb": 4, "orin-nano-8gb": 8,
                                                          "orin-nano-8gb-super": 8, "orin-nx-8gb": 8, "orin-nx-16gb": 8,
                                                          "agx-orin-32gb": 14, "agx-orin-64gb": 16}
    for m in ORIN_MODULES:
        assert m.arch == "sm_87" and m.kind == "jetson" and m.unified_memory
        assert m.cuda_cores == 128 * m.gpu_sms  # Ampere: 128 CUDA cores per SM
        assert 0 < m.os_reserve_headless < m.os_reserve_desktop < m.dram_bytes
        assert m.power_modes and m.power_modes[0].id == 0
    assert [p.name for p in by_name["orin-nano-8gb-super"].power_modes] == ["15W", "25W", "MAXN_SUPER"]
    assert [(p.name, p.watts) for p in by_name["agx-orin-64gb"].power_modes][-1] == ("MODE_50W", 50)
    assert by_name["agx-orin-64gb"].power_modes[0].watts is None  # MAXN: no cap


def test_lookup_by_name_and_unknown_name_lists_known_ones():
    assert get_module("Orin_Nano_8GB").name == "orin-nano-8gb"
    with pytest.raises(ValueError) as err:
        get_module("orin-nano-16gb")
    for name in module_names():
        assert name in str(err.value)


def test_part_numbers_map_to_modules():
    assert module_for_part("p3767-0004").name == "orin-nano-4gb"
    assert module_for_part("p3767-0005").name == "orin-nano-8gb"
    assert module_for_part("p3767-0005", super_mode=True).name == "orin-nano-8gb-super"
    assert module_for_part("p3701-0005").name == "agx-orin-64gb"
    assert module_for_part("p3448-0000") is None  # Jetson Nano (not an Orin)


def test_cpu_host_reads_this_machines_memory_and_says_bandwidth_is_unknown(tmp_path):
    (tmp_path / "proc").mkdir()
    shutil.copy("/proc/meminfo", tmp_path / "proc" / "meminfo")
    shutil.copy("/proc/cpuinfo", tmp_path / "proc" / "cpuinfo")
    info = read_meminfo(str(tmp_path))
    host = cpu_host(str(tmp_path))
    assert host.dram_bytes == info.total and host.kind == "cpu"
    assert host.bandwidth_gbps is None and "unknown" in host.bandwidth_note
    found = probe_cpu(str(tmp_path))
    assert found.kind == "cpu" and found.budget_bytes == found.meminfo.available
    assert not is_jetson(str(tmp_path))


# ---- recorded files -------------------------------------------------------------------------------------------

def test_nv_tegra_release_r36_and_r35():
    r36 = read_l4t(NANO_ROOT)
    assert (r36.major, r36.revision, r36.version, r36.jetpack, r36.board) == (36, "4.3", "36.4.3", "6.2", "generic")
    r35 = read_l4t(AGX_ROOT)
    assert (r35.version, r35.jetpack, r35.board) == ("35.4.1", "5.1.2", "t186ref")
    assert r35.date == "Tue Aug  1 19:57:35 UTC 2023"
    with pytest.raises(ValueError, match="nv_tegra_release"):
        parse_nv_tegra_release("NVIDIA Jetson\n")


def test_device_tree_model_is_nul_terminated_and_compatible_lists_parts():
    raw = (Path(NANO_ROOT) / "proc" / "device-tree" / "model").read_bytes()
    assert raw.endswith(b"\0")
    assert read_model(NANO_ROOT) == "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super"
    assert read_compatible(AGX_ROOT) == ["nvidia,p3737-0000+p3701-0005", "nvidia,tegra234"]


def test_meminfo_orin_r36_has_no_nvmap_line_and_nano_r32_has_one():
    orin = read_meminfo(NANO_ROOT)
    assert orin.total == 7802736 * KIB and orin.available == 6245596 * KIB and orin.free == 3668508 * KIB
    assert (orin.swap_total, orin.swap_free) == (3901344 * KIB, 3608100 * KIB)
    assert orin.nvmap_used is None
    nano = parse_meminfo((FIXTURES / "jetson_nano_r32_meminfo.txt").read_text())
    assert nano.nvmap_used == 244748 * KIB and nano.available == 592696 * KIB
    with pytest.raises(ValueError, match="MemTotal"):
        parse_meminfo("Hugepagesize: 2048 kB\n", "x")


def test_probe_orin_nano_uses_memavailable_not_memfree_and_reports_missing_jtop():
    found = probe_jetson(NANO_ROOT)
    assert found.kind == "jetson"
    assert found.module.name == "orin-nano-8gb-super"  # "Super" model name, 7.44 GiB visible -> the 8GB module
    assert found.budget_bytes == 6245596 * KIB  # MemAvailable, not MemFree (3.5 GiB) nor MemTotal
    assert "MemAvailable" in found.budget_source and "cannot swap" in found.budget_source
    assert found.jtop is None
    assert found.jtop_status.startswith("jtop not available: ")
    assert os.path.join(NANO_ROOT, "run", "jtop.sock") in found.jtop_status
    text = found.describe()
    assert "R36.4.3" in text and "JetPack 6.2" in text and "jtop not available" in text


def test_probe_agx_identifies_module_from_compatible_and_survives_missing_meminfo():
    found = probe(AGX_ROOT)
    assert found.kind == "jetson" and found.module.name == "agx-orin-64gb"
    assert "p3701-0005" in found.module_how
    assert found.budget_bytes is None and found.meminfo is None
    assert any("meminfo" in note for note in found.notes)


def test_identify_nx_size_from_memtotal():
    model = "NVIDIA Jetson Orin NX Engineering Reference Developer Kit"
    assert identify_module(model, [], 15189422080).module.name == "orin-nx-16gb"
    assert identify_module(model, [], 7 * 2**30).module.name == "orin-nx-8gb"
    assert identify_module("Raspberry Pi 5", [], 8 * 2**30).module is None


def test_jtop_stats_shape_from_a_recorded_board():
    recorded = json.loads((FIXTURES / "jtop_orin_nano_4gb_super_r36.json").read_text())
    info = summarize_jtop(recorded["stats"], recorded["board"], recorded["memory"])
    assert (info.nvpmodel, info.jetson_clocks, info.p_number, info.l4t, info.jetpack) == (
        "25W", False, "p3767-0004", "36.4.3", "6.2")
    assert info.ram_total_kib == 3688892 and info.emc_max_khz == 3199000
    match = identify_module(info.model, [], info.ram_total_kib * KIB, info.nvpmodel, info.p_number)
    assert match.module.name == "orin-nano-4gb" and "p3767-0004" in match.how
    assert "power mode 25W" in info.describe()


def test_jtop_socket_present_but_client_missing_says_why(tmp_path):
    pytest.importorskip("socket")
    if _importable("jtop"):
        pytest.skip("jetson-stats is installed here; this checks the message without it")
    (tmp_path / "run").mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(tmp_path / "run" / "jtop.sock"))
        status = read_jtop(str(tmp_path))
    finally:
        server.close()
    assert isinstance(status, str) and status.startswith("jtop not available: ")
    assert "jetson-stats" in status


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_jetson_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import oval_edge.jetson, oval_edge.jetson.modules, oval_edge.jetson.meminfo, oval_edge.jetson.l4t\n"
        "import oval_edge.jetson.jtop_info, oval_edge.jetson.probe\n"
        "assert 'torch' not in sys.modules, 'import'\n"
        "from oval_edge.jetson.probe import probe\n"
        f"probe({NANO_ROOT!r}).describe()\n"
        "assert 'torch' not in sys.modules, 'probe of a Jetson root'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
