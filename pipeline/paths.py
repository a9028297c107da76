"""Output paths built from names that come from data (conversation files, turn ids, sessions).

A name read from a file or the bus is not a path: `safe_name` turns it into one file-name
component that cannot leave its folder (no separator, no ``..``, not absolute, not hidden) by
percent-encoding every character outside ``[A-Za-z0-9_.-]`` and a leading dot. The encoding is
one-to-one, so two different turn ids never share a file. `path_under` joins such names under a
root and checks the result is still inside it (`UnsafePath` otherwise). Pure, no I/O.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_NAME_BYTES = 200  # file systems stop at 255 bytes per component; leave room for a suffix
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]|^\.")


class UnsafePath(ValueError):
    """A name cannot be used as a file name under its folder (empty, too long, or escaping it)."""


def safe_name(name: str) -> str:
    """`name` as one file-name component: ``t1`` stays ``t1``; ``../x`` becomes ``%2E.%2Fx``."""
    if not isinstance(name, str) or not name:
        raise UnsafePath(f"an empty name cannot be a file name: {name!r}")
    encoded = _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8", "surrogatepass")), name)
    if len(encoded.encode("ascii")) > MAX_NAME_BYTES:
        raise UnsafePath(f"name {name[:60]!r}... is too long for a file name ({len(encoded)} bytes encoded, "
                         f"at most {MAX_NAME_BYTES})")
    return encoded


def path_under(root: Path, *names: str, suffix: str = "") -> Path:
    """``root/<safe_name(n1)>/<safe_name(n2)><suffix>``, checked to stay inside `root`."""
    path = Path(root).joinpath(*(safe_name(n) for n in names[:-1]), safe_name(names[-1]) + suffix)
    resolved_root = Path(root).resolve()
    if not path.resolve().is_relative_to(resolved_root):  # e.g. a symlink inside root pointing out
        raise UnsafePath(f"{path} leaves {root}")
    return path
