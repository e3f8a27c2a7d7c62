"""The digits ViT: data, the model against a plain ``nn.Module``, the loss-through-head Hessian
against autograd, training, checkpoints and the ``load_or_train`` contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

import blockhess as bh
from blockhess_lab import vit as V

from conftest import TOL, assert_blocks_close, assert_close, assert_float32_close, assert_identities

TINY = {"patch": 2, "d_model": 8, "d_ff": 8, "d_k": 4, "ln_eps": 1e-5}


@pytest.fixture(scope="module")
def tiny():
    return V.train(0, steps=150, quiet=True, arch=TINY, optim={"warmup_steps": 10, "lr": 1e-2})


class PlainViT(nn.Module):
    """The same model written with torch.nn layers (nn.Linear stores (out, in): transposes here)."""

    def __init__(self, vit: V.TrainedViT):
        super().__init__()
        a, p = vit.arch, vit.params
        d = a["d_model"]
        self.patch = a["patch"]
        self.embed = nn.Linear(a["patch"] ** 2, d)
        self.q = nn.Linear(d, a["d_k"], bias=False)
        self.k = nn.Linear(d, a["d_k"], bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.ln1 = nn.LayerNorm(d, eps=a["ln_eps"], elementwise_affine=False)
        self.ff1 = nn.Linear(d, a["d_ff"], bias=False)
        self.ff2 = nn.Linear(a["d_ff"], d, bias=False)
        self.ln2 = nn.LayerNorm(d, eps=a["ln_eps"], elementwise_affine=False)
        self.head = nn.Linear(d, 10)
        L = (8 // a["patch"]) ** 2
        pos = torch.zeros(L, d, dtype=torch.float64)
        for t in range(L):
            for i in range(0, d, 2):
                pos[t, i] = math.sin(t / 10000 ** (i / d))
                pos[t, i + 1] = math.cos(t / 10000 ** (i / d))
        self.register_buffer("pos", pos)
        self.double()
        with torch.no_grad():
            self.embed.weight.copy_(p["W_E"].T)
            self.embed.bias.copy_(p["b_E"])
            for lin, name in ((self.q, "W_Q"), (self.k, "W_K"), (self.v, "W_V"), (self.ff1, "W_1"), (self.ff2, "W_2")):
                lin.weight.copy_(p["blocks.0." + name].T)
            self.head.weight.copy_(p["W_H"].T)
            self.head.bias.copy_(p["b_H"])
        self.requires_grad_(False)

    def block(self, x):
        att = Fn.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))
        y = self.ln1(x + att)
        return self.ln2(y + self.ff2(torch.relu(self.ff1(y))))

    def embed_images(self, images):
        x = Fn.unfold(images[:, None], kernel_size=self.patch, stride=self.patch).transpose(1, 2)
        return self.embed(x) + self.pos

    def forward(self, images):
        return self.head(self.block(self.embed_images(images)).mean(1))


# ----------------------------------------------------------------------------- data


def test_data_is_the_bundled_digits():
    images, labels = V.load_data()
    assert images.shape == (1797, 8, 8) and images.dtype == torch.float64
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))


def test_split_is_stratified_disjoint_and_seeded():
    _, labels = V.load_data()
    tr, te = V.split_data(labels, seed=0)
    assert len(tr) + len(te) == 1797 and len(set(tr.tolist()) & set(te.tolist())) == 0
    assert abs(len(te) - 0.2 * 1797) <= 10
    for c in range(10):
        frac = (labels[te] == c).sum() / (labels == c).sum()
        assert abs(float(frac) - 0.2) < 0.02
    tr2, te2 = V.split_data(labels, seed=0)
    assert torch.equal(te, te2)
    assert not torch.equal(te, V.split_data(labels, seed=1)[1])


def test_patchify_matches_unfold():
    images = torch.arange(2 * 64, dtype=torch.float64).reshape(2, 8, 8)
    for p in (1, 2, 4):
        ref = Fn.unfold(images[:, None], kernel_size=p, stride=p).transpose(1, 2)
        assert torch.equal(V.patchify(images, p), ref)
    with pytest.raises(ValueError):
        V.patchify(images, 3)


def test_sinusoidal_positions():
    P = V.sinusoidal_positions(16, 8)
    assert torch.equal(P[0], torch.tensor([0.0, 1.0] * 4, dtype=torch.float64))
    assert math.isclose(float(P[5, 0]), math.sin(5), rel_tol=TOL)
    assert math.isclose(float(P[5, 3]), math.cos(5 / 10000 ** (2 / 8)), rel_tol=TOL)


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("at_init", [False, True])
def test_vit_matches_plain_nn_module(tiny, at_init):
    vit = tiny.at_init() if at_init else tiny
    m = PlainViT(vit)
    images, labels = vit.train_images[:40], vit.train_labels[:40]
    with torch.no_grad():
        ref = m(images)
        assert_close(vit.embed(images), m.embed_images(images), what="embedding")
        assert_close(bh.forward(vit.block_params(), vit.embed(images), vit.cfg), m.block(m.embed_images(images)), what="block")
    got = vit.logits(images)
    assert got.dtype == torch.float64
    assert_close(got, ref, what="logits")
    assert_close(vit.per_sample_losses(images, labels), Fn.cross_entropy(ref, labels, reduction="none"), what="losses")
    acc = float((m(vit.test_images).argmax(-1) == vit.test_labels).double().mean())
    assert vit.test_accuracy == acc  # the same predictions, counted


def test_float32_paths(tiny):
    images, labels = tiny.train_images[:8], tiny.train_labels[:8]
    X = tiny.embed(images, torch.float32)
    assert X.dtype == torch.float32 and X.shape == (8, tiny.n_tokens, 8)
    losses = tiny.per_sample_losses(images, labels, tiny.block_params(torch.float32))
    assert losses.dtype == torch.float32
    # judged by the plain nn.Module's own float32 error, both against it in float64 on the float32 weights
    m32, m64 = PlainViT(tiny).float(), PlainViT(tiny)
    with torch.no_grad():
        for t in (*m64.parameters(), *m64.buffers()):
            t.copy_(t.float().double())
        plain32 = Fn.cross_entropy(m32(images.float()), labels, reduction="none")
        ref = Fn.cross_entropy(m64(images.float().double()), labels, reduction="none")
    assert_float32_close(losses, plain32, ref, what="float32 per-sample losses")


def test_head_loss_is_the_model_loss(tiny):
    images, labels = tiny.train_images[:12], tiny.train_labels[:12]
    Z = bh.forward(tiny.block_params(), tiny.embed(images), tiny.cfg)
    per = tiny.per_sample_losses(images, labels)
    for b in range(12):
        assert float(tiny.head_loss(Z[b], labels[b])) == pytest.approx(float(per[b]), rel=TOL)
        assert float(tiny.head_loss(Z[b], int(labels[b]))) == pytest.approx(float(per[b]), rel=TOL)
    assert float(tiny.head_loss(Z, labels)) == pytest.approx(float(per.mean()), rel=TOL)
    # one image at a time through embed
    assert torch.equal(tiny.embed(images[3]), tiny.embed(images)[3])
    # a class outside 0..9 is refused through the loss's value, naming the sequence
    assert math.isnan(float(tiny.head_loss(Z[0], 10))) and math.isnan(float(tiny.head_loss(Z[0], -1)))
    bad = labels[:3].clone()
    bad[2] = 10
    with pytest.raises(ValueError, match="NaN or Inf value, gradient or Hessian w.r.t. Z at sequence 2"):
        bh.hessian(tiny.block_params(), tiny.embed(images[:3]), tiny.cfg, loss=tiny.head_loss, target=bad)


def test_other_block_weights_change_the_loss(tiny):
    images, labels = tiny.train_images[:8], tiny.train_labels[:8]
    a = tiny.per_sample_losses(images, labels)
    b = tiny.per_sample_losses(images, labels, tiny.at_init().block_params())  # initial block, trained embedding and head
    assert not torch.allclose(a, b)
    c = tiny.at_init().per_sample_losses(images, labels)
    assert not torch.allclose(b, c)  # at_init also resets embedding and head


@pytest.mark.parametrize("at_init", [False, True])
def test_loss_through_head_hessian_matches_autograd(tiny, at_init):
    """bh.hessian with loss=vit.head_loss == torch.func.hessian of the plain module's mean CE."""
    vit = tiny.at_init() if at_init else tiny
    m = PlainViT(vit)
    images, labels = vit.train_images[:6], vit.train_labels[:6]
    params = vit.block_params()
    H = bh.hessian(params, vit.embed(images), vit.cfg, loss=vit.head_loss, target=labels)
    lins = {"W_Q": "q", "W_K": "k", "W_V": "v", "W_1": "ff1", "W_2": "ff2"}

    def mean_ce(p):
        over = {f"{lins[n]}.weight": p[n].T for n in p}
        return Fn.cross_entropy(torch.func.functional_call(m, over, (images,)), labels)

    ref = torch.func.hessian(mean_ce)(params)
    names = V.BLOCK_NAMES
    R = torch.cat([torch.cat([ref[a][b].reshape(params[a].numel(), params[b].numel()) for b in names], 1) for a in names], 0)
    D = H.dense()
    assert D.shape == (sum(H.sizes), sum(H.sizes))
    assert_close(D, R, what="full")
    # every block on its own (the Q blocks are orders smaller than V's)
    assert_blocks_close({(a, b): (H[a, b], ref[a][b].reshape(params[a].numel(), params[b].numel())) for a in names for b in names},
                        what="head CE")
    assert_identities(H, convex=True)  # CE of a linear head is convex in Z: PSD outer term


def test_the_vit_is_its_model_config(tiny):
    """The lab's model is blockhess's ModelConfig: the same logits by bh.forward, the same initial
    weights by bh.init_params, and the block's Hessian (callable head loss) is the blocks.0 part
    of the whole model's."""
    mc = tiny.model_cfg
    assert mc.n_layers == 1 and mc.blocks[0] == tiny.cfg and mc.d_in == tiny.arch["patch"] ** 2
    assert list(tiny.params) == list(bh.config.model_param_shapes(mc))
    init = bh.init_params(mc, seed=tiny.seed)
    assert all(torch.equal(init[n], tiny.init_params_[n]) for n in init)
    images, labels = tiny.train_images[:6], tiny.train_labels[:6]
    assert_close(bh.forward(tiny.params, tiny.model_inputs(images), mc), tiny.logits(images), what="logits")
    assert tiny.model_inputs(images[0]).shape == (1, 8, 8) and tiny.model_inputs(images, torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="pixel values"):
        tiny.model_inputs(images * 16)
    H = bh.hessian(tiny.params, tiny.model_inputs(images), mc, loss="ce", target=labels, wrt=[f"blocks.0.{n}" for n in V.BLOCK_NAMES])
    Hb = bh.hessian(tiny.block_params(), tiny.embed(images), tiny.cfg, loss=tiny.head_loss, target=labels)
    assert_close(H.dense(), Hb.dense(), what="blocks.0 of the model's Hessian")


# ----------------------------------------------------------------------------- training


def test_training_learns_and_is_seeded(tiny):
    assert tiny.test_accuracy > 0.35  # chance is 0.1; 150 steps of a d_model = 8 model reach about 0.5
    assert tiny.at_init().test_accuracy < 0.25
    assert tiny.train_info["final_loss_mean_last_50"] < 1.8 < math.log(10)
    a = V.train(3, steps=5, quiet=True, arch=TINY)
    b = V.train(3, steps=5, quiet=True, arch=TINY)
    c = V.train(4, steps=5, quiet=True, arch=TINY)
    assert list(a.params) == list(bh.config.model_param_shapes(a.model_cfg))
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n])
    assert not torch.equal(a.params["blocks.0.W_Q"], c.params["blocks.0.W_Q"])
    assert torch.equal(a.at_init().block_params()["W_Q"], bh.init_params(a.cfg, seed=3)["W_Q"])
    rng = torch.get_rng_state()
    V.train(3, steps=2, quiet=True, arch=TINY)
    assert torch.equal(rng, torch.get_rng_state())  # private generators only


def test_training_keeps_snapshots():
    assert V.snapshot_steps(2000) == [0, 200, 400, 600, 800, 1000] and V.snapshot_steps(10) == [0, 2, 4, 6, 8, 10]
    assert V.snapshot_steps(0) == [0] and V.snapshot_steps(3) == [0, 1, 2, 3]
    vit = V.train(1, steps=10, quiet=True, arch=TINY)
    assert sorted(vit.snapshots) == vit.train_info["snapshot_steps"] == [0, 2, 4, 6, 8, 10]
    assert vit.snapshots[0] is vit.init_params_ and vit.snapshots[10] is vit.params
    four = V.train(1, steps=4, quiet=True, arch=TINY)  # the same run, stopped after 4 updates
    assert all(torch.equal(vit.snapshots[4][n], four.params[n]) for n in four.params)
    assert vit.at_step(4).test_accuracy == four.test_accuracy
    assert all(torch.equal(vit.at_step(0).params[n], vit.at_init().params[n]) for n in vit.params)
    with pytest.raises(ValueError, match=r"no snapshot of step 3: this model kept \[0, 2, 4, 6, 8, 10\]"):
        vit.at_step(3)


def test_two_blocks():
    vit = V.train(0, steps=3, quiet=True, arch={**TINY, "n_blocks": 2})
    mc = vit.model_cfg
    assert mc.n_layers == 2 and vit.n_blocks == 2 and "blocks.1.W_2" in vit.params
    images = vit.train_images[:4]
    assert_close(bh.forward(vit.params, vit.model_inputs(images), mc), vit.logits(images), what="logits")
    with pytest.raises(ValueError, match="block_params is the one block's; this model has 2 blocks"):
        vit.block_params()


def test_train_rejects_bad_steps():
    with pytest.raises(ValueError):
        V.train(0, steps=-1, quiet=True, arch=TINY)


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_roundtrip(tiny, tmp_path):
    path = V.save(tiny, tmp_path / "sub" / "ck.pt")
    blob = torch.load(path, weights_only=True)
    assert isinstance(blob, dict) and blob["format"] == V.FORMAT
    back = V.load(path)
    assert back.arch == tiny.arch and back.cfg == tiny.cfg and back.seed == tiny.seed
    assert list(back.params) == list(tiny.params) and sorted(back.snapshots) == sorted(tiny.snapshots) != []
    for n in tiny.params:
        assert torch.equal(back.params[n], tiny.params[n]) and torch.equal(back.init_params_[n], tiny.init_params_[n])
        assert all(torch.equal(back.snapshots[s][n], tiny.snapshots[s][n]) for s in tiny.snapshots)
    assert torch.equal(back.test_images, tiny.test_images) and torch.equal(back.train_labels, tiny.train_labels)
    assert back.test_accuracy == tiny.test_accuracy
    assert back.train_info["trained_in_this_run"] is False
    assert V.load_or_train(path, seed=tiny.seed, steps=tiny.train_info["steps"]).checkpoint == str(path)
    assert V.load_for_command(path).checkpoint == str(path)
    assert not list((tmp_path / "sub").glob("*.tmp"))


def _broken(tmp_path, tiny, mutate):
    path = V.save(tiny, tmp_path / "ck.pt")
    blob = torch.load(path, weights_only=True)
    mutate(blob)
    torch.save(blob, path)
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.update(format="other"), "format"),
        (lambda b: b.update(version=99), "version"),
        (lambda b: b["params"].pop("blocks.0.W_V"), "W_V"),
        (lambda b: b["params"].update({"blocks.0.W_1": torch.zeros(3, 3, dtype=torch.float64)}), "W_1"),
        (lambda b: b["init_params"]["blocks.0.W_2"].fill_(float("nan")), "NaN"),
        (lambda b: b["snapshots"][0]["W_E"].fill_(float("inf")), "snapshot 0|NaN or Inf"),
        (lambda b: b.update(snapshots=[1, 2]), "snapshots"),
        (lambda b: b["arch"].update(n_blocks=0), "checkpoint"),
        (lambda b: b.update(test_index=b["test_index"][:5]), "split"),
        (lambda b: b["arch"].update(d_model="x"), "checkpoint"),
    ],
)
def test_corrupt_checkpoints_are_one_line_errors(tiny, tmp_path, mutate, message):
    path = _broken(tmp_path, tiny, mutate)
    with pytest.raises(ValueError, match=message) as err:
        V.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def _format_one(vit, path):
    """``vit`` (one block) written as format 1 was: the block's names, no arch n_blocks, no snapshots."""
    V.save(vit, path)
    blob = torch.load(path, weights_only=True)
    flat = lambda p: {k.removeprefix("blocks.0."): v for k, v in p.items()}  # noqa: E731
    blob.update(version=1, params=flat(blob["params"]), init_params=flat(blob["init_params"]))
    del blob["snapshots"], blob["arch"]["n_blocks"]
    torch.save(blob, path)


def test_format_one_checkpoints_load_and_a_default_one_is_retrained(tiny, tmp_path, capsys):
    path = tmp_path / "old.pt"
    _format_one(tiny, path)
    old = V.load(path)
    assert old.snapshots == {} and old.train_info["format_version"] == 1 and old.arch == tiny.arch
    assert all(torch.equal(old.params[n], tiny.params[n]) for n in tiny.params)
    plain = V.load_or_train(tmp_path / "m.pt", steps=3, quiet=True)
    _format_one(plain, tmp_path / "m.pt")
    again = V.load_or_train(tmp_path / "m.pt", steps=3)
    assert "was written by an earlier version (checkpoint format 1, no training snapshots): training" in capsys.readouterr().err
    assert again.train_info["trained_in_this_run"] and sorted(again.snapshots) == [0, 1, 2, 3]
    assert V.load(tmp_path / "m.pt").train_info["format_version"] == V.FORMAT_VERSION
    assert all(torch.equal(again.params[n], plain.params[n]) for n in plain.params)  # the same seed, the same model


def test_unreadable_and_missing_checkpoints(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(ValueError, match="cannot read") as err:
        V.load_or_train(junk)  # an existing file is read, never trained over
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="cannot read"):
        V.load_or_train(empty)
    with pytest.raises(ValueError, match="not found"):
        V.load_for_command(tmp_path / "nope.pt")  # --checkpoint: a path given must exist
    assert not (tmp_path / "nope.pt").exists()
    with pytest.raises(ValueError, match="not a file"):
        V.load_or_train(tmp_path)
    with pytest.raises(TypeError):
        V.load_or_train()  # the file is the caller's to name


def test_load_or_train_trains_once_into_the_named_file(tmp_path, capsys):
    path = tmp_path / "ck" / "m.pt"
    first = V.load_or_train(path, steps=3)
    assert first.train_info["trained_in_this_run"] is True and first.train_info["steps"] == 3
    assert path.is_file() and first.checkpoint == str(path) and [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert f"no checkpoint at {path}: training the digits ViT (seed 0, 3 steps)" in capsys.readouterr().err
    assert first.cfg == bh.BlockConfig(d_model=16, d_ff=32, d_k=16, ln_eps=1e-5)
    second = V.load_or_train(path, steps=3, quiet=True)
    assert second.train_info["trained_in_this_run"] is False and capsys.readouterr().err == ""
    assert torch.equal(second.params["blocks.0.W_V"], first.params["blocks.0.W_V"])
    with pytest.raises(ValueError, match="holds a model of seed 0 trained 3 steps, not seed 0 and 4 steps"):
        V.load_or_train(path, steps=4)
    with pytest.raises(ValueError, match="holds a model of seed 0 trained 3 steps, not seed 2 and 3 steps"):
        V.load_or_train(path, seed=2, steps=3)


def test_load_for_command_keeps_a_default_file_per_seed_and_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(V, "DEFAULT_STEPS", 3)
    first = V.load_for_command(quiet=True)
    assert first.train_info["trained_in_this_run"] is True and first.train_info["steps"] == 3
    assert (tmp_path / "checkpoints" / "digits_vit.pt").is_file()
    second = V.load_for_command(quiet=True, steps=3)
    assert second.train_info["trained_in_this_run"] is False
    assert torch.equal(second.params["blocks.0.W_V"], first.params["blocks.0.W_V"])
    other = V.load_for_command(quiet=True, steps=1, seed=2)
    assert (tmp_path / "checkpoints" / "digits_vit_seed2_steps1.pt").is_file() and other.seed == 2
    fewer = V.load_for_command(quiet=True, steps=1)  # other steps: its own model, the default one is neither read nor replaced
    assert fewer.train_info["trained_in_this_run"] is True and fewer.train_info["steps"] == 1
    assert (tmp_path / "checkpoints" / "digits_vit_steps1.pt").is_file()
    assert torch.equal(V.load_for_command(quiet=True).params["blocks.0.W_V"], first.params["blocks.0.W_V"])
    V.save(fewer, tmp_path / "checkpoints" / "digits_vit.pt")  # as an earlier `report --steps 1` did: the default file, 1 step
    with pytest.raises(ValueError, match="holds a model of seed 0 trained 1 steps, not seed 0 and 3 steps"):
        V.load_for_command(quiet=True)
    assert V.load_for_command("checkpoints/digits_vit.pt").train_info["steps"] == 1  # given: read as it is


def test_embed_refuses_raw_pixels_and_other_shapes(tiny):
    with pytest.raises(ValueError, match=r"pixel values in \[0, 1\]"):
        tiny.embed(tiny.train_images[:2] * 16)  # scikit-learn's raw 0-16 digits
    with pytest.raises(ValueError, match=r"images must be a tensor of shape \(B, 8, 8\) or \(8, 8\), got \(2, 64\)"):
        tiny.embed(tiny.train_images[:2].reshape(2, 64))


def test_the_whole_model_as_a_model_config(tiny):
    images = tiny.train_images[:5]
    cfg, params, inputs = tiny.model_cfg, tiny.model_params(), tiny.model_inputs(images)
    assert list(params) == list(bh.config.model_param_shapes(cfg))
    assert_close(bh.forward(params, inputs, cfg), tiny.logits(images))
    H = bh.hessian(params, inputs, cfg, loss="ce", target=tiny.train_labels[:5])
    Hb = bh.hessian(tiny.block_params(), tiny.embed(images), tiny.cfg, loss=tiny.head_loss, target=tiny.train_labels[:5])
    for a in V.BLOCK_NAMES:
        for b in V.BLOCK_NAMES:
            assert_close(H["blocks.0." + a, "blocks.0." + b], Hb[a, b], scale=float(Hb.dense().norm()), what=f"{a}, {b}")
