"""AD-PSGD (lian2018: Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent", ICML 2018, arXiv 1710.06952), claim by claim.

In-process tests run one Gossip per rank on threads of this process (tests/adpsgd_world.py);
the killed-peer test runs ranks as processes (tests/adpsgd_worker.py) and kills one; the
multirank tests run tests/multirank/check_adpsgd.py on 2x2 and 3x2 Horovod ranks.
"""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hvdx.adpsgd.graph import TOPOLOGIES, build_graph
from hvdx.transport.base import TransportError
from hvdx.transport.peer import PeerTransport
from tests import harness, suite
from tests.adpsgd_world import build_world, thread_allgather


def run_threads(fns, timeout=120):
    """Runs each fn on its own thread; fails naming the ones still running after `timeout` s."""
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: B902
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"threads {stuck} still running after {timeout} s (deadlock?)"
    if errors:
        raise errors[0]


def settle(world, timeout=30):
    """Waits until no exchange is in flight (the models are then a consistent snapshot)."""
    deadline = time.monotonic() + timeout
    while not all(g.idle() for g in world):
        assert time.monotonic() < deadline, "exchanges still in flight"
        time.sleep(0.01)
    time.sleep(0.05)
    assert all(g.idle() for g in world)


def finish_all(world):
    out = [None] * len(world)

    def finish(i):
        out[i] = world[i].average(final=True)
    run_threads([lambda i=i: finish(i) for i in range(len(world))], timeout=60)
    return out


# -------------------------------------------------------------------- the graphs (sec. 3.1, 3.2)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", range(2, 18))
def test_every_edge_joins_an_active_and_a_passive_rank(topology, n):
    graph = build_graph(topology, n)
    assert graph.active and len(graph.active) < n
    for a, b in graph.edges:
        assert graph.is_active(a) != graph.is_active(b), (a, b)
    assert all(graph.neighbours(r) for r in range(n))  # nobody is left out (connectivity: build_graph checks it)


def diameter(graph):
    worst = 0
    for start in range(graph.size):
        seen, frontier, depth = {start}, [start], 0
        while frontier:
            frontier = [s for r in frontier for s in graph.neighbours(r) if s not in seen and not seen.add(s)]
            depth += bool(frontier)
        worst = max(worst, depth)
    return worst


def test_exponential_graph_uses_hops_of_2_to_the_i_plus_1():
    graph = build_graph("exponential", 16)
    assert graph.neighbours(0) == (1, 3, 5, 7, 9, 11, 13, 15)  # 0 +- {1, 3, 5, 9} mod 16
    assert diameter(graph) < diameter(build_graph("ring", 16)) / 2  # O(log n) instead of O(n) (sec. 3.2)


def test_one_exchange_is_doubly_stochastic():
    w = np.array(build_graph("ring", 6).mixing_matrix(2, 3))
    np.testing.assert_allclose(w.sum(axis=0), 1.0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    np.testing.assert_allclose(w, w.T)


@pytest.mark.parametrize("topology,n,match", [
    ("star", 4, "unknown AD-PSGD topology 'star'"),
    ("ring", 1, "at least 2 ranks"),
    (lambda n: [(0, 1), (1, 2), (2, 0)], 3, "not bipartite"),
    (lambda n: [(0, 1), (2, 3)], 4, "not connected"),
    (lambda n: [(0, 0)], 2, "not two distinct ranks"),
])
def test_bad_topologies_are_refused(topology, n, match):
    with pytest.raises(ValueError, match=match):
        build_graph(topology, n)


# -------------------------------------------------------------------- the transport's exchanges
def test_peer_transport_refuses_asymmetric_peers_and_strangers():
    gather = thread_allgather(3)
    errors = []

    def build(rank, peers):
        try:
            PeerTransport._create(peers, rank, "t", 10.0, 3, gather(rank))
        except ValueError as exc:
            errors.append(str(exc))
    run_threads([lambda: build(0, [1]), lambda: build(1, [2]), lambda: build(2, [1])], timeout=60)
    assert any("rank 0 lists rank 1 as its peer, rank 1 does not" in e for e in errors), errors


def test_exchange_swaps_arrays_and_hold_delays_the_answer_and_early_notices_wait():
    gather = thread_allgather(2)
    transports = [None, None]

    def build(rank):
        transports[rank] = PeerTransport._create([1 - rank], rank, "t", 10.0, 2, gather(rank))
    run_threads([lambda: build(0), lambda: build(1)], timeout=60)
    a, b = transports
    try:
        a.notify(1, b"early")  # before b has a notice handler: kept for it, not dropped
        a.flush(10)
        time.sleep(0.2)
        notices = []
        b.set_notice_handler(lambda peer, body: notices.append((peer, body)))
        assert notices == [(0, b"early")]
        b.set_handler(lambda peer, theirs: theirs * 0 + 7.0)
        got = a.exchange(1, np.arange(4.0), on_reply=lambda theirs: theirs.sum()).wait(10)
        assert got == 28.0 and b.served == 1 and a.initiated == 1
        b.hold()
        request = a.exchange(1, np.ones(4))
        time.sleep(0.3)
        assert not request.done()  # held: the answer waits for release()
        b.release()
        np.testing.assert_array_equal(request.wait(10), np.full(4, 7.0))
        with pytest.raises(ValueError, match="not a peer"):
            a.exchange(5, np.ones(4))
    finally:
        a.close()
        b.close()
    with pytest.raises(TransportError, match="closed"):
        a.exchange(1, np.ones(2)).wait(1)


# -------------------------------------------------------------------- Algorithm 1 in process
@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_consensus_with_zero_gradients_preserves_the_mean_and_reaches_it(topology):
    rng = np.random.default_rng(0)
    models = [rng.normal(size=2000) for _ in range(6)]
    mean = np.mean(models, axis=0)
    world = build_world(models, topology)
    spreads = []

    def train(g):
        zero = np.zeros(2000)
        for _ in range(400):
            g.step(zero)  # zero gradient: the model changes by averaging alone
            time.sleep(0.002)
    try:
        run_threads([lambda g=g: train(g) for g in world])
        settle(world)
        now = [g.model() for g in world]
        spreads.append(max(np.abs(m - mean).max() for m in now))
        np.testing.assert_allclose(np.mean(now, axis=0), mean, atol=1e-12)  # doubly stochastic: mean kept
        assert spreads[0] < 1e-3 * max(np.abs(m - mean).max() for m in models), spreads
        final = finish_all(world)
    finally:
        for g in world:
            g.close()
    for m in final:
        np.testing.assert_allclose(m, mean, atol=1e-12)


def test_thousands_of_exchanges_lose_no_update():
    n = 6
    world = build_world([np.zeros(500) for _ in range(n)], "exponential")
    applied = [np.zeros(500) for _ in range(n)]

    def started() -> int:
        return sum(g.exchanges for g in world if g.active)

    def train(r):
        # 1,500 steps, then on until the active ranks started 1,200 exchanges: how many a step
        # allows depends on the machine's load (977 in 1,500 steps once under CI), the claim does not
        g, rng = world[r], np.random.default_rng(r)
        k = 0
        while k < 1500 or (started() < 1200 and k < 30000):
            update = rng.normal(size=500) * 1e-3  # the optimizer's step on a (possibly stale) copy
            applied[r] += update
            g.step(update)
            if k % 4 == 0:
                time.sleep(0.001)
            k += 1
    try:
        run_threads([lambda r=r: train(r) for r in range(n)], timeout=300)
        final = finish_all(world)
        stats = [g.stats() for g in world]  # after the final average: no exchange in flight
    finally:
        for g in world:
            g.close()
    print("exchanges per rank:", [s["exchanges"] for s in stats])
    begun = sum(s["exchanges"] for s in stats if s["active"])
    answered = sum(s["exchanges"] for s in stats if not s["active"])
    assert begun == answered >= 1000  # every exchange completed on both sides
    # every update is in the models: the final average is the mean of everything applied
    np.testing.assert_allclose(final[0], np.sum(applied, axis=0) / n, atol=1e-10)


def _run_victim_world(tmp_path, how: str, timeout: float) -> dict:
    """4 ranks as processes (tests/adpsgd_worker.py), rank 2 sends itself SIG`how` at step
    60; returns each survivor's result after checking that it wrote one."""
    world, victim = 4, 2
    worker = os.path.join(os.path.dirname(__file__), "adpsgd_worker.py")
    env = dict(os.environ, PYTHONPATH=str(harness.ROOT))
    procs = [subprocess.Popen([sys.executable, worker, str(tmp_path), str(r), str(world), "exponential",
                               str(victim), "60", how, str(timeout)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for r in range(world)]
    outputs, results = {}, {}
    try:
        for r, p in enumerate(procs):
            if r != victim:
                outputs[r] = p.communicate(timeout=240)[0].decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(30)
    for r in range(world):
        if r == victim:
            continue
        path = tmp_path / f"result.{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{outputs[r]}"
        results[r] = json.loads(path.read_text())
        assert results[r]["error"] is not None and f"rank {victim}" in results[r]["error"], (r, results[r])
        assert results[r]["step"] < 20000  # it stopped training at the failure, not at its end
    return results


def test_a_killed_peer_is_named_by_every_other_rank(tmp_path):
    """Rank 2 of 4 dies (SIGKILL, mid-training); each survivor's next step raises naming it."""
    _run_victim_world(tmp_path, "KILL", 20.0)


def test_a_stopped_peer_is_named_by_every_other_rank_in_bounded_time(tmp_path):
    """Rank 2 of 4 stops (SIGSTOP: alive, its connections open, silent); every survivor's step
    raises naming it, also the ranks that do not exchange with it, once the transport's timeout
    passes without a frame or heartbeat from it (or a neighbour forwards the news)."""
    _run_victim_world(tmp_path, "STOP", 3.0)


# -------------------------------------------------------------------- keeping up: the GIL (Appendix A)
def test_the_switch_interval_is_shortened_while_gossip_runs_and_restored_after():
    before = sys.getswitchinterval()
    world = build_world([np.zeros(10), np.ones(10)], "ring", switch_interval=0.0007)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0007)
        world[0].close()
        assert sys.getswitchinterval() == pytest.approx(0.0007)  # process-wide: rank 1's gossip still runs
    finally:
        for g in world:
            g.close()
    assert sys.getswitchinterval() == before
    left_alone = build_world([np.zeros(10), np.ones(10)], "ring", switch_interval=None)
    try:
        assert sys.getswitchinterval() == before
    finally:
        for g in left_alone:
            g.close()


def test_a_bad_switch_interval_is_refused():
    with pytest.raises(ValueError, match="switch_interval must be seconds"):
        build_world([np.zeros(10), np.ones(10)], "ring", switch_interval=0)


@pytest.mark.slow
def test_gossip_averages_beside_a_gil_holding_computation_with_either_switch_interval():
    """Two ranks as processes, 3 ms steps of pure Python (as Keras' per-step code): the gossip
    thread still gets the GIL and averages, with the short switch interval and with Python's
    default. How much more often the short one lets it average (2-4x on a quiet machine) is a
    rate that load changes: benchmarks/adpsgd_probe.py measures it, alone on the machine."""
    from benchmarks.adpsgd_probe import probe

    for interval in (0.001, None):
        ranks = probe("python", interval, steps=100)
        assert sorted(r["rank"] for r in ranks) == [0, 1]
        for r in ranks:
            assert r["steps"] == 100, (interval, r)
            assert r["exchanges"] >= 1, f"rank {r['rank']} never averaged (switch interval {interval}): {r}"


# -------------------------------------------------------------------- an epoch over all ranks
def test_a_step_budget_over_all_ranks_lets_the_fast_ranks_do_the_slow_ones_share():
    """lian2018's epochs count every worker's samples: with a budget of steps over all ranks
    and one rank 4x slower, the others run more steps, and together they run the budget."""
    n, budget = 4, 1000
    world = build_world([np.zeros(20000) for _ in range(n)], "ring", step_budget=budget)

    def train(r):
        g, zero = world[r], np.zeros(20000)
        while not g.done:
            g.step(zero)
            time.sleep(0.008 if r == n - 1 else 0.002)
    try:
        run_threads([lambda r=r: train(r) for r in range(n)], timeout=180)
        steps = [g.steps for g in world]
        finish_all(world)
    finally:
        for g in world:
            g.close()
    print("steps per rank:", steps)
    # known counts never exceed true ones: a rank stops only once the budget is truly spent
    assert sum(steps) >= budget, steps
    # each rank overshoots by the steps it makes while the news of the last steps reaches it:
    # about one exchange per graph hop (diameter 2 here), an exchange per step or two
    assert sum(steps) <= budget + n * 3 * 4, steps
    assert all(steps[r] >= 2 * steps[-1] for r in range(n - 1)), steps


def test_ranks_with_different_step_budgets_are_told_so():
    world = build_world([np.zeros(10), np.ones(10)], "ring", step_budget=None)
    world[1].step_budget = 100  # as if rank 1 was given another budget
    errors = {}

    def run(rank):
        try:
            world[rank].average()
        except (ValueError, TransportError) as exc:
            errors[rank] = exc
            world[rank].close()
    try:
        run_threads([lambda: run(0), lambda: run(1)], timeout=60)
    finally:
        for g in world:
            g.close()
    assert "ranks disagree on the step budget: rank 1 has 100, its neighbour rank 0 None" in str(errors[1])


def test_neighbour_weights_set_how_often_each_edge_mixes_and_keep_the_mean():
    """Two nodes {0, 1}, {2, 3} on a ring: the active ranks 0 and 2 each have one neighbour
    inside their node and one across; with weights 1 and 0.25 a fifth of their exchanges
    cross. Every exchange stays doubly stochastic (eq. 2): the mean of the models is kept."""
    from tests.adpsgd_world import make_gossip
    rng = np.random.default_rng(1)
    models = [rng.normal(size=300) for _ in range(4)]
    mean = np.mean(models, axis=0)
    weights = {0: {1: 1.0, 3: 0.25}, 2: {3: 1.0, 1: 0.25}}
    gather = thread_allgather(4)
    world = harness.on_threads(lambda r: make_gossip(models[r], r, 4, "ring", gather(r), weights=weights.get(r)),
                               4, join_timeout=90)

    def train(g):
        for _ in range(600):
            g.step(np.zeros(300))
            time.sleep(0.001)
    try:
        run_threads([lambda g=g: train(g) for g in world])
        settle(world)
        np.testing.assert_allclose(np.mean([g.model() for g in world], axis=0), mean, atol=1e-12)
        stats = [g.stats() for g in world]
    finally:
        for g in world:
            g.close()
    for r, across in ((0, "3"), (2, "1")):
        partners = stats[r]["partners"]
        share = partners[across] / sum(partners.values())
        assert sum(partners.values()) >= 200 and 0.1 < share < 0.3, (r, partners)  # 0.2 expected


def test_bad_neighbour_weights_are_refused():
    from hvdx.adpsgd.gossip import _check_weights
    with pytest.raises(ValueError, match="weight of neighbour 3 must be a positive finite number"):
        _check_weights({1: 1.0, 3: 0.0}, (1, 3), 0)
    with pytest.raises(ValueError, match="must give every neighbour of rank 0"):
        _check_weights({1: 1.0}, (1, 3), 0)
    assert _check_weights({3: 2, 1: 1.0}, (1, 3), 0) == [1.0, 2.0]
    from hvdx.adpsgd.keras import check_cross_node_weight
    with pytest.raises(ValueError, match="cross_node_weight must be a positive number"):
        check_cross_node_weight(-1)
    assert check_cross_node_weight(4) == 4.0


def test_a_bad_step_budget_is_refused():
    with pytest.raises(ValueError, match="step_budget must be a positive int"):
        build_world([np.zeros(10), np.ones(10)], "ring", step_budget=0)


# -------------------------------------------------------------------- Keras glue, single process
def test_callback_refuses_an_unknown_topology_and_bad_options():
    from hvdx.adpsgd import ADPSGDCallback
    with pytest.raises(ValueError, match="unknown AD-PSGD topology 'torus'"):
        ADPSGDCallback(topology="torus")
    with pytest.raises(ValueError, match="max_seconds"):
        ADPSGDCallback(max_seconds=0)
    with pytest.raises(ValueError, match="one or the other"):
        ADPSGDCallback(max_seconds=5, average_every_epoch=True)


def test_non_float_variables_are_refused():
    import tensorflow as tf

    from hvdx.adpsgd import ADPSGD
    with pytest.raises(ValueError, match="'steps:0' is int64"):
        ADPSGD([tf.Variable(1.0, name="w"), tf.Variable(np.int64(0), name="steps")])


def test_a_synchronous_optimizer_is_refused():
    import tensorflow as tf

    from hvdx.adpsgd import ADPSGD

    check_optimizer = ADPSGD.check_optimizer

    class DistributedOptimizer(tf.keras.optimizers.SGD):  # what hvdx's and Horovod's wrappers are called
        pass
    with pytest.raises(ValueError, match="cannot run with the synchronous DistributedOptimizer"):
        check_optimizer(DistributedOptimizer(0.1))
    check_optimizer(tf.keras.optimizers.SGD(0.1))  # a plain optimizer is what AD-PSGD takes


# -------------------------------------------------------------------- multirank (Horovod ranks)
@suite.runs(suite.check("adpsgd.consensus", "2x2"), suite.check("adpsgd.consensus", "3x2"))
def test_gossip_reaches_consensus_on_horovod_ranks(ranks):
    for rank, data in ranks.items():
        assert data["mean_error"] < 1e-5, (rank, data)      # float32 model: the mean is kept
        assert data["spread_after"] < 1e-3 * data["spread_before"], (rank, data)
        assert data["final_spread"] == 0.0, (rank, data)  # one allreduce: the same model everywhere


@suite.runs(suite.check("adpsgd.exchanges", "2x2"), suite.check("adpsgd.exchanges", "3x2"))
def test_thousands_of_random_exchanges_complete_on_both_sides(ranks):
    counts = {rank: data["exchanges"] for rank, data in ranks.items()}
    print("exchanges per rank:", counts)
    started = sum(d["exchanges"] for d in ranks.values() if d["active"])
    answered = sum(d["exchanges"] for d in ranks.values() if not d["active"])
    assert started == answered >= 1000, counts
    for rank, data in ranks.items():  # each pair agrees on how often it exchanged
        for peer, count in data["partners"].items():
            assert ranks[int(peer)]["partners"][str(rank)] == count, (rank, peer, ranks)
        assert data["lost"] < 1e-4, data  # the sum of the updates is in the final model


@suite.runs(suite.check("adpsgd.slow_rank", "2x2"), suite.check("adpsgd.slow_rank", "3x2"))
def test_a_slow_rank_does_not_slow_the_others(ranks):
    slow = max(ranks)
    steps = {rank: data["steps"] for rank, data in ranks.items()}
    for rank, count in steps.items():
        if rank != slow:
            # synchronous SGD would make them equal; the margin leaves room for 6 ranks on 2 busy cores
            assert count >= 2 * steps[slow], steps
    assert all(data["exchanges"] > 0 for data in ranks.values()), ranks  # the slow one still gossips


# Under load (a full test session, load 10-20 on 2 cores) a rank process can go a second without
# CPU (runnable, not scheduled: sampled from /proc): it neither steps nor answers, and the news of
# the step counts waits for it. A run of about one second once ended at {0: 671, 1: 1, 2: 641,
# 3: 20} steps against a budget of 672, so the check trains for several seconds and bounds the
# overshoot by what news that travels at all guarantees.
@suite.runs(suite.check("adpsgd.global_budget", "2x2"))
def test_an_epoch_counts_every_ranks_samples_so_the_fast_ranks_do_the_slow_ones_share(ranks):
    slow = max(ranks)
    steps = {rank: data["steps"] for rank, data in ranks.items()}
    budget = ranks[0]["budget"]
    print("steps per rank:", steps, "budget:", budget, "averagings:", {r: d["exchanges"] for r, d in ranks.items()})
    assert budget == 64 * sum(data["steps_per_epoch"] for data in ranks.values())  # 64 epochs of every rank's shard
    for rank, data in ranks.items():
        # what a rank knows of the others' steps never exceeds what they ran ...
        assert data["known_steps"][rank] == steps[rank], (rank, data)
        assert all(known <= steps[r] for r, known in enumerate(data["known_steps"])), (rank, data, steps)
        # ... and every rank stopped on the budget (not because fit's epochs ran out)
        assert sum(data["known_steps"]) >= budget, (rank, data, budget)
    assert sum(steps.values()) >= budget, (steps, budget)  # hence the budget is spent
    # the overshoot is the steps made while the news of the last steps travels; without news
    # each fast rank would run the whole budget on its own (3x)
    assert sum(steps.values()) <= 1.5 * budget, (steps, budget)
    for rank, count in steps.items():
        if rank != slow:
            assert count >= 2 * steps[slow], steps  # the fast ranks did the slowed rank's share
    assert all(data["spread"] == 0.0 for data in ranks.values())  # and every rank holds the average model


@suite.runs(suite.check("adpsgd.convergence", "2x2", timeout=600))
def test_convergence_matches_allreduce_sgd_at_equal_epochs(ranks):
    data = ranks[0]
    print("digits test accuracy:", data)
    # lian2018 Theorem 1: the same convergence per epoch as AllReduce-SGD, i.e. no worse within
    # what one run on 450 test digits resolves: AD-PSGD is not deterministic, and the standard
    # error of a difference of two accuracies near 0.95 is 1.4 points here (CI: 0.940 against
    # 0.953 once, after many passing runs), so 2 points; doing better is no failure
    assert data["adpsgd"] >= data["allreduce"] - 0.02, data
    assert data["adpsgd"] > 0.9, data
    assert all(d["adpsgd"] == data["adpsgd"] for d in ranks.values())  # every rank holds the average model


@suite.runs(suite.check("adpsgd.checkpoint", "2x2"))
def test_checkpoint_and_restore_mid_training(ranks):
    for rank, data in ranks.items():
        assert data["saved_spread"] == 0.0, (rank, data)     # the average model went to the checkpoint
        assert data["restored_equal"], (rank, data)          # restore gives it back on every rank
        assert data["final_spread"] == 0.0, (rank, data)
        assert data["loss_after"] < data["loss_before"], (rank, data)


@suite.runs(suite.check("adpsgd.errors", "2x2"))
def test_bad_arguments_get_clear_errors_on_horovod_ranks(ranks):
    for rank, data in ranks.items():
        assert "cannot run with the synchronous" in data["hvdx_optimizer"], data
        assert "unknown AD-PSGD topology" in data["topology"], data
        assert "is int32" in data["non_float"], data
        assert "cross_node_weight must be a positive number" in data["cross_node_weight"], data
        node = next(r for r in data["node_ranks"] if rank in r)
        expected = {str(p): 1.0 if p in node else 0.25 for p in data["neighbours"]}
        assert data["weights"] == expected, data  # 2x2 ring: one neighbour inside the node, one across


def test_ranks_that_average_at_different_points_are_told_so():
    """A rank at its final average beside a neighbour at an epoch's average: ValueError naming both."""
    world = build_world([np.zeros(10), np.ones(10)], "ring")
    errors = {}

    def run(rank, final):
        try:
            world[rank].average(final=final)
        except (ValueError, TransportError) as exc:
            errors[rank] = exc
            world[rank].close()  # what a failing script's exit does: the other rank is released
    try:
        run_threads([lambda: run(0, True), lambda: run(1, False)], timeout=60)
    finally:
        for g in world:
            g.close()
    assert isinstance(errors[1], ValueError), errors  # rank 1 is passive: it compares the notices
    assert "rank 1 is at average #1, its neighbour rank 0 at the final average" in str(errors[1])
    assert isinstance(errors[0], TransportError), errors
