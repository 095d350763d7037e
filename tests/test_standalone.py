"""The project stands alone: nothing reaches outside the repository, and an installed wheel works from anywhere."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from trtllm_dflash.data import GSM8K_HOLDOUT, gsm8k_records

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _tracked(*suffixes) -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.splitlines() if f.endswith(suffixes) and (ROOT / f).is_file()]


def test_no_code_reaches_outside_the_repository():
    """No path to a sibling folder, and no `Path(__file__).parents[k]` that climbs above the repository root."""
    climb = re.compile(
        r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent(?!s))+)|Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]"
    )
    offenders = []
    for f in _tracked(".py", ".sh", ".toml", ".pbtxt", ".yaml", ".yml"):
        if f == Path(__file__).resolve():
            continue  # this file spells out the patterns
        text = f.read_text(errors="replace")
        if re.search(r"\.\./shared|[\"']shared[\"']\s*/|/\s*[\"']shared[\"']", text):
            offenders.append(f"{f.relative_to(ROOT)}: names the shared folder beside the repository")
        for m in climb.finditer(text):
            up = m.group(1).count(".parent") - 1 if m.group(1) else int(m.group(2))  # parents[k] = k+1 levels up
            reached = f.parents[up] if up < len(f.parents) else Path("/")
            if not reached.is_relative_to(ROOT):
                offenders.append(f"{f.relative_to(ROOT)}: {m.group(0)} leaves the repository")
    assert not offenders, offenders


def test_every_package_is_listed_for_the_wheel():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "trtllm_dflash").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    found |= {name for name, folder in mapped.items() if (ROOT / folder / "__init__.py").is_file()}
    assert found <= listed, f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def test_gsm8k_ships_with_the_package():
    train, held_out = gsm8k_records(), gsm8k_records(holdout=True)
    assert len(held_out) == GSM8K_HOLDOUT and len(train) + len(held_out) == 7473  # GSM8K's train split
    assert all(r["question"] and "####" in r["answer"] for r in train + held_out)
    assert not {r["question"] for r in held_out} & {r["question"] for r in train[-50:]}


@pytest.mark.slow
def test_wheel_carries_everything_and_works_outside_the_source_tree(tmp_path):
    """Build the wheel, unpack it into an empty folder and use it from `/`: templates, recipes, draft and data
    must come from the installed package, not from this checkout."""
    wheel_dir = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheel_dir.glob("trtllm_dflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every tracked file of the package and of the folders mapped into it ships (a missing one degrades silently)
    tracked = subprocess.run(
        ["git", "ls-files", "trtllm_dflash", "triton_repo", "build_configs", "plugins"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    expected = {path if path.startswith("trtllm_dflash/") else f"trtllm_dflash/{path}" for path in tracked}
    assert "trtllm_dflash/drafts/smollm2-135m/draft_ngram.npz" in expected and len(expected) > 100
    assert sorted(expected - names) == []
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import trtllm_dflash, pathlib; from trtllm_dflash.serving.repository import TEMPLATE_DIR, template_files; "
        "from trtllm_dflash.resolve import resolve_draft; from trtllm_dflash.data import gsm8k_records; "
        "assert pathlib.Path(trtllm_dflash.__file__).is_relative_to(SITE), trtllm_dflash.__file__; "
        "assert TEMPLATE_DIR.is_relative_to(SITE) and template_files(('ensemble',)), TEMPLATE_DIR; "
        "assert resolve_draft(None, 'smollm2-135m').is_relative_to(SITE); "
        "assert len(gsm8k_records()) == 7273; from trtllm_dflash.data import magpie_records; assert magpie_records(); from trtllm_dflash.deploy.recipes import load_recipe, recipes_root; "
        "assert recipes_root().is_relative_to(SITE) and load_recipe('gpt-oss-120b').num_gpus == 8; print('ok')"
    ).replace("SITE", repr(str(site)))
    r = subprocess.run(
        [sys.executable, "-c", probe],
        cwd="/",
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
