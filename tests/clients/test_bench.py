"""`trtdflash bench` on bad input: one sentence and exit code 2, before any load is sent (its run against the real
server is in test_serve.py, beside the other served tests)."""

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.clients.bench import table


@pytest.mark.parametrize(
    "args, message",
    [
        (["--url", "127.0.0.1:1"], "Cannot reach Triton at 127.0.0.1:1"),
        (["--concurrency", "1,x"], "give numbers of clients separated by commas"),
        (["--concurrency", "0,2"], "must be positive numbers of clients"),
        (["--concurrency", "4", "--requests", "3"], "must exceed the highest concurrency"),
        (["--url", "a=127.0.0.1:1", "--url", "a=127.0.0.1:2"], "names 'a' twice"),
        (["--url", "=127.0.0.1:1"], "give URL or NAME=URL"),
        (["--url", "http://127.0.0.1:1"], "Cannot reach an OpenAI-compatible server at http://127.0.0.1:1"),
        (["--prompts", "missing.txt"], "no such file"),
        (["--prompts", "empty.txt"], "holds no prompts"),
        (["--prompts", "bad.jsonl"], "line 2: not valid JSON"),
        (["--prompts", "field.jsonl"], 'needs a non-empty "prompt" string'),
        (["--prompts", "latin1.txt"], "is not UTF-8 text"),
    ],
)
def test_bad_input_gets_one_sentence(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"prompt": \n')
    (tmp_path / "field.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output


def test_the_table_gives_the_first_servers_speed_up_over_each_other():
    def level(c, steady, acceptance):
        return {
            "concurrency": c,
            "steady_tokens_per_s": steady,
            "total_tokens_per_s": steady,
            "tokens_per_s_per_user": steady / c,
            "ttft_p50_s": 0.05,
            "ttft_p99_s": 0.1,
            "itl_p50_s": 0.04,
            "acceptance_length_median": acceptance,
            "errors": [],
        }

    text = table(
        {"dflash": [level(1, 45.0, 2.2), level(4, 90.0, 1.6)], "plain": [level(1, 30.0, 1.0), level(4, 100.0, 1.0)]}
    )
    rows = [line.split() for line in text.splitlines() if line[:5].strip().isdigit()]
    assert [(r[0], r[1], r[-1]) for r in rows] == [
        ("1", "dflash", "0"),
        ("1", "plain", "1.50x"),
        ("4", "dflash", "0"),
        ("4", "plain", "0.90x"),
    ]
