"""House rules, held as tests: each command option declared once, a README that stays a front door, no dates in the
package's source (dates belong to results files and the history, not to code)."""

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "trtllm_dflash"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def repeated_click_options(source: str) -> dict[str, int]:
    """Each `click.option(...)` call written more than once in `source`, with how many times."""
    calls = collections.Counter(
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "click.option"
    )
    return {call: n for call, n in calls.items() if n > 1}


def test_no_click_option_is_declared_twice():
    """An option two commands share is one decorator in cli.py (model_options, dtype_option, ...), not two copies."""
    repeated = repeated_click_options((PACKAGE / "cli.py").read_text())
    assert sum(repeated.values()) == 0, [call[:90] for call in repeated]


def test_the_repeat_finder_finds_a_repeat():
    source = 'a = click.option("--x", default=1)\nb = click.option("--x", default=1)\nc = click.option("--y")\n'
    assert repeated_click_options(source) == {"click.option('--x', default=1)": 2}


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ and link it"


def test_no_package_source_file_carries_a_date():
    data = PACKAGE / "data"
    dated = [
        f"{path.relative_to(ROOT)}:{number}: {match.group()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.suffix in (".py", ".cpp", ".h") and path.is_file() and data not in path.parents
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in DATE.finditer(line)
    ]
    assert dated == [], "dates in package source (keep them in results files and benchmarks/HISTORY.md):\n" + "\n".join(
        dated
    )
