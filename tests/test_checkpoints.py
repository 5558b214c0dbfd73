"""hvdx.checkpoints: per-epoch, per-rank checkpoints, the newest N kept, and the run's state
file a resumed run reads (the 2 x 2 resume runs in tests/test_dawnbench.py)."""
import json
import os

import pytest
import tensorflow as tf

from hvdx.checkpoints import EpochCheckpoints, read_state, write_json


def save(checkpoints, epochs, value=0.0):
    return checkpoints.write(tf.train.Checkpoint(v=tf.Variable(value)), epochs)


def files(directory):
    return sorted(os.listdir(directory))


def test_only_the_newest_are_kept_once_a_new_one_is_written(tmp_path):
    checkpoints = EpochCheckpoints(str(tmp_path / "rank0"), keep=3)
    assert checkpoints.saved() == [] and checkpoints.newest() is None
    for epochs in range(1, 6):
        save(checkpoints, epochs, float(epochs))
        assert checkpoints.saved()[-1] == epochs                 # written before anything is removed
        removed = checkpoints.prune(epochs)
        assert removed == ([epochs - 3] if epochs > 3 else [])
    assert checkpoints.saved() == [3, 4, 5]
    assert files(tmp_path / "rank0") == [f"epoch{e}.{kind}" for e in (3, 4, 5)
                                         for kind in ("data-00000-of-00001", "index")]
    assert checkpoints.newest() == str(tmp_path / "rank0" / "epoch5")
    restored = tf.train.Checkpoint(v=tf.Variable(0.0))
    restored.read(checkpoints.newest()).assert_existing_objects_matched()
    assert float(restored.v) == 5.0                              # the newest is the last written


def test_keep_zero_keeps_all_and_a_negative_keep_is_refused(tmp_path):
    checkpoints = EpochCheckpoints(str(tmp_path), keep=0)
    for epochs in range(1, 5):
        save(checkpoints, epochs)
        assert checkpoints.prune(epochs) == []
    assert checkpoints.saved() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="0 for all"):
        EpochCheckpoints(str(tmp_path), keep=-1)


def test_checkpoints_of_an_earlier_longer_run_are_not_taken_for_the_newest(tmp_path):
    """A fresh run into the directory of an earlier run: the earlier run's later epochs are
    removed with the first prune, never the checkpoint just written."""
    checkpoints = EpochCheckpoints(str(tmp_path), keep=2)
    for epochs in range(1, 7):
        save(checkpoints, epochs)
    save(checkpoints, 1, 1.0)                                    # the new run's first epoch
    assert checkpoints.prune(1) == [2, 3, 4, 5, 6]
    assert checkpoints.saved() == [1]
    save(checkpoints, 2)
    save(checkpoints, 3)
    assert checkpoints.prune(3) == [1] and checkpoints.saved() == [2, 3]


def test_only_complete_checkpoints_count(tmp_path):
    """A checkpoint is listed once its index is written (the last file tf.train.Checkpoint
    writes); stray files are ignored."""
    checkpoints = EpochCheckpoints(str(tmp_path), keep=1)
    save(checkpoints, 1)
    (tmp_path / "epoch2.data-00000-of-00001").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("mine")
    assert checkpoints.saved() == [1]
    assert checkpoints.prune(1) == [] and "notes.txt" in files(tmp_path)


def test_the_state_file_is_written_whole_and_read_back(tmp_path):
    path = str(tmp_path / "state.json")
    with pytest.raises(FileNotFoundError, match="run without --resume first"):
        read_state(path)
    write_json(path, {"epoch": 3, "checkpoint": "epoch3"})
    assert read_state(path) == {"epoch": 3, "checkpoint": "epoch3"}
    assert files(tmp_path) == ["state.json"] and json.loads((tmp_path / "state.json").read_text())["epoch"] == 3
