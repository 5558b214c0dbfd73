"""The DAWNBench recipe, examples/dawnbench.py (shi2021 sec. 5.6, Table 4), run as a user runs
it, through its main(): its presets and flags (`--dry-run` prints the plan); on 2 nodes x 2
ranks (tests/multirank/check_dawnbench.py in the suite's 2x2 launch) the smoke run, the
HiTopK -> 2DTAR switch at the configured epoch, resolution and batch per phase, resume from a
mid-run checkpoint, the checkpoints kept, and Table 4's SE per phase. Its parts are the
library's and have their own tests: test_phases.py, test_augment.py, test_batches.py,
test_throughput.py, test_checkpoints.py, test_history.py."""
import json
import os

import pytest

from hvdx.phases import parse_phases, phase_at
from tests import harness, suite
from tests.multirank.check_dawnbench import load_script

dawnbench = load_script()


def plan(*flags):
    """What the script would run with `flags` (`--dry-run`)."""
    return dawnbench.main([*flags, "--dry-run"])


def test_imagenet_preset_is_the_papers_recipe():
    """shi2021 Table 4: 13 epochs at 96 px, 11 at 128, 3 at 224 (local batch 256), 1 at 288
    (batch 128); HiTopK for the first 13 epochs, then 2DTAR; target 93 % top-5."""
    p = plan("--preset", "imagenet")
    config, epochs = p["config"], p["epochs"]
    assert config["phases"] == ["13x96@256", "11x128@256", "3x224@256", "1x288@128"]
    assert len(epochs) == 28 and [e["epoch"] for e in epochs] == list(range(28))
    assert [epochs[e]["communication"] for e in (0, 12, 13, 27)] == ["hitopk", "hitopk", "hierarchical",
                                                                     "hierarchical"]
    assert config["target"] == ("val_top5", 0.93) and config["model"] == "resnet50" and config["num_classes"] == 1000
    assert epochs[12]["phase"] == 0 and epochs[13]["phase"] == 1 and epochs[27]["phase"] == 3
    assert [q["epochs"] for q in p["phases"]] == [[0, 12], [13, 23], [24, 26], [27, 27]]
    with pytest.raises(ValueError, match="past the last phase"):
        phase_at(parse_phases(",".join(config["phases"])), 28)


def test_flags_override_the_preset():
    config = plan("--preset", "demo", "--phases", "2x16@8,1x24@4", "--switch-epoch", "1", "--lr", "3",
                  "--synthetic", "--out", "/tmp/x")["config"]
    assert config["phases"] == ["2x16@8", "1x24@4"]
    assert (config["switch_epoch"], config["lr"], config["synthetic"], config["out"]) == (1, 3.0, True, "/tmp/x")
    assert config["demo_data"] and config["num_classes"] == 10  # the rest stays the preset's
    with pytest.raises(ValueError, match="switch-epoch"):
        plan("--preset", "demo", "--switch-epoch", "99")


def test_default_output_is_outside_the_checkout():
    assert plan("--preset", "demo")["config"]["out"] == os.path.join(os.path.expanduser("~"), ".cache", "hvdx",
                                                                     "dawnbench", "demo")


def test_dry_run_prints_the_plan_as_json(capsys):
    p = plan("--preset", "smoke")
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(p))
    assert [q["phase"] for q in p["phases"]] == ["2x8@4", "1x12@2"]


def test_imagenet_preset_crops_from_a_cache_larger_than_the_phase():
    p = plan("--preset", "imagenet")
    assert p["config"]["augment"] == "rrc" and p["config"]["crop_area"] == 0.08
    assert [q["source_resolution"] for q in p["phases"]] == [120, 160, 280, 360]  # 1.25 x
    demo = plan("--preset", "demo")   # digits: no mirror, at least half the image
    assert (demo["config"]["augment"], demo["config"]["crop_area"]) == ("rrc-noflip", 0.5)
    assert (demo["phases"][0]["resolution"], demo["phases"][0]["source_resolution"]) == (24, 30)
    shift = plan("--preset", "demo", "--augment", "shift")["phases"][0]
    assert shift["source_resolution"] == 24             # pad-and-crop reads the phase's resolution
    with pytest.raises(ValueError, match="crop-source"):
        plan("--preset", "imagenet", "--crop-source", "0.5")


def test_baseline_json_and_se_steps_are_flags(tmp_path):
    path = str(tmp_path / "summary.json")
    config = plan("--preset", "demo", "--baseline-json", path, "--se-steps", "0")["config"]
    assert config["baseline_json"] == path and config["se_steps"] == 0


def test_checkpoints_kept_default_to_the_newest_three():
    assert plan("--preset", "imagenet")["config"]["keep_checkpoints"] == 3
    assert plan("--preset", "imagenet", "--keep-checkpoints", "0")["config"]["keep_checkpoints"] == 0  # all
    with pytest.raises(ValueError, match="keep-checkpoints -1"):
        plan("--preset", "imagenet", "--keep-checkpoints", "-1")


# -- 2 nodes x 2 ranks (tests/multirank/check_dawnbench.py) --------------------------------

@suite.runs(suite.check("dawnbench.resume", "2x2", timeout=400),
            *([suite.check("dawnbench.resume", "keras3:2x2", timeout=400)] if harness.HAS_KERAS3 else []))
def test_recipe_switches_resizes_and_resumes_exactly_on_2x2(ranks):
    """On both Keras: 2x2 has tf.keras as Keras 2 (the suite's environment), keras3:2x2 as
    TensorFlow makes it (Keras 3), where the recipe's model, LARS, schedule and checkpoints
    are Keras 3's."""
    print(json.dumps(ranks[0], indent=1))
    keras3 = ranks.check.topology.startswith("keras3:")
    assert all(d["keras"] == ("3" if keras3 else "2") for d in ranks.values()), ranks[0]["keras"]
    for rank, data in ranks.items():
        expected = [  # smoke: phases 2x8@4, 1x12@2, switch at epoch 2
            {"epoch": 0, "phase": 0, "resolution": 8, "batch_size": 4, "communication": "HiTopK", "steps": 2},
            {"epoch": 1, "phase": 0, "resolution": 8, "batch_size": 4, "communication": "HiTopK", "steps": 2},
            {"epoch": 2, "phase": 1, "resolution": 12, "batch_size": 2, "communication": "Hierarchical",
             "steps": 2}]
        assert data["full"] == expected, rank
        assert data["stopped"] == expected[:1], rank     # pre-empted after epoch 1
        assert data["resumed"] == expected, rank         # the resumed run's history continues the first's
        # the checkpoint carried HiTopK's error-feedback residuals (non-zero: they matter) ...
        assert data["residuals_at_checkpoint"] and all(v > 0 for v in data["residuals_at_checkpoint"].values())
        # ... and the resumed run's checkpoint after the last HiTopK epoch (one it trained after the
        # resume) is the uninterrupted run's, bit for bit: weights, LARS' momenta, residuals, steps
        assert data["checkpoint_differences"] == [], f"rank {rank}: {data['checkpoint_differences']}"
        # After the switch to 2DTAR the weights agree to rounding: Horovod's fused allreduce over the
        # 4 ranks (its flat path for small buckets) sums in an order that depends on what its cycle
        # fused. Rounding is ~1e-9 of the weights; the last epoch moved them by far more than 1e-3,
        # the scale a lost piece of state would show at.
        assert data["weights_relative_difference"] <= 1e-6, (rank, data["weights_relative_difference"])
        assert data["last_epoch_relative_change"] > 1e-3, (rank, data["last_epoch_relative_change"])
        # --keep-checkpoints 2: the newest two of each rank's, also across a resume
        assert data["checkpoints_kept"] == {"full": [2, 3], "stopped": [1], "resumed": [2, 3]}, rank
    # Table 4's SE per phase: the run's samples/s over 4 x one rank's, timed on every rank alone
    for p in ranks[0]["phases"]:
        assert p["single_samples_per_s"] > 0
        assert p["scaling_efficiency"] == pytest.approx(p["samples_per_s"] / (4 * p["single_samples_per_s"]))
    # every rank the same trainable weights (batch-norm's moving statistics are each rank's own)
    assert len({d["trainable_norm"] for d in ranks.values()}) == 1
