"""The load generator's arithmetic: the steady window counts only what streamed while every client was busy."""

from trtllm_dflash.clients.loadgen import LoadRun, Outcome, median_level, summary


def test_steady_throughput_excludes_ramp_and_drain():
    # Two clients: the first wave's tokens start at t=1 and t=2 (so every client is busy from t=2); the queue runs
    # dry at t=6. Tokens arrive one per second per request.
    a = Outcome(0, tokens=10, ttft=1.0, latency=10.0, arrivals=[(float(t), t) for t in range(1, 11)])  # t=1..10
    b = Outcome(1, tokens=4, ttft=1.0, latency=4.0, arrivals=[(float(t), t - 1) for t in range(2, 6)])  # t=2..5
    c = Outcome(2, tokens=3, ttft=1.0, latency=3.0, arrivals=[(float(t), t - 5) for t in range(6, 9)])  # t=6..8
    report = summary(LoadRun([a, b, c], wall=10.0, full=(2.0, 6.0)))
    # In (2, 6]: a streamed 6-2=4 tokens, b 4-1=3, c 1: 8 tokens in 4 s.
    assert report["steady_tokens_per_s"] == 2.0
    assert report["steady_s"] == 4.0
    assert report["total_tokens_per_s"] == 1.7  # 17 tokens over the whole 10 s
    assert report["itl_p50_s"] == 1.0


def test_no_steady_window_when_the_queue_never_holds_a_second_wave():
    a = Outcome(0, tokens=2, arrivals=[(1.0, 1), (2.0, 2)], latency=2.0)
    report = summary(LoadRun([a], wall=2.0, full=(3.0, 3.0)))
    assert report["steady_tokens_per_s"] is None and report["steady_s"] == 0.0


def test_a_level_reports_its_median_round_and_keeps_every_round():
    rounds = [
        {"steady_tokens_per_s": x, "total_tokens_per_s": x - 1, "ttft_p50_s": x / 100} for x in (30.0, 10.0, 20.0)
    ]
    level = median_level(rounds)
    assert level["steady_tokens_per_s"] == 20.0 and level["ttft_p50_s"] == 0.2  # the median round's latencies with it
    assert level["steady_tokens_per_s_rounds"] == [30.0, 10.0, 20.0] and level["total_tokens_per_s_rounds"] == [
        29.0,
        9.0,
        19.0,
    ]
