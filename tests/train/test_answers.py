"""The packed answers (train/answers.py): made resumably in shards, packed reproducibly, and used by the data phase
only for the prompt and the target that wrote them."""

import gzip
import json

import pytest
import torch

from trtllm_dflash.data import answers_card, answers_records
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.train.answers import corpus_prompts, generate_answers, pack
from trtllm_dflash.train.data import prepare_data
from trtllm_dflash.train.records import greedy_batch, prompt_hash, target_fingerprint
from trtllm_dflash.train.sources import interleave, known_answers, load_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_sources_order_does_not_depend_on_the_mix():
    """So the first prompts of a source, answered alone, are the ones a data phase over any mix takes first."""
    alone = load_prompts(("gsm8k",))[:20]
    mixed = [p for p in load_prompts(("magpie", "instruct", "gsm8k")) if p[0].startswith("gsm8k:")][:20]
    assert alone == mixed and load_prompts(("gsm8k",), seed=1)[:20] != alone
    assert corpus_prompts(["gsm8k:3", "instruct:2"]) == load_prompts(("gsm8k",))[:3] + load_prompts(("instruct",))[:2]
    assert load_prompts(("gsm8k:3", "instruct")) == interleave([alone[:3], load_prompts(("instruct",))])
    for bad, says in (
        ("gsm8k:0", "positive integer"),
        ("gsm8k:x", "positive integer"),
        ("gsm9k", "Unknown --data source"),
    ):
        with pytest.raises(DFlashError, match=says):
            load_prompts((bad,))
    with pytest.raises(DFlashError, match="twice"):
        load_prompts(("gsm8k", "gsm8k:5"))


def test_shards_share_the_work_resume_and_pack_to_the_same_bytes(target, tmp_path):
    prompts = corpus_prompts(["gsm8k:3", "instruct:2"])
    run = tmp_path / "run"
    run.mkdir()
    for i in (0, 1):
        generate_answers(target, prompts, run / f"answers-{i}.jsonl", max_new_tokens=6, batch_size=2, shard=(i, 2))
    rows = [json.loads(x) for i in (0, 1) for x in (run / f"answers-{i}.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in rows) == sorted(
        k for k, _ in prompts
    )  # batches 0 and 2 to shard 0, batch 1 to shard 1
    assert [r["key"] for r in rows[:3]] == [prompts[0][0], prompts[1][0], prompts[4][0]]
    eos = DFlashEngine(target, None, 1).eos_token_ids
    for r in rows:
        assert 1 <= len(r["answer_ids"]) <= 6 and r["finished"] == (r["answer_ids"][-1] in eos)
        assert r["prompt_hash"] == prompt_hash(dict(prompts)[r["key"]])
    before = (run / "answers-0.jsonl").read_bytes()
    assert (
        generate_answers(target, prompts, run / "answers-0.jsonl", max_new_tokens=6, batch_size=2, shard=(0, 2))[
            "answer_tokens"
        ]
        == 0
    )
    assert (run / "answers-0.jsonl").read_bytes() == before  # a rerun answers nothing again
    card = pack(run, tmp_path / "packed", target, {"max_new_tokens": 6})
    raw = (tmp_path / "packed" / "answers.jsonl.gz").read_bytes()
    assert raw[4:8] == b"\0\0\0\0"
    packed = [json.loads(x) for x in gzip.decompress(raw).decode().splitlines()]
    assert [r["key"] for r in packed] == sorted(r["key"] for r in rows)
    assert card["target_fingerprint"] == target_fingerprint(target)
    assert card["sources"]["gsm8k"]["answers"] == 3 and card["sources"]["instruct"]["answers"] == 2
    pack(run, tmp_path / "again", target, {"max_new_tokens": 6})
    assert (tmp_path / "again" / "answers.jsonl.gz").read_bytes() == raw


def test_packaged_answers_are_the_targets_and_count_only_for_their_prompt(target, target_dir):
    card, records = answers_card(), answers_records()
    assert card["target_fingerprint"] == target_fingerprint(target) and len(records) >= 1000
    by_key = {r["key"]: r for r in records}
    prompts = [p for p in load_prompts(("gsm8k",))[:8] if p[0] in by_key]
    assert len(prompts) == 8
    known = known_answers(target, ("gsm8k",), prompts)
    assert set(known) == {k for k, _ in prompts}
    assert (
        known_answers(target, ("gsm8k",), [(k, p + " ") for k, p in prompts]) == {}
    )  # another prompt under the same key
    assert known_answers(target, ("instruct",), prompts) == {}  # a source not asked for
    cut = [k for k, _ in prompts if not by_key[k]["finished"]]
    longer = known_answers(target, ("gsm8k",), prompts, max_new_tokens=card["max_new_tokens"] + 1)
    assert set(longer) == {k for k, _ in prompts} - set(cut)  # an answer cut short is no answer to a longer budget
    # The target in bf16, as it wrote them, writes them again (a near-tie may round the other way on another CPU: 3 of 4).
    bf16 = TargetModel.load(target_dir, torch.bfloat16)
    engine = DFlashEngine(bf16, None, 1)
    ids = [engine.encode(p) for _, p in prompts[:4]]
    answers, _ = greedy_batch(bf16, ids, layer_ids=[0], max_new_tokens=16, eos=engine.eos_token_ids)
    assert sum(a == known[k][:16] for a, (k, _) in zip(answers, prompts)) >= 3


def test_the_data_phase_forwards_packaged_answers_instead_of_generating(target, tmp_path):
    meta = prepare_data(
        target,
        ("gsm8k",),
        tmp_path,
        layer_ids=[1, 14, 27],
        num_samples=4,
        minutes=None,
        max_new_tokens=32,
        batch_size=4,
    )
    assert meta["packed_answers"]["prompts"] == 4 and meta["records"] == {"gsm8k": 4}
    by_key = {r["key"]: r for r in answers_records()}
    recs = [json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()]
    for rec in recs:
        assert [t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if m] == by_key[rec["key"]]["answer_ids"][:32]
    rows = (tmp_path / "data.features.bin").stat().st_size // (3 * target.hidden_size * 2)
    assert rows == sum(len(rec["input_ids"]) for rec in recs)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--shard", "2/2"], "--shard 2/2: give i/n"),
        (["--data", "gsm9k:10"], "Unknown --data source"),
        (["--until", "25:00"], "--until 25:00: give a UTC time"),
    ],
)
def test_the_command_refuses_bad_input_in_one_sentence(tmp_path, args, says):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "trtllm_dflash.train.answers", "--output", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"Error: {says}") and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # nothing written
