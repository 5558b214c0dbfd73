"""Rank side of the multi-rank test harness (tests/harness.py)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Optional


def run(main: Callable[[], Optional[dict]]) -> None:
    """Runs `main` on this rank, records its result or traceback, and ends with a barrier.

    The result is written before the barrier, so a hang there still leaves it behind.
    """
    result: dict = {"rank": int(os.environ.get("HOROVOD_RANK", "0")), "ok": False}
    try:
        result.update(ok=True, data=main() or {})
    except BaseException as exc:  # noqa: B902 - report anything, including SystemExit
        result["error"] = "".join(traceback.format_exception(exc))
    import horovod.tensorflow as hvd

    if hvd.is_initialized():
        result["rank"] = hvd.rank()
    out_dir = Path(os.environ.get("HVDX_RESULT_DIR") or tempfile.gettempdir())  # never the checkout
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".rank-{result['rank']}.json"
    tmp.write_text(json.dumps(result, default=str))
    tmp.rename(out_dir / f"rank-{result['rank']}.json")
    if hvd.is_initialized():
        import hvdx

        hvdx.barrier()
    sys.exit(0 if result["ok"] else 1)


def spread(values, tag: str) -> float:
    """Collective: the largest difference between ranks of `values` (arrays or variables,
    concatenated; 0.0: bitwise identical on every rank). `tag` names its two collectives."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    flat = tf.constant(np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values]))
    low = hvd.allreduce(flat, op=hvd.Min, name=f"spread.min.{tag}").numpy()
    high = hvd.allreduce(flat, op=hvd.Max, name=f"spread.max.{tag}").numpy()
    return float(np.max(high - low)) if flat.shape[0] else 0.0
