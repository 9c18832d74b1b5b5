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


# --------------------------------------------------------------------------- issue 21, item 1

def test_llm_applies_the_same_policy_and_close_restores_it(tiny_checkpoint, monkeypatch, capsys):
    from dsv4.engine.llm import LLM
    from dsv4.errors import UsageError

    before = torch.get_num_threads()
    with LLM(tiny_checkpoint, max_num_seqs=1, max_model_len=64, threads=2) as llm:
        assert torch.get_num_threads() == 2 and llm.threads == 2
    assert torch.get_num_threads() == before
    # "auto" is dsv4.cpu_threads' policy (here: free cores with the load faked), the CLI's --threads auto
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: {0, 1, 2})
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus=None: 3)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda cpus=None: 1.0)
    with LLM(tiny_checkpoint, max_num_seqs=1, max_model_len=64):
        assert torch.get_num_threads() == 2
        assert "cpu: 2 threads (3 core(s), 1.0 busy" in capsys.readouterr().err
    with LLM(tiny_checkpoint, max_num_seqs=1, max_model_len=64, threads=None, progress=False):
        assert torch.get_num_threads() == before
    with pytest.raises(UsageError, match="threads"):
        LLM(tiny_checkpoint, threads=0)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_thread_monitor_follows_other_load_not_its_own(monkeypatch):
    """Between engine steps the server re-evaluates the policy: other processes' load counts, the
    server's own CPU time does not."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus=None: 2)
    stat = {0: (0, 0), 1: (0, 0)}
    own = [0.0]
    clock = FakeClock()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mon = cpu_threads.ThreadMonitor("auto", interval=5.0, read_stat=lambda: dict(stat),
                                        own_cpu_seconds=lambda: own[0], clock=clock)

        def advance(busy_jiffies: tuple[int, int], own_seconds: float):
            clock.t += 5.0
            own[0] += own_seconds
            for cpu, b in zip((0, 1), busy_jiffies):     # 500 jiffies = 5 s at 100 Hz
                stat[cpu] = (stat[cpu][0] + b, stat[cpu][1] + 500)
            return mon.poll()

        clock.t += 1.0
        assert mon.poll() is None                       # before the interval: nothing is read
        assert advance((500, 500), 10.0) is None        # both cores busy, all of it this process
        assert torch.get_num_threads() == 2
        assert advance((500, 500), 5.0) == 1            # one core's worth is someone else's
        assert torch.get_num_threads() == 1
        assert advance((500, 0), 0.0) is None           # still there
        assert advance((250, 0), 2.5) == 2              # gone: the busy half is ours
        assert mon.changes == [(2, 1), (1, 2)]
    finally:
        torch.set_num_threads(before)
    assert not cpu_threads.ThreadMonitor(3).active and not cpu_threads.ThreadMonitor(None).active
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not cpu_threads.ThreadMonitor("auto").active


def test_server_engine_reevaluates_on_cpu_only(tiny_checkpoint, monkeypatch):
    """The server's engine thread gets the LLM's policy to re-evaluate, on the CPU only."""
    from types import SimpleNamespace

    import dsv4.serve.app as app
    from dsv4.text.tokenizer import Tokenizer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    made = []
    monkeypatch.setattr(app.AsyncEngine, "start", lambda self: made.append(self))  # no engine thread
    engine = SimpleNamespace(max_num_seqs=1, vocab_size=8, max_model_len=16)   # what the server reads of an Engine
    for device in ("cpu", "cuda"):
        llm = SimpleNamespace(engine=engine, max_model_len=16, tokenizer=Tokenizer.from_dir(tiny_checkpoint),
                              path=tiny_checkpoint, max_num_seqs=1, device=torch.device(device), threads="auto")
        app.ServerState(None, ["m"])._ready(llm)
    assert [e.thread_monitor.active for e in made] == [True, False]
