"""A tiny pretrained-model folder for ``--model``: a randomly initialised Llama (SmolLM2's
architecture) and a byte-level BPE trained on the corpus, saved as ``transformers`` saves a model."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def write_tiny_llama(folder: Path, corpus: str, seed: int = 0) -> str:
    """config.json, model.safetensors and tokenizer.json of a 2-layer Llama in ``folder``
    (about 30 k parameters); returns the folder's path."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = ByteLevel(add_prefix_space=False)
    bpe.decoder = ByteLevelDecoder()
    trainer = BpeTrainer(vocab_size=VOCAB, initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(Path(corpus).read_text().splitlines(keepends=True), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **SHAPE))
    model.save_pretrained(folder)
    return str(folder)
