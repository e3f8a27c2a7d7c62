"""blockhess.distributed on process groups of this machine: two gloo processes (tests/distributed_worker.py,
joined through a file store: no port to pick), their results against one process on the concatenated
shards (float64, relative Frobenius error <= 1e-12: only the order of the sum over ranks differs), the
same on both ranks; every fault named on every rank, within the groups' timeout; the command under
torchrun. Each group runs once per session (module fixture), its processes one thread each and
killed at a wall-clock limit, so no test can hang."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import blockhess as bh
import blockhess.distributed as bhd
from blockhess import convergence as cv

import distributed_worker as W

WORKER = Path(__file__).with_name("distributed_worker.py")
SRC = str(Path(bh.__file__).resolve().parents[1])
TIMEOUT = 20  # s: the process-group timeout of the groups main and dead
HANG_TIMEOUT = 4  # s: that of the group hang, whose rank 1 never arrives
WALL = 150  # s: a group's processes are killed after this (a bound, not an expectation)
REL = 1e-12  # the sum over the ranks adds the same terms in another order: rounding of n terms, far below this


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if os.path.exists("/sys/class/net/lo"):  # gloo on the loopback interface, whatever the host name resolves to
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _start(group: str, folder: Path, timeout: float, world: int = 2) -> list[subprocess.Popen]:
    folder.mkdir()
    return [subprocess.Popen([sys.executable, str(WORKER), group, str(r), str(world), str(folder / "store"), str(folder),
                              str(timeout)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)]


def _wait(procs: list[subprocess.Popen], deadline: float, ranks=None) -> dict:
    """Wait for ``ranks`` (default all) until ``deadline``; then kill every process still running (each
    by its own handle). Returns ``{rank: (returncode or None if killed, output)}``."""
    out = {}
    for r, p in enumerate(procs):
        if ranks is not None and r not in ranks:
            continue
        try:
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out[r] = (p.returncode, text)
        except subprocess.TimeoutExpired:
            out[r] = (None, "")
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            text, _ = p.communicate()
            out.setdefault(r, (None, text))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the groups main, dead and hang at once; wait for them; return their folders and exit codes."""
    root = tmp_path_factory.mktemp("distributed")
    t0 = time.monotonic()
    groups = {"main": _start("main", root / "main", TIMEOUT), "dead": _start("dead", root / "dead", TIMEOUT),
              "hang": _start("hang", root / "hang", HANG_TIMEOUT)}
    done = {}
    try:
        done["hang"] = _wait(groups["hang"], t0 + WALL, ranks=[0])  # rank 1 sleeps: killed once rank 0 is done
        done["dead"] = _wait(groups["dead"], t0 + WALL)
        done["main"] = _wait(groups["main"], t0 + WALL)
    finally:
        for procs in groups.values():
            _wait(procs, 0)
    return {"root": root, "done": done, "seconds": time.monotonic() - t0}


def _result(runs, group: str, name: str, rank: int) -> dict:
    path = runs["root"] / group / f"{name}-rank{rank}.pt"
    assert path.is_file(), f"{group}/{name} left no result on rank {rank}: {runs['done'][group]}"
    return torch.load(path, weights_only=False)


def _values(runs, name: str) -> list:
    out = []
    for r in (0, 1):
        res = _result(runs, "main", name, r)
        assert "error" not in res, f"rank {r}: {res.get('error')}: {res.get('message')}"
        out.append(res["value"])
    return out


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    err = float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())
    assert err <= REL, f"{what}: relative error {err:.2e}"


def _same_on_both(values: list, keys) -> None:
    for k in keys:
        assert torch.equal(values[0][k], values[1][k]), f"{k} differs between the ranks"


def test_main_group_exits_cleanly(runs):
    for r, (code, text) in runs["done"]["main"].items():
        assert code == 0, f"rank {r} exited with {code}:\n{text[-3000:]}"


@pytest.mark.parametrize("name", ["block", "ce", "callable", "model", "masked", "one-sequence", "empty"])
def test_hessian_and_parts_equal_one_process_on_the_whole_data(runs, name):
    values = _values(runs, name)
    c = W.case("ce" if name == "one-sequence" else "block" if name == "empty" else name)
    if name == "one-sequence":  # (2, L, d) on rank 0 and one (L, d) on rank 1: the first three sequences
        c = {**c, "X": c["X"][:3], "target": c["target"][:3]}
    H = bh.hessian(*W.args(c), **W.kw(c))
    assert values[0]["names"] == values[1]["names"] == H.names
    for which, ref in (("full", H), ("outer", H.outer), ("functional", H.functional)):
        _close(values[0][which], ref.dense(), f"{name}: {which}")
    _same_on_both(values, ("full", "outer", "functional"))


@pytest.mark.parametrize("name", ["operator-block", "operator-model", "operator-masked", "operator-empty"])
def test_operator_products_and_eigenvalues_equal_one_process(runs, name):
    """bhd.hessian_operator: each part's products, and Lanczos' top eigenvalues run on every rank (masked: the
    shares by counted tokens, 6 and 4, not by sequences, 3 and 2)."""
    values = _values(runs, name)
    model = name.endswith(("model", "masked"))
    c = W.case(name.split("-")[1] if model else "block")
    H = bh.hessian(*W.args(c), **W.kw(c))
    V = values[0]["V"]
    for which, ref in (("full", H), ("outer", H.outer), ("functional", H.functional)):
        _close(values[0][which], ref.dense() @ V, f"{name}: {which} A @ V")
    _close(values[0]["top"].sort().values, torch.linalg.eigvalsh(H.dense())[-2:], f"{name}: top eigenvalues")
    _same_on_both(values, ("full", "outer", "functional", "top"))
    if model:  # no closed-form diagonal for a model: the same error on both ranks
        assert all(v["diagonal"].startswith("NotImplementedError: ") for v in values), values[0]["diagonal"]
    else:
        _close(values[0]["diagonal"], torch.diagonal(H.dense()), f"{name}: the exact diagonal")
        _close(values[0]["view_diagonal"], torch.diagonal(H["W_V", "W_V"]), f"{name}: W_V's exact diagonal")
        _same_on_both(values, ("diagonal", "view_diagonal"))


@pytest.mark.parametrize("name", ["stats", "stats-empty"])
def test_per_sample_results_equal_one_process_in_the_global_order(runs, name):
    values = _values(runs, name)
    c = W.case("stats")
    U = torch.nn.functional.normalize(torch.randn(2, 88, generator=torch.Generator().manual_seed(3), dtype=W.DT), dim=1)
    st = cv.per_sample_statistics(*W.args(c), loss=c["loss"], target=c["target"], directions=U, keep_grads=True,
                                  lanczos_iters=None)
    for k, ref in st._asdict().items():
        _close(values[0]["stats"][k], ref, f"{name}: stats.{k}")
        assert torch.equal(values[0]["stats"][k], values[1]["stats"][k])
    assert values[0]["stats"]["loss"].shape == (sum(W.SPLIT),)
    for key, ref in (("losses", cv.per_sample_losses(*W.args(c), loss=c["loss"], target=c["target"])),
                     ("grads", cv.per_sample_gradients(*W.args(c), **W.kw(c))),
                     ("hessians", cv.per_sample_hessians(*W.args(c), **W.kw(c)))):
        _close(values[0][key], ref, f"{name}: {key}")
    _same_on_both(values, ("losses", "grads", "hessians"))


FAULTS = {  # scenario -> (error on every rank, words its message must hold)
    "fault-params": ("DistributedInputError", ["the inputs", "params['W_Q']", "rank 0 has", "rank 1 has"]),
    "fault-cfg": ("DistributedInputError", ["cfg.ln_eps", "1e-05", "1e-06"]),
    "fault-dtype": ("DistributedInputError", ["the dtype", "torch.float32"]),
    "fault-wrt": ("DistributedInputError", ["wrt", "('W_Q',)"]),
    "fault-loss": ("DistributedInputError", ["loss: rank 0 has 'mse', rank 1 has 'ce'"]),
    "fault-length": ("DistributedInputError", ["the shape of one sequence", "(4, 6)", "(3, 6)"]),
    "fault-nan": ("DistributedInputError", ["the inputs: rank 1 raised ValueError: X contains NaN"]),
    "fault-class": ("DistributedInputError", ["the local Hessians: rank 1 raised ValueError: target classes"]),
    "fault-order": ("DistributedInputError", ["the part made", "'outer'", "'functional'"]),
    "fault-all-empty": ("DistributedInputError", ["every rank's shard is empty"]),
    "fault-wrt-input": ("DistributedInputError", ["rank 1 raised ValueError: wrt_input must be False"]),
    "fault-model-stats": ("DistributedInputError", ["cfg must be a BlockConfig for per_sample_losses"]),
    "fault-runtime": ("DistributedError", ["a step: rank 1 raised RuntimeError: not an input error"]),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_raises_its_named_error_on_every_rank(runs, name):
    error, words = FAULTS[name]
    for r in (0, 1):
        res = _result(runs, "main", name, r)
        assert res.get("error") == error, f"rank {r}: {res}"
        assert all(w in res["message"] for w in words), res["message"]
        assert ("ValueError" in res["mro"]) == (error == "DistributedInputError")
        assert res["seconds"] < TIMEOUT  # named at once, not at the timeout
    if name in ("fault-nan", "fault-class", "fault-wrt-input", "fault-runtime"):
        assert list(res["failures"]) == [1]
        assert type(res["failures"][1]) is (RuntimeError if name == "fault-runtime" else ValueError)  # what rank 1 raised


def test_the_group_works_after_the_faults(runs):
    assert _values(runs, "after-faults")[0]["full"].shape[0] == bh.hessian(*W.args(W.case("block")),
                                                                          **W.kw(W.case("block"))).dense().shape[0]


def test_shard_is_contiguous_and_in_order(runs):
    values = _values(runs, "shard")
    assert values == [[slice(0, 2), slice(0, 0), slice(0, 0)], [slice(2, 5), slice(0, 1), slice(0, 0)]]


def test_a_rank_that_exits_stops_the_others_with_a_named_error(runs):
    done = runs["done"]["dead"]
    assert done[1][0] == 3  # os._exit(3) inside its local work
    res = _result(runs, "dead", "dead", 0)
    assert res["error"] == "CollectiveError" and "a rank exited or did not arrive" in res["message"], res
    assert res["seconds"] < TIMEOUT + 5  # the closed connection is seen at once; at worst the timeout
    assert done[0][0] == 0, done[0][1][-3000:]
    assert not (runs["root"] / "dead" / "dead-rank1.pt").exists()


def test_a_rank_that_never_arrives_ends_at_the_timeout(runs):
    res = _result(runs, "hang", "hang", 0)
    assert res["error"] == "CollectiveError" and "within the process group's timeout" in res["message"], res
    assert HANG_TIMEOUT - 1 <= res["seconds"] <= HANG_TIMEOUT + 15, res["seconds"]
    assert runs["done"]["hang"][0][0] == 0, runs["done"]["hang"][0][1][-3000:]


# ----------------------------------------------------------------------------- in this process


def test_without_a_process_group_it_is_a_value_error():
    assert not dist.is_initialized()
    c = W.case("block")
    with pytest.raises(ValueError, match="needs an initialised process group"):
        bhd.hessian(*W.args(c), **W.kw(c))
    with pytest.raises(ValueError, match="needs an initialised process group"):
        bhd.shard(4)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_is_the_single_process_result_exactly(world_of_one):
    for name in ("block", "model"):
        c = W.case(name)
        H, ref = bhd.hessian(*W.args(c), **W.kw(c)), bh.hessian(*W.args(c), **W.kw(c))
        assert H.names == ref.names and torch.equal(H.dense(), ref.dense())
        assert torch.equal(H.outer.dense(), ref.outer.dense()) and torch.equal(H.functional.dense(), ref.functional.dense())
        assert all(torch.equal(H[k], ref[k]) for k in ref.pairs())
    c = W.case("block")
    n = bh.hessian(*W.args(c), **W.kw(c)).dense().shape[0]
    out = torch.empty(n, n, dtype=W.DT)
    assert bhd.hessian(*W.args(c), **W.kw(c), out=out).dense().data_ptr() == out.data_ptr()
    assert bhd.shard(7) == slice(0, 7)
    assert bhd.on_every_rank(lambda: 5) == 5
    with pytest.raises(bhd.DistributedInputError, match="rank 0 raised ValueError: bad"):
        bhd.on_every_rank(lambda: (_ for _ in ()).throw(ValueError("bad")))


# ----------------------------------------------------------------------------- the command under torchrun


def test_the_command_under_torchrun_writes_the_dataset_hessian_once(tmp_path):
    from blockhess_lab import vit as V

    vit = V.train(0, steps=2, quiet=True, arch={"patch": 4, "d_model": 4, "d_ff": 4, "d_k": 2, "ln_eps": 1e-5})
    ck = V.save(vit, tmp_path / "ck.pt")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "blockhess",
           "distributed", "--checkpoint", str(ck), "--n-images", "9", "--save-dense", "--parts", "--quiet", "--out",
           str(out), "--timeout", str(TIMEOUT)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=WALL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "distributed.json").read_text())
    saved = torch.load(out / "hessian.pt", weights_only=True)
    H = bh.hessian(vit.model_params(), vit.model_inputs(vit.train_images[:9]), vit.model_cfg, loss="ce",
                   target=vit.train_labels[:9])
    _close(saved["dense"], H.dense(), "the command's dense Hessian")
    assert summary["world_size"] == 2 and summary["n_images"] == 9 and summary["shards"] == [4, 5]
    assert summary["names"] == list(H.names)
    norms = {(b["a"], b["b"]): b["frobenius"] for b in summary["blocks"]}
    assert norms[("W_E", "W_H")] == pytest.approx(float(H["W_E", "W_H"].norm()), rel=1e-12)
    assert summary["parts"]["outer"]["frobenius"] == pytest.approx(float(H.outer.dense().norm()), rel=1e-12)
    assert sorted(p.name for p in out.iterdir()) == [".blockhess-results", "distributed.json", "hessian.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary folder left


def test_the_command_under_torchrun_says_a_mistake_in_one_line_on_every_rank(tmp_path):
    from blockhess_lab import vit as V

    vit = V.train(0, steps=1, quiet=True, arch={"patch": 4, "d_model": 4, "d_ff": 4, "d_k": 2, "ln_eps": 1e-5})
    ck = V.save(vit, tmp_path / "ck.pt")
    n = len(vit.train_labels) + 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "blockhess",
           "distributed", "--checkpoint", str(ck), "--n-images", str(n), "--out", str(tmp_path / "out"),
           "--timeout", str(TIMEOUT)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=WALL)
    assert done.returncode != 0
    line = f"blockhess distributed: error: rank 0: --n-images {n} is larger than the {n - 1} training images"
    # each rank raises and says it in one line; torchrun ends the other rank once one has exited, which may be
    # before that rank has written its line (every rank's error is tested in the group main)
    assert 1 <= done.stderr.count(line) <= 2, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr  # torchrun's report of the first rank to exit: the user's mistake
    assert "blockhess_lab" not in done.stderr and not (tmp_path / "out").exists()  # no traceback of ours, nothing written
