"""A rank script that misbehaves on purpose, to test that the harness reports it."""
import argparse
import time

import horovod.tensorflow as hvd
import tensorflow as tf

import hvdx
from tests.multirank.rank import run


def main(fail_rank: int, hang_rank: int) -> dict:
    topo = hvdx.init()
    total = hvd.allreduce(tf.constant(1), op=hvd.Sum, name="count")
    if topo.rank == fail_rank:
        raise ValueError(f"deliberate failure on rank {topo.rank}")
    if topo.rank == hang_rank:
        time.sleep(3600)
    return {"size_seen": int(total)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    args = parser.parse_args()
    run(lambda: main(args.fail_rank, args.hang_rank))
