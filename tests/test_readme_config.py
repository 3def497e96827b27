"""The configuration example in README.md is a file `serve --config` accepts, with the values it shows."""

from __future__ import annotations

import re
from pathlib import Path

from oval_edge.runtime.config_file import engine_kwargs, load_config_file, oval_config

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_example_loads(tmp_path):
    example = re.search(r"```toml\n(.*?)```", README.read_text(), re.S).group(1)
    path = tmp_path / "oval-edge.toml"
    path.write_text(example)
    sections = load_config_file(str(path))
    oval = oval_config(sections)
    assert (oval.page_size, oval.top_k, oval.scorer, oval.eta, oval.rank, oval.record) == (32, 4, "oval", 0.0, 8,
                                                                                           "int4")
    assert oval.memory_budget == int(1.5 * 2**30)
    assert engine_kwargs(sections)["max_batch"] == 4
    assert sections["model"]["quant"] == "auto"
