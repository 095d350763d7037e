"""Throughput at a per-user speed, read off a measured curve: synthetic curves whose answers are known by hand."""

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.clients.interactivity import Point, curve, per_user_at, readout, readout_lines, throughput_at

# (concurrency, tokens/s per user, total tokens/s): per-user speed falls and throughput rises with load
DFLASH = [(1, 100.0, 100.0), (2, 80.0, 160.0), (4, 50.0, 200.0), (8, 30.0, 240.0)]
BASELINE = [(1, 60.0, 60.0), (2, 55.0, 110.0), (4, 45.0, 180.0), (8, 35.0, 280.0)]


def levels(points):
    return [{"concurrency": c, "tokens_per_s_per_user": u, "steady_tokens_per_s": t} for c, u, t in points]


def test_a_target_between_two_levels_reads_linearly_between_them():
    points = curve(levels(DFLASH))
    assert throughput_at(points, 90) == pytest.approx(130.0)  # halfway from (100, 100) to (80, 160)
    assert throughput_at(points, 40) == pytest.approx(220.0)  # halfway from (50, 200) to (30, 240)
    assert throughput_at(points, 80) == pytest.approx(160.0)  # on a measured level
    assert per_user_at(points, 180) == pytest.approx(65.0)  # the inverse: halfway from (160, 80) to (200, 50)


def test_outside_the_measured_range_is_not_reached_never_extrapolated():
    points = curve(levels(DFLASH))
    assert throughput_at(points, 120) is None and throughput_at(points, 29.9) is None
    assert per_user_at(points, 99) is None and per_user_at(points, 241) is None
    assert throughput_at([Point(1, 50.0, 50.0)], 50.0) == 50.0 and throughput_at([Point(1, 50.0, 50.0)], 49) is None


def test_a_curve_that_folds_back_reads_its_better_point():
    # past 4 users this server got slower for everyone: 50 tok/s/user is met at 4 users (200) and between 4 and 8
    folded = curve(levels([(1, 100.0, 100.0), (4, 50.0, 200.0), (8, 45.0, 150.0), (16, 55.0, 120.0)]))
    assert throughput_at(folded, 50) == pytest.approx(200.0)


def test_the_readout_compares_the_first_server_with_each_other_at_each_target():
    rows = readout({"dflash": levels(DFLASH), "baseline": levels(BASELINE)}, [50, 40, 90])
    at50, at40, at90 = rows
    assert at50["throughput"] == {
        "dflash": pytest.approx(200.0),
        "baseline": pytest.approx(145.0),
    }  # halfway from (55, 110) to (45, 180)
    assert at50["ratio_to_first"]["baseline"] == pytest.approx(200.0 / 145.0)
    assert at40["throughput"]["baseline"] == pytest.approx(230.0)  # halfway from (45, 180) to (35, 280)
    assert at90["throughput"]["baseline"] is None and at90["ratio_to_first"]["baseline"] is None
    lines = readout_lines(rows, ["dflash", "baseline"])
    assert "not reached" in lines[-1] and "1.38x" in lines[2]


def test_a_level_without_a_steady_window_has_no_point():
    lvs = levels(DFLASH)
    lvs[1]["steady_tokens_per_s"] = None
    assert [p.concurrency for p in curve(lvs)] == [1, 4, 8]


@pytest.mark.parametrize("value", ["fast", "0", "20,-5", ""])
def test_bench_refuses_a_bad_interactivity_in_one_sentence(value):
    result = CliRunner().invoke(main, ["bench", "--interactivity", value])
    assert result.exit_code == 2 and "tokens/s per user separated by commas" in result.output
