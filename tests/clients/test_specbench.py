"""SPEED-Bench's files read as NVIDIA's harness reads them (a parquet fixture we write in its schema), our built-in set,
and the harness's metrics checked against hand computations on a recorded stream."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trtllm_dflash.clients.datasets import PLACEHOLDER, builtin_records, read_speed_bench, select
from trtllm_dflash.clients.specbench import Conversation, Turn, acceptance, timing
from trtllm_dflash.errors import DFlashError


def row(qid, category, turns, **extra):
    return {
        "question_id": qid,
        "category": category,
        "sub_category": "",
        "turns": turns,
        "source": "ours",
        "src_id": qid,
        "difficulty": "",
        "multiturn": len(turns) > 1,
    } | extra


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def speed_dir(tmp_path):
    """prepare_data.py's layout: DATA/speed/<config>/test.parquet."""
    rows = [row(f"q{i}", c, [f"question {i}"]) for i, c in enumerate("aabcbac")]
    rows[3] = row("q3", "c", ["first turn", "second turn"])
    write(tmp_path / "speed" / "qualitative" / "test.parquet", rows)
    return tmp_path


def test_prepare_datas_layout_a_folder_or_a_file_reads_the_same_records(speed_dir):
    records = read_speed_bench(speed_dir, "qualitative")
    assert [r.question_id for r in records] == [f"q{i}" for i in range(7)]
    assert records[3].turns == ("first turn", "second turn") and records[3].multiturn
    file = speed_dir / "speed" / "qualitative" / "test.parquet"
    assert read_speed_bench(file) == records == read_speed_bench(file.parent)


def test_num_requests_picks_round_robin_over_categories_as_the_harness_does(speed_dir):
    records = read_speed_bench(speed_dir)
    # categories a,a,b,c,b,a,c: the i-th of each category in first-appearance order (specdec_bench _stratified_select)
    assert [r.question_id for r in select(records, 6)] == ["q0", "q2", "q3", "q1", "q4", "q6"]
    assert [r.question_id for r in select(records, None)] == [r.question_id for r in records]
    assert [r.question_id for r in select(records, 2, ["b"])] == ["q2", "q4"]
    with pytest.raises(DFlashError, match="--category 'x' is not in the data; it has a, b, c"):
        select(records, None, ["x"])


@pytest.mark.parametrize(
    "rows, message",
    [
        ([row("q0", "a", [f"{PLACEHOLDER}\n\nsome template {{article}}"])], "still holds SPEED-Bench's placeholder"),
        ([{k: v for k, v in row("q0", "a", ["x"]).items() if k != "category"}], "no 'category' field"),
        ([row("q0", "a", "not a list")], "'turns' must be a list of strings"),
        ([row("q0", "a", ["x"], multiturn="no")], "'multiturn' must be a boolean"),
        ([], "holds no records"),
    ],
)
def test_bad_data_gets_one_sentence(tmp_path, rows, message):
    path = tmp_path / "d.parquet"
    if rows:
        write(path, rows)
    else:
        pq.write_table(pa.table({"question_id": pa.array([], pa.string())}), path)
    with pytest.raises(DFlashError, match=message):
        read_speed_bench(path)
    if "placeholder" in message:
        with pytest.raises(DFlashError, match="prepare_data.py --dataset speed --config qualitative"):
            read_speed_bench(path)


def test_a_missing_folder_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(DFlashError, match="speed/throughput_2k/test.parquet.*--config throughput_2k"):
        read_speed_bench(tmp_path, "throughput_2k")
    with pytest.raises(DFlashError, match="--config must be one of qualitative"):
        read_speed_bench(tmp_path, "throughput_3k")


def test_the_builtin_set_has_eight_categories_or_more_in_the_same_shape():
    records = builtin_records()
    categories = {r.category for r in records}
    assert len(categories) >= 8 and {"coding", "math", "rag", "multilingual"} <= categories
    assert any(r.multiturn and len(r.turns) == 2 for r in records)
    assert len({r.question_id for r in records}) == len(records)


def test_the_metrics_match_a_hand_computation_on_a_recorded_stream():
    # two requests of category "math": one of two turns; one request of "code". Chunks are tokens per response.
    convs = [
        Conversation("m1", "math", [Turn(0.0, [1.0, 1.5, 2.0], [1, 4, 3]), Turn(3.0, [3.5, 4.0], [1, 2])]),
        Conversation("m2", "math", [Turn(0.5, [1.2, 2.2], [1, 1])]),
        Conversation("c1", "code", [Turn(1.0, [2.0, 2.5, 3.0, 5.0], [1, 4, 4, 2])]),
    ]
    a = acceptance(convs)
    # Request_AL: tokens over steps, turns pooled: m1 = 11/5, m2 = 2/2, c1 = 11/4
    assert a["Request_AL"] == pytest.approx({"m1": 2.2, "m2": 1.0, "c1": 2.75})
    assert a["Category_AL"] == pytest.approx({"math": 1.6, "code": 2.75})  # unweighted over requests
    assert a["Average_AL"] == pytest.approx((2.2 + 1.0 + 2.75) / 3)
    assert a["Acceptance_Length_Histogram"] == {1: 5, 2: 2, 3: 1, 4: 3}  # 11 steps
    # S(1)=11, S(2)=6, S(3)=4, S(4)=3: conditional S(k)/S(k-1), joint S(k)/S(1)
    assert a["Conditional_Acceptance_Rate"] == pytest.approx({1: 1.0, 2: 6 / 11, 3: 4 / 6, 4: 3 / 4})
    assert a["Joint_Acceptance_Rate"] == pytest.approx({1: 1.0, 2: 6 / 11, 3: 4 / 11, 4: 3 / 11})
    t = timing(convs)
    assert t["Output TPS"] == pytest.approx(24 / 5.0)  # 24 tokens from the first send (0.0) to the last response (5.0)
    assert t["TTFT Time"]["min"] == pytest.approx(0.5) and t["TTFT Time"]["max"] == pytest.approx(1.0)
    # generation tokens/s per turn: (tokens - 1) / (last - first response): 7/1.0, 2/0.5, 1/1.0, 10/3.0
    assert t["Request Generation Tokens Per Second"]["mean"] == pytest.approx((7 + 4 + 1 + 10 / 3) / 4)
    assert t["Request Generation Step Time"]["max"] == pytest.approx(2.0)  # c1's last gap
    assert t["E2E Request Time"]["mean"] == pytest.approx((2.0 + 1.0 + 1.7 + 4.0) / 4)


def test_a_shorter_length_never_seen_is_skipped_as_the_harness_skips_it():
    a = acceptance([Conversation("x", "a", [Turn(0.0, [1.0] * 4, [1, 1, 2, 4])])])
    assert a["Conditional_Acceptance_Rate"] == pytest.approx({1: 1.0, 2: 0.5, 4: 0.5})
    assert a["Joint_Acceptance_Rate"] == pytest.approx({1: 1.0, 2: 0.5, 4: 0.25})


def test_the_profile_gives_each_draft_positions_conditional_acceptance_overall_and_per_category():
    from trtllm_dflash.clients.specbench import per_position, profile
    from trtllm_dflash.engine.plan import Acceptance

    # steps of 1, 4, 3, 1, 2 tokens: S(1)=5, S(2)=3, S(3)=2, S(4)=1 -> positions 3/5, 2/3, 1/2
    assert per_position({1: 2, 2: 1, 3: 1, 4: 1}) == pytest.approx([0.6, 2 / 3, 0.5])
    assert per_position({1: 3}) == [] and per_position({}) == []
    convs = [
        Conversation("m1", "math", [Turn(0.0, [1.0] * 5, [1, 4, 3, 1, 2])]),
        Conversation("c1", "code", [Turn(0.0, [1.0] * 2, [1, 2])]),
    ]
    p = profile(convs, {"dataset": "builtin"})
    assert p["conditional"] == pytest.approx(per_position({1: 3, 2: 2, 3: 1, 4: 1}))
    assert p["categories"]["math"]["conditional"] == pytest.approx([0.6, 2 / 3, 0.5])
    assert p["categories"]["code"]["tau"] == pytest.approx(1.5) and p["conditions"] == {"dataset": "builtin"}
    planned = Acceptance.from_profile(p, "profile")
    assert planned.conditional == pytest.approx(tuple(p["conditional"]))
    assert planned.expected_tokens(3) == pytest.approx(1 + 4 / 7 + 2 / 7 + 1 / 7)  # S(k)/S(1) summed: 7 steps


def test_the_conditions_prompts_are_fresh_padded_to_length_and_a_thinking_switch_is_found(target_dir):
    """Each condition run's records start with their own reference line (nothing but the template's head cached from
    before), a long prompt holds about the tokens asked for with the request after the notes, and thinking is
    measurable exactly where the chat template renders enable_thinking on and off differently."""
    from transformers import AutoTokenizer

    from trtllm_dflash.clients.conditions import _fresh, padded, thinking_switch

    tok = AutoTokenizer.from_pretrained(target_dir)
    count = lambda text: len(tok(text)["input_ids"])  # noqa: E731
    records = select(builtin_records(), 3)
    a, b = _fresh(records), _fresh(records)
    assert all(x.turns[0] != y.turns[0] and x.turns[0].endswith(r.turns[0]) for x, y, r in zip(a, b, records))
    long = _fresh(padded(records, 500, count))
    assert all(500 <= count(r.turns[0]) <= 650 and r.turns[0].startswith("(ref ") for r in long)
    assert long[0].turns[0].endswith(records[0].turns[0])

    def render(template):
        return lambda messages, **kw: tok.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kw
        )

    switch = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    assert thinking_switch("127.0.0.1:1", render(switch), records) is None
    assert "no enable_thinking switch" in thinking_switch("127.0.0.1:1", render(tok.chat_template), records)
    assert "give --tokenizer" in thinking_switch("127.0.0.1:1", None, records)


def test_a_collapse_is_a_condition_under_seventy_percent_of_the_baseline():
    """Judged against the short, cold, greedy τ: 69 % collapses, 70 % does not, a run with no answer is not judged,
    and a baseline with no answer is one sentence."""
    from trtllm_dflash.clients.conditions import BASELINE, collapses, judge

    results = {BASELINE: {"tau": 2.0}, "prompt ~4096": {"tau": 1.38}, "warm": {"tau": 1.4}, "too long": {"tau": None}}
    judge(results)
    assert [n for n, r in results.items() if r["collapsed"]] == ["prompt ~4096"] and results["warm"]["ratio"] == 0.7
    (line,) = collapses({"collapse_below": 0.7, "results": results})
    assert line.startswith("Acceptance collapses with prompt ~4096: τ 1.38 is 69% of the short, cold, greedy τ 2.00")
    with pytest.raises(DFlashError, match="The baseline run failed every record; the first: q1: refused"):
        judge({BASELINE: {"tau": None, "errors": ["q1: refused"]}})
