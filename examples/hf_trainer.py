"""The Hugging Face Trainer on 2 CPU processes: a tiny GPT-2 trained with gradzip's PowerSGD hook.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py

The Trainer has no comm-hook option and its callbacks see the unwrapped model, so
``CompressionCallback`` is given the trainer: it registers the hook on ``trainer.model_wrapped``
when training begins, logs the payload bytes, ratio and norm ratio through ``trainer.log``, and
writes each rank's compressor state into every checkpoint folder.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradzip.integrations.hf import CompressionCallback

TEXT = b"To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 40


def main() -> None:
    ids = torch.tensor(list(TEXT))
    blocks = [{"input_ids": ids[i : i + 64], "labels": ids[i : i + 64]} for i in range(0, len(ids) - 64, 64)]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir="hf_example", use_cpu=True, per_device_train_batch_size=4, max_steps=40,
        learning_rate=1e-3, logging_steps=10, save_steps=20, report_to=[], disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=blocks)
    trainer.add_callback(CompressionCallback(trainer, "powersgd:approx_rank=4"))
    trainer.train()  # prints the loss and the gradzip/ figures every 10 steps


if __name__ == "__main__":
    main()
