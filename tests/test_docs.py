"""Every code block of README.md and docs/ is run, or is an excerpt of one that is, or parses
(tests/_doc_blocks.py says how a block is marked); no link leaves the repository; the
configuration page has one row per ``SelZeroConfig`` field."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from selzero_plugin import SelZeroConfig

from ._doc_blocks import LINKED, MODES, ROOT, Block, all_blocks, expected_output, known_lines, \
    normalized, output_matches, pages, unique_runs
from selzero_plugin.ports import free_port as _free_port

BIN = Path(sys.executable).parent
# [text](target "title"), ![image](target), <https://...>
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)|<(https?://[^>]+)>")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
DEEPSPEED_ONLY = {"group"}  # the DeepSpeed block's own key (docs/deepspeed.md)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    source = re.sub(r"^( *)```.*?^\1```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(source):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_code_block_says_how_it_is_checked():
    bad = [f"{b.where}: ```{b.lang} {b.mode}" for b in all_blocks()
           if b.mode not in MODES.get(b.lang, set())]
    assert not bad, ("blocks whose info string is not one of " +
                     ", ".join(f"{lang} {'|'.join(sorted(m)) or '-'}" for lang, m in MODES.items())
                     + f" (tests/_doc_blocks.py): {bad}")


def test_docs_pages_exist():
    names = {p.name for p in pages()}
    need = {"deepspeed.md", "accelerate.md", "trainer.md", "torch.md", "configuration.md",
            "checkpoints.md", "semantics.md", "limits.md", "performance.md", "faq.md"}
    assert need <= names, f"missing docs/ pages: {sorted(need - names)}"
    for p in pages():
        if p.parent.name == "docs":
            assert any(b.mode == "run" for b in _page_blocks(p)), f"{p.name}: no runnable example"


def _page_blocks(path: Path) -> list[Block]:
    return [b for b in all_blocks() if b.path == path]


def test_multi_process_blocks_say_how_to_launch_them():
    """Review finding: a copied `torchrun=2` block run with `python` fails; the tag is invisible
    on GitHub, so the block's first line says the command."""
    bad = [b.where for b in all_blocks() if b.mode == "run" and "torchrun" in b.options
           and not b.text.startswith(f"# torchrun --nproc-per-node {b.options['torchrun']} ")]
    assert not bad, f"blocks whose first line is not `# torchrun --nproc-per-node N FILE.py`: {bad}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines, at most 200"


def test_no_link_leaves_the_repository():
    bad = []
    for page in pages():
        source = re.sub(r"^( *)```.*?^\1```", "", page.read_text(), flags=re.M | re.S)
        source = re.sub(r"`[^`\n]*`", "", source)
        bad += [f"{page.name}: {u} (outside the repository)"  # anywhere: bare, in links,
                for u in re.findall(r"(?:https?://|www\.)[^\s)>\]\"']+", source)]  # href
        targets = [m.group(1) or m.group(2) for m in LINK.finditer(source)]
        targets += re.findall(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", source, re.M)  # [ref]: target
        targets += re.findall(r"""href=["']([^"']+)["']""", source)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                bad.append(f"{page.name}: {target} (outside the repository)")
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{page.name}: {target} (outside the repository)")
            elif not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading in {dest.name})")
    assert not bad, bad


def test_excerpts_are_lines_of_blocks_that_run():
    known = known_lines()
    bad = []
    for b in all_blocks():
        if b.mode != "excerpt":
            continue
        missing = [x for x in b.text.splitlines() if normalized(x) and normalized(x) not in known
                   and normalized(x) not in {"...", "…"}]
        if missing:
            bad.append(f"{b.where}: {missing[:3]}")
    assert not bad, ("excerpt lines that occur in no run block, integrations/ or configs/ file: "
                     f"{bad}")


def _parsed(b: Block) -> object:
    if b.lang == "yaml":
        return yaml.safe_load(b.text)
    try:
        return json.loads(b.text)
    except json.JSONDecodeError:
        return json.loads("{" + b.text + "}")


def _entries(value: object):
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "selected_zero2" and isinstance(v, dict):
                yield v
            yield from _entries(v)


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.lang in {"json", "yaml"}],
                         ids=lambda b: b.where)
def test_config_blocks_parse_and_are_valid(block):
    value = _parsed(block)
    for entry in _entries(value):
        SelZeroConfig.from_dict({k: v for k, v in entry.items() if k not in DEEPSPEED_ONLY})


def test_configuration_page_has_one_row_per_field():
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = re.search(r"^\| field \| type \| default \| meaning \| example \|\n\|[-| :]+\|\n"
                      r"((?:\|.*\|\n?)+)", page, re.M)
    assert table, "docs/configuration.md: the table `| field | type | default | meaning | example |`"
    rows = [re.match(r"\| *`(\w+)` *\|", r) for r in table.group(1).splitlines()]
    names = [m.group(1) if m else None for m in rows]
    fields = [f.name for f in dataclasses.fields(SelZeroConfig)]
    assert None not in names, "every row starts with a field name in backticks"
    assert names == fields, (f"fields without a row: {sorted(set(fields) - set(names))}; rows "
                             f"that name no field: {sorted(set(names) - set(fields))}; order: "
                             "that of SelZeroConfig")


def run_block(block: Block, folder: Path, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Runs a ``run`` block in ``folder`` the way a user who copied it would."""
    for name in LINKED:
        if not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if block.lang == "bash":
        (folder / "block.sh").write_text(block.text)
        command = ["bash", "-euo", "pipefail", "block.sh"]
    else:
        (folder / "block.py").write_text(block.text)
        n = block.options.get("torchrun")
        command = [sys.executable, "block.py"] if n is None else \
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
             "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "block.py"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _runs() -> list[Block]:
    """Every run block once; the README's DDP example runs 8 times in test_exit_codes.py
    (exit 0, no launch-unit warning), not again here (suite time)."""
    from .test_exit_codes import README_EXAMPLE

    return [b for b in unique_runs()
            if not (b.path.name == "README.md" and b.text.startswith(README_EXAMPLE))]


@pytest.mark.e2e
@pytest.mark.parametrize("block", _runs(), ids=lambda b: b.where)
def test_run_block(block, tmp_path):
    result = run_block(block, tmp_path)
    assert result.returncode == 0 and "terminate called" not in result.stderr, (
        f"{block.where} exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-5000:]}")
    # a copied example must not greet its user with the launch-unit warning (docs/faq.md)
    assert "launch at the end of backward" not in result.stderr, (
        f"{block.where} warns about launch units:\n{result.stderr[-3000:]}")
    shown = expected_output(block)
    if shown is not None:  # the page shows what it prints: it must still print that
        missing = output_matches(shown.text, result.stdout + "\n" + result.stderr)
        assert not missing, (f"{shown.where} shows lines {block.where} no longer prints: "
                             f"{missing[:5]}\n--- stdout\n{result.stdout[-3000:]}")


def test_output_blocks_follow_a_run_block():
    bad = []
    for b in all_blocks():
        if b.mode == "output":
            page = [x for x in all_blocks() if x.path == b.path]
            prev = page[page.index(b) - 1] if page.index(b) else None
            if prev is None or prev.mode != "run":
                bad.append(b.where)
    assert not bad, f"`text output` blocks that follow no run block: {bad}"


def test_shown_output_is_compared_line_by_line():
    """Review finding: a block whose documented error no longer happened still passed."""
    printed = "ConfigError: reduction='avg': expected one of 'mean'\nsteps 4 in 1.3 s\n"
    assert output_matches("ConfigError: reduction='avg': expected one of 'mean'\n"
                          "steps 4 in ... s", printed) == []
    assert output_matches("ConfigError: reduction='sum' is fine", printed) == \
        ["ConfigError: reduction='sum' is fine"]
