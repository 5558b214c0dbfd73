"""A process of the shared segment's lifecycle tests (tests/test_asynchronous.py), without
TensorFlow: loads hvdx/asynchronous/shared.py by path (the package hvdx.asynchronous imports
TensorFlow; hvdx and the segment kit hvdx.shm do not), so that it starts in a fraction of a
second.

    python tests/asynchronous_segment.py create N      # creates, prints the name, waits for N
                                                       # processes, unlinks, prints "unlinked",
                                                       # then sleeps until stdin closes
    python tests/asynchronous_segment.py attach NAME   # attaches, prints "attached" and the sum,
                                                       # then sleeps until stdin closes
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # `from hvdx import shm` in shared.py
_PATH = _ROOT / "hvdx" / "asynchronous" / "shared.py"
_spec = importlib.util.spec_from_file_location("hvdx_shared_standalone", _PATH)
shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared)


def main(argv):
    if argv[0] == "create":
        model = shared.SharedModel.create([4, 4], np.arange(8, dtype=np.float32))
        print(model.name, flush=True)
        model.wait_attached(int(argv[1]), timeout=float(argv[2]) if len(argv) > 2 else 60)
        model.unlink()
        print("unlinked", flush=True)
    else:
        model = shared.SharedModel.attach(argv[1], timeout=30)
        print("attached", float(model.params.sum()), flush=True)
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
