"""The smallest use of gradzip: a DDP model whose gradients travel compressed.

Run with torchrun (2 gloo ranks on CPU):

    torchrun --standalone --nproc-per-node 2 examples/ddp_minimal.py

Each rank trains a small MLP on its own shard of a fixed regression task; PowerSGD (rank 2)
compresses every DDP bucket and error feedback keeps what it dropped. Rank 0 prints the loss and
the bytes each step's payload took against the dense gradient.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DDP(model)
    state = gradzip.CompressionState("powersgd:approx_rank=2")
    ddp.register_comm_hook(state, gradzip.compression_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)

    data = torch.Generator().manual_seed(1 + rank)  # each rank its own shard
    target = torch.Generator().manual_seed(1234)
    w_true = torch.randn(32, 1, generator=target)
    for step in range(30):
        x = torch.randn(64, 32, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ w_true)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        figures = state.metrics.pop()
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1}: loss {loss.item():.4f}, payload {figures['payload_bytes']} B "
                  f"of {figures['dense_bytes']} B dense")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
