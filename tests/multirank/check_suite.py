"""Checks that misbehave on purpose, to test the suite runner itself (tests/test_suite.py)."""
import time

import horovod.tensorflow as hvd
import tensorflow as tf


def echo(topo, value: str) -> dict:
    """Prints and returns `value`, after a sum over every rank."""
    total = int(hvd.allreduce(tf.constant(1), op=hvd.Sum, name=f"echo.{value}"))
    print(f"echo {value} from rank {topo.rank}", flush=True)
    return {"value": value, "size_seen": total}


def fail_on(topo, rank: int) -> dict:
    if topo.rank == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return {}


def hang_on(topo, rank: int) -> dict:
    if topo.rank == rank:
        time.sleep(3600)
    return {}


CHECKS = {"echo": echo, "fail_on": fail_on, "hang_on": hang_on}
