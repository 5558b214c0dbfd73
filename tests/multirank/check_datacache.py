"""DataCache on an m x n job (shi2021 sec. 4.1): every rank reads two epochs of a JPEG folder
tree through a counting source and reports what it read; tests/test_datacache.py writes
the data (ROOT, TFRECORDS) and asserts.
"""
import os

import numpy as np

import hvdx
from hvdx.data import CountingSource, DataCache


def check_one_store_per_node(topo, root: str, cache_dir: str, store_dir: str, tfrecords: str) -> dict:
    source = CountingSource()
    cache = DataCache(root, resolution=24, cache_dir=cache_dir, store_dir=store_dir, source=source, seed=7,
                      memory_bytes=2**26)
    ds = cache.dataset(batch_size=5, with_index=True)  # every iteration is the next epoch
    epochs = []
    for _ in range(2):
        ids, batches, labels_ok = [], 0, True
        for images, labels, index in ds:
            batches += 1
            ids.extend(int(i) for i in index.numpy())
            labels_ok &= bool(np.array_equal(labels.numpy(), cache.catalog.labels[index.numpy()]))
        hvdx.barrier()  # every rank has finished the epoch (and filled its part of the store)
        epochs.append({"ids": ids, "batches": batches, "labels_ok": labels_ok, "source_reads": source.total_reads})
        source.reset()
    stored = sorted(int.from_bytes(k[:8], "big") for k in cache.store.keys())
    slabs = {name: os.path.getsize(os.path.join(cache.store.path, name))
             for name in os.listdir(cache.store.path) if name.startswith("slab-")}
    # TFRecord files are dealt whole to the nodes, which agree on their parts' sizes (collective).
    shards = DataCache(tfrecords=tfrecords, resolution=24, cache_dir=cache_dir + "-tfrecord",
                       store_dir=store_dir + "-tfrecord", seed=7, memory_bytes=2**26)
    tfrecord_ids = [int(i) for _, _, index in shards.dataset(batch_size=4, with_index=True)
                    for i in index.numpy()]
    hvdx.barrier()
    return {"tfrecord_ids": tfrecord_ids, "tfrecord_part": [int(i) for i in shards.part], "node": topo.node,
            "local_rank": topo.local_rank, "part": [int(i) for i in cache.part],
            "store_path": cache.store.path, "stored": stored, "slabs": slabs, "epochs": epochs,
            "steps_per_epoch": cache.steps_per_epoch(5), "per_rank": cache.samples_per_rank}


CHECKS = {"one_store_per_node": check_one_store_per_node}
