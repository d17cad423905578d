"""PyTorch Lightning on 2 CPU processes, gradients through gradzip's PowerSGD hook.

    python examples/lightning_ddp.py        # Lightning starts the second process itself

``CompressedDDPStrategy`` registers the hook on CPU as on GPU (Lightning's own ``DDPStrategy``
registers comm hooks on CUDA only), writes the payload bytes, compression ratio and norm ratio to
the logger (a CSV file under ``lightning_example/``), and keeps every rank's compressor state in
the checkpoint, so ``fit(ckpt_path=...)`` resumes it.
"""

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from gradzip.integrations.lightning import CompressedDDPStrategy


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=gen)
    y = x @ torch.randn(32, 1, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=2, log_every_n_steps=4,
        strategy=CompressedDDPStrategy("powersgd:approx_rank=2"),
        logger=CSVLogger("lightning_example"), enable_progress_bar=False,
    )
    trainer.fit(Regression(), loader)
    if trainer.is_global_zero:
        print({k: round(v, 3) for k, v in trainer.strategy.logged.items()})
        print(f"figures in {trainer.logger.log_dir}/metrics.csv")


if __name__ == "__main__":
    main()
