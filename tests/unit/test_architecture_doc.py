"""docs/ARCHITECTURE.md's module map is the newcomer's first page: it must name
every module of the client, the daemon and the bench, and only modules that exist,
with line counts close to the truth (a map that drifted says the wrong thing owns
the code)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ARCHITECTURE.md"
PACKAGES = ("client/relayd_client", "relayd", "relayd_bench")
# A stated line count may lag the module by this much before the map is stale.
SLACK_LINES, SLACK_FRACTION = 20, 0.10


def _rows() -> list[tuple[str, list[str], str]]:
    """(directory of the section, the row's module names, its line-count cell)."""
    rows = []
    base = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"#{3,4} .*`([\w/]+/)`", line)
        if heading:
            base = heading.group(1)
        elif line.startswith("## "):
            base = None
        elif base and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((base, re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return rows


def _lines(path: Path) -> int:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return sum(len(f.read_text().splitlines()) for f in files)


def test_the_map_parses() -> None:
    rows = _rows()
    assert len(rows) > 100, "the module map's tables were not found"
    assert {base for base, _, _ in rows} >= {f"{p}/" for p in PACKAGES}


def test_every_module_named_exists_with_about_its_line_count() -> None:
    wrong = []
    for base, names, counts in _rows():
        if counts == "generated":
            continue
        numbers = [int(n) for n in re.findall(r"\d+", counts)]
        assert len(numbers) == len(names), f"{names}: {counts!r} is not one count per module"
        for name, stated in zip(names, numbers, strict=True):
            path = REPO / base / name
            assert path.exists(), f"the map names {base}{name}, which does not exist"
            real = _lines(path)
            if abs(real - stated) > max(SLACK_LINES, SLACK_FRACTION * real):
                wrong.append(f"{base}{name}: map says {stated} lines, it has {real}")
    assert wrong == []


def test_every_module_is_in_the_map() -> None:
    named = {(base + name).rstrip("/") for base, names, _ in _rows() for name in names}
    listed = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = [
        path
        for path in listed
        if path.endswith(".py")
        and not path.endswith(("/__init__.py", "/__main__.py"))
        and "_pb2" not in path
        and not any(path == n or path.startswith(n + "/") for n in named)
    ]
    assert missing == [], "modules the map does not name"
