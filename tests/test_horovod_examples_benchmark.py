"""benchmarks/horovod_examples.py changes Horovod's examples only where its docstring says
(every change applies exactly once, the rest of the file is Horovod's), the seeded digits
helper reports the test accuracy, and the summary pairs each method's seeds with Horovod's
(made-up numbers). The launches themselves are the examples' runs in test_horovod_upstream."""
import json
import py_compile

import numpy as np
import pytest

from benchmarks import horovod_examples as hx
from tests.test_horovod_upstream import UPSTREAM


@pytest.mark.parametrize("script", sorted(hx.SCRIPTS))
@pytest.mark.parametrize("method", hx.METHODS)
def test_each_run_is_horovods_example_with_the_listed_changes_only(tmp_path, script, method):
    path = hx.write_script(script, method, tmp_path, epochs=2, steps_per_epoch=7)
    py_compile.compile(str(path), doraise=True)
    text = path.read_text()
    for old, new in reversed(hx.changes(script, method, 2, 7)):
        text = text.replace(new, old)
    assert text == (UPSTREAM / "horovod" / hx.SCRIPTS[script]).read_text()
    written = path.read_text()
    assert ("import hvdx" in written) == (method != "horovod")
    assert "digits_as_mnist.seed(hvd.rank())" in written and "digits_as_mnist.report(mnist_model" in written
    assert ("steps_per_epoch=7" in written and "epochs=2" in written) if script == "keras" else \
        "dataset.take(14)" in written
    assert (tmp_path / "digits_as_mnist.py").exists()


def test_a_change_that_no_longer_applies_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hx, "SEED", ("    hvd.init(42)\n", "x"))
    with pytest.raises(ValueError, match="tensorflow2_mnist.py: expected"):
        hx.write_script("tape", "horovod", tmp_path, 1, 1)


def test_digits_helper_seeds_and_reports_rank_zeros_test_accuracy(tmp_path, monkeypatch):
    import sys

    import tensorflow as tf

    monkeypatch.syspath_prepend(str(UPSTREAM))
    import digits_as_mnist

    monkeypatch.setenv("HVDX_SEED", "7")
    digits_as_mnist.seed(1)
    first = tf.random.uniform([3]).numpy()
    digits_as_mnist.seed(1)
    assert np.array_equal(first, tf.random.uniform([3]).numpy())  # seed 7 + rank 1, twice
    (_, _), (_, labels) = digits_as_mnist.load_data()

    def oracle(images, training=False):  # a "model" that answers the labels: accuracy 1
        assert images.shape == (len(labels), 28, 28, 1) and images.max() <= 1.0
        return tf.one_hot(labels, 10)

    out = tmp_path / "result.json"
    monkeypatch.setenv("HVDX_RESULT_FILE", str(out))
    digits_as_mnist.report(oracle, 1)
    assert not out.exists()  # only rank 0 writes
    digits_as_mnist.report(oracle, 0)
    assert json.loads(out.read_text()) == {"accuracy": 1.0}
    sys.modules.pop("digits_as_mnist")


def test_digits_helper_gives_the_8x8_digits_as_they_are_on_request(monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(UPSTREAM))
    import digits_as_mnist

    (big, labels), _ = digits_as_mnist.load_data()
    monkeypatch.setenv("HVDX_DIGITS_PIXELS", "8")
    (small, same), _ = digits_as_mnist.load_data()
    assert big.shape[1:] == (28, 28) and small.shape[1:] == (8, 8) and np.array_equal(labels, same)
    assert small.dtype == np.uint8 and small.max() == 255
    assert np.array_equal(big[:, 2:26:3, 2:26:3], small)  # the 28x28 images are the 8x8 ones in 3x3 blocks
    monkeypatch.setenv("HVDX_DIGITS_PIXELS", "16")
    with pytest.raises(ValueError, match="8 or 28"):
        digits_as_mnist.load_data()
    sys.modules.pop("digits_as_mnist")


def test_summary_pairs_each_seed_with_horovods():
    runs = {"keras": {"horovod": [{"accuracy": 0.95, "seconds": 10}, {"accuracy": 0.97, "seconds": 12}],
                      "hitopk": [{"accuracy": 0.94, "seconds": 8}, {"accuracy": 0.98, "seconds": 9}]}}
    s = hx.summary(runs)["keras"]
    assert s["horovod"]["points_vs_baseline"] == 0 and s["horovod"]["mean"] == pytest.approx(0.96)
    assert s["hitopk"]["paired_points"] == pytest.approx([-1.0, 1.0])
    assert s["hitopk"]["points_vs_baseline"] == pytest.approx(0.0)
    assert (s["hitopk"]["min"], s["hitopk"]["max"], s["hitopk"]["mean_seconds"]) == (0.94, 0.98, 8.5)


def test_without_horovod_the_methods_are_compared_with_hvdx_allreduce():
    """On TensorFlow 2.16+ Horovod's own Keras callbacks fail: hvdx's dense step is the baseline."""
    runs = {"keras": {"allreduce": [{"accuracy": 0.95, "seconds": 10}, {"accuracy": 0.97, "seconds": 12}],
                      "hitopk": [{"accuracy": 0.93, "seconds": 8}, {"accuracy": 0.96, "seconds": 9}]}}
    s = hx.summary(runs)["keras"]
    assert hx.baseline(list(runs["keras"])) == "allreduce" and s["allreduce"]["points_vs_baseline"] == 0
    assert s["hitopk"]["paired_points"] == pytest.approx([-2.0, -1.0])
    assert s["hitopk"]["points_vs_baseline"] == pytest.approx(-1.5)


def test_reuse_takes_the_other_methods_of_an_earlier_run_of_the_same_seeds_only(tmp_path):
    earlier = {"args": {"seeds": 2, "seed": 1, "epochs": 3, "steps_per_epoch": 100, "density": 0.01,
                        "topology": "2x2"},
               "runs": {"keras": {"horovod": [{"accuracy": 0.9, "seconds": 1}] * 2,
                                  "hitopk": [{"accuracy": 0.8, "seconds": 1}] * 2}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    args = hx.argparse.Namespace(reuse=path, pixels=28, **earlier["args"])  # an earlier run without --pixels: 28
    reused = hx.reused_runs(args, ["keras"], ["hitopk"])
    assert reused == {"keras": {"horovod": earlier["runs"]["keras"]["horovod"]}}
    assert list(reused["keras"]) == ["horovod"]  # only the methods this run does not make
    args.seeds = 5
    with pytest.raises(SystemExit, match="its seeds is 2, this run's 5"):
        hx.reused_runs(args, ["keras"], ["hitopk"])
    args.seeds = 2
    with pytest.raises(SystemExit, match=r"no runs of \['tape'\]: add horovod"):
        hx.reused_runs(args, ["keras", "tape"], ["hitopk"])
    # a run of another script with its own baseline keeps the earlier script whole
    assert hx.reused_runs(args, ["tape"], ["horovod", "hitopk"]) == earlier["runs"]
