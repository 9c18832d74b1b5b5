"""Where a tool may write a checkpoint directory, and how a finished one replaces an old one.

``dsv4 quantize SRC DST --overwrite`` once replaced ``SRC``'s parent directory with its output,
source and unrelated files included. The rules here make that impossible:

- ``DST`` may not be the source, hold the source, or lie inside it (compared after resolving
  symbolic links), and may not itself be a symbolic link.
- An existing ``DST`` is replaced only if it is empty (nothing to lose) or a previous dsv4 output:
  every output carries the :data:`OUTPUT_MARKER` file, written before the output is renamed into
  place. Anything else is refused, ``--overwrite`` or not.
- The output gets the modes any new file gets (directories ``0777 & ~umask``, files
  ``0666 & ~umask``), not the private 0700 of the temporary directory it was built in: a shared
  checkpoint must be readable by whoever the umask lets read it.
- The new output is built in a temporary sibling of ``DST`` and swapped in by renames: the old
  ``DST`` is renamed away, the new one renamed in, and only then is the old one removed. If the
  swap fails the old ``DST`` is renamed back. Nothing is ever deleted first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .. import __version__
from ..errors import Dsv4Error

OUTPUT_MARKER = ".dsv4-output"


def check_destination(src: Path, dst: Path, overwrite: bool, error: type[Dsv4Error]) -> None:
    """Raise ``error`` naming ``dst`` unless writing the output of ``src`` there loses nothing."""
    s, d = src.resolve(), dst.resolve()
    if d == s:
        raise error(f"destination {dst} is the source checkpoint")
    if s.is_relative_to(d):
        raise error(f"destination {dst} contains the source checkpoint {src}; choose a new directory")
    if d.is_relative_to(s):
        raise error(f"destination {dst} lies inside the source checkpoint {src}; choose a directory outside it")
    if dst.is_symlink():
        raise error(f"destination {dst} is a symbolic link; give the directory itself")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise error(f"destination {dst} exists and is not a directory")
    if not any(dst.iterdir()):
        return  # an empty directory holds nothing to lose
    if not (dst / OUTPUT_MARKER).is_file():
        raise error(f"destination {dst} is not empty and is not a dsv4 output (it has no {OUTPUT_MARKER} "
                    "file); refusing to replace it: choose a new directory")
    if not overwrite:
        raise error(f"destination {dst} already exists (a previous dsv4 output); pass --overwrite "
                    "(overwrite=True) to replace it")


def write_marker(directory: Path, **info: object) -> None:
    """Mark ``directory`` as a dsv4 output; ``info`` (format, policy, source, ...) is recorded."""
    record = {"producer": f"dsv4 {__version__}", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info}
    (directory / OUTPUT_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def make_temp_sibling(dst: Path) -> Path:
    """A new empty directory next to ``dst`` (same file system, so renames are atomic)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))


def current_umask() -> int:
    """The process's umask (read from /proc where possible: setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask_modes(directory: Path) -> None:
    """Give ``directory`` and everything in it the modes of newly created files under the umask
    (``mkdtemp`` made it 0700)."""
    mask = current_umask()
    for root, dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def replace_dir(new: Path, dst: Path) -> None:
    """Move the finished directory ``new`` to ``dst``; an existing ``dst`` is renamed away first
    and removed only once ``new`` is in place (renamed back if that fails)."""
    if not dst.exists():
        os.rename(new, dst)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.rename(dst, aside / "previous")
    try:
        os.rename(new, dst)
    except BaseException:
        os.rename(aside / "previous", dst)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
