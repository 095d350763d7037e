"""The draft's n-gram prior (models/draft_ngram.py): the counts, the re-weighted greedy choice, the file, and lossless
decoding with the shipped prior on the real SmolLM2-135M and the shipped draft."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.draft_ngram import FILE, RequestCounts, read_draft_ngram, write_draft_ngram
from trtllm_dflash.resources import package_dir

SHIPPED = package_dir("drafts") / "smollm2-135m"
ANSWERS = [[1, 2, 3], [1, 2, 4], [5, 2, 3]]


@pytest.fixture()
def prior(tmp_path):
    stats = write_draft_ngram(tmp_path / FILE, ANSWERS, 10, {"test": True})
    assert stats["entries"] == {"1": 4, "2": 3, "3": 0} and stats["answer_tokens"] == 9
    assert not list(tmp_path.glob(".*"))  # written through a temporary sibling, nothing left behind
    return read_draft_ngram(tmp_path, 10)


def test_probabilities_interpolate_the_longer_context_with_the_shorter(prior):
    # after 2: 3 twice, 4 once. After (1, 2): 3 and 4 once each, trusted with weight 2 / (2 + 3 * 2) = 0.25; (7, 1, 2)
    # never seen: the shorter contexts alone
    tokens, p = prior.probabilities([7, 1, 2])
    assert dict(zip(tokens.tolist(), p.round(6).tolist())) == {3: 0.625, 4: 0.375}
    tokens, p = prior.probabilities([5, 2])  # (5, 2): 3 once, weight 1 / (1 + 3) = 0.25
    assert dict(zip(tokens.tolist(), p.round(6).tolist())) == {3: 0.75, 4: 0.25}
    tokens, p = prior.probabilities([9, 2])  # (9, 2) never seen: the bigram alone
    assert dict(zip(tokens.tolist(), p.round(6).tolist())) == {3: round(2 / 3, 6), 4: round(1 / 3, 6)}
    assert prior.probabilities([3]) is None  # nothing followed 3


def test_greedy_guesses_follow_the_prior_only_against_a_close_draft(prior):
    logits = torch.zeros(2, 10)
    logits[0, 4] = (
        0.1  # the draft prefers 4 after (1, 2) a little; the prior favours 3 by 0.75 * (log(1 + 6250) - log(1 + 3750)) = 0.38
    )
    logits[1, 9] = 1.0  # after 3 nothing was seen: the draft's own choice stands
    assert prior.greedy(logits, RequestCounts([1, 2]), None) == [3, 9]
    logits[0, 4] = 3.0  # a draft this sure keeps its guess, and the next slot is conditioned on it
    assert prior.greedy(logits, RequestCounts([1, 2]), None) == [4, 9]


def test_the_requests_own_counts_take_their_share(prior):
    history = RequestCounts([1, 2, 4, 1, 2])
    tokens, p = history.probabilities([1, 2])  # its longest context seen: (1, 2), followed by 4 once
    assert tokens.tolist() == [4] and p.tolist() == [1.0]
    tokens, p = history.probabilities([7, 2])  # (7, 2) never occurred in it: what followed 2
    assert tokens.tolist() == [4] and p.tolist() == [1.0]
    assert history.probabilities([3]) is None
    tokens, p = prior.mixed([1, 2], history)  # the answers' 0.625 / 0.375, then half of it from the request's own
    assert prior.own == 0.5 and dict(zip(tokens.tolist(), p.round(6).tolist())) == {3: 0.3125, 4: 0.6875}
    # after (5, 6) the answers saw nothing, the request saw 9: its share alone outweighs a draft that prefers 4 a little
    logits = torch.zeros(1, 10)
    logits[0, 4] = 0.1
    assert prior.greedy(logits, RequestCounts([5, 6, 9, 5, 6]), None) == [9]
    prior.own = 0.0
    assert prior.greedy(logits, RequestCounts([5, 6, 9, 5, 6]), None) == [4]
    history.extend([3])  # committed tokens count as they come
    tokens, p = history.probabilities([1, 2])
    assert tokens.tolist() == [3, 4] and p.tolist() == [0.5, 0.5]


def test_a_first_format_file_without_the_requests_share_reads_as_the_answers_alone(tmp_path):
    write_draft_ngram(tmp_path / FILE, ANSWERS, 10, {})
    with np.load(tmp_path / FILE) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays["meta"]))
    del meta["own"]
    np.savez(tmp_path / FILE, **(arrays | {"meta": np.array(json.dumps(meta))}))
    assert read_draft_ngram(tmp_path, 10).own == 0.0
    np.savez(tmp_path / FILE, **(arrays | {"meta": np.array(json.dumps(meta | {"own": 1.5}))}))  # not a share
    with pytest.raises(DFlashError, match="not a draft n-gram file"):
        read_draft_ngram(tmp_path, 10)


def test_with_a_draft_vocabulary_guesses_are_its_columns(prior):
    vocab = torch.tensor([9, 4, 3])  # column 0 is token 9, 1 is 4, 2 is 3
    prior.use_vocab(vocab)
    logits = torch.zeros(1, 3)
    logits[0, 1] = 0.1
    assert prior.greedy(logits, RequestCounts([1, 2]), vocab) == [3]
    prior.use_vocab(torch.tensor([9, 4]))  # 3 outside the vocabulary: never guessed, whatever the prior says
    assert prior.greedy(logits[:, :2], RequestCounts([1, 2]), torch.tensor([9, 4])) == [4]


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.write_text("not a zip"), "not a draft n-gram file"),
        (lambda p: np.savez(p, meta=np.array(json.dumps({"format": 2}))), "not a draft n-gram file"),
        (
            lambda p: np.savez(
                p,
                **{
                    "meta": np.array(
                        json.dumps({"format": 1, "vocab_rows": 10, "weight": 0.5, "floor": 1e-4, "smoothing": 3})
                    )
                },
            ),
            "not a draft n-gram file",
        ),
    ],
)
def test_a_bad_ngram_file_is_one_clear_error(tmp_path, make, words):
    with open(tmp_path / FILE, "wb") as f:
        f.write(b"")
    make(tmp_path / FILE)
    with pytest.raises(DFlashError, match=words):
        read_draft_ngram(tmp_path, 10)
    assert read_draft_ngram(tmp_path / "missing", 10) is None


def test_an_ngram_file_of_another_vocabulary_is_refused(tmp_path):
    write_draft_ngram(tmp_path / FILE, ANSWERS, 10, {})
    with pytest.raises(DFlashError, match="another target"):
        read_draft_ngram(tmp_path, 49152)


def test_the_shipped_draft_has_a_prior_the_engine_uses():
    engine = DFlashEngine.load("smollm2-135m", dtype="fp32", progress=lambda m: None)
    assert engine.draft.ngram is not None and engine.draft.ngram.columns is not None  # mapped onto the draft vocabulary
    off = DFlashEngine.load("smollm2-135m", dtype="fp32", draft_ngram=False, progress=lambda m: None)
    assert off.draft.ngram is None


@pytest.mark.parametrize(
    "prompt",
    [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did she sell altogether?",
        "What are three simple habits that help people sleep better?",
    ],
)
def test_decoding_with_the_prior_is_lossless_and_changes_the_guesses(prompt):
    """fp32 greedy with the prior equals decoding without a draft, token for token; without the prior the same
    engine accepts a different number of guesses, so the prior really chose some of them."""
    engine = DFlashEngine.load("smollm2-135m", dtype="fp32", speculation="fixed", lookup=False, progress=lambda m: None)
    with_prior = engine.generate(prompt, max_new_tokens=64)
    assert with_prior.token_ids == engine.generate(prompt, max_new_tokens=64, block_size=1).token_ids
    prior, engine.draft.ngram = engine.draft.ngram, None
    without = engine.generate(prompt, max_new_tokens=64)
    engine.draft.ngram = prior
    assert without.token_ids == with_prior.token_ids
    assert without.stats.accepted_per_position != with_prior.stats.accepted_per_position


def test_a_bad_ngram_file_fails_the_build_in_one_sentence(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(SHIPPED, draft)
    (draft / FILE).write_text("not a zip")
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
    assert done.returncode == 2 and "not a draft n-gram file" in done.stderr and "Traceback" not in done.stderr, (
        done.stderr
    )
    assert not (tmp_path / "out").exists()
