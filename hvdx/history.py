"""The per-epoch history of a phased training run (`hvdx.phases`): what each epoch trained
with (phase, resolution, batch, strategy, learning rate), how fast (`hvdx.throughput`), its
metrics; when a target metric was first met; the curves as a PNG.

    history = []
    model.fit(..., callbacks=[hvdx.keras.callbacks.MetricAverageCallback(), hvdx.callbacks.EpochLog(phases, ranks, history)])
    reached = first_reaching(history, "val_top1", 0.9)
    plot_curves(history, phases, "curves.png", marks={13: "HiTopK -> 2DTAR"})
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from hvdx.phases import Phase, phase_start

__all__ = ["first_reaching", "plot_curves"]


def first_reaching(history: Sequence[dict], metric: str, goal: float) -> Optional[dict]:
    """The first epoch's record whose `metric` is >= `goal`, or None."""
    return next((h for h in history if h.get(metric, -1) >= goal), None)


def plot_curves(history: Sequence[dict], phases: Sequence[Phase], path: str, title: str = "",
                marks: Optional[Dict[int, str]] = None) -> None:
    """Writes a PNG to `path`: loss (log scale; train and validation) and top-1 / top-5
    (train and validation, the keys the history has) per epoch, the phases shaded, a dashed
    line before each epoch of `marks` ({epoch: label}, e.g. a strategy switch). Needs
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] + 1 for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["loss"] for h in history], "o-", label="train")
    if "val_loss" in history[0]:
        ax_loss.plot(epochs, [h["val_loss"] for h in history], "o-", label="validation")
    for key in ("top1", "top5", "val_top1", "val_top5"):
        if key in history[0]:
            ax_acc.plot(epochs, [h[key] for h in history], "o-", label=key)
    for ax in (ax_loss, ax_acc):
        for i, phase in enumerate(phases):
            start = phase_start(phases, i)
            ax.axvspan(start + 0.5, start + phase.epochs + 0.5, alpha=0.08 * (1 + i % 2), color="grey")
        for epoch, label in (marks or {}).items():
            ax.axvline(epoch + 0.5, color="red", ls="--", lw=1, label=label)
        ax.set_xlabel("epoch")
        ax.legend()
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    ax_acc.set_ylabel("accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
