"""Lightning, Accelerate and the Hugging Face Trainer training through gradzip's integrations on
2 gloo ranks: the hook ran (payload bytes below dense and equal to PowerSGD's formula), the
figures reached the framework's logging, ranks end bit-identical, and a run resumed from the
framework's checkpoint ends bit-identical to the run that went on (PowerSGD's result does not
depend on DDP's bucket layout, so the resumed process's first layout changes nothing), while
one resumed without the compressor state does not."""

import csv
import glob
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.testing import run_ranks

pytestmark = pytest.mark.e2e

SPEC = "powersgd:approx_rank=2"


def tiny_net() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def dataset(n: int = 24) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=gen), torch.randn(n, 4, generator=gen))


def payload_formula(model: nn.Module) -> int:
    """PowerSGD's bytes per backward pass: factors for each matrix that compresses, else dense."""
    codec = gradzip.build(SPEC)
    return sum(codec.matrix_payload_nbytes(p.shape, p.dtype) for p in model.parameters())


def launched_env(rank: int, world_size: int) -> None:
    """What a launcher (torchrun, accelerate launch) sets; the gloo group already exists."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def identical_on_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(gathered[0], t) for t in gathered)


def check(result: dict, model: nn.Module) -> None:
    payload = payload_formula(model)
    dense = sum(p.numel() for p in model.parameters()) * 4
    assert result["payload_bytes"] == payload < dense
    assert result["dense_bytes"] == dense
    assert result["identical"]
    assert torch.equal(result["resumed"], result["went_on"])
    assert not torch.equal(result["resumed_without_state"], result["went_on"])


# -- Lightning -----------------------------------------------------------------------------------


def lightning_run(rank: int, world_size: int, folder: str) -> dict:
    launched_env(rank, world_size)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from gradzip.integrations.lightning import CompressedDDPStrategy

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)  # 3 steps per epoch on each rank
    quiet = {"accelerator": "cpu", "devices": world_size, "max_epochs": 2, "enable_progress_bar": False,
             "enable_model_summary": False}

    def fit(ckpt_path=None, **kwargs):
        module, strategy = Regression(), CompressedDDPStrategy(SPEC)
        pl.Trainer(strategy=strategy, **quiet, **kwargs).fit(module, loader, ckpt_path=ckpt_path)
        return module, strategy

    saver = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
    module, strategy = fit(logger=CSVLogger(folder, name="logs"), log_every_n_steps=1, callbacks=[saver])
    out = {"went_on": flat(module), "identical": identical_on_ranks(flat(module)), "steps": strategy.compression.step}
    out["payload_bytes"] = strategy.logged["gradzip/payload_bytes"]
    out["dense_bytes"] = strategy.logged["gradzip/dense_bytes"]
    first = os.path.join(folder, "epoch=0-step=3.ckpt")
    out["resumed"] = flat(fit(first, logger=False, enable_checkpointing=False)[0])
    saved = torch.load(first, weights_only=True)
    out["saved_ranks"] = saved["gradzip"]["world_size"]
    if rank == 0:
        del saved["gradzip"]
        torch.save(saved, os.path.join(folder, "stripped.ckpt"))
    dist.barrier()
    stripped = os.path.join(folder, "stripped.ckpt")
    out["resumed_without_state"] = flat(fit(stripped, logger=False, enable_checkpointing=False)[0])
    return out


def test_lightning_strategy_compresses_logs_and_resumes_exactly(tmp_path):
    pytest.importorskip("lightning")
    results = run_ranks(lightning_run, 2, str(tmp_path))
    for result in results:
        check(result, tiny_net())
        assert result["steps"] == 6 and result["saved_ranks"] == 2
    with open(glob.glob(str(tmp_path / "logs" / "*" / "metrics.csv"))[0]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("gradzip/payload_bytes")]
    assert len(rows) == 6 and {float(r["gradzip/payload_bytes"]) for r in rows} == {payload_formula(tiny_net())}
    assert all(0 < float(r["gradzip/norm_ratio"]) <= 1.0 + 1e-6 for r in rows)


# -- Accelerate ----------------------------------------------------------------------------------


def accelerate_run(rank: int, world_size: int, folder: str) -> dict:
    launched_env(rank, world_size)
    import shutil

    from accelerate import Accelerator

    from gradzip.integrations import accelerate as gz_accelerate
    from gradzip.integrations.common import register

    def run(epochs: range, *, load_from: str | None = None, save_to: str | None = None, checkpointed: bool = True):
        accelerator = Accelerator(cpu=True)
        model = tiny_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if checkpointed:
            state = gz_accelerate.register(accelerator, model, SPEC)
        else:
            state = register(model, gradzip.CompressionState(SPEC))
        if load_from is not None:
            accelerator.load_state(load_from)
        logged = []
        for epoch in epochs:
            for x, y in loader:
                optimizer.zero_grad()
                accelerator.backward((model(x) - y).square().mean())
                optimizer.step()
                logged.append(gz_accelerate.figures(state))
            if save_to is not None and epoch == 0:
                accelerator.save_state(save_to)
        return accelerator.unwrap_model(model), logged

    saved = os.path.join(folder, "state")
    model, logged = run(range(2), save_to=saved)
    out = {"went_on": flat(model), "identical": identical_on_ranks(flat(model)), "steps": len(logged)}
    out["payload_bytes"] = logged[-1]["gradzip/payload_bytes"]
    out["dense_bytes"] = logged[-1]["gradzip/dense_bytes"]
    out["resumed"] = flat(run(range(1, 2), load_from=saved)[0])
    stripped = os.path.join(folder, "stripped")
    if rank == 0:
        shutil.copytree(saved, stripped, ignore=shutil.ignore_patterns("custom_checkpoint_*"))
    dist.barrier()
    out["resumed_without_state"] = flat(run(range(1, 2), load_from=stripped, checkpointed=False)[0])
    return out


def test_accelerate_register_compresses_and_resumes_exactly(tmp_path):
    pytest.importorskip("accelerate")
    for result in run_ranks(accelerate_run, 2, str(tmp_path)):
        check(result, tiny_net())
        assert result["steps"] == 6


# -- Hugging Face Trainer ------------------------------------------------------------------------


class LossNet(nn.Module):
    """The tiny net with the Trainer's calling convention (keyword inputs, a ``loss`` output)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def forward(self, x, labels):
        return {"loss": (self.net(x) - labels).square().mean()}


def trainer_run(rank: int, world_size: int, folder: str) -> dict:
    launched_env(rank, world_size)
    import shutil
    import warnings

    from transformers import Trainer, TrainingArguments

    from gradzip.integrations.hf import CompressionCallback

    records = [{"x": x, "labels": y} for x, y in dataset()]

    def train(output_dir: str, resume: str | None = None):
        args = TrainingArguments(
            output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, num_train_epochs=2,
            learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
            save_strategy="epoch" if resume is None else "no", disable_tqdm=True, seed=0,
        )
        model = LossNet()
        trainer = Trainer(model=model, args=args, train_dataset=records)
        callback = CompressionCallback(trainer, SPEC)
        trainer.add_callback(callback)
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer, callback

    model, trainer, callback = train(folder)
    logged = [e for e in trainer.state.log_history if "gradzip/payload_bytes" in e]
    out = {"went_on": flat(model), "identical": identical_on_ranks(flat(model)), "steps": callback.compression.step}
    out["logged_steps"] = [e["step"] for e in logged]
    out["payload_bytes"] = logged[-1]["gradzip/payload_bytes"]
    out["dense_bytes"] = logged[-1]["gradzip/dense_bytes"]
    out["loss_logged"] = sum("loss" in e for e in trainer.state.log_history)
    first = os.path.join(folder, "checkpoint-3")
    out["resumed"] = flat(train(folder, first)[0])
    other = os.path.join(folder, "other")
    if rank == 0:
        shutil.copytree(first, os.path.join(other, "checkpoint-3"), ignore=shutil.ignore_patterns("gradzip_state_*"))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["resumed_without_state"] = flat(train(other, os.path.join(other, "checkpoint-3"))[0])
    out["fresh_warning"] = any("starts afresh" in str(w.message) for w in caught)
    return out


def test_trainer_callback_compresses_logs_and_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    for result in run_ranks(trainer_run, 2, str(tmp_path)):
        check(result, tiny_net())
        assert result["steps"] == 6 and result["logged_steps"] == [1, 2, 3, 4, 5, 6]
        assert result["loss_logged"] == 6  # the Trainer's own logs still go out at every step
        assert result["fresh_warning"]
