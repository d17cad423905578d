"""The model: a GPT-2 style causal LM built from a ``transformers`` config (no download)."""

from __future__ import annotations

import torch

from gradzip.lab.train.config import TrainConfig


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """A freshly initialised ``GPT2LMHeadModel`` with dropout off (so steps are deterministic).

    Initialisation draws from a generator seeded by ``cfg.seed`` inside a forked RNG state, so
    the process-global RNG is left as it was.
    """
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # keeps worker output to the progress bar and the summary

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT2LMHeadModel(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
