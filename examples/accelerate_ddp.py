"""Hugging Face Accelerate on 2 CPU processes, gradients through gradzip's PowerSGD hook.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py
    # or: accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py

One call after ``prepare`` registers the hook on the prepared model and its state for
``accelerator.save_state`` / ``load_state``; ``figures(state)`` gives each step's payload bytes
and compression ratio for ``accelerator.log``.
"""

import torch
from accelerate import Accelerator
from torch import nn

from gradzip.integrations.accelerate import figures, register


def main() -> None:
    accelerator = Accelerator(cpu=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=gen)
    y = x @ torch.randn(32, 1, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register(accelerator, model, "powersgd:approx_rank=2")

    for epoch in range(2):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            logged = figures(state)
            accelerator.log({"loss": loss.item(), **logged})
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, "
                          f"{logged['gradzip/payload_bytes']:.0f} B of {logged['gradzip/dense_bytes']:.0f} B dense")
    accelerator.save_state("accelerate_example")  # every rank's residuals and factors included
    accelerator.end_training()


if __name__ == "__main__":
    main()
