"""Output of `oval-edge profile`: the terminal table, the JSON report and the TOML that `serve --config` reads.

JSON: {"device": {...}, "settings": {...}, "rows": [row, ...], "chosen": row | null, "choice": {...} | null,
"explanation": str}, where "choice" records the rule's figures (tolerance asked and applied, the tied page sizes,
the runner-up), and where
each row starts with page_size, top_k, tokens_per_step, pages, max_context, summary_bytes, decode_ms_median,
seal_ms, kl, top1 (null where not measured) and carries the supporting figures after them.
"""

from __future__ import annotations

import os

from oval_edge.config import OvalConfig
from oval_edge.units import format_bytes

from .choice import ProfileRow, Ranking


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[ProfileRow], chosen: ProfileRow | None, runner_up: ProfileRow | None = None) -> str:
    head = (f"  {'page':>5}{'top-k':>6}{'tok/step':>9}{'pages':>7}{'pool tok':>9}{'max ctx':>8}{'summaries':>11}"
            f"{'decode ms':>10}{'p25-p75':>13}{'seal ms':>9}{'KL':>9}{'top-1':>7}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        spread = (f"{r.decode_ms_p25:.1f}-{r.decode_ms_p75:.1f}" if r.decode_ms_p25 is not None else "-")
        summaries = format_bytes(r.summary_bytes).replace(" ", "") if r.summary_bytes is not None else "-"
        mark = "*" if r is chosen else "+" if r is runner_up else " "
        lines.append(
            f"{mark} {r.page_size:>5}{r.top_k:>6}{r.tokens_per_step:>9}{_num(r.pages, 'd'):>7}"
            f"{_num(r.pool_tokens, 'd'):>9}{_num(r.max_context, 'd'):>8}{summaries:>11}"
            f"{_num(r.decode_ms_median, '.1f'):>10}{spread:>13}{_num(r.seal_ms, '.1f'):>9}{_num(r.kl, '.4f'):>9}"
            f"{_num(r.top1, '.1%'):>7}" + (f"  {r.note}" if r.note else ""))
    chunk = next((r.seal_pages * r.page_size for r in rows if r.seal_pages), None)
    turns = ", page sizes stepped in turn" if any(r.interleaved for r in rows) else ""
    lines.append(f"  * chosen{', + runner-up' if runner_up is not None else ''}. decode ms: median engine step at the target context{turns} (p25-p75: its spread). "
                 f"seal ms: sealing {chunk or 'the'} tokens' pages in one batch (a prefill chunk). KL, top-1: "
                 "against dense on the calibration text.")
    return "\n".join(lines)


def report_json(device: dict, settings: dict, rows: list[ProfileRow], chosen: ProfileRow | None,
                explanation: str, ranking: Ranking | None = None) -> dict:
    return {"device": device, "settings": settings, "rows": [r.record() for r in rows],
            "chosen": chosen.record() if chosen is not None else None,
            "choice": choice_record(ranking) if ranking is not None else None, "explanation": explanation}


def choice_record(ranking: Ranking) -> dict:
    runner = ranking.runner_up
    return {
        "rule": "lowest KL among the page sizes whose median step is within the tie tolerance of the fastest "
                "(KL <= max_kl and the context held)",
        "speed_tolerance": ranking.asked, "fastest_spread": ranking.spread, "tie_tolerance": ranking.tolerance,
        "fastest_page_size": ranking.fastest.page_size, "tied_page_sizes": [r.page_size for r in ranking.tied],
        "order": [r.page_size for r in ranking.order],
        "runner_up": runner.record() if runner is not None else None,
    }


def config_sections(chosen: ProfileRow, base: OvalConfig, model_arg: str, model_path: str, quant: str,
                    device: str, settings: dict, device_record: dict) -> dict:
    """[model], [oval], [server] for `serve --config` (runtime/config_file.py), and [profile figures] in [plan].

    [server] keeps the measured budget and prefill chunk and no max_model_len, so serve sizes its pool with the
    same arithmetic (and the same workspace) as the profile did; serve measures its own process memory at
    startup, so its page count can differ from the profile's by that difference.
    """
    oval = base.replace(page_size=chosen.page_size, top_k=chosen.top_k, memory_budget=None).to_dict()
    info = {
        "written_by": "oval-edge profile", "device": device_record["title"], "cpu": device_record["cpu"],
        "torch_threads": device_record["torch_threads"], "context": settings["context"],
        "tokens_per_step": chosen.tokens_per_step, "max_kl": settings["max_kl"],
        "speed_tolerance": settings.get("speed_tolerance"), "pages": chosen.pages,
        "max_context": chosen.max_context, "summary_bytes": chosen.summary_bytes,
        "decode_ms_median": round(chosen.decode_ms_median, 3), "seal_ms": chosen.seal_ms, "kl": chosen.kl,
        "top1": chosen.top1,
    }
    for key in ("gpu", "module", "l4t", "jetpack", "nvpmodel", "jetson_clocks"):
        if device_record.get(key) is not None:
            info[key] = device_record[key]
    return {
        "model": {"path": "default" if model_arg in (None, "", "default") else os.path.abspath(model_path),
                  "quant": quant},
        "oval": oval,
        "server": {"memory_budget": settings["memory_budget"], "prefill_chunk": settings["prefill_chunk"],
                   "device": device},
        "plan": {k: v for k, v in info.items() if v is not None},
    }


def write_config(path: str, sections: dict) -> str:
    from oval_edge.runtime.config_file import write_config_file

    return write_config_file(path, sections, writer="oval-edge profile")
