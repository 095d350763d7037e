"""Every benchmark script starts: its imports resolve and its options parse (`--help`) with what the README's test
command installs, so a renamed function or a moved module breaks a test here rather than the next measurement. And
every script backs a figure a reader can find: its docstring names the doc anchor of the figure and the command that
reproduces it, and the performance page stays a short page of current figures whose every results file exists."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
RESULTS = ROOT / "benchmarks" / "results"
BACKS = re.compile(r"Backs:\s+(?P<doc>[\w./-]+\.md)#(?P<anchor>[\w-]+)\s+\(.+\)\.\s+Reproduce:\s+\S.*\.\s*$", re.DOTALL)


def anchors(doc: Path) -> set[str]:
    """The ids a link's #fragment can reach in a markdown file: explicit `<a id="...">` and GitHub's heading slugs."""
    text = doc.read_text()
    ids = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE):
        ids.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return ids


def links(doc: Path) -> list[str]:
    """The targets of a markdown file's relative links, `[text](target)`, without fragments and web addresses."""
    targets = re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
    return [t for t in targets if not t.startswith(("http://", "https://", "#", "mailto:"))]


def test_benchmarks_found():
    assert len(BENCHMARKS) >= 10, [p.name for p in BENCHMARKS]


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_starts(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_each_benchmark_names_the_figure_it_backs(script):
    """The docstring's first paragraph ends `Backs: DOC#ANCHOR (figure). Reproduce: COMMAND.`, and ANCHOR is in DOC:
    a script that backs no current figure goes (git history keeps it)."""
    doc = ast.get_docstring(ast.parse(script.read_text()), clean=True) or ""
    first = doc.split("\n\n")[0]
    found = BACKS.search(first)
    assert found, (
        f"{script.name}: the docstring's first paragraph must end with 'Backs: DOC#ANCHOR (...). Reproduce: ...'"
    )
    assert "Reproduce:" in doc
    target = ROOT / found["doc"]
    assert target.is_file(), f"{script.name} backs {found['doc']}, which does not exist"
    assert found["anchor"] in anchors(target), f"{script.name}: no anchor #{found['anchor']} in {found['doc']}"


def test_the_anchor_reader_finds_ids_and_headings(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text('# A page\n\n<a id="noise-floor"></a>**x**\n\n### Multi-turn chat: the prefix cache\n')
    assert anchors(doc) == {"a-page", "noise-floor", "multi-turn-chat-the-prefix-cache"}
    assert links(tmp_path / "d.md") == []


def test_the_performance_page_is_short_and_every_figure_links_its_data():
    page = ROOT / "docs" / "performance.md"
    lines = page.read_text().splitlines()
    assert len(lines) <= 400, f"docs/performance.md has {len(lines)} lines: current figures only, runs in INDEX.md"
    linked = [t for t in links(page) if "benchmarks/results/" in t]
    assert any(t.endswith("benchmarks/results/INDEX.md") for t in linked), "the page links benchmarks/results/INDEX.md"
    assert len(linked) >= 20, linked
    missing = [t for t in linked if not (page.parent / t.split("#")[0]).exists()]
    assert missing == [], f"docs/performance.md links results files that do not exist: {missing}"
    internal = set(re.findall(r"\]\(#([\w-]+)\)", page.read_text()))
    assert internal <= anchors(page), internal - anchors(page)

    index = RESULTS / "INDEX.md"
    targets = links(index)
    assert len(targets) >= 40, targets

    def reaches(target: str) -> bool:
        path, _, fragment = target.partition("#")
        resolved = index.parent / path
        if not resolved.exists():
            return False
        return not fragment or resolved.suffix != ".md" or fragment in anchors(resolved)

    missing = [t for t in targets if not reaches(t)]
    assert missing == [], f"benchmarks/results/INDEX.md links what does not exist: {missing}"
    runs = sorted((RESULTS / "runs").glob("*.md"))
    unindexed = [r.name for r in runs if f"runs/{r.name}" not in targets]
    assert unindexed == [], f"runs without a line in INDEX.md: {unindexed}"
