"""A stand-in for one rank of ``gradzip train`` (standard library only, so it starts at once).

It honours the torchrun contract (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), sends a known
number of bytes from every rank to rank 0 over TCP; every rank writes the CPUs it may run on
(``cpus_rank<r>.json``), and rank 0 writes metrics.jsonl (a line
every ``STEP_PAUSE_S``) and summary.json with known step times and losses. Compressor ``hang``
sleeps; ``crash`` raises on rank 1 at once and on the others a second later.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

# Stand-in runs: seconds per step and payload bytes per step, by compressor. Losses are the same
# per step for every compressor (6.0 - 0.5 * (step + 1)), so only the step time decides the race.
FAKE_STEP_S = {"limit": 0.1, "none": 0.4, "fp16": 0.25}
FAKE_PAYLOAD = {"limit": 0, "none": 200_000, "fp16": 100_000}
HELLO_BYTES = 1000  # start-up traffic of every run, the limit row's included
STEP_PAUSE_S = 0.1  # wall time between two steps' lines, for a link schedule to follow them


def fake_records(label: str, steps: int, eval_every: int = 2) -> list[dict]:
    out = []  # sent_bytes: an all_reduce over 2 ranks sends 2 (N-1)/N = 1x its payload
    for step in range(steps):
        r = {"step": step, "loss": 6.0 - 0.5 * (step + 1), "elapsed_s": (step + 1) * FAKE_STEP_S[label],
             "step_s": FAKE_STEP_S[label], "payload_bytes": FAKE_PAYLOAD[label],
             "dense_bytes": 0 if label == "limit" else 200_000, "compress_s": 0.0, "decompress_s": 0.0,
             "communicate_s": 0.0, "sent_bytes": FAKE_PAYLOAD[label]}  # fmt: skip
        if (step + 1) % eval_every == 0 or step == steps - 1:
            r["val_loss"] = 6.0 - 0.5 * (step + 1)
        out.append(r)
    return out


def _fake_train(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--compressor")
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--no-exchange", action="store_true")
    args, _ = p.parse_known_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    label = "limit" if args.no_exchange else args.compressor
    if label == "hang":
        time.sleep(600)
    if label == "crash":
        time.sleep(0.0 if rank == 1 else 1.0)
        raise RuntimeError(f"boom on rank {rank}")
    nbytes = HELLO_BYTES + args.steps * FAKE_PAYLOAD[label]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpus_rank{rank}.json").write_text(json.dumps(sorted(os.sched_getaffinity(0))))
    if rank == 0:
        with socket.create_server((addr, port)) as server:
            for _ in range(world_size - 1):
                conn, _ = server.accept()
                with conn:
                    got = 0
                    while chunk := conn.recv(1 << 16):
                        got += len(chunk)
                    assert got == nbytes, (got, nbytes)
        records = fake_records(label, args.steps, args.eval_every)
        with open(out / "metrics.jsonl", "w") as f:  # a line per step as it ends, as gradzip train writes them
            for r in records:
                f.write(json.dumps(r) + "\n")
                f.flush()
                time.sleep(STEP_PAUSE_S)
        summary = {"final_val_loss": records[-1]["val_loss"], "wall_s": records[-1]["elapsed_s"], "compute_s": 0.1}
        (out / "summary.json").write_text(json.dumps(summary))
    else:
        for _ in range(100):  # rank 0 may not listen yet
            try:
                conn = socket.create_connection((addr, port))
                break
            except OSError:
                time.sleep(0.05)
        with conn:
            conn.sendall(b"x" * nbytes)


if __name__ == "__main__":
    _fake_train(sys.argv[1:])
