"""`trtdflash quickstart` as a user runs it: two real builds and servers, and a closing table whose figures come
from real requests (fp32, so DFlash's text must equal the text of the build without a draft)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_dflash.clients.quickstart import demo_prompts

pytestmark = pytest.mark.slow  # two real builds and servers (see pyproject.toml's markers)

TRTDFLASH = str(Path(sys.executable).parent / "trtdflash")
ROW = re.compile(r"^(chat|math|code)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)-([\d.]+)x\s+([\d.]+)\s+(.+)$")


def test_quickstart_streams_then_compares_with_the_same_build_without_a_draft(tmp_path):
    out = subprocess.run(
        [
            TRTDFLASH,
            "quickstart",
            "--output",
            str(tmp_path / "qs"),
            "--dtype",
            "fp32",
            "--max-tokens",
            "16",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m[1]: m for line in out.stdout.splitlines() if (m := ROW.match(line.strip()))}
    assert set(rows) == {"chat", "math", "code"}, out.stdout
    for kind, m in rows.items():
        dflash, baseline, speedup, slowest, fastest, acceptance, same = *map(float, m.groups()[1:7]), m[8]
        assert dflash > 0 and baseline > 0 and abs(speedup - dflash / baseline) < 0.01 + 0.01 * speedup
        assert 0 < slowest <= speedup + 0.01 and speedup <= fastest + 0.01, (
            kind,
            m[0],
        )  # the pooled figure lies between its prompts'
        assert acceptance >= 1.0 and same == "yes", (kind, m[0])  # greedy fp32: lossless across the two servers
    assert "(fp32, batch 1, greedy, 3 prompts a kind x 2 rounds" in out.stdout
    streamed = next(text for kind, text in demo_prompts() if kind == "code")  # by default the first code prompt
    assert f"--prompt {shlex.quote(streamed)} --max-tokens 16" in out.stderr, out.stderr[-2000:]
    twin = json.loads((tmp_path / "qs-no-draft" / "manifest.json").read_text())
    assert twin["options"]["no_draft"] is True and twin["options"]["dtype"] == "fp32"


def test_the_demo_prompts_are_three_of_each_kind_none_from_the_training_data():
    from trtllm_dflash.clients.quickstart import CODE_STUBS
    from trtllm_dflash.data import answers_records, gsm8k_records, magpie_records

    prompts = demo_prompts()
    assert [kind for kind, _ in prompts] == ["chat", "math", "code"] * 3 and len({text for _, text in prompts}) == 9
    norm = lambda text: " ".join(text.lower().split())  # noqa: E731
    trained_chat = {norm(r["question"]) for r in magpie_records()}
    trained_math = {norm(r["question"]) for r in gsm8k_records()}
    trained_code = {
        r["key"].rsplit(":", 1)[-1] for r in answers_records() if r["key"].startswith(("code:", "docstring:"))
    }
    for kind, text in prompts:
        assert norm(text) not in (trained_chat if kind == "chat" else trained_math if kind == "math" else set()), text
    assert not {stub.split("(")[0].removeprefix("def ") for stub in CODE_STUBS} & trained_code
