"""The files a state directory keeps (stored responses, KV blocks), listed for the budgets that delete the least
recently written first."""

from __future__ import annotations

import os
import re
from pathlib import Path


def oldest_first(directory: Path, pattern: re.Pattern[str], suffix: str) -> list[tuple[str, int]]:
    """(name without ``suffix``, bytes) of the files of ``directory`` named ``<pattern><suffix>``, least recently
    written first; a file gone while listed is left out, and so is any other name (temporary files among them)."""
    found = []
    for entry in os.scandir(directory):
        stem = entry.name[:-len(suffix)] if entry.name.endswith(suffix) else ""
        if not pattern.fullmatch(stem):
            continue
        try:
            st = entry.stat()
        except OSError:
            continue
        found.append((st.st_mtime_ns, stem, st.st_size))
    return [(stem, size) for _, stem, size in sorted(found)]
