"""The configuration examples (README.md's short one, docs/configuration.md's full one) are files `serve --config`
accepts, with the values they show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from oval_edge.runtime.config_file import engine_kwargs, load_config_file, oval_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("README.md", "docs/configuration.md")


@pytest.mark.parametrize("page", EXAMPLES)
def test_config_example_loads(page, tmp_path):
    example = re.search(r"```toml\n(.*?)```", (REPO / page).read_text(), re.S).group(1)
    path = tmp_path / "oval-edge.toml"
    path.write_text(example)
    sections = load_config_file(str(path))
    oval = oval_config(sections)
    assert (oval.page_size, oval.top_k, oval.scorer, oval.eta, oval.rank, oval.record) == (32, 4, "oval", 0.0, 8,
                                                                                           "int4")
    assert oval.memory_budget == int(1.5 * 2**30)
    assert engine_kwargs(sections)["max_batch"] == 4
    assert sections["model"]["quant"] == "auto"
