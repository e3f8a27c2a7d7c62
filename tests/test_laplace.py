"""blockhess.integrations.laplace: ``Laplace(..., backend=BlockhessGGN / BlockhessHessian)`` on a tiny
ViT classifier and a tiny GPT-2 sequence classifier (random weights, float64, nothing downloaded)
against laplace-torch's ``CurvlinopsGGN`` (autograd through the wrapper, under
``sdpa_kernel(SDPBackend.MATH)``) and the Hessian against double backward through the wrapper
(laplace-torch's ``CurvlinopsHessian`` is ``torch.func``'s, wrong through ``F.layer_norm`` with a
weight in torch 2.13) to 1e-10: the posterior precision, the log marginal
likelihood, the GLM predictive; every subset laplace-torch offers (all, last layer, a subnetwork, a
LoRA-style subset), both likelihoods (the factor ½ of regression), LowRankLaplace's eigenpairs
against a dense ``eigh``, and the refusals.

laplace-torch's Curvlinops backends multiply by ``torch.eye(P)`` in the default dtype; float32 would
leave their float64 result float32-accurate (docs/guide/laplace.md), so the references run with the
default dtype float64 (:func:`reference`)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("laplace")
tf = pytest.importorskip("transformers")

from laplace import Laplace  # noqa: E402
from laplace.curvature import BackPackGGN, CurvlinopsGGN  # noqa: E402

from blockhess.integrations.laplace import BlockhessGGN, BlockhessHessian, find_model  # noqa: E402
from conftest import fro  # noqa: E402

DT = torch.float64
TOL = 1e-10
N, C = 6, 3  # examples, classes


class Wrap(nn.Module):
    """laplace-torch's Hugging Face pattern: ``forward(batch) -> model(**batch).logits``; a tensor batch is
    the input under ``key``."""

    def __init__(self, model: nn.Module, key: str):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):  # a dict batch: its input and attention_mask (labels are laplace-torch's)
        kw = {k: v for k, v in x.items() if k in (self.key, "attention_mask")} if isinstance(x, dict) else {self.key: x}
        return self.model(**kw).logits


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Weights away from the initialisation (std 0.02 leaves the model near linear), float64, eval."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=DT)
            p.copy_(1 + 0.3 * noise if "norm" in n and n.endswith("weight") or ".ln_" in n and n.endswith("weight")
                    else (0.4 if p.ndim > 1 or "embeddings" in n else 0.2) * noise)
    return model


def vit(seed: int = 0, num_labels: int = C) -> Wrap:
    cfg = tf.ViTConfig(image_size=4, patch_size=2, num_channels=1, hidden_size=8, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=12, num_labels=num_labels, attn_implementation="sdpa")
    return Wrap(randomise(tf.ViTForImageClassification(cfg), seed), "pixel_values")


PAD = 10


def gpt2(seed: int = 1) -> Wrap:
    cfg = tf.GPT2Config(vocab_size=11, n_positions=6, n_embd=8, n_layer=1, n_head=2, n_inner=12, num_labels=C,
                        pad_token_id=PAD, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return Wrap(randomise(tf.GPT2ForSequenceClassification(cfg), seed), "input_ids")


def images(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 1, 4, 4, generator=g, dtype=DT), torch.randint(0, C, (N,), generator=g)


def id_batches(seed: int = 3) -> DataLoader:
    """Dict batches as Hugging Face's datasets give: ``input_ids`` (no padding id), ``attention_mask`` of
    ones, ``labels``."""
    g = torch.Generator().manual_seed(seed)
    ids, y = torch.randint(0, PAD, (N, 5), generator=g), torch.randint(0, C, (N,), generator=g)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(5, dtype=torch.long), "labels": y[i]} for i in range(N)]
    return DataLoader(rows, batch_size=3)


def padded_batches(seed: int = 4) -> DataLoader:
    """Right-padded dict batches: sequence ``i`` keeps ``5 - i % 3`` tokens, the rest the padding id with
    ``attention_mask`` zero (the classifier scores the last token that is not padding)."""
    g = torch.Generator().manual_seed(seed)
    ids, y = torch.randint(0, PAD, (N, 5), generator=g), torch.randint(0, C, (N,), generator=g)
    mask = torch.ones(N, 5, dtype=torch.long)
    for i in range(N):
        mask[i, 5 - i % 3:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(N)]
    return DataLoader(rows, batch_size=3)


def loader(X, y) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=3)


@contextlib.contextmanager
def reference():
    """Double backward through the module (SDPA's math kernel) with float64 as the default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.set_default_dtype(old)


def fitted(model, backend, dl, likelihood="classification", **kw):
    kw.setdefault("subset_of_weights", "all")
    la = Laplace(model, likelihood, hessian_structure="full", backend=backend, **kw)
    if backend is CurvlinopsGGN:
        with reference():
            la.fit(dl)
    else:
        la.fit(dl)
    return la


def rel(A, B) -> float:
    return float(fro(A - B) / fro(B))


def check_against(ours, theirs, X, psd: bool = True):
    P, R = ours.posterior_precision, theirs.posterior_precision
    assert P.dtype == DT and P.shape == R.shape
    assert rel(ours.H, theirs.H) <= TOL
    assert rel(P, R) <= TOL
    assert fro(ours.H - ours.H.T) <= 1e-14 * fro(ours.H)
    if psd:  # the GGN: positive semi-definite to rounding
        assert float(torch.linalg.eigvalsh(ours.H).min()) >= -1e-12 * float(torch.linalg.matrix_norm(ours.H, 2))
    assert abs(float(ours.loss) - float(theirs.loss)) <= TOL * abs(float(theirs.loss))
    lml, ref = float(ours.log_marginal_likelihood()), float(theirs.log_marginal_likelihood())
    assert abs(lml - ref) <= TOL * abs(ref)
    with reference():
        p, q = ours(X, pred_type="glm", link_approx="probit"), theirs(X, pred_type="glm", link_approx="probit")
    assert rel(p, q) <= TOL


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_vit_ggn_matches_curvlinops(subset):
    model, (X, y) = vit(), images()
    ours, theirs = (fitted(model, b, loader(X, y), subset_of_weights=subset) for b in (BlockhessGGN, CurvlinopsGGN))
    n = sum(p.numel() for p in (model.model.classifier.parameters() if subset == "last_layer" else model.parameters()))
    assert ours.H.shape == (n, n)
    check_against(ours, theirs, X)


def test_gpt2_classifier_dict_batches_all_and_lora_subset():
    """Dict batches (``dict_key_x="input_ids"``); then a LoRA-style subset: everything frozen but block 0's
    ``c_attn`` and the ``score`` head (laplace-torch refuses BackPACK and ASDL there)."""
    model, dl = gpt2(), id_batches()
    ids = next(iter(dl))
    last = dict(subset_of_weights="last_layer", feature_reduction="pick_last")  # score reads every token's row
    check_against(*(fitted(model, b, dl, **last) for b in (BlockhessGGN, CurvlinopsGGN)), ids)
    for _ in range(2):
        ours, theirs = (fitted(model, b, dl) for b in (BlockhessGGN, CurvlinopsGGN))
        check_against(ours, theirs, ids)
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith(("h.0.attn.c_attn.weight", "score.weight")))
    assert ours.H.shape[0] == 8 * 24 + 8 * C
    with pytest.raises(ValueError, match="BackPACK and Asdfghjkl backends are not supported"):
        Laplace(model, "classification", hessian_structure="full", backend=BackPackGGN)


def test_gpt2_classifier_padded_batches():
    """Padded dict batches (the padding id and zeros in ``attention_mask``): the exact GGN against
    CurvlinopsGGN through the wrapper, which hands the mask to the model."""
    model, dl = gpt2(5), padded_batches()
    ours, theirs = (fitted(model, b, dl) for b in (BlockhessGGN, CurvlinopsGGN))
    check_against(ours, theirs, next(iter(dl)))


def summed_hessian(model: nn.Module, X, y, likelihood: str = "classification") -> torch.Tensor:
    """laplace-torch's ``factor ·`` Hessian of the summed loss through the wrapper, by double backward
    (``torch.autograd.functional.hessian``; laplace-torch's CurvlinopsHessian takes ``torch.func``'s, which
    is wrong through ``F.layer_norm`` with a weight in torch 2.13, docs/guide/laplace.md)."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sizes = [p.numel() for _, p in named]

    def f(flat):
        out = torch.func.functional_call(model, {n: c.reshape(p.shape) for (n, p), c in zip(named, flat.split(sizes))},
                                         (X,))
        if likelihood == "regression":
            return 0.5 * ((out - y) ** 2).sum()
        return nn.functional.cross_entropy(out, y, reduction="sum")

    with reference():
        return torch.autograd.functional.hessian(f, torch.cat([p.reshape(-1) for _, p in named]), vectorize=True)


def test_hessian_against_double_backward_and_splits():
    """The Hessian (not PSD: its functional term) against double backward through the wrapper;
    Hessian − GGN is the functional term, symmetric."""
    g = torch.Generator().manual_seed(8)
    for model, (X, y) in ((vit(4), images(5)), (gpt2(6), (torch.randint(0, PAD, (N, 5), generator=g),
                                                          torch.randint(0, C, (N,), generator=g)))):
        dl = loader(X, y)
        ours = fitted(model, BlockhessHessian, dl)
        R = summed_hessian(model, X, y)
        assert rel(ours.H, R) <= TOL
        assert rel(ours.posterior_precision, R + torch.eye(len(R), dtype=DT)) <= TOL
        ggn = fitted(model, BlockhessGGN, dl).H
        F = ours.H - ggn
        assert fro(F) > 1e-6 * fro(ours.H)  # the functional term is there
        assert fro(F - F.T) <= 1e-13 * fro(ours.H)


def test_subnetwork_indices():
    """SubnetLaplace's ``subnetwork_indices`` (scattered entries of several tensors, unsorted) against
    CurvlinopsGGN (its torch.func Jacobians there)."""
    model, (X, y) = vit(9), images(10)
    P = sum(p.numel() for p in model.parameters())
    idx = torch.randperm(P, generator=torch.Generator().manual_seed(11))[:40]
    kw = dict(subset_of_weights="subnetwork", subnetwork_indices=idx)
    ours, theirs = (fitted(model, b, loader(X, y), **kw) for b in (BlockhessGGN, CurvlinopsGGN))
    assert ours.H.shape == (40, 40)
    check_against(ours, theirs, X)


def test_regression_factor_one_half():
    """likelihood="regression": laplace-torch's ½ · summed squared error, H = Jᵀ J; against CurvlinopsGGN
    and, for the Hessian, CurvlinopsHessian."""
    model, (X, _) = vit(12, num_labels=2), images(13)
    y = torch.randn(N, 2, generator=torch.Generator().manual_seed(14), dtype=DT)
    ours, theirs = (fitted(model, b, loader(X, y), likelihood="regression", sigma_noise=0.7)
                    for b in (BlockhessGGN, CurvlinopsGGN))
    assert rel(ours.H, theirs.H) <= TOL and rel(ours.posterior_precision, theirs.posterior_precision) <= TOL
    assert abs(float(ours.loss) - float(theirs.loss)) <= TOL * float(theirs.loss)
    lml, ref = float(ours.log_marginal_likelihood()), float(theirs.log_marginal_likelihood())
    assert abs(lml - ref) <= TOL * abs(ref)
    H = fitted(model, BlockhessHessian, loader(X, y), likelihood="regression").H
    assert rel(H, summed_hessian(model, X, y, "regression")) <= TOL
    with reference():
        J = torch.autograd.functional.jacobian(
            lambda *ps: torch.func.functional_call(model, dict(zip(dict(model.named_parameters()), ps)), (X,)),
            tuple(p.detach() for p in model.parameters()))
    J = torch.cat([j.reshape(N * 2, -1) for j in J], 1)
    assert rel(fitted(model, BlockhessGGN, loader(X, y), likelihood="regression").H, J.T @ J) <= TOL


def test_lowrank_eigenpairs_against_dense_eigh(monkeypatch):
    """LowRankLaplace's constructor asks for the git-only ``asdfghjkl`` module its default backend needs
    (``pip install asdfghjkl==0.1a4`` installs it as ``asdl``); with our backend it is not used."""
    import laplace.baselaplace as base
    find_spec = base.find_spec
    monkeypatch.setattr(base, "find_spec", lambda name: find_spec("asdl" if name == "asdfghjkl" else name))
    model, (X, y) = vit(15), images(16)
    dl = loader(X, y)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="lowrank", backend=BlockhessGGN,
                 backend_kwargs={"low_rank": 4})
    la.fit(dl)
    U, lam = la.H
    H = fitted(model, CurvlinopsGGN, dl).H  # the dense summed GGN, double backward
    w, V = torch.linalg.eigh(H)
    assert lam.shape == (4,) and rel(lam, w.flip(0)[:4]) <= 1e-8
    assert fro(U.T @ U - torch.eye(4, dtype=DT)) <= 1e-12
    assert float((H @ U - U * lam).norm(dim=0).max()) <= 1e-8 * float(lam[0])
    res = la.backend.eig_result
    assert res.converged and bool((res.residuals <= res.bounds).all())
    assert torch.isfinite(la.log_marginal_likelihood())


def test_find_model_and_refusals():
    model, (X, y) = vit(17), images(18)
    assert find_model(model) == ("model", model.model)
    dl = loader(X, y)
    for structure, says in (("kron", "hessian_structure='kron'"),):
        with pytest.raises(NotImplementedError, match=says + r".*use hessian_structure='full'"):
            Laplace(model, "classification", hessian_structure=structure, backend=BlockhessGGN).fit(dl)
    with pytest.raises(NotImplementedError, match="stochastic=True"):
        Laplace(model, "classification", hessian_structure="full", backend=BlockhessGGN,
                backend_kwargs={"stochastic": True}).fit(dl)

    class Scaled(Wrap):  # not the logits of the model read
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match="returns logits .* away from ViTForImageClassification 'model'"):
        fitted(Scaled(model.model, "pixel_values"), BlockhessGGN, dl)

    class Extra(Wrap):  # a trainable parameter outside the model read
        def __init__(self, m, key):
            super().__init__(m, key)
            self.temperature = nn.Parameter(torch.ones((), dtype=DT))

    with pytest.raises(ValueError, match=r"parameters \['temperature'\] require grad but are not parameters"):
        fitted(Extra(model.model, "pixel_values"), BlockhessGGN, dl)
    with pytest.raises(ValueError, match="holds no model from_torch reads"):
        find_model(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="holds several models"):
        find_model(nn.ModuleList([model.model, vit(19).model]))

    g = gpt2(20)
    batch = next(iter(id_batches(21)))
    ids = torch.full_like(batch["input_ids"], PAD)
    with pytest.raises(ValueError, match="holds only the padding id 10"):
        BlockhessGGN(g, "classification").full(dict(batch, input_ids=ids), batch["labels"])


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_diag_is_the_exact_matrix_diagonal(subset):
    """DiagLaplace with BlockhessGGN: its curvature is the diagonal of CurvlinopsGGN's full GGN (1e-10), its
    marginal likelihood that of a diagonal precision from it."""
    model, (X, y) = vit(5), images(6)
    theirs = fitted(model, CurvlinopsGGN, loader(X, y), subset_of_weights=subset)
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure="diag", backend=BlockhessGGN)
    la.fit(loader(X, y))
    d = torch.diagonal(theirs.H)
    assert la.H.shape == d.shape and rel(la.H, d) <= TOL
    assert abs(float(la.loss) - float(theirs.loss)) <= TOL * abs(float(theirs.loss))
    P = la.H + la.prior_precision
    lml = -float(la.loss) - 0.5 * (float(torch.log(P).sum()) - float(torch.log(la.prior_precision_diag).sum())) \
        - 0.5 * float(la.scatter)
    assert abs(float(la.log_marginal_likelihood()) - lml) <= 1e-10 * abs(lml)


def test_backpack_and_asdl_fail_where_ours_fits():
    """On every weight of the ViT (its LayerNorms and attention), laplace-torch's BackPACK and ASDL backends
    raise; BlockhessGGN fits (and equals CurvlinopsGGN: test_vit_ggn_matches_curvlinops)."""
    from laplace.curvature import AsdlGGN

    model, (X, y) = vit(7), images(8)
    # BackPACK has no extension for the ViT's layers (no grad_batch); ASDL's hooks clash with the module's own
    for backend, error, says in ((BackPackGGN, AttributeError, "grad_batch"), (AsdlGGN, RuntimeError, "backward hooks")):
        with pytest.raises(error, match=says):
            Laplace(model, "classification", subset_of_weights="all", hessian_structure="full", backend=backend).fit(
                loader(X, y))
    la = fitted(model, BlockhessGGN, loader(X, y))
    n = sum(p.numel() for p in model.parameters())
    assert la.H.shape == (n, n) and bool(torch.isfinite(la.log_marginal_likelihood()))
