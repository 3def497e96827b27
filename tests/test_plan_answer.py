"""`oval-edge plan` gives one answer (issue #53): `--device NAME`, its `--json` and `--device all` print the same
fits, page size, pages and longest context; that longest context is the boundary plan itself then confirms; the
default tables fit 120 columns; a module that cannot hold the request says what it holds; the known models and the
table of which fits which Orin module (quoted in docs/plan.md and README) come from the same function."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from oval_edge.jetson.modules import get_module
from oval_edge.tools.plan.catalog import KNOWN_MODELS, known_model
from oval_edge.tools.plan.compute import PlanRequest, plan_device
from oval_edge.tools.plan.model import read_model_shape
from oval_edge.tools.plan.models_table import COMMAND, models_caption, models_table
from test_plan import flat, plan

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "tests" / "fixtures" / "configs"
DEVICES = ["orin-nano-4gb", "orin-nano-8gb", "orin-nx-8gb", "orin-nx-16gb"]
ANSWER = re.compile(r"answer: fits (\d+) x (\d+): (yes|no); page_size (\d+), (\d+) pages; longest context (\d+) "
                    r"tokens per sequence \(page_size (\d+)\)")


def text_answer(out: str) -> dict:
    m = ANSWER.search(flat(out))
    assert m, out
    return {"fits": m[3] == "yes", "page_size": int(m[4]), "pages": int(m[5]), "longest_context": int(m[6])}


def table_answer(out: str, device: str) -> dict:
    """The `--device all` row of `device`: ... page, pages, longest ctx, fits ... (sizes print as 'N.NN GiB')."""
    row = re.search(rf"^ *{device} +\S+ \S+ +\S+ \S+ +(\d+) +(\d+) +(\d+) +(yes|no) ", out, re.M)
    assert row, out
    return {"fits": row[4] == "yes", "page_size": int(row[1]), "pages": int(row[2]), "longest_context": int(row[3])}


def json_answer(dev: dict) -> dict:
    """What the JSON says, read from its own fields (not from the text's 'answer')."""
    best = dev["recommended"] or next(r for r in dev["page_sizes"] if r["page_size"] == dev["longest_context_page_size"])
    assert dev["answer"]["longest_context"] == dev["longest_context"] and dev["answer"]["fits"] == dev["fits"]
    return {"fits": dev["fits"], "page_size": best["page_size"], "pages": best["pages"],
            "longest_context": dev["longest_context"]}


@pytest.mark.parametrize("model, context", [
    ("Llama-3.1-8B-Instruct", 8192),  # the question: Orin Nano 8GB, 4-bit, 8192 tokens
    ("Llama-3.1-8B-Instruct", 4096),
    ("Llama-3.2-3B-Instruct", 8192),
    ("gemma-3-4b-it", 8192),  # sliding layers: rings beside the pool
    ("gemma-4-E2B-it", 8192),  # two head sizes, shared K/V, the per-layer input table
    ("default", 4096),  # the bundled GGUF, its own blocks
])
def test_device_json_and_all_table_give_one_answer(capsys, tmp_path, model, context):
    path = "default" if model == "default" else str(CONFIGS / model)
    all_json = tmp_path / "all.json"
    _, table, _ = plan(capsys, "--device", "all", "--model", path, "--context", str(context), "--json", str(all_json))
    everyone = {d["device"]["name"]: d for d in json.loads(all_json.read_text())["devices"]}
    model_max = read_model_shape(path).max_context
    # a GGUF's metadata takes seconds to read: the bundled one on two modules
    for device in DEVICES[:2] if model == "default" else DEVICES:
        one_json = tmp_path / f"{device}.json"
        rc, text, _ = plan(capsys, "--device", device, "--model", path, "--context", str(context),
                           "--json", str(one_json))
        dev = json.loads(one_json.read_text())["devices"][0]
        said = text_answer(text)
        assert said == json_answer(dev) == table_answer(table, device) == json_answer(everyone[device]), device
        assert rc == (0 if said["fits"] else 1)
        # every page size's 'max ctx/seq' is the same search, so the longest is the largest of them
        assert said["longest_context"] == max(r["max_context_per_sequence"] for r in dev["page_sizes"])
        assert said["fits"] == (context <= said["longest_context"]) or context > model_max
        _confirm_boundary(capsys, path, device, said["longest_context"], model_max)


def _confirm_boundary(capsys, path: str, device: str, longest: int, model_max: int) -> None:
    """Asked for the longest context it printed, plan says it fits; one token more, it does not."""
    if longest > 0:
        assert plan(capsys, "--device", device, "--model", path, "--context", str(longest))[0] == 0, (device, longest)
    if 0 < longest < model_max:
        assert plan(capsys, "--device", device, "--model", path, "--context", str(longest + 1))[0] == 1, device


@pytest.mark.parametrize("model", ["Llama-3.1-8B-Instruct", "gemma-3-4b-it", "default"])
def test_default_tables_fit_120_columns_and_cite_no_sources(capsys, model):
    path = "default" if model == "default" else str(CONFIGS / model)
    outputs = [plan(capsys, "--device", "all", "--model", path, "--context", "8192")[1],
               plan(capsys, "--device", "orin-nx-8gb", "--model", path, "--context", "8192")[1],
               plan(capsys, "--models")[1]]
    for out in outputs:
        wide = [line for line in out.splitlines() if len(line) > 120]
        assert wide == [], wide
        assert "https://" not in out and "issues/" not in out
    verbose = plan(capsys, "--device", "all", "--model", path, "--context", "8192", "--verbose")[1]
    assert "load peak" in verbose and "min budget" in verbose and "load peak" not in outputs[0]


def test_a_module_that_cannot_hold_the_model_says_what_it_holds(capsys, tmp_path):
    llama8 = str(CONFIGS / "Llama-3.1-8B-Instruct")
    out = plan(capsys, "--device", "all", "--model", llama8, "--context", "8192")[1]
    lines = {line.split(":")[0]: line for line in out.splitlines() if "Llama-3.1-8B-Instruct" in line and ";" in line}
    devices = json.loads(_json(capsys, tmp_path, "all", llama8, "8192"))["devices"]
    for dev in devices:
        name = dev["device"]["name"]
        if dev["fits"]:
            assert name not in lines and dev["what_fits"] is None
            continue
        line = lines[name]  # one line per module that cannot hold it, the same the JSON keeps
        assert line == dev["what_fits"]
        held = dev["longest_context"]
        assert (f"up to {held:,} tokens" in line) if held else ("does not fit at all" in line)
        other = re.search(r"for 8,192 tokens: (\S+) \(holds ([\d,]+)\)", line)
        # ... the named model does fit there, with the context the line says, and no larger known model does
        rc, text, _ = plan(capsys, "--device", name, "--model", other[1], "--context", "8192")
        assert rc == 0 and text_answer(text)["longest_context"] == int(other[2].replace(",", ""))
        weights = {m.name: plan_device(m.shape(), get_module(name), PlanRequest(context=8192)) for m in KNOWN_MODELS}
        larger = [n for n, p in weights.items() if p.weights.total > weights[other[1]].weights.total and p.fits]
        assert larger == [], (name, larger)
    # the single-device report carries the same line
    assert lines["orin-nx-8gb"] in flat(plan(capsys, "--device", "orin-nx-8gb", "--model", llama8, "--context", "8192")[1])


def _json(capsys, tmp_path: Path, device: str, model: str, context: str) -> str:
    path = tmp_path / f"{device}-{context}.json"
    plan(capsys, "--device", device, "--model", model, "--context", context, "--json", str(path))
    return path.read_text()


# `states` (a hybrid's state layers: kind, channels, heads, dims) and the attention output gate are part of the
# shape: a catalog entry with the wrong DeltaNet value heads reads as the same dense geometry otherwise; so are
# Gemma 4's full-layer head dim, shared K/V layers, per-layer inputs and double-wide MLPs
PLANNED_FIELDS = ("architecture", "layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                  "max_context", "tied_embeddings", "qkv_bias", "norms_per_layer", "qk_norm", "layer_kinds",
                  "sliding_window", "rotary_dim", "states", "attn_output_gate", "global_head_dim", "kv_shared_layers",
                  "per_layer_input", "per_layer_vocab", "double_wide_mlp")


@pytest.mark.parametrize("known", KNOWN_MODELS, ids=lambda m: m.name)
def test_each_known_model_is_its_published_config(known):
    folder = CONFIGS / known.name
    published = read_model_shape(str(folder)) if folder.exists() else read_model_shape("default")
    if not folder.exists():  # SmolLM2-135M-Instruct: the bundled GGUF's metadata
        assert known.name == "SmolLM2-135M-Instruct"
    mine = known.shape()
    assert {f: getattr(mine, f) for f in PLANNED_FIELDS} == {f: getattr(published, f) for f in PLANNED_FIELDS}


def test_known_names_plan_like_their_config_and_unknown_names_list_them(capsys, tmp_path):
    by_repo = _json(capsys, tmp_path, "orin-nano-8gb", "Qwen/Qwen3-8B", "4096")
    by_name = _json(capsys, tmp_path, "orin-nano-8gb", "qwen3-8b", "4096")
    by_file = _json(capsys, tmp_path, "orin-nano-8gb", str(CONFIGS / "Qwen3-8B"), "4096")
    answers = [json.loads(t)["devices"][0]["answer"] for t in (by_repo, by_name, by_file)]
    assert answers[0] == answers[1] == answers[2]
    assert known_model("meta-llama/Llama-3.2-1B-Instruct") is known_model("llama-3.2-1b-instruct") is not None
    rc, _, err = plan(capsys, "--device", "orin-nano-8gb", "--model", "Mistral-7B-Instruct")
    assert rc == 2 and "does not exist" in err and "Qwen3-8B" in err and "Llama-3.2-1B-Instruct" in err


def test_models_table_is_what_plan_answers_and_what_the_docs_quote(capsys):
    table = models_table()
    out = plan(capsys, "--models")[1]
    assert out == models_caption() + "\n\n" + table + "\n"
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[3:-1]] for r in table.splitlines()[2:]}
    header = [c.strip() for c in table.splitlines()[0].split("|")[3:-1]]
    assert header[:2] == ["Nano 4GB", "Nano 8GB / Super"]
    # two columns checked cell by cell against `plan --device NAME --model NAME` (the rest are the same call)
    for column, device in ((0, "orin-nano-4gb"), (2, "orin-nx-8gb")):
        for name, cells in rows.items():
            said = text_answer(plan(capsys, "--device", device, "--model", name, "--context", "8192")[1])
            expect = f"{said['longest_context']:,}" if said["longest_context"] >= 8192 else "-"
            assert cells[column] == expect, (name, device)
    # the quotes: docs/plan.md now, README once its section is in (each quote follows the command's name)
    quoted = [p for p in (REPO / "docs" / "plan.md", REPO / "README.md") if COMMAND in p.read_text(encoding="utf-8")]
    assert REPO / "docs" / "plan.md" in quoted
    for page in quoted:
        assert table in page.read_text(encoding="utf-8"), f"{page}: regenerate the table with `{COMMAND}`"


@pytest.mark.parametrize("page, least", [("plan-models.md", 8), ("plan.md", 1)])
def test_docs_blocks_are_the_outputs_of_their_commands(capsys, page, least):
    """Each docs block under 'Command: `oval-edge plan ARGS`' is what that command prints today."""
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    blocks = re.findall(r"^Command: `oval-edge plan ([^`]+)`\n\n```\n(.*?)\n```", text, re.M | re.S)
    assert len(blocks) >= least, f"docs/{page} lost its command-and-output blocks"
    for args, quoted in blocks:
        out = plan(capsys, *args.split())[1].rstrip("\n")
        assert quoted == out, f"docs/{page} is stale: rerun `oval-edge plan {args}` and paste its output"
