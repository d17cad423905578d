"""``gradzip bench``'s input: the main job's gradient when its token ids are cached, else synthetic."""

from __future__ import annotations

import hashlib

import pytest
import torch

from gradzip.lab.bench_input import bench_input
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.data import batch_generator, sample_batch, shakespeare_text
from gradzip.lab.train.model import build_model


@pytest.mark.slow
def test_model_gradient_when_cached_else_synthetic(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path))
    x, what = bench_input(1000)
    assert what.startswith("synthetic") and x.shape == (1000,)
    with pytest.raises(ValueError, match="--input model"):
        bench_input(1000, source="model")
    with pytest.raises(ValueError, match="--input must be"):
        bench_input(1000, source="real")

    cfg = TrainConfig()
    digest = hashlib.sha256(shakespeare_text().encode("utf-8")).hexdigest()[:16]
    ids = torch.randint(0, cfg.vocab_size, (20_000,), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / f"ids-{digest}-{cfg.vocab_size}.pt")
    model = build_model(cfg, cfg.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    numel = params + 1000  # more than one batch's gradients
    x, what = bench_input(numel)
    assert "main job's model" in what and "2 batch(es)" in what
    assert x.shape == (numel,) and x.dtype == torch.float32 and bool(torch.isfinite(x).all())

    # Independently: the first batch's gradients, concatenated in parameter order.
    batch = sample_batch(ids, cfg.batch_size, cfg.seq_len, batch_generator(0, 0))
    # the next-token loss: logits at every position against the following token
    logits = model(input_ids=batch[0]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1)).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert torch.allclose(x[: expected.numel()], expected, rtol=1e-4, atol=1e-7)
    assert float(x[expected.numel() :].abs().sum()) > 0


def test_a_missing_checkpoint_is_named_by_the_option_that_gave_it(tmp_path):
    with pytest.raises(ValueError, match=f"^--checkpoint: no such folder: {tmp_path / 'gone'}$"):
        bench_input(1000, source="model", checkpoint=str(tmp_path / "gone"))
