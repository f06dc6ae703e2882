"""File helpers the contracts share: a file's sha256, a JSON file that must hold an object."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json_object(path: Path, what: str, error: type[Exception]) -> dict:
    """A manifest file as a dict, or one `error` saying why it is not a JSON object (what: "manifest", ...)."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object of {what} fields, got {type(data).__name__}")
    return data
