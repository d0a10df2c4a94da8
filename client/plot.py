"""Attention heatmaps: one panel per head, drawn with matplotlib's Agg canvas (no display needed).

matplotlib is the optional `plot` extra (`pip install attnserve[plot]`); it is imported here only.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def plot_attention(attn_probs: np.ndarray, path: str | Path, *, item: int = 0, title: str = "") -> Path:
    """Draw `attn_probs[item]` (heads, lq, lk) as a grid of heatmaps into a PNG at `path`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'attnserve[plot]'") from None
    probs = np.asarray(attn_probs)
    if probs.ndim != 4:
        raise ValueError(f"attn_probs: expected shape (batch, heads, lq, lk), got {probs.shape}")
    if not 0 <= item < probs.shape[0]:
        raise ValueError(f"item {item} is out of range for a batch of {probs.shape[0]}")
    heads, lq, lk = probs.shape[1:]
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    # Figure + Agg canvas directly: no pyplot, so no global backend to switch or figures to leak.
    figure = Figure(figsize=(3.2 * cols + 0.8, 3.0 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False)
    vmax = float(probs[item].max()) or 1.0  # one colour scale for every head
    image = None
    for head in range(rows * cols):
        ax = axes[head // cols][head % cols]
        if head >= heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(probs[item, head], vmin=0.0, vmax=vmax, cmap="viridis", aspect="auto",
                          interpolation="nearest")
        ax.set_title(f"head {head}")
        ax.set_xlabel(f"key position (0..{lk - 1})")
        ax.set_ylabel(f"query position (0..{lq - 1})")
    if image is not None:
        figure.colorbar(image, ax=axes, label="attention probability", shrink=0.9)
    figure.suptitle(title or f"attention of item {item}")
    path = Path(path)
    figure.savefig(path, format="png", dpi=100)
    return path
