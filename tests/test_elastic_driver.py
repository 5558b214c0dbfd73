"""Horovod patch 0004 (scripts/patches/horovod-0.28.1/0004-start-an-added-hosts-processes-
before-the-reset.patch), Horovod's elastic driver in process with fake workers: an added host's
processes start before the running workers are told, the workers are told once those wait in
their first init, the reset admits them; one that dies first or outlives the job is not the
job's. (The same with real processes: tests/test_elastic.py's node-return tests.)"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Tuple
from unittest import mock

import pytest

driver_module = pytest.importorskip("horovod.runner.elastic.driver")
from horovod.runner.elastic.discovery import FixedHosts  # noqa: E402

Slot = Tuple[str, int]


@pytest.fixture(autouse=True)
def patched_horovod(monkeypatch):
    assert hasattr(driver_module, "PRELAUNCH_ENV"), \
        "this Horovod lacks hvdx's patch 0004: run scripts/bootstrap.sh (docs/developing.md)"
    monkeypatch.setattr(driver_module, "DISCOVER_HOSTS_FREQUENCY_SECS", 0.05)
    monkeypatch.delenv(driver_module.PRELAUNCH_ENV, raising=False)


class Workers:
    """The driver's create_worker_fn: records each start as (host, local_rank, started ahead);
    a worker runs until the driver stops it or the test ends it (`exit`)."""

    def __init__(self) -> None:
        self.started: List[Tuple[str, int, bool]] = []
        self._ends: List[list] = []
        self._lock = threading.Lock()

    def __call__(self, slot_info, events):
        end = [threading.Event(), 0]
        with self._lock:
            self.started.append((slot_info.hostname, slot_info.local_rank,
                                 bool(getattr(slot_info, "prelaunched", False))))
            self._ends.append(end)
        while not end[0].wait(0.02) and not any(e.is_set() for e in events):
            pass
        return end[1], time.time()

    def exit(self, index: int, code: int) -> None:
        self._ends[index][1] = code
        self._ends[index][0].set()


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def start_job(hosts: Optional[Dict[str, int]] = None):
    """A running job on `hosts` (default host-a with 2 slots; 2-4 processes); rank 0's
    notification client a mock."""
    hosts = hosts or {"host-a": 2}
    discovery = FixedHosts(hosts)
    driver = driver_module.ElasticDriver(mock.MagicMock(), discovery, min_num_proc=2, max_num_proc=4)
    workers = Workers()
    driver.start(sum(hosts.values()), workers)
    coordinator = mock.MagicMock()  # what rank 0's hvd.elastic.run registers with the driver
    rank0 = driver.get_coordinator_info()  # the driver orders the hosts as a set: rank 0 on any
    driver._worker_clients[(rank0.hostname, rank0.local_rank)] = coordinator
    return driver, discovery, workers, coordinator


def ask_rank(driver, slot: Slot, answers: Dict[Slot, object]) -> None:
    """A process started ahead at its first hvd.init (gloo_context.cc asks the rendezvous server)."""
    def ask():
        answers[slot] = driver.prelaunched_rank_and_size(*slot)
    threading.Thread(target=ask, daemon=True).start()


def reset(driver, slots: List[Slot]) -> None:
    """The running workers' reset: each asks for its new rank (Horovod's record_ready)."""
    for slot in slots:
        threading.Thread(target=driver.record_ready, args=slot, daemon=True).start()


def test_an_added_hosts_processes_start_first_and_the_workers_are_told_once_they_wait():
    driver, discovery, workers, coordinator = start_job()
    try:
        discovery.set({"host-a": 2, "host-b": 2})
        wait_for(lambda: len(workers.started) == 4, "host-b's processes")
        assert workers.started[2:] == [("host-b", 0, True), ("host-b", 1, True)], workers.started
        time.sleep(0.3)  # they import their framework: the workers train on, untold
        coordinator.notify_hosts_updated.assert_not_called()
        answers: Dict[Slot, object] = {}
        ask_rank(driver, ("host-b", 0), answers)
        time.sleep(0.3)
        coordinator.notify_hosts_updated.assert_not_called()  # host-b[1] does not wait yet
        ask_rank(driver, ("host-b", 1), answers)
        wait_for(lambda: coordinator.notify_hosts_updated.called, "the notice to rank 0")
        time.sleep(0.2)
        assert answers == {}  # admitted by the reset, not before
        reset(driver, [("host-a", 0), ("host-a", 1)])
        wait_for(lambda: len(answers) == 2, "the new processes' ranks")
        assert [(answers[("host-b", i)].rank, answers[("host-b", i)].size) for i in (0, 1)] == [(2, 4), (3, 4)]
        assert len(workers.started) == 4  # no second process for host-b's slots
        assert driver.world_size() == 4
    finally:
        driver.stop()


def test_one_that_dies_before_its_reset_is_not_the_jobs_and_its_slot_starts_afresh():
    driver, discovery, workers, coordinator = start_job()
    try:
        discovery.set({"host-a": 2, "host-b": 2})
        wait_for(lambda: len(workers.started) == 4, "host-b's processes")
        answers: Dict[Slot, object] = {}
        ask_rank(driver, ("host-b", 0), answers)
        workers.exit(3, 1)  # host-b[1] fails while it imports
        wait_for(lambda: coordinator.notify_hosts_updated.called, "the notice (not waiting for the dead one)")
        reset(driver, [("host-a", 0), ("host-a", 1)])
        wait_for(lambda: len(workers.started) == 5 and len(answers) == 1, "the reset")
        assert workers.started[4] == ("host-b", 1, False)  # started afresh, as Horovod would
        assert answers[("host-b", 0)].rank == 2
        assert not driver._host_manager.is_blacklisted("host-b")  # its exit was not the job's failure
    finally:
        driver.stop()


def test_one_still_waiting_when_the_job_ends_is_told_it_has_no_rank():
    driver, discovery, workers, coordinator = start_job()
    answers: Dict[Slot, object] = {}
    try:
        discovery.set({"host-a": 2, "host-b": 1})
        wait_for(lambda: len(workers.started) == 3, "host-b's process")
        ask_rank(driver, ("host-b", 0), answers)
        wait_for(lambda: coordinator.notify_hosts_updated.called, "the notice")
    finally:
        driver.stop()  # the workers finished before they saw the notice
    wait_for(lambda: len(answers) == 1, "the answer")
    assert answers[("host-b", 0)].rank == -1  # gloo_context.cc: "has been removed from elastic job"


def test_horovods_order_when_turned_off(monkeypatch):
    monkeypatch.setenv(driver_module.PRELAUNCH_ENV, "0")
    driver, discovery, workers, coordinator = start_job()
    try:
        discovery.set({"host-a": 2, "host-b": 2})
        wait_for(lambda: coordinator.notify_hosts_updated.called, "the notice")
        assert len(workers.started) == 2  # nothing started before the reset
        reset(driver, [("host-a", 0), ("host-a", 1)])
        wait_for(lambda: len(workers.started) == 4, "host-b's processes")
        assert workers.started[2:] == [("host-b", 0, False), ("host-b", 1, False)]
    finally:
        driver.stop()


def test_an_update_that_also_removes_a_host_is_told_at_once():
    """A removed host is not kept waiting for an added one: the notice goes at once, the added
    host's processes started ahead go on starting and the reset admits them."""
    driver, discovery, workers, coordinator = start_job({"host-a": 2, "host-b": 2})
    rank0 = driver.get_coordinator_info()
    try:
        discovery.set({rank0.hostname: 2, "host-c": 2})  # the other host replaced in one update
        wait_for(lambda: coordinator.notify_hosts_updated.called, "the notice")
        wait_for(lambda: len(workers.started) == 6, "host-c's processes")
        assert workers.started[4:] == [("host-c", 0, True), ("host-c", 1, True)], workers.started
        answers: Dict[Slot, object] = {}
        ask_rank(driver, ("host-c", 0), answers)
        ask_rank(driver, ("host-c", 1), answers)
        reset(driver, [("host-a", 0), ("host-a", 1), ("host-b", 0), ("host-b", 1)])
        wait_for(lambda: len(answers) == 2, "the new processes' ranks")
        assert len({a.rank for a in answers.values()}) == 2 and {a.size for a in answers.values()} == {4}
        assert len(workers.started) == 6
    finally:
        driver.stop()
