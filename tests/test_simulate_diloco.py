"""``gradzip simulate`` projecting DiLoCo, on the toy model of test_simulate_step where every
second can be computed by hand."""

from __future__ import annotations

import pytest
import torch
from test_simulate_step import FABRIC, SPEED, toy_workload

from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.step import simulate_step

# fp32 bytes of the toy's tensors in order (embed, layer 0, layer 1, head); the bucket cap is 100 B,
# so every tensor travels alone (two 64 B tensors together would pass it)
TENSOR_BYTES = (160, 64, 64, 160)
INNER_STEP_S = 0.9 + 0.1  # compute + inner optimizer
OUTER_S = 0.1  # the outer step: one more optimizer pass over the parameters


def _allreduce_s(nbytes: int) -> float:
    return FABRIC.collective_s("allreduce", nbytes, 2)


def test_sync_every_h_sends_the_dense_payload_once_per_h_steps():
    result = simulate_step(Method("diloco:sync_every=4"), toy_workload(), FABRIC, 2, SPEED)
    comm = sum(_allreduce_s(n) for n in TENSOR_BYTES)
    assert result.payload_bytes == pytest.approx(sum(TENSOR_BYTES) / 4)
    assert result.step_s == pytest.approx(INNER_STEP_S + (comm + OUTER_S) / 4)
    assert result.exposed_comm_s == pytest.approx(comm / 4)


def test_delay_hides_a_fragments_collectives_behind_the_next_steps():
    # fragments strided over tensors: {embed, layer 1} and {layer 0, head}
    fragments = [(TENSOR_BYTES[0], TENSOR_BYTES[2]), (TENSOR_BYTES[1], TENSOR_BYTES[3])]
    comm = [sum(_allreduce_s(n) for n in f) for f in fragments]
    shares = [sum(f) / sum(TENSOR_BYTES) for f in fragments]
    compute_s, optimizer_s = 0.05, 0.05  # shorter than an exchange: delay 1 hides part, not all, of it
    assert min(comm) > compute_s + optimizer_s
    inner = compute_s + optimizer_s
    # delay 3: both fragments in flight at once, sharing the link, which carries 4 steps' worth
    # per cycle; that bound binds here, not each fragment's own 3 steps
    assert sum(comm) - 4 * inner > sum(max(0.0, c - 3 * inner) for c in comm)
    for delay in (0, 1, 3):
        result = simulate_step(Method(f"diloco:sync_every=4,fragments=2,delay={delay}"),
                               toy_workload(compute_s=compute_s, optimizer_s=optimizer_s), FABRIC, 2, SPEED)
        late = max(sum(max(0.0, c - delay * inner) for c in comm), sum(comm) - 4 * inner)
        exposed = sum(optimizer_s * s for s in shares) + late
        assert result.step_s == pytest.approx(inner + exposed / 4), delay


def test_outer_codec_payload_over_h():
    codec = Method("uniform:bits=8").codec  # as the reducers send it, with the non-finite marker slot
    outer = simulate_step(Method("diloco:sync_every=5+uniform:bits=8"), toy_workload(), FABRIC, 2, SPEED)
    # every tensor travels alone (see TENSOR_BYTES): one payload each, once per 5 steps
    expected = sum(codec.payload_nbytes(n // 4, torch.float32) for n in TENSOR_BYTES) / 5
    assert outer.payload_bytes == pytest.approx(expected)
    assert expected < sum(TENSOR_BYTES) / 5 / 2


@pytest.mark.parametrize(("spec", "message"), [
    ("diloco:sync_every=0", "sync_every"),
    ("diloco:sync_every=4,fragments=2,delay=4", "delay must be an integer in"),
    ("diloco:fragments=2", "sync_every"),
    ("diloco:sync_every=4+onebit-adam", "must be a gradzip codec"),
])
def test_bad_diloco_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        Method(spec)


def test_diloco_is_not_modelled_under_fsdp():
    with pytest.raises(ValueError, match="strategy ddp only"):
        simulate_step(Method("diloco:sync_every=4"), toy_workload(), FABRIC, 2, SPEED, strategy="fsdp")
