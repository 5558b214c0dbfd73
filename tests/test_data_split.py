"""The split of DataCache (shi2021 sec. 4.1, hvdx/data/split.py): the nodes' parts come from
`split_seed`, every rank's samples of an epoch from (parts, epoch, ranks per node, seed,
remainder) alone, through one pure function, `assign`; every sample is read once per epoch
across the job ("drop": at most once, the leftovers decoded; "pad": at least once), every
rank reads the same number, and a job with another node count splits the same data anew.
"""
import numpy as np
import pytest

from hvdx.data.split import (Placement, RankSplit, Share, assign, deal, epoch_share, node_part,
                             samples_per_rank)


def parts_of(n, num_nodes, split_seed=5):
    return [node_part(np.arange(n), num_nodes, j, split_seed) for j in range(num_nodes)]


@pytest.mark.parametrize("num_nodes,local_size", [(1, 1), (1, 4), (2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("n", [24, 47, 101])
def test_drop_reads_every_sample_at_most_once_and_decodes_the_rest_as_leftovers(n, num_nodes, local_size):
    parts = parts_of(n, num_nodes)
    per_rank = samples_per_rank([len(p) for p in parts], local_size, "drop")
    for epoch in range(3):
        shares = assign(parts, epoch, local_size, seed=1, remainder="drop")
        assert [len(node) for node in shares] == [local_size] * num_nodes
        read = np.concatenate([s.samples for node in shares for s in node])
        left = np.concatenate([s.leftovers for node in shares for s in node])
        assert all(len(s.samples) == per_rank for node in shares for s in node)
        assert len(set(read.tolist())) == len(read) == per_rank * num_nodes * local_size  # never twice
        assert sorted(np.concatenate([read, left]).tolist()) == list(range(n))  # read or left over, once
        for part, node in zip(parts, shares):  # a rank reads only its node's part
            assert all(set(s.samples.tolist()) | set(s.leftovers.tolist()) <= set(part.tolist()) for s in node)


@pytest.mark.parametrize("num_nodes,local_size", [(1, 4), (2, 2), (3, 2)])
def test_pad_reads_every_sample_at_least_once_with_equal_counts(num_nodes, local_size):
    n = 43
    parts = parts_of(n, num_nodes)
    per_rank = samples_per_rank([len(p) for p in parts], local_size, "pad")
    shares = assign(parts, 0, local_size, seed=1, remainder="pad")
    read = np.concatenate([s.samples for node in shares for s in node])
    assert all(len(s.samples) == per_rank and len(s.leftovers) == 0 for node in shares for s in node)
    assert set(read.tolist()) == set(range(n)) and len(read) == per_rank * num_nodes * local_size


def test_assign_is_a_pure_function_of_its_arguments():
    parts = parts_of(60, 2)
    first = assign(parts, 3, 3, seed=9, remainder="drop")
    again = assign([p.copy() for p in parts], 3, 3, seed=9, remainder="drop")  # another call, other arrays
    assert all(np.array_equal(a.samples, b.samples) and np.array_equal(a.leftovers, b.leftovers)
               for x, y in zip(first, again) for a, b in zip(x, y))
    assert all(np.array_equal(p, q) for p, q in zip(parts, parts_of(60, 2)))  # its inputs are left alone
    later = assign(parts, 4, 3, seed=9, remainder="drop")
    other_seed = assign(parts, 3, 3, seed=10, remainder="drop")
    assert not np.array_equal(first[0][0].samples, later[0][0].samples)  # a new order every epoch
    assert not np.array_equal(first[0][0].samples, other_seed[0][0].samples)


def test_each_rank_computes_its_own_entry_of_assign():
    """A rank computes only its share (`RankSplit.share`, `epoch_share`): the entry of
    `assign` for its node and local rank, with nothing exchanged."""
    parts = parts_of(50, 2)
    per_rank = samples_per_rank([len(p) for p in parts], 3, "drop")
    shares = assign(parts, 2, 3, seed=4, remainder="drop")
    for node, part in enumerate(parts):
        for local_rank in range(3):
            mine = RankSplit(part, Placement(node, 2, local_rank, 3), seed=4, per_rank=per_rank).share(2)
            assert isinstance(mine, Share)
            assert np.array_equal(mine.samples, shares[node][local_rank].samples)
            assert np.array_equal(mine.leftovers, shares[node][local_rank].leftovers)
            samples, leftovers = epoch_share(part, 2, 4, local_rank, 3, per_rank)  # unpacks as a pair
            assert np.array_equal(samples, mine.samples) and np.array_equal(leftovers, mine.leftovers)


def test_deal_gives_disjoint_parts_of_round_robin_sizes_that_cover_everything():
    for count, num_nodes in [(10, 3), (7, 7), (1000, 4)]:
        dealt = [deal(count, num_nodes, j, split_seed=2) for j in range(num_nodes)]
        assert sorted(np.concatenate(dealt).tolist()) == list(range(count))
        assert [len(d) for d in dealt] == [len(range(j, count, num_nodes)) for j in range(num_nodes)]
        assert all(np.all(np.diff(d) > 0) for d in dealt)  # sorted positions
    ids = np.array([40, 10, 30, 20, 50])  # node_part takes the ids at the dealt positions, sorted
    assert node_part(ids, 2, 1, 3).tolist() == sorted(ids[deal(5, 2, 1, 3)].tolist())


def test_the_split_is_the_same_across_versions():
    """A node's store (its slab's slots) and a resumed run (`first_epoch=`) rely on the split
    being the same for the same seeds: these values were computed by earlier versions."""
    assert node_part(np.arange(10), 3, 1, 5).tolist() == [2, 6, 9]
    samples, leftovers = epoch_share(np.arange(11), 2, 7, 1, 3, 3)
    assert samples.tolist() == [5, 6, 8] and leftovers.tolist() == [7]


def test_a_changed_node_count_splits_the_same_samples_anew():
    """Elastic training re-splits the data over another set of nodes: with 3 nodes, then 2,
    each epoch's shares still read every sample at most once and read or leave each once."""
    n = 90
    for num_nodes in (3, 2):
        parts = parts_of(n, num_nodes)
        shares = assign(parts, 5, 2, seed=1, remainder="drop")
        read = [i for node in shares for s in node for i in s.samples.tolist()]
        left = [i for node in shares for s in node for i in s.leftovers.tolist()]
        assert len(read) == len(set(read)) and sorted(read + left) == list(range(n))


def test_bad_arguments_are_rejected_by_name():
    with pytest.raises(ValueError, match="remainder"):
        assign(parts_of(10, 1), 0, 1, seed=0, remainder="wrap")
    with pytest.raises(ValueError, match="placement"):
        Placement(node=0, num_nodes=1, local_rank=2, local_size=2)
