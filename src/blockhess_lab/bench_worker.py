"""One benchmark job of ``blockhess bench``, run in a fresh subprocess.

``python -m blockhess_lab.bench_worker JOB.json RESULT.json``

A job names a *problem* (what is computed: a component Jacobian or the full loss Hessian
of the paper's block at one size, dtype and loss, or the Hessian of a whole model's loss,
:class:`ModelProblem`) and a list of *methods* that compute the same dense output (our closed
form, autograd baselines, the allocate-and-fill floor).

Modes
-----
``time``
    Every method is called once (its first, cold call is timed and its peak memory taken;
    only the first method's is that of a fresh process: the tables take peaks from the
    ``memory`` jobs), then warmed up,
    then timed in interleaved rounds: round ``r`` calls the methods in an order rotated by
    ``r``, so slow drifts of a shared machine hit every method alike. A sample is ``k``
    back-to-back calls (``k`` chosen so a sample lasts ``min_sample_s``), recorded per call.
    A method whose calls are slow gets fewer samples (``method_budget_s``).
``memory``
    One method, one call, in this fresh process: peak resident memory of the call (the
    kernel's high-water mark, reset just before the call) and the cold call's time.

Every method's output is checked against the closed form's: exactly (relative Frobenius
error) when both are held in this process, and always through a random sketch
``out @ P`` (``P`` fixed by seed) that the parent compares across processes.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback

import torch

from .runtime import environment

# ---------------------------------------------------------------------------------------
# memory


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """Peak resident set size (``VmHWM``; ``ru_maxrss`` where ``/proc`` lacks it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------
# problems


DTYPES = {"float32": torch.float32, "float64": torch.float64}


class FlatParams:
    """The weights ``params`` (names and ``shapes`` in canonical order) as one flat vector ``theta``
    and back: what the autograd baselines differentiate."""

    def unflatten(self, theta: torch.Tensor) -> dict:
        out, o = {}, 0
        for name, shape in self.shapes:
            size = math.prod(shape)
            out[name] = theta[o : o + size].view(shape)
            o += size
        return out

    def theta(self) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for v in self.params.values()])


class Problem(FlatParams):
    """Inputs of one benchmark case, built deterministically from its spec.

    ``spec``: ``kind`` ("jacobian" | "hessian"), ``of`` (jacobian: "ln" | "W_1" | "W_2" |
    "block"), ``L``, ``d``, ``d_ff``, ``B`` (0: one sequence ``(L, d)``), ``dtype``, ``loss``
    ("mse" | "ce" | "digits"), ``seed``, ``ln_eps`` (default 0, the paper's), ``heads`` (if
    given: the block of a ``torch.nn.TransformerEncoderLayer(d, heads, d_ff)``, PyTorch's own
    initialisation under ``seed``, read by :func:`blockhess.from_torch`: biases, ``W_O``,
    affine LayerNorms with eps 1e-5). The inputs are drawn on the CPU (same numbers on every
    device) and moved to ``device``.
    """

    def __init__(self, spec: dict, device: str = "cpu"):
        import blockhess as bh

        self.spec = spec
        self.kind = spec["kind"]
        self.dtype = DTYPES[spec["dtype"]]
        L, d, d_ff, B = spec["L"], spec["d"], spec["d_ff"], spec.get("B", 0)
        if spec.get("heads"):
            torch.manual_seed(spec.get("seed", 0))
            layer = torch.nn.TransformerEncoderLayer(d, spec["heads"], d_ff, dropout=0.0, batch_first=True).to(self.dtype).eval()
            self.cfg, self.params = bh.from_torch(layer)
            self.params = {k: v.detach().clone() for k, v in self.params.items()}
        else:
            self.cfg = bh.BlockConfig(d_model=d, d_ff=d_ff, d_k=d, ln_eps=float(spec.get("ln_eps", 0.0)))
            self.params = bh.init_params(self.cfg, seed=spec.get("seed", 0), dtype=self.dtype)
        self.names = list(self.params)
        self.shapes = [(k, tuple(v.shape)) for k, v in self.params.items()]
        self.n = sum(v.numel() for v in self.params.values())
        gen = torch.Generator().manual_seed(spec.get("seed", 0) + 1)
        self.loss = spec.get("loss", "mse")
        self.head = None
        if self.loss == "digits":
            self.X, self.target, self.head = _digits_batch(B or 128, L, d, self.dtype, gen)
        else:
            shape = (B, L, d) if B else (L, d)
            self.X = torch.randn(shape, generator=gen, dtype=torch.float64).to(self.dtype)
            if self.loss == "mse":
                self.target = torch.randn(shape, generator=gen, dtype=torch.float64).to(self.dtype)
            else:
                self.target = torch.randint(0, d, shape[:-1], generator=gen)
        self.device = torch.device(device)
        self.params = {k: v.to(self.device) for k, v in self.params.items()}
        self.X, self.target = self.X.to(self.device), self.target.to(self.device)
        self.head = None if self.head is None else self.head.to(self.device)
        if self.kind == "jacobian":
            of = spec["of"]
            self.rows = L * d
            self.cols = {"ln": L * d, "block": self.n}.get(of) or self.params[of].numel()
        else:
            self.rows = self.cols = self.n
        self.out_bytes = self.rows * self.cols * self.dtype.itemsize

    # losses by plain torch ops, for the autograd baselines
    def loss_value(self, Z: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as Fn

        if self.loss == "mse":
            return ((Z - self.target) ** 2).mean()
        d = Z.shape[-1]
        if self.loss == "ce":
            return Fn.cross_entropy(Z.reshape(-1, d), self.target.reshape(-1))
        return Fn.cross_entropy(Z.mean(-2) @ self.head, self.target)

    def bh_loss(self):
        """``(loss, target)`` as :func:`blockhess.hessian` takes them."""
        if self.loss != "digits":
            return self.loss, self.target
        head = self.head

        def digits_loss(Z, y):  # one sequence (L, d), its label y
            import torch.nn.functional as Fn

            return Fn.cross_entropy((Z.mean(0) @ head)[None], y.reshape(1))

        return digits_loss, self.target

    def scalar(self):
        """``theta -> loss`` through :func:`blockhess.reference.forward` (autograd baselines)."""
        from blockhess import reference

        def f(theta):
            return self.loss_value(reference.forward(self.unflatten(theta), self.X, self.cfg))

        return f


class ModelProblem(FlatParams):
    """Inputs of one whole-model case (``kind="model"``): a :class:`~blockhess.config.ModelConfig`
    with random weights (:func:`blockhess.init_params` under ``seed``), a batch and the cross-entropy
    of its output.

    ``spec``: ``model`` ("vit" | "gpt2"), ``B``, ``blocks`` (``N``), ``dtype``, ``seed``, and
    ``columns`` (the column block of curvlinops ``H @ I``; default ``n``).

    * ``"vit"``: the digits ViT (:data:`blockhess_lab.vit.DEFAULT_ARCH`'s block, the paper's setting
      with ``ln_eps``): 1×8×8 images in 2×2 patches (16 tokens), sinusoidal positions, mean pooling,
      a 10-class head with bias; inputs the first ``B`` scikit-learn digits (:func:`~blockhess_lab.vit.load_data`),
      CE on their labels.
    * ``"gpt2"``: pre-LN GPT-2 blocks (``d`` = ``d``, ``d_ff``, ``heads``, biases, ``W_O``, affine
      LayerNorms with eps 1e-5, tanh GELU, causal), token embedding of a vocabulary ``vocab``,
      learned positions (``positions`` rows, every sequence that long), final LayerNorm, the head
      tied to ``W_E`` without bias; inputs uniform random token ids ``(B, positions)``, per-token CE
      on the next token of the same random sequence (targets ``(B, positions)``).
    """

    kind = "model"

    def __init__(self, spec: dict, device: str = "cpu"):
        import blockhess as bh

        self.spec = spec
        self.dtype = DTYPES[spec["dtype"]]
        self.cfg = model_config(spec)
        self.params = bh.init_params(self.cfg, seed=spec.get("seed", 0), dtype=self.dtype)
        self.names = list(self.params)
        self.shapes = [(k, tuple(v.shape)) for k, v in self.params.items()]
        self.n = sum(v.numel() for v in self.params.values())
        self.rows = self.cols = self.n
        self.out_bytes = self.n * self.n * self.dtype.itemsize
        self.columns = int(spec.get("columns") or self.n)
        self.loss, B = "ce", spec["B"]
        if spec["model"] == "vit":
            from .vit import load_data

            images, labels = load_data()
            if B > images.shape[0]:
                raise ValueError(f"model vit: B must be at most {images.shape[0]} (the digits), got {B}")
            self.X, self.target = images[:B, None].to(self.dtype), labels[:B].clone()
        else:
            gen = torch.Generator().manual_seed(spec.get("seed", 0) + 1)
            seq = torch.randint(0, spec["vocab"], (B, spec["positions"] + 1), generator=gen)
            self.X, self.target = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        self.device = torch.device(device)
        self.params = {k: v.to(self.device) for k, v in self.params.items()}
        self.X, self.target = self.X.to(self.device), self.target.to(self.device)

    def bh_loss(self):
        """``(loss, target)`` as :func:`blockhess.hessian` takes them."""
        return self.loss, self.target

    def logits(self, params: dict, X: torch.Tensor) -> torch.Tensor:
        """The model's logits by plain ops (:func:`blockhess.reference.forward`), one row per
        token of the loss: ``(B·P, classes)``."""
        from blockhess import reference

        z = reference.forward(params, X, self.cfg)
        return z.reshape(-1, z.shape[-1])

    def scalar(self):
        """``theta -> loss``: the mean cross-entropy over every token of the loss (per-token:
        every position; pooled: every sequence), by ``torch.nn.functional.cross_entropy``."""
        import torch.nn.functional as Fn

        y = self.target.reshape(-1)

        def f(theta):
            return Fn.cross_entropy(self.logits(self.unflatten(theta), self.X), y)

        return f


def model_config(spec: dict):
    """The :class:`~blockhess.config.ModelConfig` of a :class:`ModelProblem` spec."""
    from blockhess.config import BlockConfig, ModelConfig

    N = spec.get("blocks", 2)
    if spec["model"] == "vit":
        from .vit import DEFAULT_ARCH as a

        blk = BlockConfig(d_model=a["d_model"], d_ff=a["d_ff"], d_k=a["d_k"], ln_eps=a["ln_eps"])
        return ModelConfig(blocks=(blk,) * N, embedding="patch", image=(1, 8, 8), patch=a["patch"],
                           positions="sinusoidal", pool="mean", head=10)
    if spec["model"] == "gpt2":
        g = BlockConfig(d_model=spec["d"], d_ff=spec["d_ff"], n_heads=spec["heads"], norm="pre", bias=True, out_proj=True,
                        ln_affine=True, ln_eps=1e-5, activation="gelu_tanh", causal=True)
        return ModelConfig(blocks=(g,) * N, embedding="token", vocab=spec["vocab"], positions="learned",
                           n_positions=spec["positions"], final_norm=True, head=spec["vocab"], tied=True, head_bias=False)
    raise ValueError(f"model must be 'vit' or 'gpt2', got {spec['model']!r}")


def make_problem(spec: dict, device: str = "cpu"):
    """The problem of a job: a :class:`ModelProblem` for ``kind="model"``, else a :class:`Problem`."""
    return (ModelProblem if spec["kind"] == "model" else Problem)(spec, device)


def _digits_batch(B: int, L: int, d: int, dtype, gen):
    """A batch of ``B`` scikit-learn 8×8 digits as token sequences, and a classifier head.

    The images are cut into ``L`` square patches (``L`` in 4, 16, 64), each flattened and
    embedded by a fixed random projection to ``d`` plus a sinusoidal position code (the
    report's ViT layout); a fixed random head ``(d, 10)`` reads the mean-pooled tokens.
    Weights are random: the timing does not depend on training.
    """
    from sklearn.datasets import load_digits

    side = int(round(math.sqrt(L)))
    if side * side != L or 8 % side:
        raise ValueError(f"digits: L must be 4, 16 or 64 (square patches of an 8x8 image), got {L}")
    p = 8 // side
    data = load_digits()
    img = torch.tensor(data.images[:B], dtype=torch.float64) / 16.0
    y = torch.tensor(data.target[:B], dtype=torch.long)
    patches = img.reshape(B, side, p, side, p).permute(0, 1, 3, 2, 4).reshape(B, L, p * p)
    E = torch.randn(p * p, d, generator=gen, dtype=torch.float64) / math.sqrt(p * p)
    pos = torch.arange(L, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    pe = torch.zeros(L, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    X = patches @ E + pe
    head = torch.randn(d, 10, generator=gen, dtype=torch.float64) / math.sqrt(d)
    return X.to(dtype), y, head.to(dtype)


# ---------------------------------------------------------------------------------------
# methods: setup(problem) -> (call, canon, extra); call() computes the dense output,
# canon(out) turns it into one 2-D tensor (rows, cols) for the checks, outside the timing.


class Skip(Exception):
    """A baseline that cannot run here (not installed); the message says why."""


def _identity(out):
    return out


def _cat_cols(out, P: Problem):
    vals = out.values() if isinstance(out, dict) else out
    return torch.cat([v.reshape(P.rows, -1) for v in vals], dim=1)


def _jac_function(P: Problem):
    """``(fn, inputs)``: the function whose Jacobian is wanted, by plain torch ops."""
    import torch.nn.functional as Fn

    from blockhess import reference

    of = P.spec["of"]
    if of == "ln":
        d = P.cfg.d_model
        return (lambda x: Fn.layer_norm(x, (d,), eps=0.0)), (P.X,)
    if of == "block":
        names = P.names

        def fn(*ws):
            return reference.forward(dict(zip(names, ws)), P.X, P.cfg)

        return fn, tuple(P.params[n] for n in names)
    fixed = {k: v for k, v in P.params.items() if k != of}
    return (lambda w: reference.forward({**fixed, of: w}, P.X, P.cfg)), (P.params[of],)


def setup_closed_form(P: Problem):
    import blockhess as bh

    if P.kind == "jacobian":
        of = P.spec["of"]
        if of == "ln":
            return (lambda: bh.layernorm.jacobian(P.X)), _identity, {}
        if of == "block":
            return (lambda: bh.jacobian(P.params, P.X, P.cfg)), (lambda o: _cat_cols(o, P)), {}
        return (lambda: bh.jacobian(P.params, P.X, P.cfg, wrt=of)[of]), _identity, {}
    loss, target = P.bh_loss()
    return (lambda: bh.hessian(P.params, P.X, P.cfg, loss=loss, target=target).dense()), _identity, {}


def setup_closed_form_out(P: Problem):
    """The closed form assembled into one ``(n, n)`` buffer allocated here, outside the timing, and
    reused by every call (``blockhess.hessian(..., out=)``): no allocation, no fresh pages."""
    import blockhess as bh

    if P.kind != "hessian":
        raise Skip("out= is an option of a block's Hessian only")
    loss, target = P.bh_loss()
    buf = torch.empty(P.rows, P.cols, dtype=P.dtype, device=P.device)
    return (lambda: bh.hessian(P.params, P.X, P.cfg, loss=loss, target=target, out=buf).dense()), _identity, {}


def setup_floor(P: Problem):
    """Allocate and fill the dense output: the least any method must spend."""
    shape, dtype = (P.rows, P.cols), P.dtype
    return (lambda: torch.full(shape, 1.0, dtype=dtype, device=P.device)), _identity, {}


def setup_autograd(P: Problem):
    """``torch.autograd.functional.jacobian`` / ``hessian`` (the paper's baseline; loops over outputs)."""
    if P.kind == "jacobian":
        fn, inputs = _jac_function(P)
        arg = inputs[0] if len(inputs) == 1 else inputs
        return (lambda: torch.autograd.functional.jacobian(fn, arg)), (lambda o: _cat_cols(o if isinstance(o, tuple) else [o], P)), {}
    f, theta = P.scalar(), P.theta()
    return (lambda: torch.autograd.functional.hessian(f, theta)), _identity, {}


def _setup_func(P: Problem, which: str):
    if P.kind != "jacobian":
        raise Skip(f"{which} is a Jacobian baseline")
    fn, inputs = _jac_function(P)
    jac = getattr(torch.func, which)(fn, argnums=tuple(range(len(inputs))))
    return (lambda: jac(*inputs)), (lambda o: _cat_cols(o, P)), {}


def setup_jacrev(P: Problem):
    return _setup_func(P, "jacrev")


def setup_jacfwd(P: Problem):
    return _setup_func(P, "jacfwd")


def setup_func_hessian(P: Problem):
    """``torch.func.hessian`` (``jacfwd(jacrev)``) of the loss over the flat weight vector."""
    if P.kind == "jacobian":
        raise Skip("torch.func.hessian is a Hessian baseline")
    f, theta = P.scalar(), P.theta()
    hess = torch.func.hessian(f)
    return (lambda: hess(theta)), _identity, {}


def setup_curvlinops(P: Problem):
    """curvlinops ``HessianLinearOperator @ I`` (identity built once, outside the timing); for a
    model, applied to the identity's column blocks of ``P.columns`` into one ``(n, n)`` result."""
    if P.kind == "jacobian":
        raise Skip("curvlinops is a Hessian baseline")
    try:
        import curvlinops
        from curvlinops import HessianLinearOperator
    except ImportError as exc:
        raise Skip(f"curvlinops-for-pytorch not installed ({exc.__class__.__name__}); pip install --no-deps -r requirements-laplace.txt") from exc
    from blockhess import reference

    cfg, loss, head, names = P.cfg, P.loss, P.head if P.kind == "hessian" else None, P.names

    def output(p: dict, X: torch.Tensor) -> torch.Tensor:
        if P.kind == "model":
            return P.logits(p, X)
        Z = reference.forward(p, X, cfg)
        if loss == "ce":
            return Z.reshape(-1, Z.shape[-1])
        if loss == "digits":
            return Z.mean(-2) @ head
        return Z

    class Wrapped(torch.nn.Module):  # a ParameterList: model names have dots, which a module's attributes cannot
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList([torch.nn.Parameter(P.params[k].clone()) for k in names])

        def forward(self, X):
            return output(dict(zip(names, self.weights)), X)

    model = Wrapped()
    X = P.X if P.X.ndim == 3 or P.kind == "model" else P.X[None]
    if loss == "mse":
        y, lf = (P.target if P.target.ndim == 3 else P.target[None]), torch.nn.MSELoss()
    else:
        y, lf = P.target.reshape(-1), torch.nn.CrossEntropyLoss()
    H = HessianLinearOperator(model, lf, list(model.weights), [(X, y)], check_deterministic=False, progressbar=False)
    eye = torch.eye(P.n, dtype=P.dtype, device=P.device)
    extra = {"version": getattr(curvlinops, "__version__", "?")}
    if P.kind != "model" or P.columns >= P.n:
        return (lambda: H @ eye), _identity, extra
    starts = range(0, P.n, P.columns)

    def blocked():
        out = torch.empty(P.n, P.n, dtype=P.dtype, device=P.device)
        for s in starts:
            out[:, s : s + P.columns] = H @ eye[:, s : s + P.columns]
        return out

    return blocked, _identity, {**extra, "columns": P.columns}


def setup_jax(P: Problem):
    """``jax.jit(jax.hessian(f))`` in float64; compile time measured here, apart."""
    if P.kind != "hessian":
        raise Skip("the JAX baseline is a block's Hessian baseline")
    if P.dtype != torch.float64:
        raise Skip("the JAX baseline runs in float64 only")
    if P.device.type != "cpu":
        raise Skip("the JAX baseline runs on the CPU only (the bench extra installs CPU jaxlib)")
    if P.spec.get("heads"):
        raise Skip("the JAX baseline implements the paper's block only")
    try:
        import jax
        import numpy as np

        from . import bench_jax
    except ImportError as exc:
        raise Skip(f"jax not installed ({exc.__class__.__name__}); pip install -e '.[bench]'") from exc
    hess = bench_jax.make_hessian(P.shapes, P.loss, P.cfg.ln_eps)
    theta = jax.numpy.asarray(P.theta().numpy())
    X = jax.numpy.asarray(P.X.numpy() if P.X.ndim == 3 else P.X.numpy()[None])
    if P.loss == "digits":
        tgt = jax.numpy.asarray(P.target.numpy())
    else:  # give a single sequence its batch axis, as X
        tgt = jax.numpy.asarray(P.target.numpy() if P.X.ndim == 3 else P.target.numpy()[None])
    head = jax.numpy.asarray(P.head.numpy()) if P.head is not None else None
    t0 = time.perf_counter()
    compiled = hess.lower(theta, X, tgt, head).compile()
    compile_s = time.perf_counter() - t0

    def call():
        return compiled(theta, X, tgt, head).block_until_ready()

    def canon(out):
        return torch.from_numpy(np.array(out))

    return call, canon, {"compile_s": compile_s, "version": jax.__version__, "devices": str(jax.devices())}


METHODS = {
    "closed_form": setup_closed_form,
    "closed_form_out": setup_closed_form_out,
    "floor": setup_floor,
    "autograd": setup_autograd,
    "jacrev": setup_jacrev,
    "jacfwd": setup_jacfwd,
    "func_hessian": setup_func_hessian,
    "curvlinops": setup_curvlinops,
    "jax": setup_jax,
}


# ---------------------------------------------------------------------------------------
# checks


def _sketch_matrix(cols: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(20251019)
    return torch.randn(cols, 8, generator=gen, dtype=torch.float64).to(dtype)


def summarise(M: torch.Tensor, P: Problem) -> dict:
    """Sketch ``M @ P`` (8 columns), Frobenius norm and symmetry of a dense output."""
    M = M.reshape(P.rows, P.cols)
    S = M @ _sketch_matrix(P.cols, M.dtype).to(M.device)
    out = {"sketch": S.double().flatten().tolist(), "fro": float(torch.linalg.matrix_norm(M.double() if M.dtype != torch.float64 and M.numel() < 5e7 else M))}
    if P.rows == P.cols and P.kind in ("hessian", "model"):
        # ||M - M^T||_F by row panels: no n x n temporary (the output may fill most of memory)
        sq, step = 0.0, max(1, (1 << 24) // max(P.cols, 1))
        for i in range(0, P.rows, step):
            sq += float(torch.linalg.matrix_norm(M[i : i + step] - M[:, i : i + step].T) ** 2)
        out["asym"] = math.sqrt(sq) / max(out["fro"], 1e-300)
    return out


# ---------------------------------------------------------------------------------------
# runs


def _setup_all(P: Problem, names: list[str], res: dict) -> dict:
    ready = {}
    for name in names:
        entry = res.setdefault(name, {})
        try:
            t0 = time.perf_counter()
            call, canon, extra = METHODS[name](P)
            if P.device.type == "cuda":
                call = _synchronised(call)
            entry["setup_s"] = time.perf_counter() - t0
            entry.update(extra)
            entry["available"] = True
            ready[name] = (call, canon)
        except Skip as exc:
            entry.update(available=False, skip_reason=str(exc))
        except Exception as exc:  # a baseline that breaks is reported, not fatal
            entry.update(available=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    return ready


def _synchronised(call):
    """``call`` followed by ``torch.cuda.synchronize()``: a timed call ends when its kernels do."""

    def synced():
        out = call()
        torch.cuda.synchronize()
        return out

    return synced


def _guarded(call, entry) -> bool:
    """Call; on an exception record it in ``entry["error"]`` (first one only) and return False."""
    try:
        call()
        return True
    except Exception as exc:
        entry.setdefault("error", f"{type(exc).__name__} in a timed call: {exc}".splitlines()[0][:300])
        return False


def _first_call(name, call, canon, P, entry, keep: bool, measure_peak: bool):
    gc.collect()
    cuda = P.device.type == "cuda"
    entry["rss_before_bytes"] = rss_bytes()
    peak_ok = reset_peak() if measure_peak else False
    if cuda:
        torch.cuda.reset_peak_memory_stats(P.device)
        cuda_before = torch.cuda.memory_allocated(P.device)
    t0 = time.perf_counter()
    out = call()
    entry["first_call_s"] = time.perf_counter() - t0
    if measure_peak:
        entry["peak_rss_bytes"] = peak_bytes()
        entry["peak_reset"] = peak_ok
        entry["peak_delta_bytes"] = entry["peak_rss_bytes"] - entry["rss_before_bytes"]
        if cuda:  # the GPU's memory is what the method spends; the host's is kept apart
            entry["peak_host_delta_bytes"] = entry["peak_delta_bytes"]
            entry["peak_delta_bytes"] = torch.cuda.max_memory_allocated(P.device) - cuda_before
    M = canon(out)
    entry["out_shape"] = list(M.shape) if hasattr(M, "shape") else None
    entry.update(summarise(M, P))
    kept = M if keep else None
    del out, M
    gc.collect()
    entry["rss_after_bytes"] = rss_bytes()
    return kept


def run_time(job: dict) -> dict:
    P = make_problem(job["problem"], job.get("device", "cpu"))
    names = job["methods"]
    res: dict = {}
    ready = _setup_all(P, names, res)
    keep = job.get("exact", True)
    outputs = {}
    # first (cold) calls, with their peak memory (a fresh process's for the first method only)
    for i, name in enumerate(list(ready)):
        call, canon = ready[name]
        try:
            outputs[name] = _first_call(name, call, canon, P, res[name], keep, measure_peak=True)
        except Exception as exc:
            res[name]["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            del ready[name]
    if keep and "closed_form" in outputs and outputs["closed_form"] is not None:
        from blockhess.linalg import rel_error

        ref = outputs["closed_form"]
        for name, M in outputs.items():
            if name not in ("closed_form", "floor") and M is not None:
                res[name]["rel_err"] = rel_error(M.reshape(ref.shape), ref)
    outputs.clear()
    gc.collect()
    # warm-up and calibration
    budget = job.get("method_budget_s", 60.0)
    rounds = job.get("rounds", 7)
    min_sample = job.get("min_sample_s", 0.02)
    plan = {}
    for name, (call, _) in ready.items():
        warm = []
        slow = res[name]["first_call_s"] > budget / 2  # its first call was its warm-up
        for _ in range(0 if slow else job.get("warmup", 2)):
            if warm and sum(warm) > budget / 4:
                break
            t0 = time.perf_counter()
            if not _guarded(call, res[name]):
                break
            warm.append(time.perf_counter() - t0)
        t_call = min(warm) if warm else res[name]["first_call_s"]
        res[name]["warmup_s"] = warm
        inner = max(1, min(1000, math.ceil(min_sample / max(t_call, 1e-7))))
        samples = max(1, min(rounds, int(budget // max(t_call * inner, 1e-9))))
        plan[name] = [inner, samples]
        res[name].update(inner=inner, times=[], cpu_times=[])
    # interleaved rounds
    order = [n for n in ready if n in plan]
    for r in range(rounds):
        k = r % max(len(order), 1)
        for name in order[k:] + order[:k]:
            inner, left = plan[name]
            if left <= 0:
                continue
            call = ready[name][0]
            gc.collect()
            gc.disable()
            c0, t0 = time.process_time(), time.perf_counter()
            ok = True
            for _ in range(inner):
                ok = ok and _guarded(call, res[name])
            dt = (time.perf_counter() - t0) / inner
            dc = (time.process_time() - c0) / inner
            gc.enable()
            if not ok:  # failed in a later call (e.g. memory another method still holds): keep what was measured
                plan[name][1] = 0
                continue
            res[name]["times"].append(dt)
            res[name]["cpu_times"].append(dc)
            plan[name][1] -= 1
    for name in ready:
        t = res[name].get("times")
        if t:
            q = statistics.quantiles(t, n=4, method="inclusive") if len(t) >= 2 else [t[0]] * 3
            res[name].update(median_s=statistics.median(t), p25_s=q[0], p75_s=q[2], min_s=min(t), max_s=max(t), samples=len(t),
                             median_cpu_s=statistics.median(res[name]["cpu_times"]))
    return res


def run_memory(job: dict) -> dict:
    P = make_problem(job["problem"], job.get("device", "cpu"))
    (name,) = job["methods"]
    res: dict = {}
    ready = _setup_all(P, [name], res)
    if name in ready:
        call, canon = ready[name]
        try:
            _first_call(name, call, canon, P, res[name], keep=False, measure_peak=True)
        except Exception as exc:
            res[name]["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return res


def _start_device(device: str) -> None:
    """On a GPU, start the context and the BLAS and LAPACK handles (a product, a factorisation)
    before anything is timed or measured: a first call should not pay for the process's start."""
    if torch.device(device).type != "cuda":
        return
    a = torch.eye(8, dtype=torch.float64, device=device)
    torch.linalg.eigh(a @ a)
    torch.linalg.qr(a.float() @ a.float())
    torch.cuda.synchronize(device)


def main(argv: list[str]) -> int:
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    result = {"job": job, "env": environment(job.get("device", "cpu"))}
    t0 = time.perf_counter()
    try:
        _start_device(job.get("device", "cpu"))
        P = make_problem(job["problem"], job.get("device", "cpu"))
        result.update(n=P.n, rows=P.rows, cols=P.cols, out_bytes=P.out_bytes)
        del P
        result["methods"] = run_memory(job) if job["mode"] == "memory" else run_time(job)
        result["status"] = "ok"
    except Exception as exc:
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        result["traceback"] = traceback.format_exc()[-2000:]
    result["wall_s"] = time.perf_counter() - t0
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
