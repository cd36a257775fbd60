"""A progress bar on stderr (rich) while a run goes; silent when stderr is no terminal or --quiet."""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def progress_bar(label: str, duration_s: float, quiet: bool = False):
    """Yields a callback(runner) that the runner calls a few times a second; None when quiet."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[calls]} calls"),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=duration_s, calls=0)

        def update(runner) -> None:
            bar.update(task, completed=min(runner.now(), duration_s), calls=runner.done)

        yield update
        bar.update(task, completed=duration_s)
