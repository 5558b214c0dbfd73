"""One AD-PSGD rank as its own process, without Horovod (tests/test_adpsgd.py kills one of
them): `python tests/adpsgd_worker.py DIR RANK WORLD TOPOLOGY VICTIM DIE_AT [SIGNAL [TIMEOUT]]`.

Every rank trains a float64 model of zeros with zero gradients, one step every 5 ms. Rank
VICTIM sends itself SIGNAL ("KILL", the default: no goodbye; "STOP": alive but stuck, its
sockets open) at step DIE_AT; the others (transport timeout TIMEOUT s, default 20) go on until their step
raises, or until step 20000 (they would then average, and report). Each survivor writes
DIR/result.RANK.json: the error's text and the step it came at.
"""
import json
import os
import signal
import sys
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# hvdx's gossip and transports without TensorFlow (hvdx/__init__.py imports it: tens of
# seconds per process on a loaded machine): the packages as bare namespaces.
for _name in ("hvdx", "hvdx.transport", "hvdx.adpsgd"):
    _module = types.ModuleType(_name)
    _module.__path__ = [os.path.join(ROOT, *_name.split("."))]
    sys.modules[_name] = _module

from tests.adpsgd_world import file_allgather, make_gossip  # noqa: E402


def main() -> None:
    directory, rank, world, topology, victim, die_at = sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4], \
        *map(int, sys.argv[5:7])
    how = getattr(signal, "SIG" + (sys.argv[7] if len(sys.argv) > 7 else "KILL"))
    timeout = float(sys.argv[8]) if len(sys.argv) > 8 else 20.0
    gossip = make_gossip(np.zeros(10000), rank, world, topology, file_allgather(directory, rank, world),
                         timeout=timeout, finish_timeout=60.0)
    zero = np.zeros(10000)
    result = {"rank": rank, "error": None, "step": None}
    try:
        for step in range(20000):
            if rank == victim and step == die_at:
                os.kill(os.getpid(), how)
            gossip.step(zero)
            time.sleep(0.005)
        gossip.average(final=True)
    except Exception as exc:  # noqa: BLE001 - what the test asserts on
        result["error"], result["step"] = f"{type(exc).__name__}: {exc}", gossip.steps
    result["exchanges"] = gossip.exchanges
    gossip.close()
    with open(os.path.join(directory, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
