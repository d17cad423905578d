"""The model: a GPT-2 style causal LM built from a ``transformers`` config (no download), or
under ``--model`` a pretrained one (:mod:`gradzip.lab.train.pretrained`), and its loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gradzip.lab.train.config import TrainConfig


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """``cfg.model`` loaded (float32, dropout off), or a freshly initialised ``GPT2LMHeadModel``
    with dropout off (so steps are deterministic).

    Initialisation draws from a generator seeded by ``cfg.seed`` inside a forked RNG state, so
    the process-global RNG is left as it was.

    Args:
        vocab_size: the tokenizer's vocabulary size (the GPT-2's embedding rows).

    Raises:
        ValueError: if the pretrained model has fewer embedding rows than its tokenizer has tokens.
    """
    if cfg.model is not None:
        from gradzip.lab.train.pretrained import load_model, model_folder

        model = load_model(model_folder(cfg.model), cfg.seed)
        rows = model.get_input_embeddings().num_embeddings
        if vocab_size > rows:
            raise ValueError(f"--model {cfg.model}: its tokenizer has {vocab_size} tokens and its embedding {rows} rows")
        return model
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


def model_skeleton(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """``cfg``'s model on the meta device: parameter shapes only, nothing read or allocated."""
    if cfg.model is not None:
        from gradzip.lab.train.pretrained import skeleton

        return skeleton(cfg.model)
    with torch.device("meta"):
        return build_model(cfg, vocab_size)


def next_token_loss(model: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of the logits at each position of ``x`` against the next token ``y``.

    Args:
        x: input token ids, int64, ``(batch, seq_len)``.
        y: the tokens that follow each position (``x`` shifted by one), int64, ``(batch, seq_len)``.

    Returns:
        a float32 scalar, nats per token. (``transformers``' ``labels=`` would shift ``y`` once
        more and score the token after the next.)
    """
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
