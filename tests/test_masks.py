"""Padded batches (docs/models.md, "Padded batches"): ``inputs`` as the module's forward keyword arguments
(``input_ids``, ``attention_mask``, ``position_ids``, ``token_type_ids``), key padding on the left or the
right with the causal mask where the blocks have one, and cross-entropy targets of -100 ignored (the mean
over the batch's counted tokens, as ``F.cross_entropy(ignore_index=-100)``).

For Hugging Face's GPT-2 (eager attention, and sdpa under the MATH kernel) and BERT (with token types), 2
layers, float64: the module's forward equals ours on the counted positions to 1e-12; ``H.to_module(model)``
equals double backward through the module's own forward with the same keyword arguments
(``torch.autograd.functional.hessian(vectorize=True)`` on ``functional_call``) to 1e-10; the operator's
products equal the dense Hessian to 1e-12; outer + functional = full. A ModelConfig with random masks,
positions and types (rotary blocks too, by the operator) against :func:`blockhess.reference.hessian`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import blockhess as bh
from blockhess.linalg import rel_error

from conftest import assert_close, assert_identities, fro, rounding

tf = pytest.importorskip("transformers")

DT = torch.float64
FORWARD_TOL = 1e-12
V = 8  # GPT-2's vocabulary (and head)
PRODUCT_TOL = 1e-12
B, L = 2, 5
LEFT = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # a decoder's batch: the first sequence left-padded
RIGHT = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # an encoder's: both right-padded


def randomise(model, seed: int = 0):
    """Weights away from transformers' initialisation: matrices N(0, 0.4²), LayerNorm scales 1 + N(0, 0.3²),
    other vectors N(0, 0.2²); float64, eval mode."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    lns = {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=DT)
            p.copy_(1 + 0.3 * noise if n.rsplit(".", 1)[0] in lns and n.endswith("weight") else
                    (0.4 if p.ndim > 1 else 0.2) * noise)
    return model


def module_hessian(model, loss, inputs: dict):
    """Double backward of ``loss(model(**inputs))`` w.r.t. the flattened ``named_parameters``."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sizes = [p.numel() for _, p in named]

    def f(flat):
        q = {n: c.reshape(p.shape) for (n, p), c in zip(named, flat.split(sizes))}
        return loss(torch.func.functional_call(model, q, (), inputs))

    with sdpa_kernel(SDPBackend.MATH):
        return torch.autograd.functional.hessian(f, torch.cat([p.reshape(-1) for _, p in named]), vectorize=True)


def check(model, p, cfg, inputs, loss, target, R):
    """The closed form's Hessian in the module's layout against ``R``; its products, parts and symmetry."""
    H = bh.hessian(p, inputs, cfg, loss=loss, target=target)
    Hm = H.to_module(model)
    assert list(Hm.names) == [n for n, _ in model.named_parameters()]
    assert_close(Hm.dense(), R, what="H.to_module(model) against double backward")
    D = H.dense()
    assert fro(D - D.T) <= rounding(D) * fro(D)
    assert_close(Hm.outer.dense() + Hm.functional.dense(), Hm.dense(), what="outer + functional")
    V = torch.randn(D.shape[0], 3, generator=torch.Generator().manual_seed(5), dtype=DT)
    for part, ref in (("full", D), ("outer", H.outer.dense()), ("functional", H.functional.dense())):
        A = bh.hessian_operator(p, inputs, cfg, loss=loss, target=target, part=part)
        assert float(rel_error(A @ V, ref @ V)) <= PRODUCT_TOL, part
    assert_identities(H, convex=True, what="padded batch")
    return H


def gpt2(impl: str, seed: int = 0):
    config = tf.GPT2Config(n_embd=4, n_head=2, n_layer=2, vocab_size=V, n_positions=6, n_inner=8,
                           attn_implementation=impl, bos_token_id=0, eos_token_id=0)
    return randomise(tf.GPT2LMHeadModel(config), seed)


def labels_of(mask: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """Random classes, -100 at the padding and at one more token of the first sequence."""
    y = torch.randint(0, V, mask.shape, generator=torch.Generator().manual_seed(seed)).masked_fill(mask == 0, -100)
    y[0, -1] = -100
    return y


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_gpt2_padded_batch_with_ignored_labels(impl, side):
    model = gpt2(impl)
    cfg, p = bh.from_torch(model)
    mask = LEFT if side == "left" else RIGHT
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": mask}
    if side == "left":  # what generate passes with left padding: positions counted from the first real token
        inputs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    y = labels_of(mask)
    with torch.no_grad():
        logits = model(**inputs).logits
    ours = bh.forward(p, inputs, cfg)
    counted = mask.bool()
    assert_close(ours[counted], logits[counted], tol=FORWARD_TOL, what="forward on the counted positions")
    R = module_hessian(model, lambda out: F.cross_entropy(out.logits.reshape(-1, V), y.reshape(-1),
                                                          ignore_index=-100), inputs)
    check(model, p, cfg, inputs, "ce", y, R)


def test_gpt2_labels_shift_is_the_target_of_the_next_token():
    """HF's ``labels=ids`` (shifted inside, -100 ignored) is our target ``ids[:, 1:]`` then -100: the
    model's own ``loss`` (taken in float32: transformers casts the logits) equals ours."""
    model = gpt2("eager", seed=2)
    cfg, p = bh.from_torch(model)
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(4))
    labels = ids.masked_fill(RIGHT == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": RIGHT}
    with torch.no_grad():
        hf = model(**inputs, labels=labels).loss
    target = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], 1)
    ours = F.cross_entropy(bh.forward(p, inputs, cfg).reshape(-1, V), target.reshape(-1), ignore_index=-100)
    assert abs(float(ours) - float(hf)) <= 4 * torch.finfo(torch.float32).eps * abs(float(hf))
    H = bh.hessian(p, inputs, cfg, loss="ce", target=target)  # the same loss's Hessian, float64 throughout
    R = module_hessian(model, lambda out: F.cross_entropy(out.logits.reshape(-1, V), target.reshape(-1)), inputs)
    assert_close(H.to_module(model).dense(), R, what="the shifted labels' Hessian")


@pytest.mark.parametrize("side", ["left", "right"])
def test_bert_padded_batch_with_token_types(side):
    config = tf.BertConfig(vocab_size=8, hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=8, max_position_embeddings=6, attn_implementation="eager")
    model = randomise(tf.BertModel(config, add_pooling_layer=False), seed=3)
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(6)
    mask = RIGHT if side == "right" else LEFT
    ids = torch.randint(1, 8, (B, L), generator=g)
    types = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    inputs = {"input_ids": ids, "attention_mask": mask.double(), "token_type_ids": types}  # a float mask, as HF takes
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    assert_close(bh.forward(p, inputs, cfg), hidden, tol=FORWARD_TOL, what="forward (every row attends somewhere)")
    T = torch.randn(B, L, 4, generator=g, dtype=DT)
    w = mask.double()[..., None]  # the loss on the real tokens only, a callable of the whole output

    def loss(Z, t):  # one sequence: (L, d), target (L, d + 1) holding its mask in the last column
        return ((Z - t[:, :-1]) ** 2 * t[:, -1:]).sum() / 4

    target = torch.cat([T, w], -1)
    R = module_hessian(model, lambda out: sum(loss(out.last_hidden_state[b], target[b]) for b in range(B)) / B, inputs)
    H = bh.hessian(p, inputs, cfg, loss=loss, target=target)
    Hm = H.to_module(model)
    assert_close(Hm.dense(), R, what="BERT Hessian")
    tt = "embeddings.token_type_embeddings.weight"
    assert Hm[tt, tt][4:, 4:].any()  # type 1 used: its rows of W_T have curvature
    assert_close(Hm.outer.dense() + Hm.functional.dense(), Hm.dense(), what="outer + functional")
    A = bh.hessian_operator(p, inputs, cfg, loss=loss, target=target)
    V = torch.randn(A.shape[1], 2, generator=g, dtype=DT)
    assert float(rel_error(A @ V, H.dense() @ V)) <= PRODUCT_TOL


def test_bert_mse_over_every_token_of_a_right_padded_batch():
    """Right padding: a padding token still attends to the real ones (its row is the module's own), so an
    MSE over every token is the module's too."""
    config = tf.BertConfig(vocab_size=8, hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=8, max_position_embeddings=6, attn_implementation="sdpa")
    model = randomise(tf.BertModel(config, add_pooling_layer=False), seed=4)
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(7)
    inputs = {"input_ids": torch.randint(1, 8, (B, L), generator=g), "attention_mask": RIGHT.bool()}
    T = torch.randn(B, L, 4, generator=g, dtype=DT)
    R = module_hessian(model, lambda out: ((out.last_hidden_state - T) ** 2).mean(), inputs)
    check(model, p, cfg, inputs, "mse", T, R)


def _random_batch(cfg, g, left: bool):
    """Token ids, a random padding mask (one side), position ids and token types where the model has them."""
    ids = torch.randint(0, cfg.vocab, (3, 4), generator=g)
    n = torch.randint(1, 5, (3,), generator=g)  # real tokens per sequence
    ar = torch.arange(4)
    mask = (ar[None] >= 4 - n[:, None]) if left else (ar[None] < n[:, None])
    inputs = {"input_ids": ids, "attention_mask": mask.long()}
    if cfg.positions == "learned" or any(b.rope for b in cfg.blocks):
        inputs["position_ids"] = torch.randint(0, cfg.n_positions or 9, (3, 4), generator=g)
    if cfg.token_types:
        inputs["token_type_ids"] = torch.randint(0, cfg.token_types, (3, 4), generator=g)
    y = torch.randint(0, cfg.n_out, (3, 4), generator=g).masked_fill(~mask, -100)
    return inputs, y


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_model_config_against_the_reference(left, causal):
    blocks = (bh.BlockConfig(d_model=4, d_ff=5, d_k=2, n_heads=2, norm="pre", causal=causal, bias=True,
                             ln_affine=True, ln_eps=1e-5, out_proj=True),
              bh.BlockConfig(d_model=4, d_ff=3, d_k=3, causal=True, ln_eps=1e-5))
    cfg = bh.ModelConfig(blocks=blocks, embedding="token", vocab=5, positions="learned", n_positions=6, token_types=3,
                         final_norm=True, head=5, tied=True)
    p = bh.init_params(cfg, seed=1)
    inputs, y = _random_batch(cfg, torch.Generator().manual_seed(10 + 2 * left + causal), left)
    H = bh.hessian(p, inputs, cfg, loss="ce", target=y)
    R = bh.reference.hessian(p, inputs, cfg, loss="ce", target=y)
    assert_close(H.dense(), R.dense(), what="full")
    assert_close(H.outer.dense(), R.outer.dense(), scale=fro(R.dense()), what="outer")
    assert_identities(H, convex=True, reference=R, what="masked model")
    A = bh.hessian_operator(p, inputs, cfg, loss="ce", target=y)
    V = torch.randn(A.shape[1], 2, generator=torch.Generator().manual_seed(2), dtype=DT)
    assert float(rel_error(A @ V, R.dense() @ V)) <= 1e-10
    v = V[:12, 0]  # a view: W_T's rows of the product with W_T's columns (the three token types' rows)
    assert float(rel_error(A["W_T", "W_T"] @ v, R["W_T", "W_T"] @ v)) <= 1e-10


def test_rotary_blocks_take_position_ids():
    """A block with rope rotates at the positions passed (per sequence), by the operator's products."""
    blocks = (bh.BlockConfig(d_model=4, d_ff=6, d_k=2, n_heads=2, norm="pre", rope=True, causal=True, ln_eps=1e-5),) * 2
    cfg = bh.ModelConfig(blocks=blocks, embedding="token", vocab=5, head=5)
    p = bh.init_params(cfg, seed=2)
    inputs, y = _random_batch(cfg, torch.Generator().manual_seed(3), left=True)
    R = bh.reference.hessian(p, inputs, cfg, loss="ce", target=y)
    A = bh.hessian_operator(p, inputs, cfg, loss="ce", target=y)
    V = torch.randn(A.shape[1], 3, generator=torch.Generator().manual_seed(4), dtype=DT)
    assert float(rel_error(A @ V, R.dense() @ V)) <= 1e-10
    shifted = {**inputs, "position_ids": inputs["position_ids"] + 1}  # rotary scores see differences only ...
    assert float(rel_error(bh.hessian_operator(p, shifted, cfg, loss="ce", target=y) @ V, A @ V)) <= 1e-10
    other = {**inputs, "position_ids": inputs["position_ids"].flip(1)}  # ... and another order is another model
    assert float(rel_error(bh.hessian_operator(p, other, cfg, loss="ce", target=y) @ V, A @ V)) > 1e-6


def test_without_a_mask_and_with_one_that_pads_nothing_is_the_tensor_call():
    cfg, p = bh.from_torch(gpt2("eager", seed=5))
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(8))
    y = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(9))
    H = bh.hessian(p, ids, cfg, loss="ce", target=y).dense()
    for inputs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": torch.ones(B, L)}):
        assert torch.equal(bh.hessian(p, inputs, cfg, loss="ce", target=y).dense(), H)
    positions = {"input_ids": ids, "position_ids": torch.arange(L).expand(B, L)}  # W_P's rows gathered: its sums reordered
    assert_close(bh.hessian(p, positions, cfg, loss="ce", target=y).dense(), H, what="positions 0..L-1 passed")
    one = bh.hessian(p, {"input_ids": ids[0], "attention_mask": LEFT[0]}, cfg, loss="ce", target=labels_of(LEFT)[0])
    both = bh.hessian(p, {"input_ids": ids[:1], "attention_mask": LEFT[:1]}, cfg, loss="ce", target=labels_of(LEFT)[:1])
    assert torch.equal(one.dense(), both.dense())  # one sequence without its batch axis


def test_the_mean_is_over_the_counted_tokens_of_the_whole_batch():
    """A sequence weighs by its counted tokens: the batch's Hessian is the counts-weighted mean of the
    sequences' own (docs/derivations.md §22), not their plain mean."""
    cfg, p = bh.from_torch(gpt2("eager", seed=6))
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(10))
    y = labels_of(RIGHT)
    inputs = {"input_ids": ids, "attention_mask": RIGHT}
    H = bh.hessian(p, inputs, cfg, loss="ce", target=y).dense()
    n = (y != -100).sum(1)
    parts = [bh.hessian(p, {k: v[b:b + 1] for k, v in inputs.items()}, cfg, loss="ce", target=y[b:b + 1]).dense()
             for b in range(B)]
    assert_close(H, sum(int(n[b]) * parts[b] for b in range(B)) / int(n.sum()), what="counts-weighted mean")
    assert float(rel_error(H, sum(parts) / B)) > 1e-3  # the counts differ (2 and 4)


def test_transformer_encoder_takes_its_key_padding_mask_with_the_inputs():
    layer = torch.nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True, dtype=DT)
    model = randomise(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), seed=7)
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(11)
    X = torch.randn(B, L, 4, generator=g, dtype=DT)
    pad = RIGHT == 0  # PyTorch's convention: True = padding
    inputs = {"src": X, "src_key_padding_mask": pad}
    T = torch.randn(B, L, 4, generator=g, dtype=DT)
    with torch.no_grad():
        out = model(X, src_key_padding_mask=pad)
    assert_close(bh.forward(p, inputs, cfg)[~pad], out[~pad], tol=FORWARD_TOL, what="forward on the real tokens")
    R = module_hessian(model, lambda out: ((out - T) ** 2).mean(), {"src": X, "src_key_padding_mask": pad})
    assert_close(bh.hessian(p, inputs, cfg, loss="mse", target=T).to_module(model).dense(), R, what="encoder Hessian")


def test_vit_takes_pixel_values_and_no_mask():
    config = tf.ViTConfig(image_size=4, patch_size=2, num_channels=1, hidden_size=4, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=8, num_labels=3, attn_implementation="sdpa")
    cfg, p = bh.from_torch(randomise(tf.ViTForImageClassification(config), seed=8))
    x = torch.randn(B, 1, 4, 4, generator=torch.Generator().manual_seed(12), dtype=DT)
    assert torch.equal(bh.forward(p, {"pixel_values": x}, cfg), bh.forward(p, x, cfg))
    with pytest.raises(ValueError, match="a patch model takes no mask"):
        bh.forward(p, {"pixel_values": x, "attention_mask": torch.ones(B, 4)}, cfg)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_sequence_classifier_padded(attn):
    """``GPT2ForSequenceClassification`` on right-padded sequences (the padding id in ``input_ids``, zeros in
    ``attention_mask``): it scores each sequence at its last token that is not padding; ours pools there
    (``pool="last"`` with ``pad_token``). Forward to 1e-12, the Hessian against double backward."""
    pad, C = 7, 3
    conf = tf.GPT2Config(vocab_size=V, n_positions=8, n_embd=8, n_layer=2, n_head=2, n_inner=12, num_labels=C,
                         pad_token_id=pad, bos_token_id=0, eos_token_id=0, attn_implementation=attn,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = randomise(tf.GPT2ForSequenceClassification(conf), seed=3)
    cfg, p = bh.from_torch(model)
    assert cfg.pool == "last" and cfg.pad_token == pad
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, pad, (3, L), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 3:], mask[1, 4:] = 0, 0  # sequence 2 unpadded
    ids = ids.masked_fill(mask == 0, pad)
    y = torch.randint(0, C, (3,), generator=g)
    args = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        out = model(**args).logits
    assert_close(bh.forward(p, args, cfg), out, tol=FORWARD_TOL, what="forward (last non-padding token)")
    assert_close(bh.reference.forward(p, args, cfg).reshape(out.shape), out, tol=FORWARD_TOL, what="reference forward")
    R = module_hessian(model, lambda o: F.cross_entropy(o.logits, y), args)
    check(model, p, cfg, args, "ce", y, R)
    with pytest.raises(ValueError, match=r"sequence 0 holds only the padding id 7"):
        bh.forward(p, {"input_ids": torch.full((1, L), pad), "attention_mask": torch.ones(1, L, dtype=torch.long)}, cfg)
