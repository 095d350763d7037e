"""`trtdflash chat` and `Conversation`: turns on the real SmolLM2 target through the engine loop with its prefix cache."""

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.clients.chat import Conversation
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError


@pytest.fixture(scope="module")
def engine():
    return DFlashEngine.load("smollm2-135m", dtype="fp32", progress=lambda m: None)


def test_each_turn_is_the_targets_answer_to_the_whole_conversation(engine):
    """Greedy turns equal `generate` on the conversation rendered by the chat template (no scheduler, no cache), and a
    later turn copies the earlier prompt's chunks from the prefix cache instead of prefilling them."""
    asks = [
        "Name three fruits and say one thing about each.",
        "Which of them is the sweetest?",
        "Thanks! Now name a vegetable.",
    ]
    with Conversation(engine) as conversation:
        answers, stats = [], []
        for ask in asks:
            stats.append(GenerationStats())
            answers.append("".join(conversation.ask(ask, max_new_tokens=64, stats=stats[-1])))
        messages = conversation.messages
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3 and [
        m["content"] for m in messages[1::2]
    ] == answers
    for turn in range(3):
        text = engine.tokenizer.apply_chat_template(
            messages[: 2 * turn + 1], add_generation_prompt=True, tokenize=False
        )
        alone = engine.generate(text, chat=False, max_new_tokens=64)
        assert alone.text == answers[turn] and alone.stats.prompt_tokens == stats[turn].prompt_tokens
    assert stats[1].prompt_tokens > stats[0].prompt_tokens + stats[0].num_tokens  # the first exchange is in the prompt
    assert stats[2].cached_tokens > stats[1].cached_tokens > 0


def test_the_oldest_exchanges_give_way_when_the_window_is_full(engine):
    with Conversation(engine, system="You are brief.") as conversation:
        conversation.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! " * 40}]
        window = engine.target.max_positions
        whole = conversation.prompt_ids(conversation.messages[:] + [{"role": "user", "content": "Bye"}], 16)
        messages = conversation.messages[:] + [{"role": "user", "content": "Bye"}]
        short = conversation.prompt_ids(messages, window - len(whole) - engine.block_size + 20)  # 20 tokens too few
        assert conversation.dropped == 1 and [m["content"] for m in messages] == ["Bye"] and len(short) < len(whole)
        assert engine.tokenizer.decode(short).count("You are brief.") == 1  # the system message stays
        with pytest.raises(DFlashError, match="does not fit"):
            conversation.prompt_ids([{"role": "user", "content": "Bye"}], window - 5)
        with pytest.raises(DFlashError, match="empty"):
            next(conversation.ask("   "))


def test_chat_command_reads_turns_from_stdin():
    r = CliRunner().invoke(
        main,
        ["chat", "--dtype", "fp32", "--max-new-tokens", "24"],
        input="What is the capital of France?\nAnd of Italy?\n/reset\n\nSay hi.\n",
    )
    assert r.exit_code == 0, r.output
    assert "Paris" in r.output and "Rome" in r.output and "(a new conversation)" in r.output
    assert r.output.count("acceptance length") == 3 and "Traceback" not in r.output


def test_chat_command_bad_input_is_one_sentence():
    r = CliRunner().invoke(main, ["chat", "--max-new-tokens", "0"], input="Hi\n")
    assert r.exit_code == 2 and "--max-new-tokens must be at least 1" in r.output and "Traceback" not in r.output
    # a turn that cannot fit is refused in one sentence and the chat goes on to the next; the exit code says so
    r = CliRunner().invoke(main, ["chat", "--dtype", "fp32", "--max-new-tokens", "8180"], input="Hi\n/reset\n")
    assert r.exit_code == 2 and r.output.count("does not fit") == 1 and "(a new conversation)" in r.output
    assert "Traceback" not in r.output
