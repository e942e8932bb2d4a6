import io
import sys

from autosp.experiments.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_and_stays_quiet_otherwise(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress(range(3), desc="suite cpu") as bar:
        for _ in bar:
            bar.set_postfix_str("bench-tiny-512")
    assert "suite cpu" in terminal.getvalue() and "/3 [" in terminal.getvalue()  # how many, elapsed
    assert "bench-tiny-512" in terminal.getvalue()
    log = io.StringIO()  # a log file, a CI job, a Snakemake rule
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress(range(3), desc="suite cpu"):
        pass
    assert log.getvalue() == ""
