"""The chunked pieces' CPU thread count (:mod:`hf_fpdt.attention.threads`): the count from the load, and scopes that
restore torch's count after forward and after backward, also where a backward stops before a piece's input."""

from __future__ import annotations

import pytest
import torch

from hf_fpdt.attention.threads import CpuThreads, backward_scope, thread_count


@pytest.mark.parametrize(
    ("requested", "usable", "load", "own", "want"),
    [
        (2, 2, 2.0, 2.0, 2),  # idle: the load is this process's own
        (2, 2, 1.2, 2.0, 2),  # the load average lags this process's start: never above torch's count
        (2, 2, 3.0, 1.3, 1),  # one other busy process (this one's two threads get 1.3 cores): one thread
        (2, 2, 20.0, 0.5, 1),  # a crowded machine: at least one
        (16, 16, 17.0, 16.0, 15),  # one busy process on 16 cores: one core less
        (4, 16, 2.0, 2.0, 4),  # plenty free: torch's count, never more
        (2, 2, None, 2.0, 2),  # no load average on this platform: torch's count
    ],
)
def test_thread_count(requested, usable, load, own, want):
    assert thread_count(requested, usable, load, own) == want


class Fixed(CpuThreads):
    """A policy whose count is fixed (the load of the machine running the test must not decide it)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def count(self, requested: int) -> int:
        return self.n


def test_scope_sets_and_restores_torch_threads(monkeypatch):
    before = torch.get_num_threads()
    calls = [before]  # torch's count is the last one set (patched: the test must not change the process's)
    monkeypatch.setattr(torch, "get_num_threads", lambda: calls[-1])
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = Fixed(before + 1)  # differs from torch's, so the scope must set it and set torch's back
    with threads.scope(torch.device("cpu")):
        with threads.scope(torch.device("cpu")):  # nested: keeps the outer scope's
            pass
    assert calls == [before, before + 1, before]
    del calls[1:]
    with threads.scope(torch.device("meta")):  # not a CPU: nothing changes
        pass
    assert calls == [before]


def test_backward_scope_covers_the_piece_backward_and_restores():
    outer = torch.get_num_threads()
    if outer < 2:
        pytest.skip("needs 2 torch threads to see a change")
    seen = {}

    class Piece(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward"] = torch.get_num_threads()
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["backward"] = torch.get_num_threads()
            return g * 2

    threads = Fixed(1)
    x = torch.ones(3, requires_grad=True)
    y = backward_scope(threads, Piece.apply, x)
    assert torch.get_num_threads() == outer
    (y.sum() * 3).backward()
    assert seen == {"forward": 1, "backward": 1} and torch.get_num_threads() == outer
    assert torch.equal(x.grad, torch.full((3,), 6.0))

    # a backward that stops before the piece's input leaves the scope open; the next scope closes it
    x2 = torch.ones(3, requires_grad=True)
    mid = backward_scope(threads, Piece.apply, x2 * 1)
    torch.autograd.grad(mid.sum(), mid)  # reaches the output marker only: no gradient flows into the piece
    torch.autograd.grad(backward_scope(threads, Piece.apply, x2).sum(), x2)
    assert torch.get_num_threads() == outer
