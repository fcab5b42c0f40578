"""Atomic checkpoints: a crash mid-write never corrupts the last good checkpoint."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_atomic(obj: Any, path: str | Path) -> None:
    """torch.save to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by save_atomic, with a clear error when it is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; was the run started with this out_dir/name?")
    return torch.load(path, map_location="cpu", weights_only=False)
