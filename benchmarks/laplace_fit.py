"""``python benchmarks/laplace_fit.py --out FILE`` (not ``laplace.py``: the script's folder comes first on ``sys.path``): ``Laplace(..., hessian_structure="full").fit`` with
blockhess's exact GGN (``blockhess.integrations.laplace.BlockhessGGN``) against laplace-torch's default,
``CurvlinopsGGN``, on a small ViT classifier and a small GPT-2 sequence classifier (random weights,
float64, ``attn_implementation="sdpa"``; curvlinops under ``sdpa_kernel(SDPBackend.MATH)`` and with
float64 as the default dtype, so that its ``torch.eye`` is float64), for the last layer and for every
weight. Each run is a fresh process (``--worker``): the fit's wall time (a warm-up fit first, on other
data of the same shapes), the peak resident memory the timed fit added above the process's before it
(``VmHWM`` reset first), and the two precisions' relative Frobenius difference. One thread; the load
average is recorded (docs/results.md, "laplace-torch").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

MODELS = ("vit", "gpt2")
SUBSETS = ("last_layer", "all")
BACKENDS = ("BlockhessGGN", "CurvlinopsGGN")
N, C, BATCH = 32, 10, 16


def build(name: str, tiny: bool = False):
    """The wrapped model and a loader of ``N`` examples (tensor batches of ``BATCH``); ``tiny``: the ViT of
    tests/test_laplace.py's size (1 layer, d 8, 4x4 one-channel images), for the accuracy rows."""
    import transformers as tf
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)  # transformers' initialisation draws from the global generator: the same model in every process
    g = torch.Generator().manual_seed(0)
    if name == "vit":
        size = dict(image_size=4, patch_size=2, num_channels=1, hidden_size=8, num_hidden_layers=1,
                    intermediate_size=12) if tiny else dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                                             num_hidden_layers=2, intermediate_size=32)
        cfg = tf.ViTConfig(num_attention_heads=2, num_labels=C, attn_implementation="sdpa", **size)
        model, key = tf.ViTForImageClassification(cfg), "pixel_values"
        X = torch.randn(N, size["num_channels"], size["image_size"], size["image_size"], generator=g, dtype=torch.float64)
    else:
        cfg = tf.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=32, num_labels=C,
                            pad_token_id=31, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        model, key = tf.GPT2ForSequenceClassification(cfg), "input_ids"
        X = torch.randint(0, 31, (N, 12), generator=g)
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    y = torch.randint(0, C, (N,), generator=g)

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, x):
            return self.model(**{key: x}).logits

    return Wrap(model), DataLoader(TensorDataset(X, y), batch_size=BATCH)


def fit(backend: str, model, dl, subset: str):
    import contextlib

    from laplace import Laplace
    from laplace.curvature import CurvlinopsGGN
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from blockhess.integrations.laplace import BlockhessGGN

    kw = dict(feature_reduction="pick_last") if subset == "last_layer" and "GPT2" in type(model.model).__name__ else {}
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure="full",
                 backend=BlockhessGGN if backend == "BlockhessGGN" else CurvlinopsGGN, **kw)
    ctx = contextlib.nullcontext() if backend == "BlockhessGGN" else sdpa_kernel(SDPBackend.MATH)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with ctx:
            la.fit(dl)
    finally:
        torch.set_default_dtype(old)
    return la


def worker(model_name: str, subset: str, backend: str, out: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from blockhess_lab.bench_worker import peak_bytes, reset_peak, rss_bytes

    torch.set_num_threads(1)
    model, dl = build(model_name)
    fit(backend, model, dl, subset)  # warm-up: the same shapes
    before, reset = rss_bytes(), reset_peak()
    t = time.perf_counter()
    la = fit(backend, model, dl, subset)
    seconds = time.perf_counter() - t
    peak = peak_bytes() - before if reset else None
    torch.save(la.posterior_precision, out)
    print(json.dumps({"seconds": seconds, "peak_bytes": peak, "n_params": la.n_params}))


def accuracy_rows() -> dict:
    """On the tiny ViT (one batch of ``N``): the summed-loss GGN of CurvlinopsGGN under the default dtype
    float32 and float64, and of BlockhessGGN, against the GGN from float64 Jacobians (``torch.func.jacrev``,
    first derivatives only); the Hessian of CurvlinopsHessian (``torch.func``'s products) and of
    BlockhessHessian against double backward (``torch.autograd.functional.hessian``); relative Frobenius."""
    from laplace.curvature import CurvlinopsGGN, CurvlinopsHessian
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from blockhess.integrations.laplace import BlockhessGGN, BlockhessHessian

    model, dl = build("vit", tiny=True)
    X, y = next(iter(DataLoaderAll(dl)))
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sizes = [p.numel() for _, p in named]
    flat0 = torch.cat([p.reshape(-1) for _, p in named])

    def out(flat):
        return torch.func.functional_call(model, {n: c.reshape(p.shape) for (n, p), c in zip(named, flat.split(sizes))},
                                          (X,))

    with sdpa_kernel(SDPBackend.MATH):
        J = torch.func.jacrev(out)(flat0)  # (N, C, P)
        f = out(flat0)
        pr = torch.softmax(f, -1)
        G = torch.einsum("bcp,bck,bkq->pq", J, torch.diag_embed(pr) - pr[:, :, None] * pr[:, None, :], J)
        R = torch.autograd.functional.hessian(lambda v: torch.nn.functional.cross_entropy(out(v), y, reduction="sum"),
                                              flat0, vectorize=True)

    def rel(A, B):
        return float((A - B).norm() / B.norm())

    def curvlinops(cls, dtype):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with sdpa_kernel(SDPBackend.MATH):
                return cls(model, "classification").full(X, y)[1]
        finally:
            torch.set_default_dtype(old)

    return {"model": "tiny vit", "n_params": len(flat0), "examples": N,
            "ggn_CurvlinopsGGN_default_float32": rel(curvlinops(CurvlinopsGGN, torch.float32), G),
            "ggn_CurvlinopsGGN_default_float64": rel(curvlinops(CurvlinopsGGN, torch.float64), G),
            "ggn_BlockhessGGN": rel(BlockhessGGN(model, "classification").full(X, y)[1], G),
            "hessian_CurvlinopsHessian_default_float64": rel(curvlinops(CurvlinopsHessian, torch.float64), R),
            "hessian_BlockhessHessian": rel(BlockhessHessian(model, "classification").full(X, y)[1], R)}


def DataLoaderAll(dl):
    """The loader's whole data set as one batch."""
    from torch.utils.data import DataLoader
    return DataLoader(dl.dataset, batch_size=len(dl.dataset))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "SUBSET", "BACKEND", "PT"))
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from blockhess_lab.runtime import environment

    env = environment()
    rows = []
    tmp = args.out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    for model_name in MODELS:
        for subset in SUBSETS:
            res = {}
            for backend in BACKENDS:
                pt = os.path.join(tmp, f"{model_name}-{subset}-{backend}.pt")
                load = os.getloadavg()
                run = subprocess.run([sys.executable, __file__, "--out", args.out, "--worker", model_name, subset,
                                      backend, pt], capture_output=True, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
                if run.returncode:
                    raise RuntimeError(run.stderr)
                r = json.loads(run.stdout.strip().splitlines()[-1])
                res[backend] = torch.load(pt)
                rows.append({"model": model_name, "subset": subset, "backend": backend, "load_average_before": load, **r})
                print(rows[-1], flush=True)
            a, b = res["BlockhessGGN"], res["CurvlinopsGGN"]
            rows[-1]["precision_rel_diff"] = rows[-2]["precision_rel_diff"] = float((a - b).norm() / b.norm())
    accuracy = accuracy_rows()
    print(accuracy, flush=True)
    env["load_average_at_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump({"environment": env, "n_examples": N, "batch": BATCH, "classes": C, "rows": rows,
                   "accuracy": accuracy}, f, indent=1)
    for p in os.listdir(tmp):
        os.remove(os.path.join(tmp, p))
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
