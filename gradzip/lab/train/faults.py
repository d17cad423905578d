"""Faults in the main job: non-finite steps, lost workers, and test-only fault injection.

Non-finite gradients: gradzip's reducers hand every rank an all-NaN bucket when any rank's bucket
held inf or NaN (:mod:`gradzip.comm.nonfinite`), and a dense all_reduce carries inf and NaN by itself,
so every rank sees the same averaged gradient and :func:`gradients_finite` gives the same answer
on all of them: the step is skipped everywhere, with no extra collective. Where ranks hold
different gradients (FSDP shards; a compressed optimizer's own steps) :func:`step_finite` agrees
with one small all_reduce instead. Under ``--outer`` each DiLoCo replica skips its own step
(``DiLoCo.skip_step`` keeps the outer schedule counting), so nothing crosses the slow link
between outer exchanges.

Lost workers: a worker that dies closes its connections and the others' next collective fails at
once; a worker that hangs makes it fail after the collective timeout (``--timeout-s``). The
survivors then hold a roll call in the rendezvous store to name the rank that is gone, and stop
with :class:`PeerLost`, whose message is one line. They wait up to ``ROLL_CALL_WAIT_S`` for each
other, less where gradzip's launcher has already marked the silent ranks as gone.

Fault injection, for tests and drills. It is inert unless the environment variable
``GRADZIP_FAULTS`` is set, to one or more specs joined by ``+`` (the codec spec grammar):

- ``exit:rank=R,step=S[,code=C]``: rank R leaves at once (``os._exit(C)``, default code 1) when
  step S starts, as a killed process would.
- ``hang:rank=R,step=S``: rank R stops responding (sleeps) when step S starts.
- ``error:rank=R,step=S``: rank R raises a ``RuntimeError`` when step S starts, as a bug would.
- ``nonfinite:rank=R,step=S[,value=inf|-inf|nan]``: rank R's gradient of its first parameter
  gets one non-finite element (default inf) in step S.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradzip.comm import nonfinite
from gradzip.optim.base import group_world_size

ENV = "GRADZIP_FAULTS"
KINDS = ("exit", "hang", "error", "nonfinite")
ROLL_CALL_WAIT_S = 5.0

#: words in the errors of a collective whose peer died or timed out (gloo and NCCL)
_LOST_PEER_WORDS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "peer")


def gradients_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter's gradient is finite on this rank (one pass; no collective)."""
    return all(nonfinite.is_finite(p.grad) for p in model.parameters() if p.grad is not None)


def step_finite(model: torch.nn.Module, *, own_gradients: bool) -> bool:
    """Whether every rank may take this step, the same answer on every rank.

    Args:
        own_gradients: the ranks hold different gradients (FSDP shards, or a compressed optimizer
            that exchanges its momenta itself after its warm-up), so a local check could split
            them; they then agree with one all_reduce of a flag. Otherwise every rank holds the
            same averaged gradient (a non-finite one reaches all of them as NaN) and the local
            check is the agreement.
    """
    finite = gradients_finite(model)
    if not own_gradients:
        return finite
    return everywhere(finite, next(model.parameters(), torch.empty(0)).device)


def _alone() -> bool:
    """Whether this process is the only rank (no group, or a group of one)."""
    return group_world_size(None) == 1


def everywhere(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` holds on every rank (one small all_reduce on ``device``, where the backend
    reduces; the flag itself without a group)."""
    if _alone():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() == 1.0)


def gathered(count: int, device: torch.device | str = "cpu") -> list[int]:
    """``count`` of every rank, in rank order (one small all_gather on ``device``; ``[count]``
    without a group)."""
    if _alone():
        return [count]
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([count], dtype=torch.int64, device=device))
    return [int(c.item()) for c in counts]


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring)."""

    kind: str
    rank: int
    step: int
    code: int = 1
    value: float = math.inf


def parse_faults(text: str | None) -> list[Fault]:
    """Faults from a ``GRADZIP_FAULTS`` value (None or empty: none).

    Raises:
        ValueError: for an unknown kind or a bad parameter, naming it.
    """
    from gradzip.compressors.spec import parse_spec

    if not text or not text.strip():
        return []
    faults = []
    for kind, params in parse_spec(text):
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r}; known: {', '.join(KINDS)}")
        allowed = {"rank", "step"} | {"exit": {"code"}, "hang": set(), "error": set(), "nonfinite": {"value"}}[kind]
        unknown = set(params) - allowed
        if unknown or not {"rank", "step"} <= set(params):
            raise ValueError(f"{ENV}: {kind} takes {', '.join(sorted(allowed))} (rank and step required)")
        for name in ("rank", "step", "code"):
            value = params.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{ENV}: {name} must be an integer >= 0; got {value!r}")
        # Spec values read nan and inf as words (numbers are ASCII decimals there): name them here.
        value = NON_FINITE.get(str(params.get("value", "inf")).lower())
        if value is None:
            raise ValueError(f"{ENV}: value must be inf, -inf or nan; got {params['value']!r}")
        faults.append(Fault(kind, params["rank"], params["step"], params.get("code", 1), value))
    return faults


#: the values a ``nonfinite`` fault may write
NON_FINITE = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class FaultPlan:
    """The faults this process was asked to inject; :meth:`at_step` does nothing without any."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self._handles: list = []

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(parse_faults(os.environ.get(ENV)))

    def at_step(self, model: torch.nn.Module, *, rank: int, step: int) -> None:
        """Inject the faults of (``rank``, ``step``); call as the step starts."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for fault in self.faults:
            if fault.rank != rank or fault.step != step:
                continue
            if fault.kind == "exit":
                os._exit(fault.code)
            if fault.kind == "hang":
                while True:
                    time.sleep(60)
            if fault.kind == "error":
                raise RuntimeError(f"{ENV}: injected error at step {step}")
            if fault.kind == "nonfinite":
                param = next(p for p in model.parameters() if p.requires_grad)
                self._handles.append(param.register_hook(_spoil(fault.value)))


def _spoil(value: float):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # Runs before DDP sees the gradient, as a real overflow in backward would.
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return hook


#: exit code of a worker that stopped because another one was lost
EXIT_LOST_PEER = 75


class PeerLost(RuntimeError):
    """This rank stopped because another rank died or stopped responding (one-line message).

    Attributes:
        silent: the ranks that did not answer the roll call (None: the store was unreachable).
    """

    def __init__(self, message: str, silent: list[int] | None = None) -> None:
        super().__init__(message)
        self.silent = silent


def leave(message: str, code: int = EXIT_LOST_PEER) -> None:
    """Print ``message`` on stderr and end the process at once.

    A process whose process group lost a peer can block forever while Python tears it down at
    exit (gloo's threads wait on the dead connection), so a worker that lost a peer skips that.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    # One write of the whole line: several workers share the terminal, and a line written in
    # pieces can interleave with another's.
    os.write(2, f"gradzip: {message}\n".encode())
    os._exit(code)


def is_lost_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective whose peer died or timed out."""
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _LOST_PEER_WORDS)


def roll_call_key(rank: int, what: str) -> str:
    """Store key of ``rank``'s answer (``here``) or of the launcher's word that it is ``gone``;
    per torchrun restart, as a restarted group reuses the store."""
    return f"gradzip/roll-call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{what}/{rank}"


def rendezvous_store() -> dist.Store:
    """The store the process group met in, without the group's key prefixes."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def missing_ranks(rank: int, world_size: int, wait_s: float) -> list[int] | None:
    """Roll call in the rendezvous store: the ranks that did not check in within ``wait_s``
    (sooner when every silent rank is marked gone).

    Returns:
        the silent ranks (empty if all answered), or None if the store itself is unreachable.
    """
    try:
        store = rendezvous_store()
        store.set(roll_call_key(rank, "here"), "1")
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in range(world_size) if r != rank and not store.check([roll_call_key(r, "here")])]
            gone = all(store.check([roll_call_key(r, "gone")]) for r in silent)
            if not silent or gone or time.monotonic() > deadline:
                return silent
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - an unreachable store is an answer too
        return None


def short_cause(exc: BaseException) -> str:
    """The gist of a collective's error in a few words."""
    text = str(exc)
    for phrase in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out"):
        if phrase.lower() in text.lower():
            return phrase.lower()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:160]


def lost_peer(exc: BaseException, *, rank: int, world_size: int, wait_s: float = ROLL_CALL_WAIT_S) -> PeerLost | None:
    """A :class:`PeerLost` naming the rank that is gone, or None if every rank answered (then
    ``exc`` is not about a lost worker and should propagate as it is)."""
    silent = missing_ranks(rank, world_size, wait_s)
    if silent == []:
        return None
    if silent is None:
        who = "the rendezvous store is unreachable"
    else:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped responding"
    return PeerLost(f"rank {rank} stopped: {who} ({short_cause(exc)})", silent)
