"""Medians across runs, OVAL's ratios to every other engine, the table `oval-edge bench` prints and its JSON."""

from __future__ import annotations

import json

from oval_edge.tools.timing import median

REFERENCE = "oval"
# Per-run numbers whose median becomes the row's figure.
MEDIAN_FIELDS = ("prefill_tok_s", "decode_tok_s", "ttft_s", "peak_rss_mb", "run_peak_rss_mb", "rss_after_load_mb",
                 "peak_device_mb", "run_peak_device_mb", "kv_bytes_per_step", "summary_bytes_per_step",
                 "state_bytes_per_step", "weight_bytes", "prefill_s", "decode_s",
                 "reuse_hit_rate", "ops_per_decode_step", "gpu_kernels_per_decode_step")
# Per-run facts that do not vary between runs: taken from the first successful run.
FIRST_FIELDS = ("label", "prompt_tokens", "gen_tokens", "decode_steps", "kv_bytes_source", "kv_dtype", "device",
                "threads", "pool_pages", "pool_bytes", "n_ctx", "output_ids", "ops_counted", "decode_path")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def effective_gb_s(weight_bytes: float | None, kv_bytes: float | None, summary_bytes: float | None,
                   decode_tok_s: float | None, state_bytes: float | None = None) -> float | None:
    """Bytes a decode step must stream (all weights once + the K/V it reads + the page summaries it scores + a
    hybrid's layer states) x steps per second, in GB/s (1e9)."""
    if weight_bytes is None or decode_tok_s is None:
        return None
    return (weight_bytes + (kv_bytes or 0) + (summary_bytes or 0) + (state_bytes or 0)) * decode_tok_s / 1e9


def aggregate(runs: list[dict], bandwidth_gb_s: float | None = None) -> list[dict]:
    """One row per (engine, context), in first-seen order, with the medians of its successful runs."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["engine"], run["context"]), []).append(run)
    rows = []
    for (engine, context), group in groups.items():
        ok = [r for r in group if "error" not in r]
        row: dict = {"engine": engine, "context": context, "runs_ok": len(ok), "runs_failed": len(group) - len(ok)}
        for name in FIRST_FIELDS:
            if ok and name in ok[0]:
                row[name] = ok[0][name]
        for name in MEDIAN_FIELDS:
            row[name] = median(r.get(name) for r in ok)
        row["decode_tok_s_runs"] = [r.get("decode_tok_s") for r in ok]
        row["effective_gb_s"] = effective_gb_s(row["weight_bytes"], row["kv_bytes_per_step"],
                                               row["summary_bytes_per_step"], row["decode_tok_s"],
                                               row["state_bytes_per_step"])
        row["bandwidth_fraction"] = ratio(row["effective_gb_s"], bandwidth_gb_s)
        errors = [r["error"] for r in group if "error" in r]
        if errors:
            row["errors"] = errors
        rows.append(row)
    return rows


def label_rows(rows: list[dict], model_name: str, synthetic: bool) -> list[dict]:
    """Every row names its model, and says when that model is synthetic (random weights: speed only)."""
    for row in rows:
        row["model"], row["synthetic"] = model_name, synthetic
    return rows


def read_bytes(row: dict) -> float | None:
    """K/V + summary + layer-state bytes one decode step reads (None when the K/V figure is missing)."""
    kv = row.get("kv_bytes_per_step")
    if kv is None:
        return None
    return kv + (row.get("summary_bytes_per_step") or 0) + (row.get("state_bytes_per_step") or 0)


def ratios(rows: list[dict], reference: str = REFERENCE) -> list[dict]:
    """OVAL's figures divided by each other engine's at the same context (decode x > 1: OVAL is faster;
    RSS x < 1: OVAL uses less memory)."""
    by_key = {(r["engine"], r["context"]): r for r in rows}
    out = []
    for row in rows:
        ref = by_key.get((reference, row["context"]))
        if row["engine"] == reference or ref is None:
            continue
        out.append({
            "context": row["context"], "engine": reference, "vs": row["engine"],
            "decode_tok_s_ratio": ratio(ref["decode_tok_s"], row["decode_tok_s"]),
            "prefill_tok_s_ratio": ratio(ref["prefill_tok_s"], row["prefill_tok_s"]),
            "peak_rss_ratio": ratio(ref["peak_rss_mb"], row["peak_rss_mb"]),
            "run_peak_rss_ratio": ratio(ref["run_peak_rss_mb"], row["run_peak_rss_mb"]),
            "peak_device_ratio": ratio(ref["peak_device_mb"], row["peak_device_mb"]),
            "kv_bytes_ratio": ratio(ref["kv_bytes_per_step"], row["kv_bytes_per_step"]),
            "read_bytes_ratio": ratio(read_bytes(ref), read_bytes(row)),  # K/V + summaries
        })
    return out


def scaling(rows: list[dict]) -> list[dict]:
    """Each engine's decode tok/s at every context over its own at the smallest context it ran."""
    out = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = sorted((r for r in rows if r["engine"] == engine and r["decode_tok_s"]), key=lambda r: r["context"])
        if not mine:
            continue
        base = mine[0]
        for row in mine:
            out.append({"engine": engine, "context": row["context"], "base_context": base["context"],
                        "decode_vs_base": ratio(row["decode_tok_s"], base["decode_tok_s"])})
    return out


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _mib(row: dict, name: str) -> str:
    """A bytes-per-step figure in MiB; * when it is computed for a dense cache rather than measured (a dense peer
    reads every cached K/V and scores no summaries, so its summary bytes are 0, computed too)."""
    value = row.get(name)
    if value is None:
        return "-"
    mark = "*" if str(row.get("kv_bytes_source", "")).startswith("computed") else ""
    return f"{value / 2**20:.2f}{mark}"


def format_table(rows: list[dict], ratio_rows: list[dict], meta: dict) -> str:
    on_gpu = meta.get("device") == "cuda"
    show_bw = on_gpu or meta.get("bandwidth_gb_s") is not None
    by_vs = {(r["vs"], r["context"]): r for r in ratio_rows}
    head = ["context", "engine", "prompt", "prefill tok/s", "decode tok/s", "peak RSS MB", "run RSS MB",
            "K/V MiB/step", "summary MiB/step", "state MiB/step", "ops/step"]
    if on_gpu:
        head.append("peak GPU MB")
    if show_bw:
        head += ["GB/s", "% of BW"]
    head += ["OVAL decode x", "OVAL RSS x"]
    lines = []
    for row in rows:
        ratio_row = by_vs.get((row["engine"], row["context"]), {})
        engine = f"{row['engine']} (synthetic)" if row.get("synthetic") else row["engine"]
        cells = [str(row["context"]), engine, _num(row.get("prompt_tokens"), "{}"),
                 _num(row["prefill_tok_s"]), _num(row["decode_tok_s"], "{:.2f}"), _num(row["peak_rss_mb"], "{:.0f}"),
                 _num(row["run_peak_rss_mb"], "{:.0f}"), _mib(row, "kv_bytes_per_step"),
                 _mib(row, "summary_bytes_per_step"), _mib(row, "state_bytes_per_step"), _num(row.get("ops_per_decode_step"), "{:.0f}")]
        if on_gpu:
            cells.append(_num(row["peak_device_mb"], "{:.0f}"))
        if show_bw:
            fraction = row.get("bandwidth_fraction")
            cells += [_num(row["effective_gb_s"], "{:.2f}"), _num(None if fraction is None else 100 * fraction)]
        cells += [_num(ratio_row.get("decode_tok_s_ratio"), "{:.2f}x"), _num(ratio_row.get("peak_rss_ratio"), "{:.2f}x")]
        if row["runs_ok"] == 0:
            cells[3:] = ["FAILED"] + [""] * (len(cells) - 4)
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    text = [f"model: {meta['model_name']}"] if meta.get("model_name") else []
    text += ["  ".join(h.rjust(w) if i > 1 else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    text.append("  ".join("-" * w for w in widths))
    previous = None
    for row, cells in zip(rows, lines):
        if previous is not None and row["context"] != previous:
            text.append("")
        previous = row["context"]
        text.append("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    return "\n".join(text) + "\n" + _footnotes(rows, meta, show_bw)


def _footnotes(rows: list[dict], meta: dict, show_bw: bool) -> str:
    notes = [f"medians of {meta.get('runs')} run(s) per cell, {meta.get('gen')} generated tokens, each run in its own "
             f"process; device {meta.get('device')}, {meta.get('threads')} threads"]
    for engine in dict.fromkeys(r["engine"] for r in rows):
        label = next((r.get("label") for r in rows if r["engine"] == engine and r.get("label")), None)
        if label:
            notes.append(f"{engine}: {label}")
    notes.append("prefill = prompt in -> first token; decode = (N-1) tokens / time from first to last token")
    notes.append("peak RSS = the run's process over its whole life (load included); run RSS = peak during the timed "
                 "request alone")
    notes.append("K/V MiB/step: K/V bytes read at the last decode step, all layers; summary MiB/step: page summaries "
                 "read to score the pages at that step (OVAL's index; 0 for dense attention, which scores nothing); "
                 "* = computed for a dense cache (tokens x bytes per token; no summaries), not measured")
    notes.append("ops/step: torch ops one decode step dispatches (counted by a TorchDispatchMode around the step, this "
                 "runtime only); each costs launch overhead a CUDA graph removes. On CUDA: the step's launch calls "
                 "(torch.profiler: one per kernel eager, one per graph replay); JSON gpu_kernels_per_decode_step "
                 "counts the kernels the GPU ran")
    notes.append("OVAL decode x = OVAL decode tok/s / this engine's; OVAL RSS x = OVAL peak RSS / this engine's")
    if show_bw:
        bw = meta.get("bandwidth_gb_s")
        notes.append("GB/s = (weight bytes + K/V bytes + summary bytes per step) x decode tok/s; "
                     + (f"% of {bw:.0f} GB/s ({meta.get('bandwidth_note')})" if bw else "device bandwidth unknown"))
    if meta.get("synthetic"):
        notes.append(f"every row runs {meta.get('model_name')}: random weights, so the tokens it generates mean "
                     "nothing and quality is not measured on it (eval and calibrate use the real model)")
    for note in meta.get("notes", []):
        notes.append(note)
    return "\n".join("  " + n for n in notes)


def report_json(meta: dict, rows: list[dict], runs: list[dict]) -> dict:
    return {"meta": meta, "rows": rows, "ratios": ratios(rows), "scaling": scaling(rows), "runs": runs}


def write_json_report(path: str, report: dict) -> None:
    """Write a --json report; an unwritable path is a ValueError that names it."""
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    except OSError as exc:
        raise ValueError(f"cannot write --json {path}: {exc.strerror or exc}") from exc
    print(f"wrote {path}")
