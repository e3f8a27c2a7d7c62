"""One rank of the process groups tests/test_distributed.py starts (a script, run by path), and the
cases both sides build: the whole data of a case (``case(name)``) and each rank's shard of it.

``python distributed_worker.py GROUP RANK WORLD STORE OUTDIR TIMEOUT`` joins a gloo group through the
file ``STORE`` (no port to pick) with a process-group timeout of ``TIMEOUT`` seconds, runs the
scenarios of ``GROUP`` in order, and writes each one's outcome to ``OUTDIR/<scenario>-rank<RANK>.pt``:
``{"value": ...}`` (tensors on the CPU) or ``{"error": type name, "message", "failures", "seconds"}``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time

import torch

import blockhess as bh
from blockhess.config import ModelConfig, init_model_params

DT = torch.float64
#: sequences of each rank in the unequal split of a case (rank 0, rank 1)
SPLIT = (3, 2)

BLOCK = bh.BlockConfig(d_model=6, d_ff=8, d_k=4, n_heads=2, bias=True, ln_affine=True, ln_eps=1e-5)
SMALL = bh.BlockConfig(d_model=4, d_ff=6, d_k=3, ln_eps=1e-5)  # n = 4·3·2 + 16 + 24·2 = 88 > 64: Lanczos or eigvalsh
#: a token model with a causal block, fed padded batches (left padding, -100 targets: unequal counted tokens)
MASKED = ModelConfig(blocks=(bh.BlockConfig(d_model=4, d_ff=6, d_k=2, ln_eps=1e-5, causal=True, bias=True),),
                     embedding="token", vocab=5, positions="learned", n_positions=4, final_norm=True, head=5)
MODEL = ModelConfig(blocks=(bh.BlockConfig(d_model=4, d_ff=6, d_k=2, ln_eps=1e-5),), embedding="linear", d_in=3,
                    positions="sinusoidal", pool="mean", head=3)


def soft_loss(Z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A callable loss of one sequence ``Z`` ``(L, d)`` and its target ``t`` ``(d,)``."""
    return torch.logsumexp(Z.mean(0) * t, 0) + (Z ** 2).mean()


def case(name: str) -> dict:
    """The whole data of a case: ``params``, ``X``, ``cfg``, ``loss``, ``target``, ``wrt`` (seeded)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    N = sum(SPLIT)
    if name == "masked":
        ids = torch.randint(0, 5, (N, 4), generator=g)
        mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 1]])
        y = torch.randint(0, 5, (N, 4), generator=g).masked_fill(mask == 0, -100)
        y[0, :3] = -100  # rank 0 (sequences 0-2) counts 6 tokens, rank 1 (3-4) counts 4
        return {"params": init_model_params(MASKED, seed=3), "X": {"input_ids": ids, "attention_mask": mask},
                "cfg": MASKED, "loss": "ce", "target": y, "wrt": None}
    if name == "model":
        cfg = MODEL
        return {"params": init_model_params(cfg, seed=1), "X": torch.randn(N, 5, 3, generator=g, dtype=DT), "cfg": cfg,
                "loss": "ce", "target": torch.randint(0, 3, (N,), generator=g), "wrt": None}
    cfg = SMALL if name == "stats" else BLOCK
    X = torch.randn(N, 4, cfg.d_model, generator=g, dtype=DT)
    out = {"params": bh.init_params(cfg, seed=2, dtype=DT), "X": X, "cfg": cfg, "wrt": None}
    if name == "ce":
        out.update(loss="ce", target=torch.randint(0, cfg.d_model, (N, 4), generator=g), wrt=["W_V", "W_Q", "W_1"])
    elif name == "callable":
        out.update(loss=soft_loss, target=torch.randn(N, cfg.d_model, generator=g, dtype=DT))
    else:
        out.update(loss="mse", target=torch.randn(N, 4, cfg.d_model, generator=g, dtype=DT))
    return out


def part(c: dict, rank: int, split=SPLIT) -> dict:
    """Rank ``rank``'s shard of case ``c``: its rows of ``X`` and ``target`` by ``split``."""
    lo = sum(split[:rank])
    rows = slice(lo, lo + split[rank])
    X = {k: v[rows] for k, v in c["X"].items()} if isinstance(c["X"], dict) else c["X"][rows]
    return {**c, "X": X, "target": c["target"][rows]}


def args(c: dict) -> tuple:
    return c["params"], c["X"], c["cfg"]


def kw(c: dict) -> dict:
    return {"loss": c["loss"], "target": c["target"], "wrt": c["wrt"]}


# ----------------------------------------------------------------------------- scenarios


def _hessian_with_parts(c: dict, order=("outer", "functional")) -> dict:
    import blockhess.distributed as bhd

    H = bhd.hessian(*args(c), **kw(c))
    out = {"full": H.dense().clone(), "names": H.names}
    for which in order:
        out[which] = getattr(H, which).dense().clone()
    return out


def _main(rank: int) -> dict:
    """The scenarios of the group ``main`` (2 ranks), in order: results, then faults."""
    import blockhess.distributed as bhd

    s = {}
    for name in ("block", "ce", "callable", "model", "masked"):
        s[name] = lambda name=name: _hessian_with_parts(part(case(name), rank))
    s["one-sequence"] = lambda: _hessian_with_parts({**part(case("ce"), rank, (2, 1)), **(
        {"X": case("ce")["X"][2], "target": case("ce")["target"][2]} if rank == 1 else {})})
    s["empty"] = lambda: _hessian_with_parts(part(case("block"), rank, (0, 5)))

    def operator(name, split=SPLIT):  # products of the collective operator, each part, and top eigenvalues on it
        from blockhess.operators import lanczos_eigs
        c = part(case(name), rank, split)
        out = {}
        for which in ("full", "outer", "functional"):
            A = bhd.hessian_operator(*args(c), **kw(c), part=which)
            V = torch.randn(A.shape[0], 3, generator=torch.Generator().manual_seed(11), dtype=DT)
            out[which] = A @ V
        out["V"] = V
        A = bhd.hessian_operator(*args(c), **kw(c))
        out["top"] = lanczos_eigs(A, 2, tol=1e-10, seed=0).eigenvalues
        try:  # the exact diagonal: the block's closed form; a model's engine has none (on every rank)
            out["diagonal"] = A.diagonal()
            out["view_diagonal"] = A["W_V", "W_V"].diagonal()
        except NotImplementedError as exc:
            out["diagonal"] = f"NotImplementedError: {exc}"
        return out

    for name in ("block", "model", "masked"):
        s[f"operator-{name}"] = lambda name=name: operator(name)
    s["operator-empty"] = lambda: operator("block", (0, 5))

    def stats(split=SPLIT):
        c = part(case("stats"), rank, split)
        U = torch.nn.functional.normalize(torch.randn(2, 88, generator=torch.Generator().manual_seed(3), dtype=DT), dim=1)
        st = bhd.per_sample_statistics(*args(c), loss=c["loss"], target=c["target"], directions=U, keep_grads=True,
                                       lanczos_iters=None, chunk_size=2)
        return {"stats": st._asdict(), "losses": bhd.per_sample_losses(*args(c), loss=c["loss"], target=c["target"]),
                "grads": bhd.per_sample_gradients(*args(c), **kw(c)),
                "hessians": bhd.per_sample_hessians(*args(c), **kw(c))}

    s["shard"] = lambda: [bhd.shard(5), bhd.shard(1), bhd.shard(0)]
    s["stats"] = stats
    s["stats-empty"] = lambda: stats((0, 5))

    def fault(change):
        def run():
            c = part(case("block"), rank)
            if rank == 1:
                c = change(c)
            return _hessian_with_parts(c)
        return run

    p2 = lambda c, **new: {**c, "params": {**c["params"], **new}}  # noqa: E731
    s["fault-params"] = fault(lambda c: p2(c, W_Q=c["params"]["W_Q"] + 1e-12))
    s["fault-cfg"] = fault(lambda c: {**c, "cfg": dataclasses.replace(BLOCK, ln_eps=1e-6)})
    s["fault-dtype"] = fault(lambda c: {**c, "params": {k: v.float() for k, v in c["params"].items()}, "X": c["X"].float(),
                                        "target": c["target"].float()})
    s["fault-wrt"] = fault(lambda c: {**c, "wrt": ["W_Q"]})
    s["fault-loss"] = fault(lambda c: {**c, "loss": "ce", "target": torch.zeros(c["X"].shape[:2], dtype=torch.int64)})
    s["fault-length"] = fault(lambda c: {**c, "X": c["X"][:, :3], "target": c["target"][:, :3]})
    s["fault-nan"] = fault(lambda c: {**c, "X": c["X"].clone().index_fill_(0, torch.tensor([1]), float("nan"))})
    s["fault-class"] = lambda: _hessian_with_parts({**part(case("ce"), rank), **(
        {"target": torch.full_like(part(case("ce"), 1)["target"], 99)} if rank == 1 else {})})
    s["fault-order"] = lambda: _hessian_with_parts(part(case("block"), rank),
                                                   ("outer", "functional") if rank == 0 else ("functional", "outer"))
    s["fault-all-empty"] = lambda: _hessian_with_parts(part(case("block"), rank, (0, 0)))
    s["fault-wrt-input"] = lambda: bhd.hessian(*args(part(case("block"), rank)), **kw(part(case("block"), rank)),
                                               wrt_input=rank == 1).dense()

    s["fault-model-stats"] = lambda: bhd.per_sample_losses(*args(part(case("model"), rank)), loss="ce",
                                                           target=part(case("model"), rank)["target"])

    def raises_runtime():
        if rank == 1:
            raise RuntimeError("not an input error")
        return 1

    s["fault-runtime"] = lambda: bhd.on_every_rank(raises_runtime, what="a step")
    s["after-faults"] = s["block"]  # the group still works
    return s


def _dead(rank: int) -> dict:
    """Group ``dead``: rank 1 exits in the middle of its local work (inside the callable loss)."""
    def dying_loss(Z, t):
        if rank == 1:
            os._exit(3)
        return soft_loss(Z, t)

    def run():
        import blockhess.distributed as bhd

        c = {**part(case("callable"), rank), "loss": dying_loss}
        return bhd.hessian(*args(c), **kw(c)).dense()

    return {"dead": run}


def _hang(rank: int) -> dict:
    """Group ``hang``: rank 1 never arrives (it sleeps past the timeout; the test ends it)."""
    def run():
        import blockhess.distributed as bhd

        if rank == 1:
            time.sleep(600)
        c = part(case("block"), rank)
        return bhd.hessian(*args(c), **kw(c)).dense()

    return {"hang": run}


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


def main(argv: list[str]) -> int:
    group, rank, world, store, outdir, timeout = argv
    rank, world = int(rank), int(world)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=float(timeout)))
    try:
        for name, run in {"main": _main, "dead": _dead, "hang": _hang}[group](rank).items():
            t0 = time.perf_counter()
            try:
                result = {"value": _cpu(run())}
            except Exception as exc:  # noqa: BLE001 — recorded for the test to judge
                result = {"error": type(exc).__name__, "message": str(exc), "failures": getattr(exc, "failures", None),
                          "mro": [k.__name__ for k in type(exc).__mro__]}
            result["seconds"] = time.perf_counter() - t0
            path = os.path.join(outdir, f"{name}-rank{rank}.pt")
            torch.save(result, path + ".tmp")
            os.replace(path + ".tmp", path)
            if "error" in result and result["error"] == "CollectiveError":
                break  # the group is unusable
    finally:
        torch.distributed.destroy_process_group()  # after a CollectiveError too: it only frees this rank's side
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # every result is written and the group destroyed: leave without the interpreter's teardown, where
    # gloo's worker threads, still joinable when C++ statics are destroyed, can abort the process
    # ("terminate called without an active exception", exit -6) after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
