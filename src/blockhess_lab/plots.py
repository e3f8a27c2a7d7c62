"""Figure helpers for the experiment commands (matplotlib, Agg backend: no display needed).

* :func:`hessian_heatmap` — ``log10|H|`` with dashed block boundaries and block labels
  (the paper's Figs. 3–4);
* :func:`block_norm_bars` — per block pair spectral norms, outer vs functional term;
* :func:`eigen_spectrum` — sorted eigenvalues on a symmetric-log axis.

Each returns nothing and writes one PNG; callers pass plain tensors/arrays and labels.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["log_abs", "hessian_heatmap", "block_norm_bars", "eigen_spectrum"]


def log_abs(H, floor: float) -> np.ndarray:
    """``log10(max(|H|, floor))`` as a float64 numpy array."""
    A = np.abs(np.asarray(H, dtype=np.float64))
    return np.log10(np.maximum(A, floor))


def _draw_blocks(ax, names, sizes, vmin, vmax, data, title):
    im = ax.imshow(data, cmap="viridis", vmin=vmin, vmax=vmax, interpolation="antialiased")
    edges = np.cumsum([0] + list(sizes))
    for e in edges[1:-1]:
        ax.axhline(e - 0.5, color="white", ls="--", lw=0.8)
        ax.axvline(e - 0.5, color="white", ls="--", lw=0.8)
    centres = (edges[:-1] + edges[1:]) / 2 - 0.5
    ax.set_xticks(centres, names)
    ax.set_yticks(centres, names)
    ax.tick_params(length=0)
    ax.set_title(title)
    return im


def hessian_heatmap(path, panels, vmin: float, vmax: float, suptitle: str, note: str = "") -> None:
    """One row of ``log10|H|`` panels; ``panels`` is a list of ``(H, names, sizes, title)``.

    ``vmin``/``vmax`` are decades (shared by all panels, and by the caller across figures so
    that init and trained compare); entries below ``10**vmin`` are drawn at ``vmin``, which the
    figure says under the panels, followed by ``note``.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels) + 1.2, 6.0), squeeze=False)
    im = None
    for ax, (H, names, sizes, title) in zip(axes[0], panels):
        im = _draw_blocks(ax, names, sizes, vmin, vmax, log_abs(H, 10.0**vmin), title)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.85, label=r"$\log_{10}|H_{ij}|$")
    fig.suptitle(suptitle)
    floor = f"Entries below $10^{{{vmin:g}}}$, exact zeros included, are drawn in the lowest colour."
    fig.text(0.45, 0.1, floor + (" " + note if note else ""), ha="center", va="top", fontsize=9, wrap=True)
    fig.savefig(Path(path), dpi=150, bbox_inches="tight")
    plt.close(fig)


def block_norm_bars(path, groups: dict, labels: list[str], suptitle: str) -> None:
    """Grouped bars per block pair, log scale, one panel per entry of ``groups``.

    ``groups``: ``{panel title: {series name: [value per label]}}`` (e.g. series ``outer``,
    ``functional``, ``full``). Zero values are drawn at the axis floor.
    """
    n_panels = len(groups)
    fig, axes = plt.subplots(n_panels, 1, figsize=(max(8.0, 0.62 * len(labels) + 2), 3.4 * n_panels), squeeze=False)
    colours = {"full": "0.25", "outer": "tab:blue", "functional": "tab:orange"}
    allpos = [v for g in groups.values() for s in g.values() for v in s if v > 0]
    lo = 10 ** math.floor(math.log10(min(allpos))) if allpos else 1e-12
    hi = 10 ** math.ceil(math.log10(max(allpos))) if allpos else 1.0
    for ax, (title, series) in zip(axes[:, 0], groups.items()):
        x = np.arange(len(labels))
        width = 0.8 / len(series)
        for k, (name, vals) in enumerate(series.items()):
            v = np.maximum(np.asarray(vals, dtype=float), lo)
            ax.bar(x + (k - (len(series) - 1) / 2) * width, v, width, label=name, color=colours.get(name))
        ax.set_yscale("log")
        ax.set_ylim(lo, hi * 1.5)
        ax.set_xticks(x, labels, rotation=0)
        ax.set_ylabel(r"spectral norm $\|\cdot\|_2$")
        ax.set_title(title)
        ax.grid(axis="y", which="major", alpha=0.3)
        ax.legend(loc="upper left", fontsize=8, ncols=len(series))
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=150, bbox_inches="tight")
    plt.close(fig)


def eigen_spectrum(path, panels: dict, suptitle: str) -> None:
    """Sorted eigenvalues (descending) against their rank on a symmetric-log axis.

    ``panels``: ``{panel title: {series name: 1-D array of eigenvalues}}`` (the first word of a
    series name picks its colour: full, outer, functional); the linear zone of the axis spans
    six decades below the largest magnitude in the panel, and its width is in the y label (so
    eigenvalues drawn on the zero line can still be counted as non-zero by the caller).
    """
    colours = {"full": "0.1", "outer": "tab:blue", "functional": "tab:orange"}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels.items()):
        big = max(max(float(np.abs(np.asarray(v)).max()) for v in series.values()), 1e-300)
        for name, lam in series.items():
            lam = np.sort(np.asarray(lam, dtype=np.float64))[::-1]
            key = name.split(" ")[0]
            ax.plot(np.arange(1, len(lam) + 1), lam, lw=1.6 if key == "full" else 1.0, color=colours.get(key), label=name)
        lin = 10.0 ** (math.floor(math.log10(big)) - 6)
        ax.set_yscale("symlog", linthresh=lin)
        top = math.ceil(math.log10(big))
        decades = list(range(top, math.floor(math.log10(lin)), -2))
        ax.set_yticks([10.0**k for k in decades] + [0.0] + [-(10.0**k) for k in decades],
                      [f"$10^{{{k}}}$" for k in decades] + ["0"] + [f"$-10^{{{k}}}$" for k in decades])
        ax.set_ylim(-(10.0**top), 10.0**top)
        ax.axhline(0, color="0.6", lw=0.6)
        ax.set_xlabel("rank")
        ax.set_ylabel(f"eigenvalue (symmetric log; linear within ±{lin:.0e})")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=150, bbox_inches="tight")
    plt.close(fig)
