"""blockhess.threads: small operations on one thread, large ones on the caller's count, the caller's setting restored."""

import pytest
import torch

import blockhess as bh
from blockhess import threads
from blockhess.threads import PARALLEL_ENTRIES, PARALLEL_MACS, serial, threads_for


@pytest.fixture
def two_threads():
    """torch on 2 intra-op threads for the test (the suite runs on 1), restored after."""
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
