"""hvdx.throughput: per-phase throughput of a phased run and Table 4's scaling efficiency
(shi2021); single_rank_throughput runs on 2 x 2 in tests/test_dawnbench.py."""
import json

import pytest

from hvdx.phases import parse_phases
from hvdx.throughput import EpochTime, comm_shares, load_baseline, phase_throughput, scaling_efficiency, table


def test_an_epochs_throughput_leaves_out_its_first_step():
    """The first step of an epoch may trace the model (a new phase's shape): samples/s and
    step time are those of the steps after it, over all ranks."""
    t = EpochTime(steps=11, seconds=6.0, epoch_seconds=7.0, first_step_s=1.0)
    assert t.timed() == (10, 5.0) and t.step_s == 0.5
    assert t.samples_per_s(batch_size=32, ranks=4) == pytest.approx(10 * 32 * 4 / 5.0)
    assert EpochTime(1, 2.0, 2.5, 2.0).timed() == (1, 2.0)        # one step: it is all there is
    assert EpochTime(4, 2.0, 2.5, None).timed() == (4, 2.0)       # first step not seen


def epoch(e, phase, samples, communication="HiTopK"):
    return dict(epoch=e, phase=phase, communication=communication, samples_per_s=samples, step_s=1000 / samples)


def test_a_phases_throughput_is_the_median_of_its_epochs_after_the_first():
    phases = parse_phases("3x24@32,2x32@32,1x40@16")
    history = [epoch(0, 0, 100.0), epoch(1, 0, 300.0), epoch(2, 0, 200.0),
               epoch(3, 1, 50.0, "Hierarchical"), epoch(4, 1, 80.0, "Hierarchical")]
    rows = phase_throughput(history, phases)
    assert [r["phase"] for r in rows] == ["3x24@32", "2x32@32"]      # no epochs of the last phase yet
    assert rows[0]["epochs"] == [0, 1, 2] and rows[0]["communication"] == ["HiTopK"]
    assert rows[0]["samples_per_s"] == 250.0 and rows[0]["step_s"] == pytest.approx((1000 / 300 + 1000 / 200) / 2)
    assert rows[1]["samples_per_s"] == 80.0                         # epoch 3, the phase's first, left out
    one = phase_throughput([dict(epoch=0, phase=0, communication="HiTopK", samples_per_s=7.0, seconds=4.0,
                                 steps=2)], phases)
    assert one[0]["samples_per_s"] == 7.0 and one[0]["step_s"] == 2.0  # a phase of one epoch: that epoch
    comm_shares(rows, {"HiTopK": 1.0})
    assert rows[0]["comm_share"] == {"HiTopK": pytest.approx(1.0 / rows[0]["step_s"])}
    assert rows[1]["comm_share"] == {}


def test_scaling_efficiency_is_throughput_over_ranks_times_one_ranks():
    """Table 4's SE: samples/s on P ranks / (P x samples/s of one rank), per phase; phases
    the 1-rank figures do not cover get none."""
    phases = [{"phase": "3x24@32", "samples_per_s": 300.0}, {"phase": "1x40@16", "samples_per_s": 90.0}]
    scaling_efficiency(phases, 4, {"3x24@32": 100.0}, "test")
    assert phases[0]["scaling_efficiency"] == pytest.approx(0.75) and phases[0]["single_samples_per_s"] == 100.0
    assert phases[0]["se_source"] == "test"
    assert "scaling_efficiency" not in phases[1]


def test_baseline_json_is_a_one_rank_runs_summary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"ranks": 1, "phases": [{"phase": "3x24@32", "samples_per_s": 120.0}]}))
    assert load_baseline(str(path)) == {"3x24@32": 120.0}
    path.write_text(json.dumps({"ranks": 4, "phases": []}))
    with pytest.raises(ValueError, match="1-rank run"):
        load_baseline(str(path))


def test_the_table_has_a_line_per_phase_and_says_where_se_came_from():
    rows = [dict(phase="3x24@32", epochs=[0, 1, 2], communication=["HiTopK"], samples_per_s=1416.0, step_s=0.0904,
                 comm_share={"HiTopK": 0.42}),
            dict(phase="1x40@16", epochs=[5], communication=["Hierarchical"], samples_per_s=516.8, step_s=0.1238)]
    scaling_efficiency(rows[:1], 4, {"3x24@32": 504.2}, "5 steps per phase on each rank alone")
    lines = table(rows, ranks=4, nodes=2).splitlines()
    assert lines[0] == "per phase (2 nodes x 2 ranks; as shi2021 Table 4):"
    assert lines[1].split() == ["phase", "epochs", "strategy", "samples/s", "step", "ms", "comm", "share", "1",
                                "rank", "SE"]
    assert lines[2].split() == ["3x24@32", "3", "HiTopK", "1416.0", "90.4", "42%", "504.2", "70%"]
    assert lines[3].split() == ["1x40@16", "1", "Hierarchical", "516.8", "123.8", "-", "-", "-"]
    assert lines[4] == "  (SE = samples/s / (4 x 1 rank's); 1 rank's from 5 steps per phase on each rank alone)"
