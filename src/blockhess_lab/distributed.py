r"""``blockhess distributed``: the exact Hessian of the digits ViT's loss over its training set, the
images sharded over the processes of a ``torchrun`` launch (:mod:`blockhess.distributed`).

::

    torchrun --standalone --nproc_per_node=2 -m blockhess distributed --out runs/distributed

Each process takes its contiguous share of the first ``--n-images`` training images (default: all
1,438; :func:`blockhess.distributed.shard`) and computes, by the closed form, the Hessian of the mean
cross-entropy over its share: of the whole model w.r.t. every weight (``--what model``: patch
embedding, block, head; ``n = 2,042``) or of the block w.r.t. its weights with the head's
cross-entropy as its loss (``--what block``, ``n = 1,792``); one ``all_reduce`` gives every process the
Hessian over all the images. Without ``torchrun`` the command runs as a group of one process.
Processes use gloo, on the CPU, one torch thread each by default (``--threads``).

Rank 0 checks ``--out`` and reads (or trains, as the other commands do) the model before any work;
the others then read the same checkpoint (``--checkpoint`` must be readable by every process: on
several machines, a shared file system or a copy; the ranks' weights are compared before any work).
Rank 0 alone writes, when all is done, atomically (a temporary folder moved into place):
``distributed.json`` (the Frobenius norm of every block pair, of the whole and, with ``--parts``, of
the outer and functional parts; the timing of every rank: the Hessian (wall clock, and the process's
CPU time), its parts, one ``all_reduce`` of the ``n × n`` buffer measured on its own; the environment) and, with ``--save-dense``, ``hessian.pt``
(``{"dense", "names", "sizes", "n_images"}``). ``--statistics`` adds Theorem 7's per-sample statistics
of the block over the same images (losses, gradient norms, spectral norms of the per-sample Hessians,
their maxima ``L`` and ``M``; about 0.1 s per image on one core).

Exit status as every command (:mod:`blockhess_lab.cli`); a process that exits or stops answering
makes the others stop with one line and status 1 (:class:`blockhess.distributed.CollectiveError`)
within ``--timeout`` seconds (the process group's; it must exceed the spread of the processes'
local work), and nothing is written.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, positive_int, progress, torch_threads

HELP = ("the dense Hessian of the digits ViT over its training set, the images sharded over the processes of a "
        "torchrun launch (blockhess.distributed)")
DETAILS = "torchrun --standalone --nproc_per_node=2 -m blockhess distributed --out runs/distributed"
#: timed all-reduces of the n × n buffer after the Hessian (the median is reported)
ALL_REDUCE_REPEATS = 3
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="distributed", metavar="DIR", help=out_help("distributed", "written by rank 0"))
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="digits ViT checkpoint to read, on every process; a path given here must exist (default: "
                        "checkpoints/digits_vit.pt under the current folder, trained there by rank 0 when absent)")
    p.add_argument("--what", choices=("model", "block"), default="model",
                   help="model: the whole ViT's Hessian w.r.t. every weight (a ModelConfig); block: the block's "
                        "weights with the head's cross-entropy as the block's loss (default: model)")
    p.add_argument("--n-images", type=positive_int, default=None, metavar="N",
                   help="the first N training images (default: all of them)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="(default: float64)")
    p.add_argument("--parts", action="store_true", help="also the outer (Gauss-Newton) and functional parts")
    p.add_argument("--save-dense", action="store_true", help="also write the dense matrix, hessian.pt")
    p.add_argument("--statistics", action="store_true",
                   help="also Theorem 7's per-sample statistics of the block over the same images")
    p.add_argument("--lanczos-iters", type=positive_int, default=64, metavar="K",
                   help="Lanczos steps per per-sample spectral norm with --statistics (default: 64)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="the process group's timeout in seconds, when this command starts the group: how long a "
                        "process waits for the others at each step (default: 1800)")
    add_threads_argument(p)
    add_quiet_argument(p)


def _start_group(timeout: float) -> bool:
    """Initialise the default process group (gloo) unless one is: from ``torchrun``'s environment, or
    as a group of one process. Returns whether it was started here (and is to be destroyed here)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if not (timeout > 0):
        raise ValueError(f"--timeout must be a number of seconds > 0, got {timeout}")
    td = datetime.timedelta(seconds=timeout)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any env:// launcher)
        dist.init_process_group("gloo", timeout=td)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=td)
    return True


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import blockhess.distributed as bhd

    started = _start_group(args.timeout)
    try:
        return _run(args)
    except bhd.CollectiveError as exc:  # a process exited or stopped answering: one line, nothing written
        print(f"blockhess distributed: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    except bhd.DistributedError as exc:  # a rank's own error, on every rank: the user's mistakes as the CLI says them
        user = {r: e for r, e in exc.failures.items() if isinstance(e, (ValueError, OSError))}
        if not exc.failures or len(user) < len(exc.failures):
            raise  # the ranks disagree (a ValueError: one line), or a bug on some rank (its traceback)
        r, e = next(iter(user.items()))
        message = str(e) if dist.get_world_size() == 1 else f"rank {r}: {e}"
        raise (ValueError(message) if isinstance(e, ValueError) else OSError(message)) from exc
    finally:
        if started:
            dist.destroy_process_group()


def _problem(model, args, rows: slice):
    """``(params, X, cfg, loss, target)`` of this rank's images ``rows`` of the first ``--n-images``."""
    dtype = DTYPES[args.dtype]
    images, labels = model.train_images[rows], model.train_labels[rows]
    if args.what == "model":
        return model.model_params(dtype), model.model_inputs(images, dtype), model.model_cfg, "ce", labels
    return model.block_params(dtype), model.embed(images, dtype), model.cfg, model.head_loss, labels


def _time_all_reduce(like: torch.Tensor) -> float:
    """The median seconds of :data:`ALL_REDUCE_REPEATS` all-reduces of a buffer like ``like`` (started together)."""
    import torch.distributed as dist

    import blockhess.distributed as bhd

    buf = torch.zeros_like(like)
    times = []
    for _ in range(ALL_REDUCE_REPEATS):
        bhd.on_every_rank(lambda: None, what="the start of a timed all-reduce")
        t0 = time.perf_counter()
        if dist.get_world_size() > 1:
            try:
                dist.all_reduce(buf)
            except RuntimeError as exc:
                raise bhd.CollectiveError(f"a timed all-reduce failed: {str(exc).splitlines()[0]}") from exc
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import blockhess.distributed as bhd

    from . import vit as vitmod

    rank, world = dist.get_rank(), dist.get_world_size()
    quiet = args.quiet or rank != 0
    t_start = time.perf_counter()
    with torch_threads(args.threads):
        def first():  # rank 0: --out and the model (trained once, here, when absent); then the others read it
            if rank == 0:
                check_out(args.out)
                plan = vitmod.would_train(args.checkpoint)
                if plan and args.n_images is not None:  # checked before a model is trained, too
                    vitmod.check_batch("--n-images", args.n_images, plan["n_train"])
                return vitmod.load_for_command(args.checkpoint, quiet=quiet)
            return None

        model = bhd.on_every_rank(first, what="checking --out and reading the model on rank 0")

        def rest():
            m = model if rank == 0 else vitmod.load_for_command(args.checkpoint, quiet=True)
            if args.n_images is not None:
                vitmod.check_batch("--n-images", args.n_images, len(m.train_labels))
            return m

        model = bhd.on_every_rank(rest, what="reading the model on every rank")
        env = environment()  # here: it records the thread count the work runs on
        n = args.n_images or len(model.train_labels)
        rows = bhd.shard(n)
        params, X, cfg, loss, target = _problem(model, args, rows)
        timing = {"rank": rank, "sequences": rows.stop - rows.start}

        bhd.on_every_rank(lambda: None, what="the start")
        c0, t0 = time.process_time(), time.perf_counter()
        H = bhd.hessian(params, X, cfg, loss=loss, target=target)
        timing["hessian_seconds"] = time.perf_counter() - t0
        timing["hessian_cpu_seconds"] = time.process_time() - c0  # this process's CPU time: its work, without waits
        parts = {}
        if args.parts:
            t0 = time.perf_counter()
            parts = {which: getattr(H, which) for which in ("outer", "functional")}
            timing["parts_seconds"] = time.perf_counter() - t0
        timing["all_reduce_seconds"] = _time_all_reduce(H.dense())
        stats = None
        if args.statistics:
            bp, Xb = model.block_params(DTYPES[args.dtype]), model.embed(model.train_images[rows], DTYPES[args.dtype])
            bar = progress(total=rows.stop - rows.start, quiet=quiet, desc="per-sample statistics (rank 0)", unit="image")
            t0 = time.perf_counter()
            stats = bhd.per_sample_statistics(bp, Xb, model.cfg, loss=model.head_loss, target=model.train_labels[rows],
                                              lanczos_iters=args.lanczos_iters, progress=bar.update)
            timing["statistics_seconds"] = time.perf_counter() - t0
            bar.close()
        timings = bhd.gather_objects(timing, what="the timings")

        def write():
            if rank != 0:
                return None
            res = _summary(args, model, H, parts, stats, timings, n, env)
            res["runtime_s"] = time.perf_counter() - t_start
            with atomic_dir(args.out) as tmp:
                write_json(tmp / "distributed.json", res)
                if args.save_dense:
                    torch.save({"dense": H.dense(), "names": list(H.names), "sizes": list(H.sizes), "n_images": n,
                                "what": args.what}, tmp / "hessian.pt")
            return res

        res = bhd.on_every_rank(write, what="writing the results on rank 0")
    if rank == 0 and not quiet:
        t = res["timing"]
        print(f"distributed: {args.what} Hessian {res['n']}x{res['n']} over {n} images on {world} process"
              f"{'es' if world > 1 else ''} in {t['hessian_seconds']:.2f} s ({t['images_per_second']:.1f} images/s; "
              f"one all-reduce {t['all_reduce_seconds']:.3f} s); ||H||_F = {res['frobenius']:.6g} -> {args.out}")
    return 0


def _summary(args, model, H, parts: dict, stats, timings: list[dict], n: int, env: dict) -> dict:
    import torch.distributed as dist

    D = H.dense()
    hess = max(t["hessian_seconds"] for t in timings)
    allr = max(t["all_reduce_seconds"] for t in timings)
    res = {
        "command": "distributed", "what": args.what, "dtype": args.dtype, "n_images": n,
        "world_size": dist.get_world_size(), "backend": str(dist.get_backend()),
        "shards": [t["sequences"] for t in timings],
        "names": list(H.names), "sizes": list(H.sizes), "n": int(D.shape[0]),
        "frobenius": float(D.norm()), "trace": float(D.diagonal().sum()), "max_abs": float(D.abs().max()),
        "blocks": [{"a": a, "b": b, "frobenius": float(block.norm())} for (a, b), block in H.items()],
        "parts": {which: {"frobenius": float(P.dense().norm()), "trace": float(P.dense().diagonal().sum())}
                  for which, P in parts.items()},
        "timing": {
            "hessian_seconds": hess, "images_per_second": n / hess, "all_reduce_seconds": allr,
            "hessian_cpu_seconds_max": max(t["hessian_cpu_seconds"] for t in timings),
            "all_reduce_share": allr / hess, "all_reduce_bytes": D.numel() * D.element_size(),
            "threads_per_process": args.threads, "per_rank": timings,
        },
        "model": {"checkpoint": model.checkpoint, "test_accuracy": model.test_accuracy, "arch": model.arch},
        "environment": {**env, "load_average_at_end": load_average()},
    }
    if stats is not None:
        upper = stats.spectral + stats.spectral_residual
        res["statistics"] = {
            "of": "the block's per-sample Hessians, the head's cross-entropy as its loss (Theorem 7)",
            "lanczos_iters": args.lanczos_iters,
            "loss_max_L": float(stats.loss.max()), "spectral_max": float(stats.spectral.max()),
            "spectral_max_upper_M": float(upper.max()), "grad_norm_max": float(stats.grad_norm.max()),
            "frobenius_max": float(stats.frobenius.max()),
            "per_sample": {k: getattr(stats, k).tolist() for k in ("loss", "spectral", "spectral_residual", "grad_norm")},
        }
    return res
