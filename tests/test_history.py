"""hvdx.history: the per-epoch history of a phased run (EpochLog runs on 2 x 2 in
tests/test_dawnbench.py), the first epoch that met a target, the curves."""
from hvdx.history import first_reaching, plot_curves
from hvdx.phases import parse_phases

HISTORY = [dict(epoch=e, loss=2.0 / (e + 1), val_loss=2.5 / (e + 1), top1=0.3 + 0.1 * e, val_top1=v)
           for e, v in enumerate([0.1, 0.85, 0.93, 0.91, 0.97])]


def test_the_target_is_met_by_the_first_epoch_reaching_it():
    assert first_reaching(HISTORY, "val_top1", 0.9)["epoch"] == 2
    assert first_reaching(HISTORY, "val_top1", 0.99) is None
    assert first_reaching(HISTORY, "val_top5", 0.5) is None          # a metric the run did not log


def test_the_curves_are_a_png(tmp_path):
    path = tmp_path / "curves.png"
    plot_curves(HISTORY, parse_phases("3x24@32,2x32@32"), str(path), "title", marks={3: "HiTopK -> 2DTAR"})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
