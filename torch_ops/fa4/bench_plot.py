"""``python -m fa4.bench --plot FILE.png``: the forward table as a figure (matplotlib, the ``plot``
extra): TFLOP/s per provider, one group of bars per (head_dim, seqlen, mask) case, fa4's ratio to
each peer over its bar."""
from __future__ import annotations


def plot_rows(rows, names: list[str], path: str, title: str = "") -> None:
    """rows: [(head_dim label, seqlen, causal, {provider: TFLOP/s})] as fa4.bench collects them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(f"--plot needs matplotlib (pip install 'fa4[plot]'): {error}") from None
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(rows) + 2), 4.8))
    for i, name in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(rows))]
        values = [r[3].get(name, 0.0) for r in rows]
        bars = ax.bar(xs, values, width, label=name)
        if name != "fa4" and "fa4" in names:
            for bar, row in zip(bars, rows):
                if row[3].get(name):
                    ax.annotate(f"fa4 {row[3]['fa4'] / row[3][name]:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                bar.get_height()), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"hd{r[0]}\n{r[1] // 1024}k{' causal' if r[2] else ''}" for r in rows], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or "fa4 forward against its peers (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
