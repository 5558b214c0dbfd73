"""DataCache (shi2021 sec. 4.1, Fig. 5): files are read once from the slow source, decoded
once per node, and served from node memory from the second epoch on; the node's ranks share
one store and read disjoint shares; bad data and full caches degrade with a message.

Data: scikit-learn's digits upscaled to 40 px, encoded as JPEG files into tmp dirs.
"""
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import tensorflow as tf

import hvdx
import hvdx.version
from hvdx.data import CountingSource, DataCache, DiskCache, NodeStore, Placement, decode_image, sample_key
from hvdx.data import epoch_share, node_part, samples_per_rank
from hvdx.data.store import Slab
from tests import harness, suite

RES = 24


def write_digits(root, n, size=40, seed=0):
    """`n` digits as RGB JPEGs of `size` px under root/<digit>/; returns the paths by label."""
    from sklearn.datasets import load_digits

    data = load_digits()
    rng = np.random.default_rng(seed)
    for i in range(n):
        image = tf.image.resize(data.images[i][..., None] * 15, (size, size))
        noise = rng.integers(0, 40, (size, size, 3))
        image = tf.cast(tf.clip_by_value(tf.tile(image, [1, 1, 3]) + noise, 0, 255), tf.uint8)
        folder = os.path.join(root, f"digit{data.target[i]}")
        os.makedirs(folder, exist_ok=True)
        tf.io.write_file(os.path.join(folder, f"{i:04d}.jpg"), tf.io.encode_jpeg(image, quality=90))
    return str(root)


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("digits"), 48)


def make_cache(root, tmp_path, source=None, **kwargs):
    kwargs.setdefault("resolution", RES)
    kwargs.setdefault("memory_bytes", 2**26)
    return DataCache(root, cache_dir=str(tmp_path / "disk"), store_dir=str(tmp_path / "shm"),
                     source=source or CountingSource(), **kwargs)


def epoch(ds):
    """(images, labels, sample ids) of one pass over a `with_index` dataset."""
    images, labels, ids = [], [], []
    for x, y, i in ds:
        images.append(x.numpy())
        labels.append(y.numpy())
        ids.append(i.numpy())
    return np.concatenate(images), np.concatenate(labels), np.concatenate(ids)


def direct(path, resolution=RES):
    return decode_image(tf.io.read_file(path), resolution).numpy()


# -- both levels: byte-identical, and the source read once -----------------------------------

def test_seeds_are_integers_numpy_s_included(digits_root, tmp_path):
    cache = make_cache(digits_root, tmp_path, seed=np.int64(3), split_seed=np.int32(7))
    assert (cache.seed, cache.split_seed) == (3, 7) and type(cache.seed) is int
    for bad in (2.5, "3", True, None, -1):
        with pytest.raises(ValueError, match="seed"):
            make_cache(digits_root, tmp_path, seed=bad)


def test_samples_are_byte_identical_through_both_levels(digits_root, tmp_path):
    cache = make_cache(digits_root, tmp_path)
    ds = cache.dataset(8, with_index=True)
    for _ in range(2):  # epoch 1 (decoded now) and epoch 2 (from the store)
        images, labels, ids = epoch(ds)
        assert sorted(ids) == list(range(48))
        for image, label, i in zip(images, labels, ids):
            assert np.array_equal(image, direct(cache.catalog.paths[i]))
            folder = os.path.basename(os.path.dirname(cache.catalog.paths[i]))
            assert label == cache.catalog.labels[i] == int(folder[len("digit"):])
    # ... and equal to what a plain tf.data pipeline decodes from the source (graph mode)
    plain = tf.data.Dataset.from_tensor_slices(cache.catalog.paths).map(lambda p: decode_image(tf.io.read_file(p), RES))
    by_id = dict(zip(ids, images))
    assert all(np.array_equal(x.numpy(), by_id[i]) for i, x in enumerate(plain))
    for path in cache.catalog.paths:  # level 1: the copies are the source's bytes
        with open(path, "rb") as f:
            assert cache.disk.read(path) == f.read()


def test_second_epoch_reads_nothing_from_the_source_nor_the_disk(digits_root, tmp_path):
    source = CountingSource()
    cache = make_cache(digits_root, tmp_path, source=source, seed=3)
    ds = cache.dataset(6, with_index=True)
    _, _, first = epoch(ds)
    assert source.total_reads == 48 and set(source.reads.values()) == {1}  # every file once
    disk_reads = cache.disk.stats["hits"] + cache.disk.stats["misses"]
    source.reset()
    _, _, second = epoch(ds)
    assert source.total_reads == 0
    assert cache.disk.stats["hits"] + cache.disk.stats["misses"] == disk_reads  # from node memory only
    assert sorted(second) == sorted(first) and list(second) != list(first)  # a new order each epoch


def test_a_second_run_reads_nothing_from_the_source_through_level_1(digits_root, tmp_path):
    first = CountingSource()
    epoch(make_cache(digits_root, tmp_path, source=first).dataset(16, with_index=True))
    assert first.total_reads == 48
    second = CountingSource()  # a new run: new process state, a new node store, the same disk
    cache = DataCache(digits_root, resolution=RES, cache_dir=str(tmp_path / "disk"),
                      store_dir=str(tmp_path / "shm-run2"), memory_bytes=2**26, source=second)
    images, _, ids = epoch(cache.dataset(16, with_index=True))
    assert second.total_reads == 0 and cache.disk.stats["hits"] == 48
    assert all(np.array_equal(x, direct(cache.catalog.paths[i])) for x, i in zip(images, ids))


def test_a_restarted_job_finds_its_full_slab_with_one_look_up_and_serves_the_same_samples(digits_root, tmp_path,
                                                                                          monkeypatch):
    """Issue 45: a relaunched job on the same node (same store) starts at epoch-2+ speed: the
    store remembers that its slab holds the node's whole part, so the new job's epoch 1 is
    planned without one LMDB look-up per sample and reads nothing from the source. The new
    DataCache opens the slab when it is made, so its pages map in while the job goes on."""
    first = make_cache(digits_root, tmp_path, seed=1)
    images, _, ids = epoch(first.dataset(16, with_index=True))
    epoch(first.dataset(16, with_index=True, first_epoch=1))  # the epoch that finds the slab full
    slab = first.reader.slab((RES, RES))
    assert first.store.slab_complete(slab)
    assert all(len(k) == 20 for k in first.store.keys()) and len(first.store.keys()) == 48  # the marker is no sample
    first.close()
    source = CountingSource()
    # a new process opens the slab (its pages mapping in) when it makes the DataCache, before any dataset
    code = ("import pathlib, hvdx\nfrom tests.test_datacache import make_cache\n"
            f"cache = make_cache({digits_root!r}, pathlib.Path({str(tmp_path)!r}), seed=1)\n"
            f"print('mapped', {slab.path!r} in open('/proc/self/maps').read())\ncache.close()\n")
    new = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=harness.ROOT)
    assert "mapped True" in new.stdout, new.stdout + new.stderr[-3000:]
    again = make_cache(digits_root, tmp_path, seed=1, source=source)  # the same store: a restart
    looked_up = []
    real_locate = again.store.locate
    monkeypatch.setattr(again.store, "locate", lambda keys: looked_up.append(1) or real_locate(keys))
    images2, _, ids2 = epoch(again.dataset(16, with_index=True))
    assert looked_up == [] and source.total_reads == 0
    assert list(ids2) == list(ids) and np.array_equal(images2, images)  # epoch 0 again, the same batches
    again.close()




def test_a_slab_on_a_tmpfs_with_huge_pages_is_mapped_by_huge_pages(digits_root, tmp_path):
    """Issue 45: a store_dir on a tmpfs mounted with huge=within_size gives the slab huge pages
    (its fallocate and pwrite allocate them), so every process maps it with one page-table
    entry per 2 MiB instead of per 4 KiB; hvdx.data.pages.huge_pages tells such a store_dir
    from /dev/shm. The tmpfs is mounted in a private mount namespace (skipped without root)."""
    mount = tmp_path / "huge"
    mount.mkdir()
    namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f'mount -t tmpfs -o huge=within_size,size=64m hvdx-test {mount} && exec "$@"', "sh"]
    probe = subprocess.run([*namespace, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace with a huge-page tmpfs here: {probe.stderr.strip()[-300:]}")
    # 160 px: a slab of 48 x 160 x 160 x 3 bytes holds one whole 2 MiB page
    code = ("import json\nfrom hvdx.data import DataCache\nfrom hvdx.data.pages import huge_pages\n"
            f"cache = DataCache({digits_root!r}, resolution=160, cache_dir={str(tmp_path / 'disk')!r}, "
            f"store_dir={str(mount / 'store')!r}, memory_bytes=2**26)\n"
            "for epoch in range(2):\n    for batch in cache.dataset(16, first_epoch=epoch):\n        pass\n"
            "kib = sum(int(line.split()[1]) for line in open('/proc/self/smaps_rollup')"
            " if line.startswith('ShmemPmdMapped:'))\n"
            f"print(json.dumps({{'huge': huge_pages({str(mount / 'store')!r}), 'pmd_kib': kib, "
            "'in_slab': cache.stats['store']['hits']}))\ncache.close()\n")
    done = subprocess.run([*namespace, sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=harness.ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["huge"] and found["in_slab"] == 48  # epoch 2 served from the slab
    assert found["pmd_kib"] >= 2048, found  # at least one 2 MiB page mapped whole
    from hvdx.data.pages import huge_pages

    assert not huge_pages(str(tmp_path)) and not huge_pages(str(mount))  # outside the namespace: not mounted


# -- an elastic job's membership change (issue 40): the data split again, the node store kept --

def test_a_membership_change_splits_the_data_again_and_keeps_the_node_store(digits_root, tmp_path):
    """Node 0 of 2 loses the other node, later gets it back (Elastic Horovod's resets,
    `DataCache.reset`): on one node its rank reads the whole data set per epoch, the samples
    of its own part from its store and the other node's from the source once; back on two
    nodes its part is served from its slab again, nothing read. The samples are byte-identical
    throughout, and a dataset made before a reset refuses to go on under the new split."""
    source = CountingSource()
    cache = make_cache(digits_root, tmp_path, source=source, placement=Placement(0, 2, 0, 1))
    home = set(cache.part.tolist())
    stale = cache.dataset(8, with_index=True, epochs=None)
    _, _, ids = epoch(cache.dataset(8, with_index=True))
    assert set(ids.tolist()) == home and source.total_reads == len(home) == 24
    store = cache.store
    source.reset()

    cache.reset(Placement(0, 1, 0, 1))  # the other node is gone
    assert cache.store is store and len(cache.part) == 48 and cache.per_rank == 48
    for e in (1, 2):
        images, _, ids = epoch(cache.dataset(8, with_index=True, first_epoch=e))
        assert sorted(ids.tolist()) == list(range(48))  # every sample once per epoch
        assert all(np.array_equal(x, direct(cache.catalog.paths[i])) for x, i in zip(images, ids))
    paths = cache.catalog.paths
    assert sorted(source.reads) == sorted(paths[i] for i in range(48) if i not in home)  # the other part, once
    assert set(source.reads.values()) == {1}
    with pytest.raises(tf.errors.InvalidArgumentError, match="made before an elastic reset"):
        next(iter(stale))
    source.reset()

    cache.reset(Placement(0, 2, 0, 1))  # the node is back: the store's own part, from its slab
    images, _, ids = epoch(cache.dataset(8, with_index=True, first_epoch=3))
    assert set(ids.tolist()) == home and source.total_reads == 0
    assert cache.reader.slab((RES, RES)) is not None and cache.store.slab_complete(cache.reader.slab((RES, RES)))
    assert all(np.array_equal(x, direct(paths[i])) for x, i in zip(images, ids))
    cache.close()


def test_open_caches_are_split_again_in_the_order_they_were_made(digits_root, tmp_path, monkeypatch):
    """`hvdx.elastic`'s reset calls `reset_open()`: every cache not closed, oldest first."""
    import weakref

    from hvdx.data import datacache

    monkeypatch.setattr(datacache, "_OPEN", weakref.WeakSet())  # not the other tests' caches
    train = make_cache(digits_root, tmp_path, placement=Placement(1, 2, 0, 1))
    val = make_cache(digits_root, tmp_path, placement=Placement(1, 2, 0, 1), seed=1)
    closed = make_cache(digits_root, tmp_path, placement=Placement(1, 2, 0, 1), seed=2)
    closed.close()
    order = []
    for c in (train, val, closed):
        c.reset = lambda placement=None, c=c: order.append(c)
    assert datacache.reset_open(Placement(0, 1, 0, 1)) == 2 and order == [train, val]
    train.close()
    val.close()


def test_progressive_resizing_keeps_each_resolution_under_its_own_key(digits_root, tmp_path):
    source = CountingSource()
    cache = make_cache(digits_root, tmp_path, source=source)
    for res in (8, 20):  # 40 px JPEGs: 8 px is decoded by libjpeg at 1/4 scale, 20 px at 1/2
        images, _, ids = epoch(cache.dataset(16, resolution=res, with_index=True))
        assert images.shape[1:] == (res, res, 3)
        assert all(np.array_equal(x, direct(cache.catalog.paths[i], res)) for x, i in zip(images, ids))
        graph = tf.function(lambda p, r=res: decode_image(tf.io.read_file(p), r))  # tf.data's way, the same pixels
        assert all(np.array_equal(x, graph(tf.constant(cache.catalog.paths[i])).numpy())
                   for x, i in zip(images[:8], ids[:8]))
    assert source.total_reads == 48  # the second phase decodes from level 1
    assert len(cache.store.keys()) == 96
    assert {k[8:] for k in cache.store.keys()} == {sample_key(0, (8, 8))[8:], sample_key(0, (20, 20))[8:]}


def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def slabs(store):
    return sorted(name for name in os.listdir(store.path) if name.startswith("slab-"))


def test_epoch_2_is_gathered_from_the_node_slab_without_a_copy_per_rank(digits_root, tmp_path):
    """The node's part at one resolution is one flat file on /dev/shm; from epoch 2 on each
    batch is gathered from its mapping (shared pages), not from a per-rank copy."""
    res = 160  # 48 x 160 x 160 x 3 = 3.5 MiB: a per-rank copy would show in anonymous memory
    cache = make_cache(digits_root, tmp_path, resolution=res, memory_bytes=2**27)
    ds = cache.dataset(8, with_index=True)
    mapped = rss_kib("RssFile") + rss_kib("RssShmem")
    first = epoch(ds)  # gathered from the slab too, once each batch's samples are decoded into it
    slab = Slab(os.path.join(cache.store.path, slabs(cache.store)[0]), cache.part, (res, res, 3))
    decoded = 48 * res * res * 3
    assert slabs(cache.store) == [f"slab-{res}x{res}x3-n48"] and slab.size == Slab.file_size(48, (res, res, 3))
    assert decoded <= cache.store.memory_used() <= decoded + 2**18  # the part, once (+ the LMDB index)
    assert set(cache.store.locate(cache.store.keys())) == {2}  # LMDB holds no pixels
    anon, peak = rss_kib("RssAnon"), 0
    images, labels, ids = [], [], []
    for x, y, i in ds:  # epoch 2
        peak = max(peak, rss_kib("RssAnon") - anon)
        images.append(x.numpy())
        labels.append(y.numpy())
        ids.append(i.numpy())
    images, labels, ids = np.concatenate(images), np.concatenate(labels), np.concatenate(ids)
    # read from the store's file mapping (on /dev/shm: shared memory; here under tmp_path)...
    assert (rss_kib("RssFile") + rss_kib("RssShmem") - mapped) * 1024 >= 0.9 * decoded
    assert peak * 1024 < decoded / 2  # ... not from a copy of them
    assert sorted(ids) == list(range(48)) and list(ids) != list(first[2])
    for x, y, i in zip(images, labels, ids):  # byte-identical to the source, and to the slab's slot
        assert np.array_equal(x, direct(cache.catalog.paths[i], res)) and y == cache.catalog.labels[i]
        assert np.array_equal(x, slab.pixels[slab.slots([i])[0]]) and slab.labels[slab.slots([i])[0]] == y
    assert cache.store.stats["hits"] == 48


@pytest.mark.filterwarnings("ignore:hvdx.data.*is full:RuntimeWarning")
def test_without_a_fixed_resolution_or_room_for_a_slab_samples_stay_in_lmdb(digits_root, tmp_path):
    for kwargs in ({"resolution": None}, {"memory_bytes": 60 * 1024}):  # the part takes 81 KiB at 24 px
        cache = make_cache(digits_root, tmp_path / str(len(kwargs)) / next(iter(kwargs)), **kwargs)
        for _ in range(2):
            images, labels, ids = epoch(cache.dataset(8, with_index=True))
            assert len(ids) == 48 and images.shape[1:] == ((40, 40, 3) if "resolution" in kwargs else (RES, RES, 3))
            assert all(np.array_equal(x, direct(cache.catalog.paths[i], cache.resolution)) for x, i in zip(images, ids))
        assert slabs(cache.store) == [] and set(cache.store.locate(cache.store.keys())) == {1}


def test_augmentation_runs_per_sample_after_the_cache(digits_root, tmp_path):
    cache = make_cache(digits_root, tmp_path)
    for _ in range(2):
        images, _, ids = epoch(cache.dataset(48, augment=tf.image.random_flip_left_right, with_index=True))
        flipped = [np.array_equal(x, direct(cache.catalog.paths[i])[:, ::-1]) for x, i in zip(images, ids)]
        kept = [np.array_equal(x, direct(cache.catalog.paths[i])) for x, i in zip(images, ids)]
        assert all(f or k for f, k in zip(flipped, kept)) and 0 < sum(flipped) < 48  # drawn per sample
    x, y = next(iter(cache.dataset(4, augment=lambda image: tf.cast(image, tf.float32)[2:-2, 2:-2] / 255.0)))
    assert x.dtype == tf.float32 and x.shape == (4, RES - 4, RES - 4, 3) and y.shape == (4,)

    def upside_down(image):  # a Python op: XLA cannot compile it, so it runs uncompiled
        return tf.ensure_shape(tf.numpy_function(lambda x: np.ascontiguousarray(x[::-1]), [image], tf.uint8),
                               image.shape)

    with pytest.warns(RuntimeWarning, match="cannot be compiled with XLA"):
        ds = cache.dataset(8, augment=upside_down, with_index=True)
    for ds in (ds, cache.dataset(8, augment=tf.image.flip_up_down, compile_augment=False, with_index=True)):
        images, _, ids = epoch(ds)
        assert all(np.array_equal(x, direct(cache.catalog.paths[i])[::-1]) for x, i in zip(images, ids))


def _fill_slab(path, meta, part, start, barrier):
    store = NodeStore(path, meta, 2**26)
    assert store.slab((16, 16), 3, part) is not None
    barrier.wait()
    for i in range(start, start + 300):  # one transaction each: many interleaved writers
        store.put_many([(sample_key(int(part[i]), (16, 16)), np.full((16, 16, 3), i % 251, np.uint8), i)])


def test_two_processes_filling_one_slab_at_once_do_not_corrupt_it(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    path, meta, part = str(tmp_path / "store"), {"fingerprint": "f", "node": 0}, np.arange(0, 1350, 3)
    procs = [ctx.Process(target=_fill_slab, args=(path, meta, part, start, barrier)) for start in (0, 150)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    store = NodeStore(path, meta, 2**26)
    assert not store.rebuilt and os.listdir(path).count("slab-16x16x3-n450") == 1
    slab = store.slab((16, 16), 3, part)
    keys = [sample_key(int(s), (16, 16)) for s in part]
    assert set(store.locate(keys)) == {2}
    assert all((slab.pixels[j] == j % 251).all() and slab.labels[j] == j for j in range(450))
    images, labels = store.get_batch(keys[::-1], (16, 16, 3))
    assert np.array_equal(labels, np.arange(450)[::-1]) and np.array_equal(images[:, 0, 0, 0], labels % 251)
    store.close()
    other = NodeStore(path, {"fingerprint": "g", "node": 0}, 2**26)  # another data set: the slab goes too
    assert other.rebuilt and not [n for n in os.listdir(path) if n.startswith("slab-")]


def test_reduced_size_jpeg_decoding_is_close_to_a_full_decode(digits_root):
    data = tf.io.read_file(os.path.join(digits_root, "digit0", "0000.jpg"))
    reduced = decode_image(data, 10).numpy().astype(int)  # 40 -> 10: decode_jpeg(ratio=4)
    full = tf.image.resize(tf.io.decode_jpeg(data, channels=3), (10, 10), antialias=True).numpy()
    assert np.abs(reduced - full).mean() < 8


# -- the split: parts per node, disjoint shares, equal counts --------------------------------

@pytest.mark.parametrize("n,remainder", [(40, "drop"), (43, "drop"), (43, "pad")])
def test_every_sample_once_per_epoch_and_every_rank_the_same_count(n, remainder):
    ids = np.arange(n)
    parts = [node_part(ids, 2, j, split_seed=5) for j in range(2)]
    assert sorted(np.concatenate(parts)) == list(ids)  # each node keeps only its part
    per_rank = samples_per_rank([len(p) for p in parts], 2, remainder)
    for e in range(3):
        read, left = [], []
        for part in parts:
            for lr in range(2):
                share, leftover = epoch_share(part, e, seed=1, local_rank=lr, local_size=2, per_rank=per_rank)
                assert len(share) == per_rank and set(share) <= set(part)
                read.extend(share)
                left.extend(leftover)
        if remainder == "drop":
            assert per_rank == n // 4 and len(set(read)) == len(read)  # never twice
            assert sorted(read + left) == list(ids)  # leftovers are still decoded into the store
        else:
            assert per_rank == -(-n // 4) and set(read) == set(ids)  # everyone at least once
            assert len(read) - len(set(read)) == 4 * per_rank - n
    e0 = epoch_share(parts[0], 0, 1, 0, 2, per_rank)[0]
    assert not np.array_equal(e0, epoch_share(parts[0], 1, 1, 0, 2, per_rank)[0])


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_the_ranks_of_a_node_share_its_store_and_split_every_epoch(digits_root, tmp_path, remainder):
    """Five local ranks of one node (in one process): 48 samples, 9 (drop) or 10 (pad) each."""
    source = CountingSource()
    caches = [make_cache(digits_root, tmp_path, source=source, remainder=remainder, placement=Placement(0, 1, l, 5))
              for l in range(5)]
    assert len({c.store.path for c in caches}) == 1
    per_rank = {"drop": 9, "pad": 10}[remainder]
    datasets = [c.dataset(4, with_index=True) for c in caches]
    for e in range(2):
        shares = [epoch(ds)[2] for ds in datasets]
        assert [len(s) for s in shares] == [per_rank] * 5 and all(c.samples_per_rank == per_rank for c in caches)
        read = np.concatenate(shares)
        if remainder == "drop":
            assert len(set(read)) == 45  # 3 left over, never one twice
        else:
            assert set(read) == set(range(48)) and len(read) == 50
        if e == 0:
            assert len(caches[0].store.keys()) == 48 and source.total_reads == 48  # leftovers stored too
            source.reset()
    assert source.total_reads == 0
    for augment in (None, tf.image.flip_left_right):  # two epochs in one iteration: batches never straddle
        sizes = [len(i) for _, _, i in caches[0].dataset(4, epochs=2, augment=augment, with_index=True)]
        assert sizes == [4, 4, per_rank - 8] * 2
        sizes = [len(i) for _, _, i in caches[0].dataset(4, epochs=2, augment=augment, drop_remainder=True,
                                                           with_index=True)]
        assert sizes == [4, 4] * 2 and caches[0].steps_per_epoch(4, drop_remainder=True) == 2


def two_nodes_data(tmp_path):
    """66 digits as JPEGs and 40 of them as 4 TFRecord shards, for the 2x2 check (its kwargs)."""
    root = write_digits(tmp_path / "data", 66)
    write_tfrecords(sorted(DataCache(root, cache_dir=str(tmp_path / "d0"), store_dir=str(tmp_path / "s0"),
                                     memory_bytes=2**24).catalog.paths)[:40], tmp_path / "records", shards=4)
    return {"root": root, "cache_dir": str(tmp_path / "disk"), "store_dir": str(tmp_path / "shm"),
            "tfrecords": str(tmp_path / "records" / "train-*.tfrecord")}


@suite.runs(suite.check("datacache.one_store_per_node", "2x2", timeout=240, setup=two_nodes_data))
def test_two_by_two_ranks_one_store_per_node_each_with_its_part(ranks):
    """Horovod's 2-node topology on one machine: both "nodes" share the level-1 directory
    (file locks), each keeps its own store, named by its node."""
    data, tmp_path = ranks, ranks.workdir
    assert sorted(os.listdir(tmp_path / "shm")) == sorted(
        f"{name}{suffix}" for name in {r["store_path"].rsplit("/", 1)[1] for r in data.values()}
        for suffix in ("", ".lock", ".users"))  # .users: held (shared) while a process has it open
    stores = {r["node"]: r["store_path"] for r in data.values()}
    assert len(stores) == 2 and all(data[r]["store_path"] == stores[data[r]["node"]] for r in data)
    parts = {r["node"]: r["part"] for r in data.values()}
    assert sorted(parts[0] + parts[1]) == list(range(66)) and len(parts[0]) == len(parts[1]) == 33
    for r in data.values():
        assert r["stored"] == parts[r["node"]]  # the node's part, all of it, and nothing else
        assert r["slabs"] == {"slab-24x24x3-n33": Slab.file_size(33, (24, 24, 3))}  # once per node, its part
        assert r["per_rank"] == 16 and r["steps_per_epoch"] == 4
    for e in range(2):
        ids = [i for r in data.values() for i in r["epochs"][e]["ids"]]
        assert len(ids) == len(set(ids)) == 64  # 66 = 4 x 16 + 2 dropped this epoch, none twice
        assert all(set(r["epochs"][e]["ids"]) <= set(parts[r["node"]]) for r in data.values())
        assert {r["epochs"][e]["batches"] for r in data.values()} == {4}
        assert all(r["epochs"][e]["labels_ok"] for r in data.values())
    assert sum(r["epochs"][0]["source_reads"] for r in data.values()) == 66  # every file once per job
    assert sum(r["epochs"][1]["source_reads"] for r in data.values()) == 0
    # TFRecords: 4 files of 10 records, two whole files per node, 10 records per rank, each once
    tf_parts = {r["node"]: r["tfrecord_part"] for r in data.values()}
    assert sorted(tf_parts[0] + tf_parts[1]) == sorted(s * 2**32 + j for s in range(4) for j in range(10))
    assert {len({i // 2**32 for i in part}) for part in tf_parts.values()} == {2}
    ids = [i for r in data.values() for i in r["tfrecord_ids"]]
    assert len(ids) == len(set(ids)) == 40 and all(len(r["tfrecord_ids"]) == 10 for r in data.values())


# -- concurrency: one writer per file, two processes filling one store ------------------------

def test_concurrent_readers_fetch_each_file_once(digits_root, tmp_path):
    source = CountingSource()
    paths = DataCache(digits_root, cache_dir=str(tmp_path / "d0"), store_dir=str(tmp_path / "s"),
                      memory_bytes=2**24).catalog.paths
    disks = [DiskCache(str(tmp_path / "disk"), "fp", source) for _ in range(4)]  # as 4 ranks would
    threads = [threading.Thread(target=lambda d=d: [d.read(p) for p in paths]) for d in disks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert source.total_reads == len(paths) and set(source.reads.values()) == {1}


def _fill(path, meta, start, barrier):
    store = NodeStore(path, meta, 2**26)
    barrier.wait()
    for i in range(start, start + 300):  # one transaction each: many interleaved writers
        image = np.full((16, 16, 3), i % 251, np.uint8)
        store.put_many([(sample_key(i, (16, 16)), image, i)])


def test_two_processes_filling_one_node_store_at_once_do_not_corrupt_it(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    path, meta = str(tmp_path / "store"), {"fingerprint": "f", "node": 0}
    procs = [ctx.Process(target=_fill, args=(path, meta, start, barrier)) for start in (0, 150)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    check = subprocess.run([sys.executable, "-c", f"""
import lmdb, struct, numpy as np
env = lmdb.open({path!r}, readonly=True, lock=False)
with env.begin() as txn:
    out = {{}}
    for k, v in txn.cursor():
        if len(k) != 20: continue  # the metadata (keys: index, height, width, channels)
        i = struct.unpack(">QIII", k)[0]
        label, h, w, c = struct.unpack_from("<qIII", v)
        px = np.frombuffer(v, np.uint8, offset=20)
        out[i] = bool(label == i and (h, w, c) == (16, 16, 3) and px.size == 768 and (px == i % 251).all())
print(len(out), all(out.values()))
"""], capture_output=True, text=True, timeout=60)
    assert check.stdout.split() == ["450", "True"], check.stdout + check.stderr


# -- damaged copies, foreign caches, bad data, limits -----------------------------------------

def test_a_truncated_cached_copy_is_detected_and_fetched_again(digits_root, tmp_path):
    source = CountingSource()
    disk = DiskCache(str(tmp_path / "disk"), "fp", source)
    path = os.path.join(digits_root, "digit1", "0001.jpg")
    original = disk.read(path)
    local = disk.path_of(path)
    with open(local, "r+b") as f:
        f.truncate(os.path.getsize(local) // 2)
    source.reset()
    assert disk.read(path) == original and source.total_reads == 1 and disk.stats["refetched"] == 1
    with open(local, "r+b") as f:  # same size, one byte flipped: the checksum catches it
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert disk.read(path) == original and source.total_reads == 2 and disk.read(path) == original
    assert source.total_reads == 2


def test_caches_of_another_data_set_or_version_are_rebuilt(digits_root, tmp_path, monkeypatch):
    path = os.path.join(digits_root, "digit1", "0001.jpg")
    old = DiskCache(str(tmp_path / "disk"), "data-set-A", CountingSource())
    old.read(path)
    assert os.path.exists(old.path_of(path))
    new = DiskCache(str(tmp_path / "disk"), "data-set-B", CountingSource())
    assert not os.path.exists(new.path_of(path))
    assert json.loads((tmp_path / "disk" / "CACHE.json").read_text())["fingerprint"] == "data-set-B"
    new.read(path)
    with monkeypatch.context() as m:  # the same data set, cached by another hvdx version
        m.setattr(hvdx.version, "__version__", "99.0")
        assert not os.path.exists(DiskCache(str(tmp_path / "disk"), "data-set-B", CountingSource()).path_of(path))

    store = NodeStore(str(tmp_path / "store"), {"fingerprint": "A", "node": 0}, 2**24)
    store.put_many([(sample_key(1, None), np.zeros((2, 2, 3), np.uint8), 1)])
    again = NodeStore(str(tmp_path / "store"), {"fingerprint": "A", "node": 0}, 2**24)
    assert not again.rebuilt and len(again.keys()) == 1
    monkeypatch.setattr(hvdx.version, "__version__", "99.0")  # written by another hvdx version
    newer = NodeStore(str(tmp_path / "store"), {"fingerprint": "A", "node": 0}, 2**24)
    assert newer.rebuilt and newer.keys() == []
    other = NodeStore(str(tmp_path / "store"), {"fingerprint": "B", "node": 0}, 2**24)
    assert other.rebuilt and other.keys() == []


@pytest.fixture
def bad_root(tmp_path):
    root = write_digits(tmp_path / "bad", 16)
    with open(os.path.join(root, "digit0", "0000.jpg"), "rb") as f:
        good = f.read()
    with open(os.path.join(root, "digit0", "truncated.jpg"), "wb") as f:
        f.write(good[: len(good) // 3])
    with open(os.path.join(root, "digit1", "garbage.jpg"), "wb") as f:
        f.write(b"this is not an image" * 10)
    return root


def test_an_undecodable_jpeg_is_reported_with_its_path(bad_root, tmp_path):
    cache = make_cache(bad_root, tmp_path)
    with pytest.raises(tf.errors.OpError, match=r"cannot decode .*digit(0/truncated|1/garbage)\.jpg"):
        epoch(cache.dataset(4, with_index=True))


def test_undecodable_files_can_be_skipped_and_counted(bad_root, tmp_path):
    cache = make_cache(bad_root, tmp_path / "skip", on_error="skip")
    with pytest.warns(RuntimeWarning, match="skipping undecodable"):
        images, labels, ids = epoch(cache.dataset(6, with_index=True))
    assert len(ids) == 18 and cache.steps_per_epoch(6) == 3  # replaced in their batch: counts stay equal
    assert cache.stats["skipped"] == 2
    assert sorted(os.path.basename(p) for p in cache.skipped) == ["garbage.jpg", "truncated.jpg"]
    assert all(np.array_equal(x, direct(cache.catalog.paths[i])) for x, i in zip(images, ids))


def test_an_exhausted_memory_budget_reads_through_with_one_warning(digits_root, tmp_path):
    source = CountingSource()
    cache = make_cache(digits_root, tmp_path, source=source, memory_bytes=40 * 1024)  # ~20 samples
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            images, _, ids = epoch(cache.dataset(8, with_index=True))
            assert sorted(ids) == list(range(48))
            assert all(np.array_equal(x, direct(cache.catalog.paths[i])) for x, i in zip(images, ids))
    full = [w for w in caught if "is full" in str(w.message)]
    assert len(full) == 1 and cache.store.full
    assert source.total_reads == 48  # what memory cannot hold is decoded again from level 1


def test_a_full_disk_reads_through_with_one_warning(digits_root, tmp_path, monkeypatch):
    import errno

    from hvdx.data import disk as disk_module

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    source = CountingSource()
    disk = DiskCache(str(tmp_path / "disk"), "fp", source)
    monkeypatch.setattr(disk_module.os, "replace", no_space)
    paths = [os.path.join(digits_root, "digit0", "0000.jpg"), os.path.join(digits_root, "digit1", "0001.jpg")]
    with pytest.warns(RuntimeWarning, match="disk is full") as caught:
        for path in paths * 2:
            with open(path, "rb") as f:
                assert disk.read(path) == f.read()
    assert len([w for w in caught if "disk is full" in str(w.message)]) == 1
    assert source.total_reads == 4 and disk.stats["read_through"] == 3
    assert not [name for _, _, names in os.walk(tmp_path / "disk" / "files") for name in names]  # no debris


def test_a_bounded_disk_evicts_the_least_recently_used(digits_root, tmp_path):
    source = CountingSource()
    paths = sorted(DataCache(digits_root, cache_dir=str(tmp_path / "d0"), store_dir=str(tmp_path / "s"),
                             memory_bytes=2**24).catalog.paths)[:8]
    bound = sum(os.path.getsize(p) + 16 for p in paths[:4])
    disk = DiskCache(str(tmp_path / "disk"), "fp", source, max_bytes=bound)
    for p in paths[:4]:
        disk.read(p)
    disk.read(paths[0])  # recently used again
    for p in paths[4:6]:
        disk.read(p)
    assert disk.size_bytes() <= bound and disk.stats["evicted"] >= 2
    assert os.path.exists(disk.path_of(paths[0])) and not os.path.exists(disk.path_of(paths[1]))


# -- inputs and use: TFRecords, Model.fit, arguments ------------------------------------------

def write_tfrecords(paths, folder, shards):
    """The JPEGs at `paths` as tf.train.Examples, file s holding paths[s::shards], labelled
    100 s + j for the j-th record of file s."""
    os.makedirs(folder, exist_ok=True)
    for s in range(shards):
        with tf.io.TFRecordWriter(os.path.join(folder, f"train-{s}.tfrecord")) as writer:
            for j, path in enumerate(paths[s::shards]):
                with open(path, "rb") as f:
                    encoded = f.read()
                example = tf.train.Example(features=tf.train.Features(feature={
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[100 * s + j]))}))
                writer.write(example.SerializeToString())


def test_tfrecord_shards_are_cached_like_a_folder_tree(digits_root, tmp_path):
    paths = sorted(DataCache(digits_root, cache_dir=str(tmp_path / "d0"), store_dir=str(tmp_path / "s"),
                             memory_bytes=2**24).catalog.paths)
    write_tfrecords(paths, tmp_path, shards=3)
    source = CountingSource()
    cache = DataCache(tfrecords=str(tmp_path / "train-*.tfrecord"), resolution=RES, source=source,
                      cache_dir=str(tmp_path / "disk"), store_dir=str(tmp_path / "shm"), memory_bytes=2**26)
    assert source.total_reads == 3  # each shard fetched once, whole
    for _ in range(2):
        images, labels, ids = epoch(cache.dataset(10, with_index=True))
        assert len(ids) == 48 == len(set(ids))
        for x, y, i in zip(images, labels, ids):
            shard, record = divmod(int(i), 2**32)
            assert y == 100 * shard + record
            assert np.array_equal(x, direct(paths[shard::3][record]))
    assert source.total_reads == 3


def test_model_fit_trains_on_it_with_augmentation_after_the_cache(digits_root, tmp_path):
    source = CountingSource()
    cache = make_cache(digits_root, tmp_path, source=source)
    seen = []

    def augment(image):
        return tf.image.random_flip_left_right(image)

    ds = cache.dataset(16, augment=augment).map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y))
    model = tf.keras.Sequential([tf.keras.layers.Input((RES, RES, 3)), tf.keras.layers.Conv2D(4, 3),
                                 tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])
    model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(source.total_reads))
    history = model.fit(ds, epochs=3, verbose=0, callbacks=[callback])
    assert len(history.history["loss"]) == 3 and np.isfinite(history.history["loss"]).all()
    assert seen == [48, 48, 48]  # Keras re-iterates the dataset every epoch: no file read again


def test_bad_arguments_are_rejected_by_name(digits_root, tmp_path):
    with pytest.raises(ValueError, match="remainder"):
        make_cache(digits_root, tmp_path, remainder="wrap")
    with pytest.raises(ValueError, match="on_error"):
        make_cache(digits_root, tmp_path, on_error="ignore")
    with pytest.raises(ValueError, match="resolution"):
        make_cache(digits_root, tmp_path, resolution=(0, 4))
    with pytest.raises(ValueError, match="exactly one of root"):
        DataCache()
    with pytest.raises(ValueError, match="root .* is not a directory"):
        make_cache(str(tmp_path / "missing"), tmp_path)
    cache = make_cache(digits_root, tmp_path)
    with pytest.raises(ValueError, match="batch_size"):
        cache.dataset(0)
    with pytest.raises(ValueError, match="placement"):
        Placement(node=2, num_nodes=2)
    with pytest.raises(ValueError, match="too small"):
        make_cache(digits_root, tmp_path / "p", placement=Placement(0, 64, 0, 1))


# -- what changes the stored bytes is in the key or the store's identity -----------------------

def test_the_same_data_at_another_channel_count_is_decoded_again_not_read_as_zeros(digits_root, tmp_path):
    """Issue 27 (6): channels=3 then channels=1 on one node (one store, slab and LMDB values):
    the second run's pixels are its own decode, never the first run's slots or zeros."""
    for kwargs in ({}, {"resolution": None}):  # a slab at 24 px; LMDB values at 40 px
        folder = tmp_path / ("slab" if not kwargs else "values")
        for channels in (3, 1):
            cache = make_cache(digits_root, folder, channels=channels, **kwargs)
            for _ in range(2):
                images, labels, ids = epoch(cache.dataset(16, with_index=True))
                assert images.shape[-1] == channels and sorted(ids) == list(range(48))
                assert np.array_equal(labels, cache.catalog.labels[ids]) and images.any()
                assert all(np.array_equal(x, decode_image(tf.io.read_file(cache.catalog.paths[i]), cache.resolution,
                                                          channels).numpy()) for x, i in zip(images, ids))
            stored = len(cache.store.keys())
            cache.close()
        assert stored == 96  # one entry per sample per channel count


def test_the_decoder_format_and_version_are_the_stores_identity(digits_root, tmp_path):
    """Issue 27 (6): the resolution and channels are in the key (above); the decoder, the value
    format and hvdx's version are in the store's metadata: a store made by another is rebuilt."""
    from hvdx.data.decode import DECODER
    from hvdx.data.store import FORMAT

    cache = make_cache(digits_root, tmp_path)
    epoch(cache.dataset(16, with_index=True))
    meta = {k: v for k, v in cache.store.meta.items() if k not in ("format", "hvdx")}
    assert cache.store.meta["decoder"] == DECODER and cache.store.meta["format"] == FORMAT
    assert cache.store.meta["hvdx"] == hvdx.__version__ and meta["fingerprint"] == cache.fingerprint
    path = cache.store.path
    cache.close()
    same = NodeStore(path, meta, 2**26)
    assert not same.rebuilt and len(same.keys()) == 48
    same.close()
    other = NodeStore(path, {**meta, "decoder": DECODER + "|antialias"}, 2**26)
    assert other.rebuilt and other.keys() == [] and not slabs(other)
    other.close()


def test_a_file_replaced_in_place_is_read_and_decoded_again(tmp_path):
    """Issue 27 (9): size and mtime are in the fingerprint and name each level-1 copy."""
    root = write_digits(tmp_path / "data", 12)
    source = CountingSource()
    cache = make_cache(root, tmp_path, source=source)
    epoch(cache.dataset(4, with_index=True))
    path = cache.catalog.paths[5]
    cache.close()
    other = write_digits(tmp_path / "other", 12, seed=9)  # different noise: different pixels
    with open(os.path.join(other, os.path.relpath(path, root)), "rb") as f:
        replacement = f.read()
    with open(path, "wb") as f:  # in place, under the same name
        f.write(replacement)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    source.reset()
    again = make_cache(root, tmp_path, source=source)
    images, _, ids = epoch(again.dataset(4, with_index=True))
    assert again.store.rebuilt and source.reads == {path: 1}  # the others come from level 1
    assert np.array_equal(images[list(ids).index(5)], direct(path))
    again.close()


def test_the_local_disk_copy_defaults_to_node_local_scratch(digits_root, tmp_path, monkeypatch):
    """Issue 27 (9): $TMPDIR (not ~/.cache, often NFS on clusters), unless HVDX_DATACACHE_DIR."""
    monkeypatch.delenv("HVDX_DATACACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "scratch"))
    remote = CountingSource()  # a source that does not say its files are local
    cache = DataCache(digits_root, resolution=RES, store_dir=str(tmp_path / "shm"), memory_bytes=2**26, source=remote)
    assert cache.disk.directory.startswith(str(tmp_path / "scratch" / f"hvdx-datacache-{os.getuid()}"))
    assert cache.disk.directory in repr(cache)
    cache.close()
    monkeypatch.setenv("HVDX_DATACACHE_DIR", str(tmp_path / "chosen"))
    cache = DataCache(digits_root, resolution=RES, store_dir=str(tmp_path / "shm"), memory_bytes=2**26, source=remote)
    assert cache.disk.directory.startswith(str(tmp_path / "chosen"))
    cache.close()


def test_files_on_a_local_disk_get_no_level_1_copy(digits_root, tmp_path):
    """Issue 27 (8b): a copy of a file on a local disk costs a file write per sample in epoch 1
    and saves nothing; `disk_copy=True` keeps one anyway."""
    cache = DataCache(digits_root, resolution=RES, cache_dir=str(tmp_path / "disk"), store_dir=str(tmp_path / "shm"),
                      memory_bytes=2**26)  # the default source, GFileSource, on a local file system
    images, _, ids = epoch(cache.dataset(16, with_index=True))
    assert not os.path.exists(tmp_path / "disk") and cache.disk.stats["hits"] == cache.disk.stats["misses"] == 0
    assert all(np.array_equal(x, direct(cache.catalog.paths[i])) for x, i in zip(images, ids))
    assert "disk=None" in repr(cache)
    cache.close()
    kept = DataCache(digits_root, resolution=RES, cache_dir=str(tmp_path / "disk"), store_dir=str(tmp_path / "shm2"),
                     memory_bytes=2**26, disk_copy=True)
    epoch(kept.dataset(16, with_index=True))
    assert kept.disk.stats["misses"] == 48 and kept.disk.size_bytes() > 0
    kept.close()


def test_a_decode_error_in_a_dropped_leftover_fails_the_epoch_that_decodes_it(bad_root, tmp_path):
    """Issue 27 (9): remainder="drop" leftovers are decoded in epoch 1 by the prefetcher; an
    undecodable one fails that epoch, naming its file (it used to surface epochs later)."""
    probe = make_cache(bad_root, tmp_path / "probe", placement=Placement(0, 1, 0, 4))
    bad = {i for i, p in enumerate(probe.catalog.paths) if "garbage" in p or "truncated" in p}
    seed = next(s for s in range(200)  # a seed whose epoch-0 leftovers of rank 0 hold a bad file, its share none
                if bad & set(epoch_share(probe.part, 0, s, 0, 4, probe.per_rank)[1])
                and not bad & set(epoch_share(probe.part, 0, s, 0, 4, probe.per_rank)[0]))
    probe.close()
    cache = make_cache(bad_root, tmp_path, seed=seed, placement=Placement(0, 1, 0, 4))
    with pytest.raises(tf.errors.OpError, match=r"cannot decode .*digit(0/truncated|1/garbage)\.jpg"):
        epoch(cache.dataset(2, with_index=True))
    cache.close()
    skipping = make_cache(bad_root, tmp_path / "skip", seed=seed, on_error="skip", placement=Placement(0, 1, 0, 4))
    with pytest.warns(RuntimeWarning, match="skipping undecodable"):
        epoch(skipping.dataset(2, with_index=True))
    assert skipping.stats["skipped"] == 1
    skipping.close()


def test_batches_have_a_static_shape_so_keras_augmentation_maps_over_them(digits_root, tmp_path):
    """Issue 27 (8): the like-for-like pipeline maps uncompiled Keras layers over the batches
    of either pipeline; the layers need the batch's rank and sizes."""
    cache = make_cache(digits_root, tmp_path)
    ds = cache.dataset(16)
    assert ds.element_spec[0].shape.as_list() == [None, RES, RES, 3]
    flip = tf.keras.layers.RandomFlip("horizontal", seed=0)
    images = [x.numpy() for x, _ in ds.map(lambda x, y: (flip(x, training=True), y))]
    assert sum(len(x) for x in images) == 48 and images[0].shape[1:] == (RES, RES, 3)
    cache.close()


# -- stores do not leak ----------------------------------------------------------------------------

def test_a_run_replaces_the_stores_of_its_data_set_and_names_stale_ones(digits_root, tmp_path, capsys, caplog,
                                                                         monkeypatch):
    """Issue 27 (7): another split rebuilds the node's store; another node count makes its
    own (the unused stores of the old node count go); stores of other data sets that no process uses are
    named (in a log line while small: a job's validation set, a finished job's warm store;
    in a warning once they hold a share of the file system), listed and cleared by
    `python -m hvdx.data`, never one in use."""
    from hvdx.data import store as store_module
    from hvdx.data.__main__ import main

    shm = tmp_path / "shm"
    for node in (0, 1):  # a 2-node job on this machine
        c = make_cache(digits_root, tmp_path, placement=Placement(node, 2, 0, 1))
        epoch(c.dataset(8, with_index=True))
        c.close()
    assert len(os.listdir(shm)) == 2 * 3  # two stores (directory, .lock, .users)
    resplit = make_cache(digits_root, tmp_path, placement=Placement(0, 2, 0, 1), split_seed=3)  # another split
    assert resplit.store.rebuilt and len(os.listdir(shm)) == 2 * 3
    resplit.close()
    one = make_cache(digits_root, tmp_path, split_seed=4)  # a 1-node job: its own store, the 2 nodes' go
    assert not one.store.rebuilt and sorted(os.listdir(shm)) == sorted(os.path.basename(one.store.path) + s
                                                                       for s in ("", ".lock", ".users"))
    other = write_digits(tmp_path / "other", 8)
    old = DataCache(other, resolution=RES, cache_dir=str(tmp_path / "disk-o"), store_dir=str(shm), memory_bytes=2**26)
    epoch(old.dataset(4, with_index=True))
    old.close()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="hvdx.data"):
        warnings.simplefilter("error", RuntimeWarning)  # a small stale store: no warning
        make_cache(digits_root, tmp_path, split_seed=4).close()
    assert "holds 1 stale node store" in caplog.text
    monkeypatch.setattr(store_module, "STALE_WARNING_SHARE", 0.0)  # as if it held much of /dev/shm
    with pytest.warns(RuntimeWarning, match=r"holds 1 stale node store.*python -m hvdx.data clear"):
        again = make_cache(digits_root, tmp_path, split_seed=4)
    assert main(["list", "--store-dir", str(shm)]) == 0
    listed = capsys.readouterr().out
    assert f"{os.path.basename(old.store.path)}" in listed and "stale" in listed and "in use" in listed
    assert main(["clear", "--store-dir", str(shm)]) == 0  # the stale one only
    assert [s for s in os.listdir(shm) if "." not in s] == [os.path.basename(again.store.path)]
    assert main(["clear", "--store-dir", str(shm), os.path.basename(again.store.path)]) == 1  # in use: kept
    assert os.path.isdir(again.store.path)
    one.close()
    again.close()
    assert main(["clear", "--store-dir", str(shm)]) == 0 and os.listdir(shm) == []


# -- the benchmark (Figure 9) runs end to end (tiny sizes; timings are never asserted) --------

@pytest.mark.slow
def test_datacache_benchmark_writes_json_plot_and_table(tmp_path):
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "datacache.py"), "--quick",
                           "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "datacache.json").read_text())
    assert result["config"]["images"] == 64 and result["config"]["rounds"] == 1
    rounds = result["rounds_seconds"]
    assert sorted(rounds) == sorted(["no_cache", "no_cache_16", "tf_cache", "datacache", "datacache_uncompiled",
                                     "datacache_rerun"])
    full = [m for m in rounds if m not in ("datacache_rerun", "datacache_uncompiled")]
    assert all(len(rounds[m]) == 1 and len(rounds[m][0]) == 2 and min(rounds[m][0]) > 0 for m in full)
    assert len(rounds["datacache_rerun"][0]) == 1
    assert rounds["datacache_uncompiled"][0][0] is None and rounds["datacache_uncompiled"][0][1] > 0  # epoch 2+ only
    cpu = result["rounds_cpu_seconds"]
    assert all(len(cpu[m][0]) == len(rounds[m][0]) and min(v for v in cpu[m][0] if v is not None) > 0 for m in rounds)
    assert len(result["machine"]["load_average"]["start"]) == 3
    assert sorted(result["training_step_s"]) == ["datacache", "no_cache", "tf_cache"]
    assert result["memory_per_node_bytes"]["datacache"] > result["decoded_bytes"] > 0  # the store holds it all
    assert (tmp_path / "datacache.png").stat().st_size > 10_000
    assert sorted(result["training_step_seconds"]) == ["datacache", "no_cache", "tf_cache"]
    text = readme.read_text()
    assert "<!-- datacache:begin -->" in text and "| DataCache, later run |" in text
    assert "| DataCache, augmentation not compiled |" in text and "load average" in text
    assert "Epoch 2+ input time, no cache over DataCache" in text and "goal >= 10x" in text
    readme.write_text("# benchmarks\n")  # --render redoes table, plot and summary from the raw JSON alone
    from benchmarks import datacache  # its command line in this process: no second TensorFlow start-up

    datacache.main(["--render", "--out", str(tmp_path), "--readme", str(readme)])
    block = text[text.index("<!-- datacache:begin -->"):]
    assert readme.read_text() == "# benchmarks\n\n" + block


@pytest.mark.slow
def test_datacache_benchmark_like_for_like_rows(tmp_path):
    """Issue 27 (8): files on a local disk, no augmentation and uncompiled Keras augmentation,
    DataCache against `.cache()` (epochs 2+) and plain tf.data (epoch 1); 1 rank here (the
    2x2 row launches horovodrun: `--like-topologies 2x2`, the default). The 1-rank rows run in
    this process, through the script's command line (the test above runs it as a script)."""
    from benchmarks import datacache

    readme = tmp_path / "README.md"
    datacache.main(["--like-for-like", "--quick", "--like-topologies", "", "--out", str(tmp_path),
                    "--readme", str(readme)])
    result = json.loads((tmp_path / "datacache_like.json").read_text())
    rounds = result["topologies"]["1"]["rounds_seconds"]
    assert sorted(rounds) == sorted(["plain_epoch1", "tf_cache_epoch1", "datacache_epoch1", "tf_cache_none",
                                     "datacache_none", "tf_cache_keras", "datacache_keras"])
    assert all(len(v) == 1 for v in rounds.values()) and len(rounds["datacache_none"][0]) == 1  # epochs 2+
    text = readme.read_text()
    assert "<!-- datacache-like:begin -->" in text and "| 1 | **" in text and "uncompiled Keras augmentation" in text


@pytest.mark.slow
def test_datacache_scale_benchmark_rows(tmp_path):
    """Issue 45's table: per-sample and fixed costs of epochs 2+ with three augmentations,
    epoch 1 from a slow source, a restarted job (a new process over the kept node store),
    node memory, the slab's mapping by a new process; 1 rank here, in this process."""
    from benchmarks import datacache_scale

    readme = tmp_path / "README.md"
    datacache_scale.main(["--quick", "--topologies", "1", "--out", str(tmp_path), "--readme", str(readme)])
    result = json.loads((tmp_path / "datacache_scale.json").read_text())["topologies"]["1"]
    rounds = result["rounds"]
    later = [f"{m}_{k}" for m in ("tf_cache", "datacache") for k in ("none", "keras", "crop")]
    assert sorted(rounds) == sorted(["plain_epoch1", "tf_cache_epoch1", "datacache_epoch1"] + later)
    budget = json.loads((tmp_path / "datacache_scale.json").read_text())["over_budget"]
    assert budget["budget_bytes"] < budget["decoded_bytes"] and len(budget["epochs"]) == 2
    assert budget["stats"][-1]["store"]["hits"] > 0  # part of epoch 2 from memory
    (job,) = result["relaunched"]  # --quick: one relaunch, one epoch 2+
    total, first, samples = job["epoch1"]
    assert 0 < first <= total and samples == 96 and len(job["later"]) == 1
    assert job["epoch1"][2] == 96 and job["epoch1_misses"] == 0  # served by the kept store: nothing decoded again
    assert result["memory_bytes"]["datacache_node"][0] >= 96 * 24 * 24 * 3  # the node's slab
    text = readme.read_text()
    assert "<!-- datacache-scale:begin -->" in text and "| 1 | **" in text and "restarted job" in text
    assert list(result["relaunched_variants"]) == ["default"] and "| 1 | default | **" in text
    mapping = json.loads((tmp_path / "datacache_scale.json").read_text())["mapping"]
    (run,) = mapping["4k"]["runs"]  # a new process mapped a slab-sized file on /dev/shm
    assert run["failed"] == 0 and run["bytes"] >= 96 * 24 * 24 * 3 and run["page_table_kib"] >= 0
    assert mapping["huge"] == {"skipped": "--quick"} and "**Mapping the slab**" in text


def test_datacache_scale_huge_tmpfs_is_never_mounted_by_a_smoke_run_and_checks_a_given_dir(tmp_path):
    """The `huge-pages` restart variant and the mapping measurement: --quick mounts nothing,
    and a --huge-dir without huge pages is refused with the reason, not measured as one."""
    import argparse

    from benchmarks import datacache_scale

    with datacache_scale.huge_tmpfs(2**20, argparse.Namespace(huge_dir=None, quick=True)) as (place, why):
        assert place is None and why == "--quick"
    with datacache_scale.huge_tmpfs(2**20, argparse.Namespace(huge_dir=str(tmp_path), quick=False)) as (place, why):
        assert place is None and "has no huge pages" in why
    assert list(tmp_path.iterdir()) == []  # its scratch folder is gone


def test_datacache_benchmark_verdict_says_by_how_much_a_goal_is_missed():
    from benchmarks import datacache

    assert datacache.verdict([8.0, 9.0, 12.0], 10.0) == "**9.00x** (goal >= 10x: missed by 10%; rounds 8.00-12.00x)"
    assert datacache.verdict([1.2], 1.0) == "**1.20x** (goal >= 1x: met; rounds 1.20-1.20x)"


def test_datacache_scale_restart_rows_per_variant():
    """The restarted job's rows: epoch 1 over the median of epochs 2+, whole and per sample
    (after the first batch), and the first batches, per variant."""
    from benchmarks import datacache_scale

    job = {"epoch1": (0.30, 0.08, 164), "later": [(0.20, 0.02, 164), (0.24, 0.02, 164), (0.22, 0.02, 164)]}
    fast = {"epoch1": (0.22, 0.02, 164), "later": job["later"]}
    text = datacache_scale.restart_table({"1": {"relaunched_variants": {"default": [job], "onednn-off": [fast]}}},
                                         batch=64)
    assert "| 1 | default | **0.73x** (goal >= 0.9x: missed by 19%" in text  # 0.22 / 0.30
    assert "| 0.91x | 80 / 20 |" in text  # per sample: (0.22 - 0.02) / (0.30 - 0.08), 100 samples each
    assert "| 1 | onednn-off | **1.00x** (goal >= 0.9x: met" in text and "| 1.00x | 20 / 20 |" in text
    assert datacache_scale.restart_table({"1": {}}, batch=64) == ""  # a run from before the variants
