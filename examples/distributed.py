"""The exact Hessian over a dataset sharded across the processes of a torch.distributed group: each
rank computes its shard's Hessian in closed form and one all_reduce sums them. Run alone it is a group
of one process; under torchrun each rank takes its share:

    python examples/distributed.py
    torchrun --standalone --nproc_per_node=2 examples/distributed.py
"""

import os

import torch
import torch.distributed as dist

import blockhess as bh
import blockhess.distributed as bhd
from blockhess.linalg import rel_error

torch.set_num_threads(1)
if "RANK" in os.environ:
    dist.init_process_group("gloo")  # torchrun's environment
else:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
rank, world = dist.get_rank(), dist.get_world_size()

cfg = bh.BlockConfig(d_model=8, d_ff=16)
params = bh.init_params(cfg, seed=0)  # the same on every rank (checked by SHA-256)
g = torch.Generator().manual_seed(0)
X = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)  # the whole dataset, 10 sequences
T = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)
rows = bhd.shard(len(X))  # this rank's contiguous share
H = bhd.hessian(params, X[rows], cfg, loss="mse", target=T[rows])  # collective: every rank calls it
st = bhd.per_sample_statistics(params, X[rows], cfg, loss="mse", target=T[rows])  # (10,) per field, in X's order

if rank == 0:
    whole = bh.hessian(params, X, cfg, loss="mse", target=T).dense()  # one process, the whole dataset
    print(f"{world} process(es); rank 0 held sequences {rows.start}..{rows.stop - 1}")
    print(f"Hessian over all 10 sequences: {tuple(H.dense().shape)}, against one process's: {rel_error(H.dense(), whole):.1e}")
    print("per-sample losses:", [f"{x:.4f}" for x in st.loss.tolist()])
    print("per-sample ‖H_i‖_2:", [f"{x:.4f}" for x in st.spectral.tolist()])
dist.destroy_process_group()
