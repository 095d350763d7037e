"""Draft vocabularies (models/draft_vocab.py): the file, the command that writes it, and lossless decoding with it on
the real SmolLM2-135M and the shipped draft."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.draft_ngram import FILE as NGRAM_FILE
from trtllm_dflash.models.draft_vocab import FILE, rank_tokens, read_draft_vocab, write_draft_vocab
from trtllm_dflash.resources import package_dir

SHIPPED = package_dir("drafts") / "smollm2-135m"


def test_ranking_is_by_count_then_id_and_coverage_is_the_kept_share(tmp_path):
    ranked = rank_tokens([[5, 5, 7, 9], [7, 5, 2], [9]])
    assert ranked == [(5, 3), (7, 2), (9, 2), (2, 1)]
    stats = write_draft_vocab(tmp_path / FILE, ranked, 2, 10, {"test": True})
    assert stats["coverage"] == 5 / 8 and stats["size"] == 2 and stats["answer_tokens"] == 8
    assert read_draft_vocab(tmp_path, 10).tolist() == [5, 7]
    stats = write_draft_vocab(
        tmp_path / FILE, ranked, 6, 10, {"test": True}
    )  # more than seen: unseen ids fill up, in order
    assert read_draft_vocab(tmp_path, 10).tolist() == [5, 7, 9, 2, 0, 1] and stats["coverage"] == 1.0
    assert not list(tmp_path.glob(".*"))  # written through a temporary sibling, nothing left behind
    with pytest.raises(DFlashError, match="between 1 and"):
        write_draft_vocab(tmp_path / FILE, ranked, 11, 10, {})


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json", "not a draft vocabulary"),
        (json.dumps({"format": 1, "token_ids": []}), "not a draft vocabulary"),
        (json.dumps({"format": 2, "token_ids": [1, 2]}), "not a draft vocabulary"),
        (json.dumps({"format": 1, "token_ids": [1, "2"]}), "not a draft vocabulary"),
        (json.dumps({"format": 1, "token_ids": [1, 10]}), "another target"),
        (json.dumps({"format": 1, "token_ids": [1, 1]}), "another target"),
        (json.dumps({"format": 1, "token_ids": [-1]}), "another target"),
    ],
)
def test_a_bad_vocabulary_file_is_one_clear_error(tmp_path, content, words):
    (tmp_path / FILE).write_text(content)
    with pytest.raises(DFlashError, match=words):
        read_draft_vocab(tmp_path, 10)
    assert read_draft_vocab(tmp_path / "missing", 10) is None


@pytest.fixture(scope="module")
def vocab_draft(tmp_path_factory):
    """The shipped draft with a vocabulary written by the real command: 40 tokens from 3 GSM8K answers, small enough
    that the draft often cannot guess the target's token."""
    draft = tmp_path_factory.mktemp("vocab") / "draft"
    shutil.copytree(SHIPPED, draft)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtllm_dflash.cli",
            "draft-vocab",
            "--output",
            str(draft),
            "--size",
            "40",
            "--data",
            "gsm8k",
            "--prompts",
            "3",
            "--max-new-tokens",
            "48",
            "--dtype",
            "fp32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "40 tokens, covering" in done.stdout and "n-grams of" in done.stdout
    return draft


def test_the_command_writes_a_vocabulary_the_engine_uses(vocab_draft):
    card = json.loads((vocab_draft / FILE).read_text())
    assert len(card["token_ids"]) == 40 and card["source"]["data"] == ["gsm8k"] and 0 < card["source"]["coverage"] <= 1
    engine = DFlashEngine.load("smollm2-135m", str(vocab_draft), dtype="fp32", progress=lambda m: None)
    assert engine.draft.vocab_token_ids.tolist() == card["token_ids"]
    ngram = json.loads(str(np.load(vocab_draft / NGRAM_FILE)["meta"]))  # the same answers' n-grams, beside it
    assert ngram["source"]["answer_tokens"] == card["source"]["answer_tokens"] and engine.draft.ngram is not None
    plain = DFlashEngine.load(
        "smollm2-135m", str(vocab_draft), dtype="fp32", draft_vocab=False, progress=lambda m: None
    )
    assert plain.draft.vocab_token_ids is None


@pytest.mark.parametrize(
    "prompt",
    [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did she sell altogether?",
        "Write a haiku about the sea.",
    ],
)
def test_decoding_with_a_draft_vocabulary_is_lossless(vocab_draft, prompt):
    """fp32 greedy with the vocabulary-limited draft equals decoding without a draft, token for token; the draft
    still gets some guesses accepted, so its head really ran."""
    engine = DFlashEngine.load(
        "smollm2-135m", str(vocab_draft), dtype="fp32", speculation="fixed", progress=lambda m: None
    )
    with_vocab = engine.generate(prompt, max_new_tokens=48)
    reference = engine.generate(prompt, max_new_tokens=48, block_size=1)
    assert with_vocab.token_ids == reference.token_ids
    assert with_vocab.stats.drafted_tokens > 0


def test_a_bad_vocabulary_fails_the_build_and_the_engine_in_one_sentence(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(SHIPPED, draft)
    (draft / FILE).write_text(json.dumps({"format": 1, "token_ids": [1, 10**6]}))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtllm_dflash.cli",
            "build",
            "--target",
            "smollm2-135m",
            "--draft",
            str(draft),
            "--output",
            str(tmp_path / "out"),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2 and "another target" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(DFlashError, match="another target"):
        DFlashEngine.load("smollm2-135m", str(draft), dtype="fp32", progress=lambda m: None)
