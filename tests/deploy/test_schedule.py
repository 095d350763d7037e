"""Draft length by load (deploy/schedule.py): every preset's recipe carries a planned draft_len_schedule that TensorRT-LLM's
own rules accept in every release we validate against, read alike under both of upstream's readings of its keys; the
planner drafts where verifying is cheap and stops where it is not; an operator's own choice stands."""

import shutil
from bisect import bisect_left, bisect_right

import pytest
import yaml
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.deploy import recipes
from trtllm_dflash.deploy.recipes import load_recipe, presets
from trtllm_dflash.deploy.schedule import plan_recipe_schedule
from trtllm_dflash.deploy.trtllm.options import llm_options
from trtllm_dflash.deploy.trtllm.schema import RELEASES, upstream_errors
from trtllm_dflash.engine.plan import Acceptance, plan_schedule
from trtllm_dflash.errors import DFlashError

RECIPES = [rid for ids in presets().values() for rid in ids]


def older_reading(schedule: dict[int, int], batch: int) -> int:
    """A key is the smallest batch size of its length (tensorrt_llm/_torch/speculative/drafter.py, before 1.3)."""
    keys = sorted(schedule)
    return schedule[keys[bisect_right(keys, batch) - 1]]


def newer_reading(schedule: dict[int, int], batch: int) -> int:
    """A key is the largest batch size of its length; beyond the last, none (speculative/utils.py, main)."""
    keys = sorted(schedule)
    i = bisect_left(keys, batch)
    return schedule[keys[i]] if i < len(keys) else 0


def _recipe(rid: str):
    model, stem = rid.split("/")
    gpu, _, profile = stem.partition("-")
    return load_recipe(model, gpu, profile or None)


@pytest.mark.parametrize("rid", RECIPES)
def test_every_preset_carries_a_planned_schedule_upstreams_rules_accept(rid):
    recipe = _recipe(rid)
    if recipe.draft_config is None:
        pytest.skip("no draft")
    plan = plan_recipe_schedule(recipe, recipe.max_draft_len)
    for rel in RELEASES:
        spec = llm_options(recipe, model="m", draft="d", trtllm_version=rel)["speculative_config"]
        assert upstream_errors({"speculative_config": spec}) == []
        schedule = spec["draft_len_schedule"]
        assert schedule == plan.schedule() and min(schedule) == 1 and spec["max_draft_len"] == plan.max_draft_len
    for batch in range(1, recipe.max_batch_size + 1):
        assert older_reading(schedule, batch) == newer_reading(schedule, batch) == plan.length_at(batch), batch


def test_the_planner_drafts_while_verifying_is_cheap_and_stops_when_it_is_not():
    """A step that costs the same up to 64 tokens and grows with every token beyond (weight-bound, then
    compute-bound): one user takes the longest block, a full batch drafts nothing, and lengths never grow with load."""
    acceptance = Acceptance((0.8,) * 7, "test")
    plan = plan_schedule(acceptance, lambda b, k: max(1.0, b * (k + 1) / 64) + 0.05 * (k > 0), 128, 7)
    lengths = [r.draft_len for r in plan.rows]
    assert lengths[0] == 7 and lengths[-1] == 0 and lengths == sorted(lengths, reverse=True)
    assert all(r.speedup >= 1.0 for r in plan.rows)
    assert plan.schedule() == {1: 7, **{k: v for k, v in plan.schedule().items() if k > 1}}


def test_a_draft_that_never_pays_still_drafts_one_token_at_batch_one():
    """TensorRT-LLM takes no DFlash deployment with max_draft_len 0 (its validator); the twin built --no-draft is
    how to turn drafting off."""
    plan = plan_schedule(Acceptance((0.0,) * 3, "useless"), lambda b, k: 1.0 + k, 4, 3)
    assert plan.max_draft_len == 1 and plan.length_at(4) == 0


def test_a_published_acceptance_length_is_what_the_plan_expects_at_its_block():
    a = Acceptance.from_tau(3.28, 16, "MT-Bench")
    assert a.expected_tokens(15) == pytest.approx(3.28, abs=1e-6)
    assert a.expected_tokens(0) == 1.0 and a.expected_tokens(3) < a.expected_tokens(15)
    with pytest.raises(DFlashError, match="between 1 and the block size"):
        Acceptance.from_tau(17, 16, "impossible")


def test_an_operators_own_draft_lengths_stand():
    recipe = load_recipe("qwen3-8b", "h100")
    spec = llm_options(recipe, model="m", draft="d", extra={"speculative_config": {"max_concurrency": 8}})[
        "speculative_config"
    ]
    assert "draft_len_schedule" not in spec and spec["max_concurrency"] == 8


def test_the_dry_run_and_deploy_md_show_the_plan(tmp_path):
    r = CliRunner().invoke(main, ["build", "--target", "qwen3-8b", "--output", str(tmp_path / "d"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "Draft length by load" in r.output and "| 1 | 15 |" in r.output and "τ 3.28 at block 16" in r.output


def test_a_malformed_draft_acceptance_is_one_sentence(tmp_path, monkeypatch):
    src = recipes.recipes_root() / "qwen3-8b"
    root = tmp_path / "presets"
    shutil.copytree(src, root / "qwen3-8b")
    meta = yaml.safe_load((src / recipes.MODEL_FILE).read_text())
    meta["draft_acceptance"] = {"tau": 30, "block_size": 16, "source": "a typo"}
    (root / "qwen3-8b" / recipes.MODEL_FILE).write_text(yaml.safe_dump(meta))
    monkeypatch.setattr(recipes, "recipes_root", lambda: root)
    with pytest.raises(DFlashError, match="draft_acceptance: tau must lie between 1 and block_size"):
        load_recipe("qwen3-8b", "h100")


def test_a_measured_profile_plans_the_draft_lengths_in_place_of_an_assumed_tau(tmp_path):
    """`build --acceptance-profile`: gpt-oss-20b publishes no τ (τ 3 is assumed, and the plan drafts its cap of 5 at
    every load); a profile that measured a draft rarely accepted past its first guess plans shorter drafts, names
    itself in DEPLOY.md, and upstream's rules accept its schedule in every release we validate against. A profile
    that is no profile is one sentence."""
    import json

    from trtllm_dflash.deploy.trtllm.schema import validate_llm_args

    profile = tmp_path / "speculation_profile.json"
    conditions = {"dataset": "builtin", "date": "2026-12-07T17:30:00+00:00", "machine": "test"}
    profile.write_text(json.dumps({"conditional": [0.5, 0.1, 0.05, 0.02, 0.01], "conditions": conditions}))

    def build(*extra):
        out = tmp_path / f"out{len(extra)}"
        result = CliRunner().invoke(main, ["build", "--target", "gpt-oss-20b", "--output", str(out), *extra])
        assert result.exit_code == 0, result.output
        return out, yaml.safe_load((out / "trtllm-serve.yaml").read_text())["speculative_config"]["draft_len_schedule"]

    assumed_dir, assumed = build()
    measured_dir, measured = build("--acceptance-profile", str(profile))
    assert max(assumed.values()) == 5 and max(measured.values()) < 5
    assert "assumed" in (assumed_dir / "DEPLOY.md").read_text()
    deploy = (measured_dir / "DEPLOY.md").read_text()
    assert "profile speculation_profile.json (builtin, 2026-12-07T17:30:00+00:00, test): measured" in deploy
    options = yaml.safe_load((measured_dir / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    for rel in RELEASES:
        validate_llm_args(options, "model.yaml", rel)
    profile.write_text(json.dumps({"conditional": [1.5]}))
    bad = CliRunner().invoke(
        main,
        [
            "build",
            "--target",
            "gpt-oss-120b",
            "--tp",
            "8",
            "--output",
            str(tmp_path / "x"),
            "--acceptance-profile",
            str(profile),
        ],
    )
    assert bad.exit_code == 2 and "acceptance rates between 0 and 1" in bad.output and not (tmp_path / "x").exists()
