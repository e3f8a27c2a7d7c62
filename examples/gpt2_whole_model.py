"""A Hugging Face GPT-2's whole Hessian: a tiny random config (nothing is downloaded), read by
bh.from_torch, its exact Hessian w.r.t. every parameter, and the blocks back in the model's own names
and layouts (to_module); one block checked against double backward through the model itself.

Needs the hf extra (pip install 'blockhess[hf]').

    python examples/gpt2_whole_model.py
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GPT2Config, GPT2LMHeadModel

import blockhess as bh
from blockhess.linalg import rel_error

torch.set_num_threads(1)
torch.manual_seed(0)
config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).double().eval()

cfg, params = bh.from_torch(model)  # a ModelConfig (token embedding, learned positions, 2 pre-LN blocks, tied head)
print(f"{len(cfg.blocks)} blocks, {sum(p.numel() for p in params.values())} parameters")
ids = torch.randint(0, 16, (2, 8))  # what model.forward takes first: token ids (B, L)
labels = torch.randint(0, 16, (2, 8))  # one class per token (per-token cross-entropy, no shift)
H = bh.hessian(params, ids, cfg, loss="ce", target=labels)
print("dense:", tuple(H.dense().shape))
print("cross-layer block H[blocks.0.W_Q, blocks.1.W_2]:", tuple(H["blocks.0.W_Q", "blocks.1.W_2"].shape))

Hm = H.to_module(model)  # keyed by model.named_parameters(), in their own layouts
a, b = "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"
print(f"H[{a}, {b}]:", tuple(Hm[a, b].shape))

# the same block by autograd through the model itself (double backward; the math attention kernel)
names = [a, b]
base = dict(model.named_parameters())


def loss_of(wa, wb):
    p = {**base, a: wa, b: wb}
    logits = torch.func.functional_call(model, p, (ids,)).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))


with sdpa_kernel(SDPBackend.MATH):
    R = torch.autograd.functional.hessian(loss_of, tuple(base[n].detach() for n in names), vectorize=True)
print(f"relative error against autograd: {rel_error(Hm[a, b], R[0][1].reshape(Hm[a, b].shape)):.1e}")
