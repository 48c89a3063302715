"""The fenced code blocks of README.md and docs/*.md, and how each is checked (docs/README
"Conventions" in tests/test_docs.py).

An info string is ``LANG [MODE] [key=value ...]``:

- ``python run`` / ``bash run``: run as a program (``torchrun=N``: under ``torchrun
  --nproc-per-node N``), in a fresh folder where the repository's ``configs/``,
  ``integrations/`` and ``benchmarks/`` are linked, with the venv's ``bin`` first on ``PATH``;
- ``LANG excerpt``: a fragment shown for reading; every line of it occurs in a ``run`` block or
  in a file under ``integrations/`` or ``configs/``;
- ``json`` / ``yaml``: parsed; a ``selected_zero2`` mapping in them is a valid config;
- ``text``: not code (folder layouts, command synopses); ``text output`` right after a run
  block: what that block prints, checked line by line against its stdout and stderr (a line
  with ``...`` matches any text in its place).
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("configs", "integrations", "benchmarks")
FENCE = re.compile(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.M | re.S)
MODES = {"python": {"run", "excerpt"}, "bash": {"run", "excerpt"}, "json": {"", "excerpt"},
         "yaml": {"", "excerpt"}, "text": {"", "output"}}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    mode: str
    options: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    text: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def digest(self) -> str:
        key = f"{self.lang} {self.mode} {sorted(self.options.items())}\n{self.text}"
        return hashlib.sha256(key.encode()).hexdigest()[:12]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    source = path.read_text()
    found = []
    for m in FENCE.finditer(source):
        words = m.group(2).split()
        lang = words[0] if words else ""
        rest = words[1:]
        mode = rest[0] if rest and "=" not in rest[0] else ""
        options = dict(w.split("=", 1) for w in rest if "=" in w)
        text = textwrap.dedent(m.group(3))
        found.append(Block(path, source.count("\n", 0, m.start()) + 1, lang, mode, options, text))
    return found


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


def expected_output(run: Block) -> Block | None:
    """The ``text output`` block that follows ``run`` in its page, if the next block is one."""
    page = blocks(run.path)
    i = next(i for i, b in enumerate(page) if b.line == run.line)
    nxt = page[i + 1] if i + 1 < len(page) else None
    return nxt if nxt is not None and nxt.lang == "text" and nxt.mode == "output" else None


def output_matches(expected: str, printed: str) -> list[str]:
    """The lines of ``expected`` that occur in no line of ``printed``."""
    lines = [x.strip() for x in printed.splitlines()]
    missing = []
    for want in (x.strip() for x in expected.splitlines()):
        if not want:
            continue
        pattern = re.compile(".*".join(re.escape(p) for p in re.split(r"\.\.\.|…", want)) + "$")
        if not any(pattern.match(x) for x in lines):
            missing.append(want)
    return missing


def unique_runs() -> list[Block]:
    seen, runs = set(), []
    for b in all_blocks():
        if b.mode == "run" and b.digest not in seen:
            seen.add(b.digest)
            runs.append(b)
    return runs


def normalized(line: str) -> str:
    """A line without its indentation and its trailing ``# comment`` (a ``#`` after a space)."""
    return re.sub(r"(^|\s)#(?!!).*$", "", line).strip()


def known_lines() -> set[str]:
    """Every normalized line of the run blocks and of the repository's example files."""
    lines = {normalized(x) for b in all_blocks() if b.mode == "run" for x in b.text.splitlines()}
    for folder in ("integrations", "configs"):
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and f.suffix in {".py", ".json", ".yaml", ".yml", ".sh"}:
                lines |= {normalized(x) for x in f.read_text().splitlines()}
    return lines - {""}
