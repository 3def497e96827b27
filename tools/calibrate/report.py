"""Output of `oval-edge calibrate`: the fit and scorer tables, and the [oval] settings written to a config file."""

from __future__ import annotations

import os


def fit_table(report: dict) -> str:
    head = f"{'split':<13}{'positions':>10}{'MAE module':>12}{'MAE per-head':>14}{'MAE global':>12}" \
           f"{'R2 module':>11}{'R2 per-head':>13}{'mean window':>13}{'mean target':>13}"
    lines = [head, "-" * len(head)]
    for split in ("calibration", "heldout"):
        r = report.get(split)
        if r is None:
            continue
        lines.append(f"{split:<13}{r['positions']:>10}{r['mae_tokens']:>12.2f}{r['mae_per_head_constant']:>14.2f}"
                     f"{r['mae_global_constant']:>12.2f}{r['r2']:>11.3f}{r['r2_per_head_constant']:>13.3f}"
                     f"{r['mean_window']:>13.1f}{r['mean_target']:>13.1f}")
    lines.append("per-head = one window per (layer, KV head) fitted on the calibration split (no step information);"
                 " global = one window for all")
    return "\n".join(lines)


def scorer_table(rows: list[dict]) -> str:
    head = f"{'eta':>7}{'rank':>6}{'record':>8}{'output error cal.':>19}{'held-out':>10}{'mass recall cal.':>18}" \
           f"{'held-out':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        eta = "oracle" if r["eta"] is None else format(r["eta"], "g")
        rank = "-" if r["rank"] is None else str(r["rank"])
        record = r.get("record") or "-"
        lines.append(f"{eta:>7}{rank:>6}{record:>8}{r['error_calibration']:>19.4f}{r['error_heldout']:>10.4f}"
                     f"{r['recall_calibration']:>18.4f}{r['recall_heldout']:>10.4f}")
    lines.append("output error = Σ‖o_sparse − o_dense‖² / Σ‖o_dense‖² of the attention outputs (sink + top-k + "
                 "window); oracle = the k pages of most attention mass")
    return "\n".join(lines)


def update_config(path: str, eta: float, rank: int, module: tuple[str, int, int] | None = None,
                  record: str | None = None) -> str:
    """Set [oval] eta and rank (the record format when given; window_module, window_min, window_max when `module` =
    (file, lo, hi)) in the TOML at `path`, keeping every other setting; the file is created if it does not exist."""
    import tomli_w

    from oval_edge.runtime.config_file import load_config_file, validate_sections

    path = os.path.abspath(os.path.expanduser(path))
    sections = load_config_file(path) if os.path.exists(path) else {}
    oval = dict(sections.get("oval", {}))
    oval.update(eta=float(eta), rank=int(rank))
    if record is not None:
        oval["record"] = record
    if module is not None:
        file, lo, hi = module
        oval.update(window_module=os.path.abspath(file), window_min=int(lo), window_max=int(hi))
    sections["oval"] = oval
    clean = validate_sections(sections, f"config for {path}")
    header = ("# [oval] eta, rank and record frozen by `oval-edge calibrate`; read by `oval-edge serve --config`. "
              "Sizes are bytes.\n")
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(header + tomli_w.dumps({k: v for k, v in clean.items() if v}))
    except OSError as exc:
        raise ValueError(f"cannot write config file {path}: {exc.strerror or exc}") from exc
    return path
