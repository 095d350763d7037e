"""Calibration (`trtdflash plan --calibrate`, deploy/calibrate.py): the roofline's shape in K with its level taken from
measured steps reproduces every measurement; a drafter dearer than the roofline said shortens the plan; the
acceptance comes from the lightest load that drafted; and what calibration cannot judge is refused in one sentence
before any load is sent. Against the real tritonserver: tests/clients/test_gate.py."""

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.deploy.calibrate import Point, calibrated_cost, length_at, measured_acceptance, noise_points
from trtllm_dflash.deploy.recipes import load_recipe
from trtllm_dflash.deploy.schedule import plan_recipe_schedule, recipe_acceptance, roofline_parts
from trtllm_dflash.engine.plan import plan_schedule
from trtllm_dflash.errors import DFlashError


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("gpt-oss-120b", "b200", None)


def _served(parts, schedule, verify_scale, draft_scale, loads=(1, 4, 16, 64)):
    """Steps as a GPU that is `verify_scale` times the roofline's verify and `draft_scale` times its drafting serves."""
    points = []
    for b in loads:
        k = length_at(schedule, b)
        v, d = parts(b, k)
        points.append(Point(b, k, verify_scale(b) * v + draft_scale * d, verify_scale(b) * parts(b, 0)[0], 3.0))
    return points


def test_the_calibrated_cost_reproduces_every_measured_step_and_interpolates_between(recipe):
    parts = roofline_parts(recipe)
    schedule = plan_recipe_schedule(recipe, recipe.max_draft_len).schedule()
    points = _served(parts, schedule, lambda b: 1.5 if b < 16 else 2.5, 3.0)
    cost, scales = calibrated_cost(parts, points)
    for p in points:
        assert cost(p.batch, p.draft_len) == pytest.approx(p.step_s, rel=1e-9)
        assert cost(p.batch, 0) == pytest.approx(p.twin_step_s, rel=1e-9)
    assert scales[1][0] == pytest.approx(1.5) and scales[64][0] == pytest.approx(2.5)
    drafting = [s for _, s in (scales[p.batch] for p in points if p.draft_len)]
    assert drafting and all(s == pytest.approx(3.0) for s in drafting)
    # between 4 and 16 users the verify scale lies between theirs; beyond the measured loads it is held
    v8 = cost(8, 0) / parts(8, 0)[0]
    assert 1.5 < v8 < 2.5 and cost(128, 0) / parts(128, 0)[0] == pytest.approx(2.5)


def test_a_drafter_dearer_than_the_roofline_said_drafts_less(recipe):
    parts = roofline_parts(recipe)
    planned = plan_recipe_schedule(recipe, recipe.max_draft_len)
    points = _served(parts, planned.schedule(), lambda b: 1.0, 8.0)
    cost, _ = calibrated_cost(parts, points)
    replanned = plan_schedule(recipe_acceptance(recipe), cost, recipe.max_batch_size, recipe.max_draft_len)
    lengths = [(replanned.length_at(b), planned.length_at(b)) for b in range(1, recipe.max_batch_size + 1)]
    assert all(new <= old for new, old in lengths) and any(new < old for new, old in lengths)


def test_a_step_noise_left_no_time_for_drafting_is_never_priced_as_free_drafting(recipe):
    parts = roofline_parts(recipe)
    v, d = parts(1, 3)
    twin = parts(1, 0)[0]
    point = Point(1, 3, twin * 0.9, twin, 2.5)  # the deployment's step below the twin's: noise
    cost, scales = calibrated_cost(parts, [point])
    assert scales[1][0] > 0 and scales[1][1] == pytest.approx(scales[1][0]) and noise_points(parts, [point]) == [point]
    assert cost(1, 3) == pytest.approx(v + d) and cost(1, 3) > point.step_s


def test_without_a_twin_one_scale_covers_the_whole_step(recipe):
    parts = roofline_parts(recipe)
    v, d = parts(1, 3)
    cost, scales = calibrated_cost(parts, [Point(1, 3, 2 * (v + d), None, 2.5)])
    assert scales[1] == pytest.approx((2.0, 2.0)) and cost(1, 3) == pytest.approx(2 * (v + d))


def test_the_acceptance_is_the_lightest_drafting_loads_spread_over_every_position():
    points = [Point(8, 0, 1.0, 1.0, 1.0), Point(2, 3, 1.0, 0.9, 2.5), Point(4, 2, 1.0, 0.9, 2.0)]
    a = measured_acceptance(points, 7)
    assert len(a.conditional) == 7 and a.expected_tokens(3) == pytest.approx(2.5, abs=1e-6)
    assert "at 2 users" in a.source
    with pytest.raises(DFlashError, match="measure at 1 user"):
        measured_acceptance([Point(8, 0, 1.0, 1.0, 1.0)], 7)
    with pytest.raises(DFlashError, match="measure at 1 user"):
        calibrated_cost(roofline_parts(load_recipe("gpt-oss-120b", "b200", None)), [Point(8, 0, 1.0, 1.0, 1.0)])


def test_both_readings_of_a_written_schedule_give_every_batch_its_length(recipe):
    plan = plan_recipe_schedule(recipe, recipe.max_draft_len)
    assert all(length_at(plan.schedule(), b) == plan.length_at(b) for b in range(1, recipe.max_batch_size + 1))
    assert length_at(plan.schedule(), recipe.max_batch_size + 1) == 0


def _plan(*args):
    return CliRunner().invoke(main, ["plan", *args])


def test_what_calibration_cannot_judge_is_one_sentence_and_nothing_is_sent(tmp_path, trtllm_deployment):
    from trtllm_dflash.deploy import BuildOptions, run_build

    embedded = run_build(BuildOptions(output=tmp_path / "embedded"), progress=lambda m: None)
    twin = run_build(
        BuildOptions(output=tmp_path / "twin", target="smollm2-135m", gpu="h100", no_draft=True),
        progress=lambda m: None,
    )
    before = (trtllm_deployment / "trtllm-serve.yaml").read_text()
    for args, message in (
        ([str(tmp_path / "none"), "--calibrate", "127.0.0.1:1"], "not a trtdflash build output"),
        ([str(embedded), "--calibrate", "127.0.0.1:1"], "an embedded build"),
        ([str(twin), "--calibrate", "127.0.0.1:1"], "no planned draft_len_schedule"),
        ([str(trtllm_deployment), "--calibrate", "127.0.0.1:1", "--concurrency", "4"], "exceeds the deployment's"),
        ([str(trtllm_deployment), "--calibrate", "127.0.0.1:1", "--concurrency", "1"], "127.0.0.1:1"),
    ):
        r = _plan(*args)
        assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output
    assert (trtllm_deployment / "trtllm-serve.yaml").read_text() == before
