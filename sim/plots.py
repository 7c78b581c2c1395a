"""PNG plots of result rows (matplotlib, Agg backend; optional: the bench extra)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def plot_rows(path: str, rows: list[dict], x: str, ys: tuple[str, ...], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is missing (pip install .[bench]); no plot written to %s", path)
        return
    fig, axes = plt.subplots(1, len(ys), figsize=(4 * len(ys), 3.2))
    for ax, y in zip(axes if len(ys) > 1 else [axes], ys):
        for router in dict.fromkeys(r["router"] for r in rows):
            pts = [(r[x], r[y]) for r in rows if r["router"] == router]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=router)
        ax.set_xlabel(x)
        ax.set_title(y)
        if x == "replicas":
            ax.set_xscale("log")
    axes_list = axes if len(ys) > 1 else [axes]
    axes_list[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
