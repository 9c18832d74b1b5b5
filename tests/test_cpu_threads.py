"""CPU threads are chosen from the free cores (issue 8, item 10)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import cpu_threads
from dsv4.cli import main


def fake_stat(samples):
    """A /proc/stat reader returning ``samples`` one after the other: {cpu: (busy, total)}."""
    it = iter(samples)
    return lambda: next(it)


def test_busy_cpus_counts_other_work():
    before = {0: (100, 1000), 1: (100, 1000)}
    after = {0: (200, 1100), 1: (110, 1100)}  # cpu0 fully busy, cpu1 10% busy
    assert cpu_threads.busy_cpus({0, 1}, 0, fake_stat([before, after])) == pytest.approx(1.1)
    assert cpu_threads.busy_cpus({1}, 0, fake_stat([before, after])) == pytest.approx(0.1)


@pytest.mark.parametrize("busy,want", [(0.0, 2), (0.4, 2), (1.0, 1), (1.7, 1), (2.0, 1)])
def test_free_cores_minus_load(monkeypatch, busy, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus=None: 2)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda cpus=None: busy)
    threads, why = cpu_threads.choose_threads("auto")
    assert threads == want and "2 core(s)" in why


def test_explicit_and_environment(monkeypatch):
    assert cpu_threads.choose_threads(3) == (3, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_threads.choose_threads("auto") == (5, "OMP_NUM_THREADS")


def test_cli_sets_threads_for_the_command_only(tiny_checkpoint, capsys, monkeypatch):
    seen = []
    import dsv4.cli as cli
    monkeypatch.setattr(cli, "cmd_inspect", lambda args: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    monkeypatch.setattr(cli, "build_parser", _parser_with_threads(cli.build_parser))
    assert main(["inspect", "--threads", "3"]) == 0
    assert seen == [3] and torch.get_num_threads() == before
    assert "cpu: 3 threads (--threads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--threads", "0"])


def _parser_with_threads(build):
    """inspect runs no model and has no --threads; give it one to observe the setting."""
    def wrapped():
        parser = build()
        from dsv4.cli_common import add_threads_arg
        sub = next(a for a in parser._actions if a.dest == "command")
        add_threads_arg(sub.choices["inspect"])
        return parser
    return wrapped
