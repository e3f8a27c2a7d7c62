"""blockhess.threads: small operations on one thread, large ones on the caller's count, the caller's setting restored."""

import os
import subprocess
import sys
import time

import pytest
import torch

import blockhess as bh
from blockhess import threads
from blockhess.threads import PARALLEL_ENTRIES, PARALLEL_MACS, serial, threads_for


def _fit(monkeypatch, cores: int, elsewhere):
    """The fit on (whatever BLOCKHESS_FIT_FREE_CORES says), ``cores`` cores, all online, ``elsewhere`` tasks
    of other processes running; no reading kept."""
    monkeypatch.setattr(threads, "_FIT", True)
    monkeypatch.setattr(threads, "_cores", lambda: cores)
    monkeypatch.setattr(threads, "_whole_machine", lambda: True)
    monkeypatch.setattr(threads, "_running_elsewhere", lambda: elsewhere)
    monkeypatch.setitem(threads._reading, "free", None)


@pytest.fixture
def two_threads(monkeypatch):
    """torch on 2 intra-op threads for the test (the suite runs on 1), restored after; both cores read as free
    (the suite's other worker must not change what these tests see)."""
    _fit(monkeypatch, cores=2, elsewhere=0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    if torch.get_num_threads() != 2:
        pytest.skip("this torch build cannot run 2 intra-op threads")
    yield
    torch.set_num_threads(before)


def test_serial_runs_on_one_thread_and_restores(two_threads):
    with serial():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"):
        with serial():
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_threads_for_gives_large_work_the_callers_count(two_threads):
    with serial():
        with threads_for(macs=PARALLEL_MACS - 1, entries=PARALLEL_ENTRIES - 1):
            assert torch.get_num_threads() == 1
        with threads_for(macs=PARALLEL_MACS):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with threads_for(entries=PARALLEL_ENTRIES):
            assert torch.get_num_threads() == 2
        with serial():  # nested: the outermost caller's count is kept for large work
            with threads_for(macs=PARALLEL_MACS):
                assert torch.get_num_threads() == 2
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    assert getattr(threads._state, "threads", None) is None


def test_threads_for_outside_serial(two_threads):
    with threads_for(macs=1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with threads_for(macs=PARALLEL_MACS):
        assert torch.get_num_threads() == 2
    with pytest.raises(ValueError):
        with threads_for(entries=1):
            raise ValueError
    assert torch.get_num_threads() == 2


def _problem():
    cfg = bh.BlockConfig(d_model=4, d_ff=6, ln_eps=1e-5)
    params = bh.init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(2, 3, 4, dtype=torch.float64, generator=g)
    return cfg, params, X, torch.randn(2, 3, 4, dtype=torch.float64, generator=g)


def test_library_calls_restore_the_callers_count(two_threads):
    cfg, params, X, T = _problem()
    H = bh.hessian(params, X, cfg, loss="mse", target=T)
    assert torch.get_num_threads() == 2
    H.outer.dense(), H.functional.dense()
    bh.bounds.exact_norms(H)
    bh.jacobian(params, X, cfg)
    bh.input_jacobian(params, X, cfg)
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="target"):  # raised inside the passes, after the switch to one thread
        bh.hessian(params, X, cfg, loss="mse", target=T[:, :2])
    assert torch.get_num_threads() == 2


def test_result_does_not_depend_on_the_callers_count(two_threads):
    cfg, params, X, T = _problem()
    H2 = bh.hessian(params, X, cfg, loss="ce", target=torch.tensor([[0, 1, 2], [3, 0, 1]])).dense()
    torch.set_num_threads(1)
    H1 = bh.hessian(params, X, cfg, loss="ce", target=torch.tensor([[0, 1, 2], [3, 0, 1]])).dense()
    assert torch.equal(H1, H2)  # every operation here is below the thresholds: the same single-thread arithmetic


def test_serial_gives_large_work_no_more_threads_than_free_cores(two_threads, monkeypatch):
    _fit(monkeypatch, cores=2, elsewhere=1)  # one core held by another process
    with serial():
        with threads_for(macs=PARALLEL_MACS):
            assert torch.get_num_threads() == 1
        with serial():  # nested: the outermost call's team
            monkeypatch.setattr(threads, "_running_elsewhere", lambda: 0)
            monkeypatch.setitem(threads._reading, "free", None)
            with threads_for(macs=PARALLEL_MACS):
                assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2  # the caller's own setting is untouched
    with serial():  # the other process gone: the team is 2 again
        with threads_for(macs=PARALLEL_MACS):
            assert torch.get_num_threads() == 2


@pytest.mark.parametrize("elsewhere, cores, free", [(0, 2, 2), (1, 2, 1), (5, 2, 1), (1, 8, 7), (None, 4, 4)])
def test_free_cores_from_the_reading(monkeypatch, elsewhere, cores, free):
    _fit(monkeypatch, cores, elsewhere)
    assert threads.free_cores() == free


def test_free_cores_not_fitted_on_a_narrower_affinity(monkeypatch):
    """Pinned to 2 of 8 cores: the machine's count of tasks says nothing about those two; both are free."""
    _fit(monkeypatch, cores=2, elsewhere=5)
    monkeypatch.setattr(threads, "_whole_machine", lambda: False)
    assert threads.free_cores() == 2


def test_free_cores_reading_is_kept_for_its_ttl(monkeypatch):
    calls = []
    _fit(monkeypatch, cores=2, elsewhere=0)
    monkeypatch.setattr(threads, "_running_elsewhere", lambda: calls.append(1) or 0)
    clock = iter([100.0, 100.0 + threads.FREE_CORES_TTL / 2, 100.0 + 2 * threads.FREE_CORES_TTL])
    monkeypatch.setattr(threads, "_clock", lambda: next(clock))
    threads.free_cores(), threads.free_cores()
    assert len(calls) == 1
    threads.free_cores()
    assert len(calls) == 2


def test_free_cores_can_be_switched_off(monkeypatch):
    _fit(monkeypatch, cores=3, elsewhere=2)
    monkeypatch.setattr(threads, "_FIT", False)
    assert threads.free_cores() == 3


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads Linux's /proc")
def test_running_elsewhere_sees_a_busy_process():
    quiet = threads._running_elsewhere()
    assert quiet is not None and quiet >= 0
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        seen = [threads._running_elsewhere() for _ in range(5)]
    finally:
        proc.kill()
        proc.wait()
    assert max(seen) >= 1  # a task that never blocks is always runnable
