"""Output of `oval-edge eval`: the terminal tables, the JSON rows and the PNG plot.

JSON: a list of rows {task, policy, eta, page_size, top_k, tokens_per_step, context, kl, top1, ppl, accuracy,
retention, ...}; a field that does not apply to the row's task is null.
"""

from __future__ import annotations

import json
import math
import os

from .fidelity import FidelityRow
from .passkey import PasskeyResult, retention

FIELDS = ("task", "policy", "eta", "page_size", "top_k", "tokens_per_step", "context", "kl", "top1", "ppl",
          "accuracy", "retention")


def _finite(value):
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value


def fidelity_records(rows: list[FidelityRow]) -> list[dict]:
    return [{
        "task": "fidelity", "policy": r.policy.name, "eta": r.policy.eta, "page_size": r.page_size,
        "top_k": r.policy.top_k, "tokens_per_step": r.tokens_per_step, "context": r.context,
        "kl": r.kl, "top1": r.top1, "ppl": _finite(r.ppl), "accuracy": None, "retention": None,
        "tokens_attended": r.tokens_attended, "window_mean": r.window_mean, "window_range": r.policy.window,
        "steps": r.steps, "reuse_tau": r.policy.reuse_tau, "group_pages": r.policy.group_pages,
        "reuse_hit_rate": r.reuse["hit_rate"] if r.reuse else None,
        "reuse_head_hit_rate": r.reuse["head_hit_rate"] if r.reuse else None, "kv_dtype": r.kv_dtype,
        "activations": r.activations, "kl_own": r.kl_own,
    } for r in rows]


def passkey_records(results: list[PasskeyResult]) -> list[dict]:
    """results: one list entry per (context, page size, policy), dense entries first within each group."""
    out, dense = [], {}
    for r in results:
        if r.policy.name == "dense":
            dense[(r.context, r.page_size, r.kv_dtype)] = r
        ref = dense[(r.context, r.page_size, r.kv_dtype)]
        out.append({
            "task": "passkey", "policy": r.policy.name, "eta": r.policy.eta, "page_size": r.page_size,
            "top_k": r.policy.top_k, "tokens_per_step": r.tokens_per_step, "context": r.context,
            "kl": None, "top1": None, "ppl": None, "accuracy": r.accuracy, "retention": retention(ref, r),
            "cases": len(r.answers), "correct": sum(r.answers), "tokens_attended": r.tokens_attended,
            "window_mean": r.window_mean, "window_range": r.policy.window, "reuse_tau": r.policy.reuse_tau,
            "group_pages": r.policy.group_pages,
            "kv_dtype": r.kv_dtype,
            "answers": [{"depth": d, "key": k, "output": o, "correct": a}
                        for (d, k), o, a in zip(r.cases, r.outputs, r.answers)],
        })
    return out


def _num(value, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _label(rec: dict) -> str:
    kv = rec.get("kv_dtype", "float32")
    return _policy_label(rec) + ("" if kv == "float32" else f" {KV_SHORT.get(kv, kv)}")


KV_SHORT = {"bfloat16": "bf16", "float16": "fp16", "int8": "int8"}  # K/V storage (and activations) short names


def _policy_label(rec: dict) -> str:
    if rec["policy"] == "dense":
        return "dense"
    if rec["policy"] == "oval" and rec.get("reuse_tau") is not None:
        return f"oval reuse τ={rec['reuse_tau']:g}"
    if rec["policy"] == "oval" and rec.get("group_pages"):
        return f"oval groups of {rec['group_pages']}"
    if rec["policy"] == "oval":
        return f"oval eta={rec['eta']:g}"
    if rec.get("window_range"):
        lo, hi = rec["window_range"]
        return f"{rec['policy']} W{lo}-{hi}"
    return rec["policy"]


def _attended(rec: dict) -> str:
    """Measured mean tokens attended and mean window per KV head per sparse layer-step: 'attended/window'."""
    if rec["tokens_per_step"] is None or rec.get("tokens_attended") is None:
        return "-"
    window = rec.get("window_mean")
    return f"{rec['tokens_attended']:.0f}/{window:.0f}" if window else f"{rec['tokens_attended']:.0f}"


def fidelity_table(records: list[dict]) -> str:
    # Selection reuse rows (--reuse-tau) add a column: the share of their sparse row-layer steps that reused.
    reuse = any(rec.get("reuse_tau") is not None for rec in records)
    # Activations other than fp32 (--dtype) add two columns: the row's activations, and its KL from the dense row of
    # its own activations and K/V storage (KL is from the one reference: dense, the first --dtype, fp32 K/V).
    acts = any(rec.get("activations", "float32") != "float32" for rec in records)
    head = (f"{'policy':<18}" + (f"{'act':>6}" if acts else "") + f"{'page':>5}{'k':>4}{'tokens/step':>12}{'read':>7}"
            f"{'attended/window':>16}{'KL':>11}" + (f"{'KL own':>11}" if acts else "") + f"{'top-1':>8}{'ppl':>8}"
            + (f"{'reused':>8}" if reuse else ""))
    lines = [head, "-" * len(head)]
    for rec in records:
        tokens = "all" if rec["tokens_per_step"] is None else str(rec["tokens_per_step"])
        read = "-" if rec["tokens_per_step"] is None else f"{rec['tokens_per_step'] / rec['context']:.0%}"
        act = KV_SHORT.get(rec.get("activations", "float32"), "fp32")
        lines.append(f"{_label(rec):<18}" + (f"{act:>6}" if acts else "") + f"{rec['page_size']:>5}"
                     f"{_num(rec['top_k'], 'd'):>4}{tokens:>12}{read:>7}{_attended(rec):>16}{rec['kl']:>11.4g}"
                     + (f"{_num(rec.get('kl_own'), '11.4g'):>11}" if acts else "")
                     + f"{rec['top1']:>8.1%}{_num(rec['ppl'], '.3f'):>8}"
                     + (f"{_num(rec.get('reuse_hit_rate'), '.1%'):>8}" if reuse else ""))
    return "\n".join(lines)


def passkey_table(records: list[dict]) -> str:
    head = (f"{'policy':<18}{'context':>8}{'page':>5}{'k':>4}{'tokens/step':>12}{'read':>7}{'attended/window':>16}"
            f"{'accuracy':>14}{'retention':>10}")
    lines = [head, "-" * len(head)]
    for rec in records:
        tokens = "all" if rec["tokens_per_step"] is None else str(rec["tokens_per_step"])
        read = "-" if rec["tokens_per_step"] is None else f"{rec['tokens_per_step'] / rec['context']:.0%}"
        acc = f"{rec['correct']}/{rec['cases']} {rec['accuracy']:.0%}"
        lines.append(f"{_label(rec):<18}{rec['context']:>8}{rec['page_size']:>5}{_num(rec['top_k'], 'd'):>4}"
                     f"{tokens:>12}{read:>7}{_attended(rec):>16}{acc:>14}{_num(rec['retention'], '.0%', 'n/a'):>10}")
    return "\n".join(lines)


def write_json(path: str, records: list[dict]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(records, handle, indent=2)
        handle.write("\n")


def write_plot(path: str, records: list[dict], title: str) -> None:
    """KL (log scale) and passkey retention versus K/V tokens read per step, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fidelity = [r for r in records if r["task"] == "fidelity" and r["tokens_per_step"] is not None]
    passkey = [r for r in records if r["task"] == "passkey" and r["tokens_per_step"] is not None]
    panels = [p for p in (("fidelity", fidelity), ("passkey", passkey)) if p[1]]
    if not panels:
        raise ValueError("--plot: there is nothing to plot (no sparse policy rows)")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (task, recs) in zip(axes[0], panels):
        lines: dict[str, list[tuple[int, float]]] = {}
        attended = any(r.get("window_range") for r in recs)
        for rec in recs:
            value = rec["kl"] if task == "fidelity" else rec["retention"]
            if value is None:
                continue
            suffix = f" P={rec['page_size']}" if len({r["page_size"] for r in recs}) > 1 else ""
            if task == "passkey" and len({r["context"] for r in recs}) > 1:
                suffix += f" ctx={rec['context']}"
            # Window policies gather more slots than they attend: with them, every row sits at what it attended.
            x = rec["tokens_attended"] if attended and rec.get("tokens_attended") else rec["tokens_per_step"]
            lines.setdefault(_label(rec) + suffix, []).append((x, value))
        markers = "osD^vP*X"  # distinct markers: policies that tie (e.g. retention 1.0) stay visible
        for i, (name, points) in enumerate(sorted(lines.items())):
            points.sort()
            ax.plot([p[0] for p in points], [max(p[1], 1e-8) if task == "fidelity" else p[1] for p in points],
                    marker=markers[i % len(markers)], markersize=9 - (i % 4), alpha=0.8, label=name)
        ax.set_xlabel(("K/V tokens attended per step, measured mean" if attended else "K/V tokens read per step")
                      + " (per KV head, sparse layers)")
        if task == "fidelity":
            ax.set_yscale("log")
            ax.set_ylabel("mean KL(dense || policy), nats")
            ax.set_title("teacher-forced fidelity")
        else:
            ax.set_ylabel("retention (of cases dense gets right)")
            ax.set_ylim(-0.05, 1.05)
            ax.set_title("passkey retrieval")
        ax.grid(True, alpha=0.3)
        if lines:
            ax.legend(fontsize=8)
        else:  # e.g. dense answered no passkey case: retention is undefined
            ax.text(0.5, 0.5, "no value to plot", transform=ax.transAxes, ha="center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
