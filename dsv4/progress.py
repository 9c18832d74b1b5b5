"""Progress bars that never tangle with error messages.

A live tqdm bar owns the current terminal line: an error printed while it is open lands glued to
the bar, and a bar that is never closed redraws itself after the error. :func:`progress_bar`
closes the bar when its block ends; when the block raises, it first erases the bar, so the error
is the only thing on the line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm


@contextmanager
def progress_bar(enabled: bool = True, **kwargs: Any) -> Iterator[tqdm]:
    """A tqdm bar on stderr (``disable`` when not ``enabled``), closed on exit, erased on error."""
    bar = tqdm(disable=not enabled, file=kwargs.pop("file", sys.stderr), dynamic_ncols=True, **kwargs)
    try:
        yield bar
    except BaseException:
        bar.leave = False  # erase the bar's line instead of leaving a stale bar above the error
        bar.close()
        raise
    bar.close()
