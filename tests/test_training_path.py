"""A training path users can trust: each defect a user hit, checked on 2 nodes x 2 ranks.

The checks of tests/multirank/check_training_path.py run on every rank (in the suite's 2x2
launch); each test below asserts one claim on what the ranks returned.
"""
import pytest

from tests import suite

SPARSE = ("hitopk", "sparse_allgather")


def on_2x2(check: str):
    """The test asserts on CHECKS[check] of tests/multirank/check_training_path.py, on 2x2."""
    return suite.runs(suite.check(f"training_path.{check}", "2x2"))


@pytest.mark.second_stack
@on_2x2("mixed_precision")
def test_mixed_precision_does_not_hang_and_ranks_stay_identical(ranks):
    """1. Keras' loss scaler decides on the averaged gradients: rank 1's overflows skip the
    step on every rank, and weights and loss scale stay identical."""
    for result in ranks.every():
        for strategy, r in result.items():
            assert r["weights_equal"] and r["scale_equal"] and r["finite"], (strategy, r)
            assert r["scale"] < 2 ** 15, f"{strategy}: no overflow happened, the test proves nothing: {r}"
        assert result["hitopk"]["residuals_finite"]


@on_2x2("non_finite")
def test_a_non_finite_step_is_seen_skipped_and_forgotten(ranks):
    """2. An Inf reaches that step's output (for the loss scaler), leaves every residual as
    it was, and later steps are finite again, through every strategy and wire type."""
    for result in ranks.every():
        for label, r in result.items():
            if "1e5" in label:  # a finite value too large for float16 arrives finite and close
                assert r["finite"] and abs(r["value"] - 1e5) / 1e5 < 1e-3, (label, r)  # every rank sends 1e5
                continue
            assert r["inf_reaches_output"] and r["residuals_untouched"] and r["finite_after"], (label, r)
            assert r["has_residuals"] == label.startswith(SPARSE), (label, r)


@on_2x2("loss_scaled_tape")
def test_custom_loop_with_loss_scaling_keeps_training(ranks):
    """2. A custom loop with dynamic loss scaling and HiTopK: the overflow of step 3 is skipped
    everywhere, the scale halves, the residuals follow the scale, training goes on."""
    for r in ranks.every():
        assert r["applied"] == 11, r
        assert r["scales"][3] == r["scales"][2] / 2, r
        assert r["stored_scale"] == r["scales"][-1], r
        assert r["weights_equal"], r


@on_2x2("two_models")
def test_residuals_belong_to_their_model(ranks):
    """3. Two models of equal size with tapes of equal options: B (gradient 0) gets 0."""
    for r in ranks.every():
        assert r["b_grad_max"] == 0.0 and r["residual_sets"] == 2, r


@on_2x2("mismatches")
@pytest.mark.parametrize("case,needle", [("none_gradient", "rank 1: fused="), ("length", "rank 2: gradients="),
                                         ("density", "rank 3: strategy=HiTopK(density=0.02"),
                                         ("strategy", "rank 1: strategy=Hierarchical()"),
                                         ("steps", "steps per epoch=4 (rank 0: 5)")])
def test_ranks_that_disagree_fail_clearly_on_every_rank(ranks, case, needle):
    """4. Every rank raises RankMismatchError within seconds, naming the rank and the field."""
    for r in ranks.every():
        assert r[case]["raised"], r[case]
        assert needle in r[case]["message"], r[case]["message"]
        assert r[case]["seconds"] < 30, r[case]


@pytest.mark.second_stack
@on_2x2("checkpoints")
@pytest.mark.parametrize("fmt", ["keras", "savedmodel", "h5", "checkpoint"])
@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_checkpoints_keep_optimizer_state_and_never_mix_residuals(ranks, fmt, kind):
    """5. Every format restores the optimizer's state; each rank gets its own residual back
    from its own file; from rank 0's file only rank 0 does, the others start from zero.
    (.h5 stores no residuals: every rank starts from zero.)"""
    for rank, result in enumerate(ranks.every()):
        for who in ("own", "rank0"):
            r = result[f"{fmt}/{kind}/{who}"]
            assert r["type"] == "DistributedOptimizer" and r["iterations"] and r["inner_state"], (rank, who, r)
            assert r["nonzero_saved"], r
            if fmt == "h5":
                assert r["zero_residual"], (rank, who, r)
            elif who == "own" or rank == 0:
                assert r["own_residual"], (rank, who, r)
            else:
                assert r["zero_residual"] and not r["own_residual"], (rank, who, r)
    for rank in (1, 2, 3):  # the ranks that got rank 0's residual said so
        assert f"rank {rank} starts this residual from zero" in ranks.output, ranks.rank_output(rank)


@on_2x2("horovod_options")
def test_horovod_options_match_horovod(ranks):
    """6. Each Horovod option gives Horovod's numbers (dense, and HiTopK at density 1)."""
    for r in ranks.every():
        mismatched = [k for k, v in r.items() if "/" in k and not k.startswith("local_var/") and v is not True]
        assert not mismatched, mismatched
        assert r["name_positional"] and r["strategy_as_name_rejected"]
        assert r["local_var"] and r["momentum_reachable"] and r["tape_wraps"]
        assert r["float64"] == {"dtype": "float64", "exact": True}
    assert all(ranks[rank]["process_set"] for rank in (0, 1))


@on_2x2("defaults_and_errors")
def test_default_is_lossless_and_bad_options_fail_at_construction(ranks):
    """7. Dense averaging by default; contradictory options are rejected with a message."""
    r = ranks[0]
    assert r["default"] == "Allreduce"
    assert "dense and lossless" in r["density_with_dense"]
    assert "density must be a number in (0, 1]" in r["density_zero"]
    assert "configure the instance itself" in r["instance_with_options"]
    assert "Adasum" in r["adasum_sparse"]
    assert "integer" in r["mstopk_fractional_k"]
    assert "tf.GradientTape to wrap" in r["tape_persistent_positional"]
    assert abs(r["numpy_density"] - 0.05) < 1e-6
    assert r["config_json"] and r["from_config_pure"]


@on_2x2("small_things")
def test_small_things_users_hit(ranks):
    """8. No gradients, unknown shapes, Embedding under mixed precision, the bucket cap."""
    for r in ranks.every():
        assert all(r.values()), r
