"""The manual's links resolve, and the README's first screen holds the commands CI runs.

Every relative link (and image) in README.md, docs/*.md and bench/results/NOTES.md must name a file or
folder that exists; a `#anchor` into a markdown file must name one of its headings (GitHub's slugs).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "NOTES.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def strip_code(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    h = re.sub(r"<[^>]+>", "", h).replace("`", "").replace("*", "").lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for h in HEADING.findall(text):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for target in LINK.findall(strip_code(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(root)}: {target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.is_file(), f"{page} is missing"
    assert broken_links(page) == []


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [gone](missing.json) [bad](there.md#nope)\n"
                    "`[in code](not-checked.md)`\n```\n[fenced](not-checked-either.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["page.md: missing.json (no such file)",
                                                 "page.md: there.md#nope (no heading #nope in there.md)"]


def test_slugs_follow_github():
    assert slug("Where a round's time goes: `edgespec profile`") == "where-a-rounds-time-goes-edgespec-profile"
    assert slug("vla.json and vla-run1.json") == "vlajson-and-vla-run1json"
    assert slug("GPU: CUDA and TensorRT") == "gpu-cuda-and-tensorrt"


def ci_test_command() -> str:
    """The command .ci/run runs: its last non-comment line, the README's test command."""
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return lines[-1].strip()


def test_readme_first_screen_has_both_commands():
    head = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40]
    test_cmd = ci_test_command()
    assert test_cmd.endswith("python -m pytest -q"), test_cmd
    assert test_cmd in [ln.strip() for ln in head], "the README's first 40 lines must hold .ci/run's test command"
    # the demo command: the same environment setup as the test command, ending in `edgespec demo`
    setup = test_cmd[test_cmd.index("python3 -m venv"):test_cmd.index("pip install -e")]
    demo = [ln for ln in head if ln.startswith(setup) and ln.rstrip().endswith("&& edgespec demo")]
    assert demo, "the README's first 40 lines must hold the demo command"
    shlex.split(demo[0])  # well-formed shell
