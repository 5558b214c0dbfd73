"""One way to add a strategy: a class registered with `hvdx.comm.register` declares its
options, validates them once, and saves its config; the optimizer, the tape and the
aggregator ask the registry (no list of strategies or of their options anywhere else)."""
import json

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import comm


@comm.register("test_scaled", aliases=("test_scaled_alias",))
class Scaled(comm.Strategy):
    """A strategy of a user's own module: averages, then multiplies by `factor` (its option)."""

    options = ("factor", "wire_dtype")

    def __init__(self, factor: float = 1.0, wire_dtype=None, topo=None) -> None:
        super().__init__(topo)
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        self.factor = float(factor)
        self.wire_dtype = None if wire_dtype is None else comm.wire.check_dtype(wire_dtype)

    def _aggregate(self, buffer, name, residual_scale=None):
        return comm.Aggregated(buffer * self.factor)

    def __repr__(self) -> str:
        return f"Scaled(factor={self.factor})"


def test_builtin_strategies_are_registered_with_their_aliases():
    assert set(comm.names()) >= {"allreduce", "hierarchical", "hitopk", "sparse_allgather"}
    for alias, cls in (("dense", comm.Allreduce), ("2DTAR", comm.Hierarchical), ("naiveag", comm.SparseAllgather),
                       ("HiTopKComm", comm.HiTopK)):
        assert comm.strategy_class(alias) is cls
        assert comm.is_name(alias)
    assert not comm.is_name("ring") and not comm.is_name(3)
    with pytest.raises(ValueError, match="unknown communication strategy 'ring'"):
        comm.get("ring")


def test_a_registered_strategy_is_usable_by_name_everywhere():
    assert comm.strategy_class("TEST_SCALED_ALIAS") is Scaled
    assert isinstance(comm.get("test_scaled", factor=2), Scaled)
    tape_aggregator = hvdx.GradientAggregator("test_scaled")
    assert isinstance(tape_aggregator.strategy, Scaled)
    # its own option, beside hvdx's: passed as an instance, saved and rebuilt by name
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication=Scaled(factor=3.0))
    config = json.loads(json.dumps(opt.get_config()))
    assert config["communication"] == "test_scaled" and config["factor"] == 3.0
    again = hvdx.DistributedOptimizer.from_config(config)
    assert isinstance(again.communication, Scaled) and again.communication.factor == 3.0
    # the second positional argument is the name (Horovod's order): a strategy name there is caught
    with pytest.raises(ValueError, match="communication='test_scaled'"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), "test_scaled")


def test_a_name_taken_by_another_class_is_refused():
    with pytest.raises(ValueError, match="taken by"):
        comm.register("hitopk")(type("Other", (comm.Strategy,), {}))
    with pytest.raises(ValueError, match="taken by"):
        comm.register("fresh_name", aliases=("2dtar",))(type("Other2", (comm.Strategy,), {}))
    assert not comm.is_name("fresh_name")


def test_options_are_validated_once_by_the_strategy():
    """Each option either applies to the strategy or is rejected, naming who takes it."""
    with pytest.raises(ValueError, match=r"'allreduce' is dense and lossless.*density by \['hitopk', "
                                         r"'sparse_allgather'\]"):
        comm.get("allreduce", density=0.01)
    with pytest.raises(ValueError, match=r"'hitopk' does not take factor .*factor by \['test_scaled'\]"):
        comm.get("hitopk", factor=2.0)
    with pytest.raises(ValueError, match="density must be a number in"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk", density=1.5)
    with pytest.raises(ValueError, match="configure the instance itself"):
        comm.get(comm.HiTopK(), density=0.1)
    # NumPy numbers are numbers
    strategy = comm.get("hitopk", density=np.float32(0.05), num_samplings=np.int64(12))
    assert strategy.num_samplings == 12 and type(strategy.num_samplings) is int
    with pytest.raises(ValueError, match="num_samplings must be an int >= 1"):
        comm.get("hitopk", num_samplings=0.5)
    # strict=False: what a strategy does not take is dropped (switching strategies)
    assert repr(comm.get("hierarchical", strict=False, density=0.3)) == "Hierarchical()"


def test_horovod_options_reach_the_strategies_that_take_them():
    with pytest.raises(ValueError, match="Adasum"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk", op=hvd.Adasum)
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), op=hvd.Sum)
    assert opt.communication.op is hvd.Sum
    with pytest.raises(ValueError, match="contradict"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), compression=hvd.Compression.fp16,
                                  wire_dtype=tf.bfloat16)
    fp16 = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk",
                                     compression=hvd.Compression.fp16)
    assert fp16.communication.wire_dtype == tf.float16
    assert "wire_dtype" not in fp16.get_config()  # the compression option says it


def test_switching_keeps_the_options_that_apply_and_reuses_residual_owners():
    agg = hvdx.GradientAggregator("hitopk", density=0.2, wire_dtype=tf.bfloat16)
    first = agg.strategy
    agg.strategy = "2dtar"
    assert repr(agg.strategy) == "Hierarchical(wire_dtype=bfloat16)"
    agg.strategy = "hitopk"
    assert agg.strategy is first  # the same instance, so its residuals are resumed
    assert agg.config == {"communication": "hitopk", "density": 0.2, "num_samplings": 30,
                          "wire_dtype": "bfloat16", "bucket_bytes": "auto"}


def test_each_strategy_brings_its_bucket_size_unless_one_is_given():
    """"auto" (the default) plans with the current strategy's bucket size: 2DTAR's three
    collectives per bucket want 4 MiB buckets, the others 32 MiB; a given size always wins."""
    agg = hvdx.GradientAggregator("hitopk")
    assert agg.bucket_bytes == "auto" and agg.effective_bucket_bytes == 32 << 20
    agg.strategy = "hierarchical"  # as SwitchCommunication does: the next trace plans anew
    assert agg.effective_bucket_bytes == 4 << 20
    assert hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="allreduce"
                                     ).aggregator.effective_bucket_bytes == 32 << 20
    given = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hierarchical", bucket_bytes=1 << 20)
    assert given.aggregator.effective_bucket_bytes == 1 << 20
    assert hvdx.GradientAggregator("hierarchical", bucket_bytes=None).effective_bucket_bytes is None
    again = type(given).from_config(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(),
                                                              communication="hierarchical").get_config())
    assert again.aggregator.bucket_bytes == "auto" and again.aggregator.effective_bucket_bytes == 4 << 20
    with pytest.raises(ValueError, match="'auto'"):
        hvdx.GradientAggregator("hitopk", bucket_bytes="big")


def test_environment_default_takes_density_only_where_it_applies(monkeypatch):
    from hvdx.aggregator import default_communication

    monkeypatch.setenv("HVDX_COMMUNICATION", "2dtar")
    monkeypatch.setenv("HVDX_DENSITY", "0.05")
    assert default_communication() == ("hierarchical", None)
    monkeypatch.setenv("HVDX_COMMUNICATION", "naiveag")
    assert default_communication() == ("sparse_allgather", 0.05)
    assert hvdx.DistributedOptimizer(tf.keras.optimizers.SGD()).communication.density == 0.05


def test_an_unregistered_strategy_cannot_be_saved():
    class Anonymous(comm.Strategy):
        def _aggregate(self, buffer, name, residual_scale=None):
            return comm.Aggregated(buffer)

    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication=Anonymous())
    with pytest.raises(ValueError, match="not registered"):
        opt.get_config()


def test_every_strategy_of_the_package_registers_itself():
    """A strategy module in hvdx/comm is imported with the package and registers its class:
    no list of strategies to extend elsewhere."""
    import inspect
    import pkgutil

    for info in pkgutil.iter_modules(comm.__path__):
        module = getattr(comm, info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, comm.Strategy) and cls is not comm.Strategy and cls.__module__ == module.__name__ \
                    and "aggregate" in vars(cls):
                assert comm.strategy_class(cls.key) is cls, cls


def test_2dtar_size_rule_option_is_validated_and_kept_in_the_config():
    assert comm.Hierarchical().flat_below == 4 << 20  # buckets under 4 MiB go flat unless asked
    pure = comm.get("2dtar", flat_below=0)
    assert pure.flat_below == 0 and repr(pure) == "Hierarchical(flat_below=0)"
    assert comm.Hierarchical.from_config(pure.get_config()).flat_below == 0
    for bad in (-1, 1.5, True, "4MiB"):
        with pytest.raises(ValueError, match="flat_below must be a number of bytes"):
            comm.Hierarchical(flat_below=bad)
