"""The PNG of `oval-edge profile --plot`: median decode step (with its quartiles) and KL against page size.

Left: decode latency at the target context, one point per page size that holds it (error bars: p25..p75 of the
timed steps). Right: KL(dense || OVAL) on the calibration text (log scale) with the --max-kl bar. The chosen
page size is ringed on both; each point is labelled with its top-k.
"""

from __future__ import annotations

import os

from .choice import ProfileRow


def write_plot(path: str, rows: list[ProfileRow], chosen: ProfileRow | None, max_kl: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    timed = [r for r in rows if r.decode_ms_median is not None]
    if timed:
        left.errorbar([r.page_size for r in timed], [r.decode_ms_median for r in timed],
                      yerr=[[r.decode_ms_median - r.decode_ms_p25 for r in timed],
                            [r.decode_ms_p75 - r.decode_ms_median for r in timed]],
                      marker="o", capsize=4, label="median decode step (p25-p75)")
    else:
        left.text(0.5, 0.5, "no page size holds the context", transform=left.transAxes, ha="center")
    scored = [r for r in rows if r.kl is not None]
    right.plot([r.page_size for r in scored], [max(r.kl, 1e-8) for r in scored], marker="s", color="tab:red",
               label="KL(dense || OVAL)")
    right.axhline(max_kl, color="gray", linestyle="--", label=f"--max-kl {max_kl:g}")
    for ax, points, value in ((left, timed, "decode_ms_median"), (right, scored, "kl")):
        for r in points:
            ax.annotate(f"k={r.top_k}, {r.tokens_per_step} tok", (r.page_size, max(getattr(r, value), 1e-8)), textcoords="offset points",
                        xytext=(6, 6), fontsize=8)
        if chosen is not None and chosen in points:
            ax.plot([chosen.page_size], [max(getattr(chosen, value), 1e-8)], "o", markersize=16, fillstyle="none",
                    color="black", label=f"chosen: page {chosen.page_size}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.page_size for r in rows}))
        ax.set_xticklabels([str(p) for p in sorted({r.page_size for r in rows})])
        ax.set_xlabel("page size (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("decode step, ms")
    left.set_title("decode latency at the target context")
    right.set_yscale("log")
    right.set_ylabel("mean KL per token, nats")
    right.set_title("fidelity on the calibration text")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ValueError(f"cannot write --plot {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
