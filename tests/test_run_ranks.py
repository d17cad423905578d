"""gradzip.testing.run_ranks: ranks see the caller's environment and working directory as they
are at the call, start as fresh processes, and a rank's error reaches the caller."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

_TOUCHED: list[int] = []  # appended to by each rank; a rank reusing a process would see earlier entries


def where_am_i(rank: int, world_size: int) -> dict:
    _TOUCHED.append(rank)
    return {
        "env": os.environ.get("GRADZIP_TEST_MARK"),
        "cwd": os.getcwd(),
        "touched": list(_TOUCHED),
        "pid": os.getpid(),
        "group": (dist.get_rank(), dist.get_world_size()),
    }


def fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")


def fails_on_rank_two_while_the_others_wait(rank: int, world_size: int) -> None:
    if rank == 2:
        raise ValueError("rank two gives up")
    dist.all_reduce(torch.ones(3))  # never completes: rank two has gone


def test_ranks_see_the_callers_environment_and_directory_at_the_call(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADZIP_TEST_MARK", raising=False)
    first = run_ranks(where_am_i, 2)  # also starts the fork server, before the changes below
    monkeypatch.setenv("GRADZIP_TEST_MARK", "second")
    monkeypatch.chdir(tmp_path)
    second = run_ranks(where_am_i, 2)
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in second] == ["second", "second"]
    assert all(r["cwd"] == str(tmp_path) for r in second)
    assert [r["group"] for r in second] == [(0, 2), (1, 2)]
    # Every rank a new process that has run nothing before it.
    assert [r["touched"] for r in first + second] == [[0], [1], [0], [1]]
    assert len({r["pid"] for r in first + second}) == 4


def test_a_rank_that_raises_makes_the_call_raise_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank one gives up"):
        run_ranks(fails_on_rank_one, 2)


def test_the_rank_that_raised_leads_the_report_before_its_peers_aftermath():
    with pytest.raises(RuntimeError) as info:
        run_ranks(fails_on_rank_two_while_the_others_wait, 3, timeout_s=60)
    report = str(info.value)
    assert report.startswith("rank 2 failed:") and "ValueError: rank two gives up" in report
    # the waiting ranks failed too (gloo saw the peer go) and are reported after it
    assert "rank 0 failed:" in report and "rank 1 failed:" in report
