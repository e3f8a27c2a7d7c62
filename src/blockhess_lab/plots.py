"""Figure helpers for the experiment commands (matplotlib, Agg backend: no display needed).

* :func:`hessian_heatmap` — ``log10|H|`` with dashed block boundaries and block labels
  (the paper's Figs. 3–4);
* :func:`block_norm_bars` — per block pair spectral norms, outer vs functional term;
* :func:`eigen_spectrum` — sorted eigenvalues on a symmetric-log axis;
* :func:`norm_grid` — ``log10`` of a norm per block pair as a matrix of cells (a model's parameter groups);
* :func:`training_curves` — values per group against the training step (the paper's Fig. 5);
* :func:`block_eigenvalues` — each block's top eigenvalues, one panel per Hessian part;
* :func:`densities` — spectral densities with their error bands, one panel per block;
* :func:`trace_bars` — traces with error bars per block and part;
* :func:`eigenvalue_trajectories` — top eigenvalues against the training step per block, and products counts;
* :func:`distance_matrix` — a symmetric matrix of distances between named items, as coloured cells;
* :func:`per_module_metric` — one metric per module, a line per method, one panel per reference.

Each returns nothing and writes one PNG; callers pass plain tensors/arrays and labels.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["log_abs", "hessian_heatmap", "block_norm_bars", "eigen_spectrum", "norm_grid", "training_curves",
           "block_eigenvalues", "densities", "trace_bars", "eigenvalue_trajectories", "distance_matrix", "per_module_metric"]


def log_abs(H, floor: float) -> np.ndarray:
    """``log10(max(|H|, floor))`` as a float64 numpy array."""
    A = np.abs(np.asarray(H, dtype=np.float64))
    return np.log10(np.maximum(A, floor))


NARROW = 0.03  # a block narrower than this fraction of its axis is labelled on the opposite side


def _ticks(ax, axis: str, names, sizes, small: bool):
    """Dashed block boundaries and one label per block, at its centre; the labels of narrow blocks
    (:data:`NARROW`, e.g. a bias next to its weight) go on the opposite side (top, right) so that
    neighbours do not overlap."""
    edges = np.cumsum([0] + list(sizes))
    centres = (edges[:-1] + edges[1:]) / 2 - 0.5
    for e in edges[1:-1]:
        (ax.axvline if axis == "x" else ax.axhline)(e - 0.5, color="white", ls="--", lw=0.6 if small else 0.8)
    narrow = np.asarray(sizes) < NARROW * edges[-1]
    if narrow.all():
        narrow[:] = False
    kw = {"fontsize": 7} if small else {}
    far = [(c, n) for c, n, w in zip(centres, names, narrow) if w]
    near = [(c, n) for c, n, w in zip(centres, names, narrow) if not w]
    if axis == "x":
        ax.set_xticks([c for c, _ in near], [n for _, n in near], rotation=90 if small else 0, **kw)
    else:
        ax.set_yticks([c for c, _ in near], [n for _, n in near], **kw)
    if far:
        sec = ax.secondary_xaxis("top") if axis == "x" else ax.secondary_yaxis("right")
        if axis == "x":
            sec.set_xticks([c for c, _ in far], [n for _, n in far], rotation=90 if small else 0, **kw)
        else:
            sec.set_yticks([c for c, _ in far], [n for _, n in far], **kw)
        sec.tick_params(length=0)


def _draw_blocks(ax, rows, cols, vmin, vmax, data, title):
    im = ax.imshow(data, cmap="viridis", vmin=vmin, vmax=vmax, interpolation="antialiased")
    small = max(len(rows[0]), len(cols[0])) > 6  # many groups, some narrow: smaller labels, upright on x
    _ticks(ax, "y", *rows, small)
    _ticks(ax, "x", *cols, small)
    ax.tick_params(length=0)
    ax.set_title(title)
    return im


def hessian_heatmap(path, panels, vmin: float, vmax: float, suptitle: str, note: str = "") -> None:
    """One row of ``log10|H|`` panels; ``panels`` is a list of ``(H, names, sizes, title)`` (a
    square matrix of blocks) or ``(H, row_names, row_sizes, title, col_names, col_sizes)`` (a
    rectangular part of one, e.g. cross-layer blocks).

    ``vmin``/``vmax`` are decades (shared by all panels, and by the caller across figures so
    that init and trained compare); entries below ``10**vmin`` are drawn at ``vmin``, which the
    figure says under the panels, followed by ``note``.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels) + 1.2, 6.0), squeeze=False)
    im = None
    for ax, (H, names, sizes, title, *cols) in zip(axes[0], panels):
        cols = tuple(cols) if cols else (names, sizes)
        im = _draw_blocks(ax, (names, sizes), cols, vmin, vmax, log_abs(H, 10.0**vmin), title)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.85, label=r"$\log_{10}|H_{ij}|$")
    fig.suptitle(suptitle)
    floor = f"Entries below $10^{{{vmin:g}}}$, exact zeros included, are drawn in the lowest colour."
    fig.text(0.45, 0.1 if len(panels[0][1]) <= 6 else 0.05, floor + (" " + note if note else ""), ha="center", va="top",
             fontsize=9, wrap=True)
    fig.savefig(Path(path), dpi=150, bbox_inches="tight")
    plt.close(fig)


def norm_grid(path, panels: dict, labels: list[str], ncols: int, suptitle: str) -> None:
    """``log10`` of a norm per block pair, one square matrix per panel (``{title: (k, k) array}``,
    rows and columns ``labels``), ``ncols`` panels a row, one colour scale; a zero norm is drawn
    blank and each cell carries its ``log10`` (one decimal)."""
    mats = list(panels.values())
    pos = [float(v) for m in mats for v in np.asarray(m).ravel() if v > 0]
    lo, hi = (math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))) if pos else (-1, 0)
    nrows = math.ceil(len(panels) / ncols)
    k = len(labels)
    side = 0.42 * k + 1.2
    fig, axes = plt.subplots(nrows, ncols, figsize=(side * ncols + 1.2, side * nrows), squeeze=False)
    im = None
    for ax, (title, M) in zip(axes.ravel(), panels.items()):
        M = np.asarray(M, dtype=np.float64)
        L = np.where(M > 0, np.log10(np.where(M > 0, M, 1.0)), np.nan)
        im = ax.imshow(L, cmap="magma", vmin=lo, vmax=hi)
        for i in range(k):
            for j in range(k):
                if np.isfinite(L[i, j]):
                    ax.text(j, i, f"{L[i, j]:.1f}", ha="center", va="center", fontsize=5.5,
                            color="white" if L[i, j] < (lo + hi) / 2 else "black")
        ax.set_xticks(range(k), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(k), labels, fontsize=7)
        ax.tick_params(length=0)
        ax.set_title(title, fontsize=9)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label=r"$\log_{10}\|H_{ab}\|_F$")
    fig.suptitle(suptitle)
    fig.savefig(Path(path), dpi=150, bbox_inches="tight")
    plt.close(fig)


def training_curves(path, steps, panels: dict, suptitle: str, log: tuple = ()) -> None:
    """Curves against the training step, one panel per entry of ``panels``
    (``{title: {series: [value per step]}}``), markers at the steps; the panels whose titles are in
    ``log`` on a log y axis."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.2), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels.items()):
        for name, vals in series.items():
            ax.plot(steps, vals, marker="o", ms=3, lw=1.3, label=name)
        if title in log:
            ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(suptitle)
    fig.tight_layout()
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


PART_COLOURS = {"full": "0.15", "outer": "tab:blue", "functional": "tab:orange"}


def _symlog(ax, values, axis: str = "y") -> None:
    """A symmetric-log axis whose linear zone starts at the decade of the smallest non-zero ``|value|``,
    at most six decades below the largest (``1`` where every value is zero)."""
    mags = [abs(float(v)) for v in values if float(v) != 0.0]
    if mags:
        lin = 10.0 ** max(math.floor(math.log10(min(mags))), math.floor(math.log10(max(mags))) - 6)
    else:  # every value exactly zero (e.g. a part that is zero): any linear zone shows them
        lin = 1.0
    (ax.set_yscale if axis == "y" else ax.set_xscale)("symlog", linthresh=lin)
    ax.axhline(0, color="0.6", lw=0.6) if axis == "y" else ax.axvline(0, color="0.6", lw=0.6)


def block_eigenvalues(path, panels: dict, suptitle: str) -> None:
    """Each block's eigenvalues as dots above its label, one panel per part; ``panels``:
    ``{part: {block label: (eigenvalues, method)}}``; method ``"dense"`` is drawn as an open square,
    Lanczos as a dot; symmetric-log y axis."""
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, 0.5 * max(len(p) for p in panels.values()) + 2) * len(panels),
                                                     4.6), squeeze=False)
    for ax, (part, blocks) in zip(axes[0], panels.items()):
        allv = []
        for i, (name, (lam, method)) in enumerate(blocks.items()):
            lam = np.asarray(lam, dtype=np.float64)
            allv += list(lam)
            if method == "dense":
                ax.scatter(np.full(lam.shape, i), lam, s=26, facecolors="none", edgecolors=PART_COLOURS.get(part), lw=1.0)
            else:
                ax.scatter(np.full(lam.shape, i), lam, s=14, color=PART_COLOURS.get(part))
        _symlog(ax, allv)
        ax.set_xticks(range(len(blocks)), list(blocks), rotation=90, fontsize=7)
        ax.set_title(part)
        ax.set_ylabel("eigenvalue (symmetric log)")
        ax.grid(alpha=0.3)
    methods = {method for blocks in panels.values() for _, method in blocks.values()}
    if methods - {"dense"}:
        axes[0][0].scatter([], [], s=14, color="0.3", label="Lanczos")
    if "dense" in methods:
        axes[0][0].scatter([], [], s=26, facecolors="none", edgecolors="0.3", label="dense eigh (small block)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=130, bbox_inches="tight")
    plt.close(fig)


def densities(path, panels: dict, suptitle: str, ncols: int = 4, floors: dict | None = None) -> None:
    """Spectral densities, one panel per block; ``panels``: ``{block label: {part: (grid, density,
    stderr)}}``; a band of ±1 standard error; log y axis from the panel's floor: ``1e-4`` of its peak,
    or lower where ``floors`` (``{block label: value}``, e.g. a tenth of one eigenvalue's broadened
    peak ``1/(n σ √(2π))``) asks, so that single outlying eigenvalues of a large block show. The title
    wraps to the figure's width."""
    nrows = math.ceil(len(panels) / ncols)
    ncols = min(ncols, len(panels))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.8 * nrows), squeeze=False)
    for ax, (name, parts) in zip(axes.ravel(), panels.items()):
        peak = max(float(np.max(d)) for _, d, _ in parts.values())
        floor = 1e-4 * peak if peak > 0 else 1e-12
        if floors and name in floors and 0 < floors[name] < floor:
            floor = floors[name]
        for part, (grid, dens, se) in parts.items():
            grid, dens, se = (np.asarray(a, dtype=np.float64) for a in (grid, dens, se))
            ax.plot(grid, np.maximum(dens, floor), color=PART_COLOURS.get(part), lw=1.1, label=part)
            ax.fill_between(grid, np.maximum(dens - se, floor), np.maximum(dens + se, floor), color=PART_COLOURS.get(part),
                            alpha=0.2, lw=0)
        ax.set_yscale("log")
        ax.set_ylim(floor, peak * 2)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(4))  # a spectrum spanning 1e-4 labels in scientific notation, apart
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        ax.xaxis.get_offset_text().set_fontsize(7)
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("eigenvalue")
    fig.supylabel("density")
    fig.suptitle(textwrap.fill(suptitle, max(40, int(16 * 3.6 * ncols))), fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=130, bbox_inches="tight")
    plt.close(fig)


def trace_bars(path, panels: dict, suptitle: str) -> None:
    """Traces per block, grouped by part; ``panels``: ``{part: {block label: (value, stderr)}}``;
    error bars of ±2 standard errors; symmetric-log y axis."""
    parts = list(panels)
    blocks = list(next(iter(panels.values())))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.55 * len(blocks) * len(parts) ** 0.5 + 2), 4.2))
    width = 0.8 / len(parts)
    allv = []
    for j, part in enumerate(parts):
        vals = np.array([panels[part][b][0] for b in blocks], dtype=np.float64)
        err = np.array([2 * panels[part][b][1] for b in blocks], dtype=np.float64)
        allv += list(np.abs(vals) + err)
        x = np.arange(len(blocks)) + (j - (len(parts) - 1) / 2) * width
        ax.bar(x, vals, width, yerr=err, color=PART_COLOURS.get(part), label=part, capsize=2,
               error_kw={"lw": 0.8})
    _symlog(ax, allv)
    ax.set_xticks(range(len(blocks)), blocks, rotation=90, fontsize=7)
    ax.set_ylabel("trace (symmetric log)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=130, bbox_inches="tight")
    plt.close(fig)


def eigenvalue_trajectories(path, x, panels: dict, counts: dict, count_x, xlabel: str, suptitle: str,
                            ticks=None, ncols: int = 4) -> None:
    """Top eigenvalues against ``x`` (the training step), one panel per block (``{block label: {part:
    [eigenvalues per point]}}``, one line per rank, the part's colour), and a last panel with the
    products counts per point (``{series name: [count per point of count_x]}``); ``ticks``: labels for
    ``x`` (e.g. checkpoint names)."""
    n = len(panels) + 1
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.8 * nrows), squeeze=False)
    flat = axes.ravel()
    for ax, (name, parts) in zip(flat, panels.items()):
        allv = []
        for part, rows in parts.items():
            lam = np.asarray(rows, dtype=np.float64)  # (points, k)
            allv += list(lam.ravel())
            for r in range(lam.shape[1]):
                ax.plot(x, lam[:, r], color=PART_COLOURS.get(part), lw=1.4 if r == 0 else 0.8, marker="o", ms=2,
                        label=part if r == 0 else None)
        _symlog(ax, allv)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ticks is not None:
            ax.set_xticks(x, ticks, rotation=90, fontsize=6)
    flat[0].legend(fontsize=7)
    ax = flat[len(panels)]
    for i, (name, vals) in enumerate(counts.items()):
        ax.plot(count_x, vals, marker="o" if i == 0 else "s", ms=3, lw=1.2, ls="-" if i == 0 else "--",
                label=name)  # the second dashed: two equal series stay visible
    ax.set_title("Lanczos products per point", fontsize=9)
    ax.set_ylim(bottom=0)  # from zero: a saving of a few per cent looks like one
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if ticks is not None:
        ax.set_xticks(count_x, ticks[1:], rotation=90, fontsize=6)
    for ax in flat[n:]:
        ax.axis("off")
    fig.supxlabel(xlabel)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=130, bbox_inches="tight")
    plt.close(fig)


def per_module_metric(path, rows: list[str], panels: dict, ylabel: str, suptitle: str, log: bool = False) -> None:
    """One metric per module: ``panels`` ``{reference: {method: [value per row]}}`` (NaN where a method does
    not cover the row), a line with markers per method, one panel per reference; log y axis with ``log``."""
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 0.45 * len(rows) + 2) * len(panels) ** 0.6, 4.4),
                             squeeze=False, sharey=True)
    for ax, (title, methods) in zip(axes[0], panels.items()):
        for method, values in methods.items():
            ax.plot(range(len(rows)), np.asarray(values, dtype=np.float64), marker="o", ms=3, lw=1, label=method)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), rows, rotation=90, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=130, bbox_inches="tight")
    plt.close(fig)


def distance_matrix(path, labels: list[str], D, title: str) -> None:
    """A square matrix ``D`` (``len(labels)`` rows, e.g. Jensen–Shannon distances) as coloured cells from 0 to its
    largest entry, each row and column labelled, a colour bar beside it."""
    D = np.asarray(D, dtype=np.float64)
    n = len(labels)
    fig, ax = plt.subplots(figsize=(max(4.5, 0.32 * n + 2.5), max(4.0, 0.32 * n + 1.8)))
    im = ax.imshow(D, cmap="viridis", vmin=0.0, vmax=max(float(D.max()), 1e-12))
    ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(n), labels, fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=130, bbox_inches="tight")
    plt.close(fig)
