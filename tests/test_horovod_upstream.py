"""Horovod's own code runs with hvdx's classes in place of Horovod's.

tests/upstream/horovod/ holds Horovod v0.28.1's TF2 example scripts and its Keras
optimizer tests, unmodified (Apache 2.0, see LICENSE there). Each test below writes an
adapted copy into a temporary directory, changing only what `ADAPTATIONS` lists: the
import of Horovod's API becomes hvdx's (`hvdx.keras` / `hvdx.tensorflow`), MNIST (a
download) becomes scikit-learn's bundled digits, and the examples train for a few steps
instead of thousands. Every listed change must apply exactly once.

The four examples as a Keras 3 user writes them (`KERAS3_FORM`: Horovod ships none) run the
same way, adapted alike, with tf.keras left to TensorFlow (Keras 3: the
suite's "keras3:2x2" launch), on 2 nodes x 2 ranks with allreduce, 2DTAR and HiTopK, one also
with hvdx imported before Keras and TensorFlow.

The tests run with dense averaging (hvdx's default) on 2 nodes x 1 rank, and with HiTopK
($HVDX_COMMUNICATION=hitopk) on 2 nodes x 2 ranks: at density 0.01 where a test asserts no
exact numbers, at density 1.0 where it does (gradient sums checked to the last digit). The
examples run on 2 nodes x 1 rank with each. All of them are checks of
tests/multirank/check_upstream.py in the suite's launch of their topology.
"""
import re
import shutil
from pathlib import Path
from typing import Callable, Dict

import pytest

from tests import suite
from tests.harness import HAS_KERAS3

UPSTREAM = Path(__file__).resolve().parent / "upstream"
HVDX_KERAS = ("import horovod.tensorflow.keras as hvd", "import hvdx.keras as hvd")
MNIST = ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", "digits_as_mnist.load_data()")
DIGITS_IMPORT = ("import tensorflow as tf\n", "import tensorflow as tf\nimport digits_as_mnist\n")

ADAPTATIONS = {
    "test_tensorflow2_keras.py": [HVDX_KERAS, ("import horovod.keras as hvd_keras", "import hvdx.keras as hvd_keras")],
    "tensorflow2_keras_mnist.py": [HVDX_KERAS, MNIST, DIGITS_IMPORT,
                                   ("steps_per_epoch=500 // hvd.size()", "steps_per_epoch=8 // hvd.size()"),
                                   ("callbacks=callbacks, epochs=24", "callbacks=callbacks, epochs=3")],
    "tensorflow2_mnist.py": [("import horovod.tensorflow as hvd", "import hvdx.tensorflow as hvd"), MNIST,
                             DIGITS_IMPORT, ("dataset.take(10000 // hvd.size())", "dataset.take(16 // hvd.size())")],
    "tensorflow2_keras_synthetic_benchmark.py": [HVDX_KERAS],
    "tensorflow2_synthetic_benchmark.py": [("import horovod.tensorflow as hvd", "import hvdx.tensorflow as hvd")],
}
# The synthetic benchmarks' own flags: a small model and a few batches on the CPU. MobileNet
# (v1, 91 Keras layers) rather than MobileNetV2 (156): building and tracing the model is most of
# a run's cost, and the four synthetic checks of the 2x1 launch took 88 CPU s against 137 with
# MobileNetV2 (both launches side by side on the same loaded machine).
SYNTHETIC_ARGS = ["--model", "MobileNet", "--batch-size", "2", "--num-batches-per-iter", "1", "--num-iters", "2",
                  "--no-cuda"]
# Tests of test_tensorflow2_keras.py that check gradient values exactly: HiTopK at density 1.
EXACT = "test_gradient_aggregation or test_partial_distributed_optimizer"
# tf.test.TestCase's own deprecated test_session, which TensorFlow always skips: not Horovod's.
TF_SKIP = "test_session"
DENSE = {"HVDX_COMMUNICATION": "allreduce"}
HITOPK = {"HVDX_COMMUNICATION": "hitopk"}


#: Horovod's examples as a Keras 3 user writes them (Horovod ships none): `import keras`,
#: keras.* for tf.keras.* / tf.optimizers / tf.losses, `optimizer.variables` (a list), `.keras`
#: checkpoints, no Keras 2 compile argument. (pattern, replacement, count: 0 = every match).
KERAS3_FORM = [
    (r"import tensorflow as tf\n", "import keras\nimport tensorflow as tf\n", 1),
    (r"from tensorflow\.keras import applications", "from keras import applications", 0),
    (r"\btf\.(keras|optimizers|losses)\.", lambda m: "keras." + ("" if m.group(1) == "keras" else m.group(1) + "."), 0),
    (r"opt\.variables\(\)", "opt.variables", 0),
    (r"'\./checkpoint-\{epoch\}\.h5'", "'./checkpoint-{epoch}.keras'", 0),
    (r"\n *# Horovod: Specify `experimental_run_tf_function=False`[^\n]*\n *# uses hvd\.DistributedOptimizer\(\)[^\n]*\n",
     "\n", 0),
    (r",\n *experimental_run_tf_function=False\)", ")", 0),
]
KERAS3_MNIST = ("keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", "digits_as_mnist.load_data()")
KERAS3_ADAPTATIONS = {
    "tensorflow2_keras_mnist.py": [HVDX_KERAS, KERAS3_MNIST, DIGITS_IMPORT, ADAPTATIONS["tensorflow2_keras_mnist.py"][3],
                                   ADAPTATIONS["tensorflow2_keras_mnist.py"][4]],
    "tensorflow2_mnist.py": [ADAPTATIONS["tensorflow2_mnist.py"][0], KERAS3_MNIST, DIGITS_IMPORT,
                             ADAPTATIONS["tensorflow2_mnist.py"][3]],
    "tensorflow2_keras_synthetic_benchmark.py": [HVDX_KERAS],
    "tensorflow2_synthetic_benchmark.py": ADAPTATIONS["tensorflow2_synthetic_benchmark.py"],
}
#: hvdx imported first, before Keras and TensorFlow (the examples import TensorFlow first).
HVDX_FIRST = [("import horovod\nimport hvdx.keras as hvd\n", "import horovod\n"),
              ("import keras\nimport tensorflow as tf\n", "import hvdx.keras as hvd\nimport keras\nimport tensorflow as tf\n")]


def keras3_form(name: str) -> str:
    """Horovod's tests/upstream/horovod/<name> as a Keras 3 user writes it (KERAS3_FORM)."""
    text = (UPSTREAM / "horovod" / name).read_text()
    for pattern, replacement, count in KERAS3_FORM:
        text = re.sub(pattern, replacement, text, count=count)
    return text


def adapt(name: str, into: Path, form: str = "horovod", extra=()) -> Path:
    """The adapted copy of Horovod's tests/upstream/horovod/<name> in `into` (with the digits
    helper): form "horovod" (the file, ADAPTATIONS) or "keras3" (its Keras 3 form,
    KERAS3_ADAPTATIONS), then `extra` changes."""
    text = (UPSTREAM / "horovod" / name).read_text() if form == "horovod" else keras3_form(name)
    for old, new in [*(ADAPTATIONS if form == "horovod" else KERAS3_ADAPTATIONS)[name], *extra]:
        assert text.count(old) == 1, f"{name}: expected {old!r} once, found it {text.count(old)} times"
        text = text.replace(old, new)
    shutil.copy(UPSTREAM / "digits_as_mnist.py", into / "digits_as_mnist.py")
    path = into / name
    path.write_text(text)
    return path


def adapted(name: str, form: str = "horovod", extra=()) -> Callable[[Path], Dict[str, str]]:
    """A suite check's setup: the adapted copy of `name` in the check's work directory."""
    return lambda workdir: {"path": str(adapt(name, workdir, form, extra))}


@pytest.mark.parametrize("form", ["horovod", "keras3"])
def test_adaptations_change_only_imports_data_and_length(tmp_path, form):
    """Undoing the listed changes gives the files back, byte for byte."""
    adaptations = ADAPTATIONS if form == "horovod" else KERAS3_ADAPTATIONS
    for name in adaptations:
        text = adapt(name, tmp_path, form).read_text()
        for old, new in reversed(adaptations[name]):
            text = text.replace(new, old)
        original = (UPSTREAM / "horovod" / name).read_text() if form == "horovod" else keras3_form(name)
        assert text == original, name


def test_the_keras3_forms_use_keras3s_names_only():
    """Every change of KERAS3_FORM applies to one of the four files at least, and leaves no
    Keras 2 name: no tf.keras, tf.optimizers, tf.losses, optimizer.variables(), `.h5`
    checkpoint or experimental_run_tf_function; Horovod's import stays (the test swaps it)."""
    texts = {name: (UPSTREAM / "horovod" / name).read_text() for name in KERAS3_ADAPTATIONS}
    for pattern, _, _ in KERAS3_FORM:
        assert any(re.search(pattern, text) for text in texts.values()), pattern
    for name in texts:
        keras3 = keras3_form(name)
        assert keras3.count("import keras\n") == 1 and "import horovod" in keras3, name
        assert not re.search(r"tf\.(keras|optimizers|losses)\b|variables\(\)|\.h5'|experimental_run_tf_function",
                             keras3), name


# (topology, environment, phases: (pytest -k expression, $HVDX_DENSITY or "")) per strategy
KERAS_TESTS = {"dense-2x1": ("2x1", DENSE, ((f"not {TF_SKIP}", ""),)),
               "hitopk-2x2": ("2x2", HITOPK, ((f"not ({EXACT} or {TF_SKIP})", "0.01"), (EXACT, "1.0")))}
EXAMPLES = {"tensorflow2_keras_mnist.py": (), "tensorflow2_mnist.py": (),
            "tensorflow2_keras_synthetic_benchmark.py": (*SYNTHETIC_ARGS, "--fp16-allreduce"),
            "tensorflow2_synthetic_benchmark.py": (*SYNTHETIC_ARGS, "--num-warmup-batches", "1")}


@pytest.mark.second_stack
@suite.runs(*[suite.check("upstream.pytest", topology, env=env, phases=phases, timeout=600,
                          setup=adapted("test_tensorflow2_keras.py"))
              for topology, env, phases in KERAS_TESTS.values()], ids=list(KERAS_TESTS))
def test_horovods_keras_tests_pass_with_hvdx(ranks):
    data = ranks
    for rank, phases_run in data.items():
        for phase, result in phases_run.items():
            failed = {t: o for t, o in result["outcomes"].items() if o != "passed"}
            assert result["exit"] == 0 and not failed, (rank, phase, failed, ranks.rank_output(rank, 60))
            assert result["outcomes"], (rank, phase, "no test ran")
    counted = sum(len(r["outcomes"]) for r in data[0].values())
    assert counted == 13, f"Horovod's file has 13 tests, {counted} ran"


@suite.runs(*[suite.check("upstream.script", "2x1", env=env, args=args, setup=adapted(name))
              for env in (DENSE, HITOPK) for name, args in EXAMPLES.items()],
            ids=[f"{env}-{name}" for env in ("dense", "hitopk") for name in EXAMPLES])
def test_horovods_examples_run_with_hvdx(ranks):
    assert sorted(ranks) == [0, 1]
    for data in ranks.values():  # the example ran to its end on every rank
        assert Path(data["ran"]).parent == ranks.workdir and Path(data["ran"]).name in EXAMPLES


#: Every strategy on the Keras 3 forms; the synthetic benchmarks (a MobileNet each) with HiTopK.
KERAS3_RUNS = {f"{strategy}-{name}": (name, {"HVDX_COMMUNICATION": strategy}, ())
               for strategy in ("allreduce", "hierarchical", "hitopk")
               for name in ("tensorflow2_keras_mnist.py", "tensorflow2_mnist.py")}
KERAS3_RUNS.update({f"hitopk-{name}": (name, HITOPK, args) for name, args in EXAMPLES.items() if "synthetic" in name})
KERAS3_RUNS["hitopk-hvdx-first-tensorflow2_keras_mnist.py"] = ("tensorflow2_keras_mnist.py", HITOPK, ())


@suite.runs(*[suite.check("upstream.script", "keras3:2x2", env=env, args=args, timeout=600,
                          setup=adapted(name, "keras3", HVDX_FIRST if "hvdx-first" in key else ()))
              for key, (name, env, args) in KERAS3_RUNS.items() if HAS_KERAS3],
            ids=list(KERAS3_RUNS) if HAS_KERAS3 else [])
def test_horovods_examples_in_keras3_form_run_with_hvdx(ranks):
    """The Keras 3 forms, import swapped, with tf.keras as TensorFlow makes it (Keras 3): every
    rank runs each to its end; rank 0 of the Keras example writes a `.keras` checkpoint per epoch."""
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        assert data["tf_keras"] == "keras", (rank, data)
        assert Path(data["ran"]).parent == ranks.workdir and Path(data["ran"]).name in KERAS3_ADAPTATIONS
    if Path(ranks[0]["ran"]).name == "tensorflow2_keras_mnist.py":
        assert [f for f in ranks[0]["files"] if f.startswith("checkpoint-")] == [
            f"checkpoint-{epoch}.keras" for epoch in (1, 2, 3)], ranks[0]["files"]
