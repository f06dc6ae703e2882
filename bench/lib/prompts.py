"""Benchmark prompts: held-out Python standard-library code (files the demo pair never trained on).

A prompt is the ~`context` tokens of a held-out file that end just after a `def ...:` line, so the
model continues a function body. Same held-out rule as export/training/train_demo.py: crc32(path) % 50 == 0.
"""
from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

PROSE = [
    "The quick brown fox jumps over the lazy dog. This sentence is often used to",
    "In the beginning of the project, the team decided that every benchmark would",
    "Speculative decoding works by letting a small model guess several tokens ahead, and",
    "The documentation describes how to install the package and how to",
]


def held_out_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts
             and zlib.crc32(str(p.relative_to(root)).encode()) % 50 == 0]
    return files


def code_prompts(tokenizer, n: int = 20, context: int = 96) -> list[str]:
    """n prompts, at most one per held-out file, each ending after a `def` line."""
    out = []
    for path in held_out_files():
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i >= 8:
                start = i
                while start > 0 and len(tokenizer.encode("".join(lines[start - 1:i + 1]))) <= context:
                    start -= 1
                out.append("".join(lines[start:i + 1]))
                break
        if len(out) == n:
            break
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} code prompts in the held-out standard library files")
    return out
