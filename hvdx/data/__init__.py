"""DataCache (shi2021 sec. 4.1, Fig. 5): training data read once from slow storage, decoded
once per node, and served from node memory from the second epoch on.

    cache = hvdx.data.DataCache("/nfs/imagenet/train", resolution=96)
    dataset = cache.dataset(batch_size=256, augment=tf.image.random_flip_left_right)

Modules: `source` (where files come from), `disk` (level 1, local disk), `store` (level 2,
one store per node on /dev/shm: a flat slab per resolution and an LMDB index; lmdb is
imported only when a store is opened),
`catalog` (folder trees and TFRecord files), `decode` (decoding at a resolution), `split`
(which node keeps which samples, which rank reads which in each epoch), `loader` (a sample
read through level 1 and decoded), `prefetch` (epoch 1's filling of the store ahead of the
reader), `reader` (a rank's batches out of the store), `pipeline` (the tf.data dataset),
`datacache` (`DataCache`, composing them); `python -m hvdx.data list|clear` lists and
removes the node stores left in memory (`__main__`).
"""
from hvdx.data.datacache import DataCache, Placement, default_cache_dir, epoch_share, node_part, samples_per_rank
from hvdx.data.decode import decode_image
from hvdx.data.disk import DiskCache
from hvdx.data.source import CountingSource, GFileSource, SlowSource, Source
from hvdx.data.store import NodeStore, list_stores, remove_store, sample_key

__all__ = ["CountingSource", "DataCache", "DiskCache", "GFileSource", "NodeStore", "Placement", "SlowSource",
           "Source", "decode_image", "default_cache_dir", "epoch_share", "list_stores", "node_part", "remove_store",
           "sample_key", "samples_per_rank"]
