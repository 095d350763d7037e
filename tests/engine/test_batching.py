"""In-flight batching: a request's greedy output is its batch-1 output (the target's own greedy decoding) whatever runs
beside it, on the real SmolLM2-135M target and the shipped draft; requests join, leave, stop and get cancelled
mid-stream; the engine loop queues, admits and retires them."""

import threading
import time

import pytest
import torch

from trtllm_dflash.engine.batch import Batch
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.prefix_cache import BLOCK
from trtllm_dflash.engine.request import MAX_PARTS, Request
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.engine.scheduler import Scheduler
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.resolve import DRAFTS_DIR
from trtllm_dflash.text import shared_prefix
from trtllm_dflash.threads import WIDE_TOKENS

PROMPTS = [  # (prompt, chat, max_new_tokens): different lengths and budgets
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
        True,
        40,
    ),
    ("Write a Python function that returns the n-th Fibonacci number.", True, 24),
    ("What should I pack for a weekend trip to the mountains?", True, 56),
    ("The capital of France is", False, 12),
    ("A train travels 60 miles per hour for 3 hours. How far does it go?", True, 32),
    ("def is_prime(n):", False, 44),
]


@pytest.fixture(scope="module")
def engine(target):
    draft = load_draft(DRAFTS_DIR / "smollm2-135m")
    target.set_taps(draft.config.target_layer_ids)
    return DFlashEngine(target, draft, draft.config.block_size)


@pytest.fixture(scope="module")
def references(engine):
    """Per prompt: ids and the target's own HF generate() greedy continuation (the ground truth)."""
    refs = []
    for prompt, chat, max_new in PROMPTS:
        ids = engine.encode(prompt, chat)
        out = engine.target.model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=engine.tokenizer.pad_token_id,
        )
        refs.append((ids, out[0, len(ids) :].tolist()))
    return refs


def request(engine, ids, max_new, stop_token_ids=()):
    return Request(ids, max_new, stop_token_ids=engine.eos_token_ids | frozenset(stop_token_ids))


def test_a_burst_of_contention_during_calibration_inflates_no_size(engine, monkeypatch):
    """A neighbour that takes the CPU for a few consecutive forwards (a server's other models loading beside this one)
    must not leave some sizes looking dearer than the rest: the policy learns a size's cost relative to the others
    only by choosing it. Calibration's sizes take turns, so the burst meets each size at most once and the fastest
    of its rounds is clean."""
    target, forward, sizes = engine.target, engine.target.forward, []

    def beside_a_neighbour(ids, *args, **kwargs):
        sizes.append(ids.shape[1])
        if 4 <= len(sizes) < 4 + 6:  # six consecutive forwards, each 0.3 s slower
            time.sleep(0.3)
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", beside_a_neighbour)
    policy = BlockPolicy(engine.block_size, adaptive=True)
    Batch(target, engine.draft, engine.block_size, slots=1, policy=policy).calibrate(1)
    assert sorted(policy.verify_cost) == sorted(set(sizes)) and len(set(sizes)) == 6  # 1, 2, ... 32 (lookup's longest)
    assert max(policy.verify_cost.values()) < 0.3, policy.verify_cost


@pytest.mark.parametrize("short", [False, True])
def test_calibration_drafts_as_steps_do(engine, monkeypatch, short):
    """The policy prices a step's draft by the slots it drafts: whole blocks, or with a draft trained on short blocks
    (DraftConfig.short_blocks) one row of 2, 4, ... slots up to a block, then rows of whole blocks."""
    draft = load_draft(DRAFTS_DIR / "smollm2-135m")
    if short:
        draft.config.extra["dflash_config"]["short_blocks"] = 0.5
    drafted, draft_block = [], draft.draft_block

    def recording(x, *args):
        drafted.append(tuple(x.shape[:2]))
        return draft_block(x, *args)

    monkeypatch.setattr(draft, "draft_block", recording)
    policy = BlockPolicy(engine.block_size, adaptive=True, short=short)
    Batch(engine.target, draft, engine.block_size, slots=2, policy=policy).calibrate(2)
    shapes = [(1, w) for w in range(2, 9)] + [(2, 8)] if short else [(1, 8), (2, 8)]
    assert sorted(set(drafted)) == shapes and sorted(policy.draft_cost) == [r * w for r, w in shapes]


@pytest.mark.parametrize("speculation", ["fixed", "adaptive", "planned"])
def test_rows_join_leave_stop_and_cancel_without_changing_output(engine, references, speculation):
    """Four slots, six requests: two start, others join at later steps, one stops on a token, one is cancelled. The
    chat template's head is prefilled once, by the first chat request, and copied into the others' slots."""
    engine.policy.adaptive, engine.policy.planned = speculation == "adaptive", speculation == "planned"
    prefix = shared_prefix(engine.tokenizer, engine.target.max_positions)
    batch = Batch(engine.target, engine.draft, engine.block_size, slots=4, policy=engine.policy, prefix=prefix)
    engine.calibrate(batch)
    forward, prefilled = engine.target.forward, []

    def recording(ids, start, *args, **kwargs):  # the prompt chunks as they go into the target
        prefilled.append((start, ids.shape[1]))
        return forward(ids, start, *args, **kwargs)

    stop_at = references[4][1][5]  # request 4 stops at the first occurrence of its 6th token
    reqs = [request(engine, ids, PROMPTS[i][2], (stop_at,) if i == 4 else ()) for i, (ids, _) in enumerate(references)]
    joins = {0: [0, 1], 1: [2], 3: [3]}  # step -> requests admitted before it; the rest wait for a free slot
    waiting, out, step, cancelled_at, sizes = [4, 5], {i: [] for i in range(len(reqs))}, 0, None, []
    over_plan = 0  # steps with a row longer than the plan allowed that step's batch size
    while step < 400:
        for i in joins.get(step, []) + (
            [waiting.pop(0)] if waiting and step > 3 and len(batch.rows) < batch.slots else []
        ):
            engine.target.forward = recording
            try:
                while not (first := batch.add(reqs[i])):  # prefill (chunked) until the first token
                    pass
            finally:
                del engine.target.forward  # the class's method again
            out[i] += first
        for r in [r for r in batch.rows if r.stats.finish_reason]:
            batch.remove(r)
        if step == 6 and reqs[1] in batch.rows:  # the client of request 1 goes away
            cancelled_at = len(out[1])
            batch.remove(reqs[1])
        if not batch.rows and not waiting:
            break
        if batch.ready:
            ready = batch.ready
            sizes.append(len(ready))
            allowed = engine.policy.planned_block(len(ready))  # the plan may change between steps (replan)
            advanced = batch.step()
            assert all(advanced[r] for r in ready), "every running row advances every step"
            over_plan += max(batch.last_step.ks) > allowed
            for r, tokens in advanced.items():
                out[reqs.index(r)] += tokens
        step += 1
    assert max(sizes) == 4 and not batch.rows
    chat = sum(c for _, c, _ in PROMPTS)
    assert (
        len(prefix) > 10
        and prefilled.count((0, len(prefix))) == 1
        and sum(s == len(prefix) for s, _ in prefilled) == chat
    )
    assert sum(s == 0 for s, _ in prefilled) == len(PROMPTS) - chat + 1, "the other chat prompts start past the head"
    for i, (_, ref) in enumerate(references):
        if i == 1:
            assert out[1] == ref[:cancelled_at] and 0 < cancelled_at < len(ref)
        elif i == 4:
            assert out[4] == ref[: ref.index(stop_at) + 1] and reqs[4].stats.finish_reason == "stop"
        else:
            assert out[i] == ref, f"request {i} differs from its batch-1 output"
    chosen = {k for r in reqs for k in r.stats.block_lengths}
    if engine.policy.adaptive:
        assert chosen and max(chosen) <= 1 + batch.max_guesses  # a lookup row's block may pass the draft's
    if engine.policy.planned:  # every row at most its batch size's planned length at that step
        assert over_plan == 0 and engine.policy.schedule is not None
    engine.policy.planned = False


class CyclingPolicy(BlockPolicy):
    """Block lengths that differ between rows and steps (8, 1, 3, 5, 2, ...), whatever acceptance says, so each verify
    forward mixes rows of every length; the policy's own choices are tested in test_policy.py."""

    PATTERN = (8, 1, 3, 5, 2, 7, 1, 4)

    def __init__(self, max_block):
        super().__init__(max_block)
        self.mixed_steps, self.looked_steps, self.step = 0, 0, 0

    def choose(self, rows, lookup=None):
        """Every other step a row with lookup guesses verifies them, so drafted, looked-up and plain rows share forwards."""
        self.step += 1
        ks = [
            min(self.PATTERN[(self.step + 3 * i) % len(self.PATTERN)], max(r.remaining, 1)) for i, r in enumerate(rows)
        ]
        looked = [bool(lookup and lookup[i]) and k > 1 and (self.step + i) % 2 == 0 for i, k in enumerate(ks)]
        ks = [min(k, 1 + lookup[i]) if lk else k for i, (k, lk) in enumerate(zip(ks, looked))]
        self.mixed_steps += len(set(ks)) > 1
        self.looked_steps += any(looked)
        return ks, looked


class OneLongRowPolicy(CyclingPolicy):
    """One row at a time speculates (cycling through rows and PATTERN's lengths), the others decode plainly: the flat
    layout's per-row attention for few long rows (FlatRows.long)."""

    def choose(self, rows, lookup=None):
        self.step += 1
        ks = [1] * len(rows)
        i = self.step % len(rows)
        ks[i] = min(self.PATTERN[self.step // len(rows) % len(self.PATTERN)], max(rows[i].remaining, 1))
        self.mixed_steps += len(set(ks)) > 1
        return ks, [False] * len(rows)


@pytest.mark.parametrize(
    "ragged,policy_cls",
    [(True, CyclingPolicy), (True, OneLongRowPolicy), (False, CyclingPolicy)],
    ids=["flat-token-axis", "flat-one-long-row", "padded"],
)
def test_rows_with_different_block_lengths_in_one_forward_keep_their_output(engine, references, ragged, policy_cls):
    """Four requests at once, each row its own block length every step, on the flat token axis (rows padded to the
    longest inside attention, or one long row attended on its own) and on the padded layout a target without our
    attention takes: every output is the target's own greedy continuation."""
    previous, engine.target.ragged = engine.target.ragged, ragged
    try:
        policy = policy_cls(engine.block_size)
        batch = Batch(engine.target, engine.draft, engine.block_size, slots=4, policy=policy)
        reqs = [request(engine, ids, PROMPTS[i][2]) for i, (ids, _) in enumerate(references[:4])]
        out = {r: [] for r in reqs}
        for r in reqs:
            while not (first := batch.add(r)):
                pass
            out[r] += first
        while batch.ready:
            for r, tokens in batch.step().items():
                out[r] += tokens
            for r in [r for r in batch.rows if r.stats.finish_reason]:
                batch.remove(r)
    finally:
        engine.target.ragged = previous
    assert policy.mixed_steps >= 10
    for r, (_, ref) in zip(reqs, references):
        assert out[r] == ref


def test_scheduler_serves_concurrent_streams_in_order(engine, references):
    """Six client threads on a three-slot engine loop: same tokens as alone, batched steps, a cancelled stream freed."""
    engine.policy.adaptive = True
    seen = []
    scheduler = engine.scheduler(3, 512, on_step=lambda m: seen.append((m.batch_size, m.running, m.queued)))
    results, errors = {}, []

    def client(i):
        ids, _ = references[i]
        tokens = []
        try:
            steps = engine.stream(ids, max_new_tokens=PROMPTS[i][2], scheduler=scheduler)
            for new, _ in steps:
                tokens += new
                if i == 2 and len(tokens) >= 8:  # a client that leaves mid-stream
                    steps.close()
                    break
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        results[i] = tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not errors
        for i, (_, ref) in enumerate(references):
            if i == 2:
                assert results[2] == ref[: len(results[2])] and len(results[2]) < len(ref)
            else:
                assert results[i] == ref
        assert max(b for b, _, _ in seen) >= 2, "steps were batched"
        assert max(q for _, _, q in seen) >= 1 or len(PROMPTS) <= 3
        assert scheduler.metrics.requests_finished == len(PROMPTS)
        assert seen[-1][1] == 0 and not scheduler.batch.rows  # everything retired, the cancelled stream included
        with pytest.raises(DFlashError, match="KV-cache positions"):
            engine.stream(references[0][0], max_new_tokens=600, scheduler=scheduler).__next__()
    finally:
        scheduler.stop()


def test_a_servers_forwards_all_run_on_its_engine_thread(engine, references, monkeypatch):
    """Calibration and the measured steps run on the engine thread before the scheduler returns, as its prefills and
    steps do (an OpenMP team started from a second thread made every later prefill slower: Scheduler); a calibration
    that fails is raised by the constructor."""
    threads, forward = set(), engine.target.forward

    def recording(*args, **kwargs):
        threads.add(threading.current_thread())
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.target, "forward", recording)
    monkeypatch.setattr(engine, "_calibrated_rows", 0)
    monkeypatch.setattr(engine, "_measured_rows", 0)
    engine.policy.adaptive, engine.policy.step_seconds = True, {}
    scheduler = engine.scheduler(2, 512, prefix_cache_tokens=0)
    try:
        assert engine.policy.step_seconds and threads == {scheduler.thread}  # measured, on the engine thread
        ids, ref = references[3]
        assert [
            t for new, _ in engine.stream(ids, max_new_tokens=PROMPTS[3][2], scheduler=scheduler) for t in new
        ] == ref
        assert threads == {scheduler.thread}
    finally:
        scheduler.stop()

    def failing():
        raise DFlashError("calibration failed")

    with pytest.raises(DFlashError, match="calibration failed"):
        Scheduler(Batch(engine.target, engine.draft, engine.block_size, slots=1), 512, calibrate=failing)


def test_long_prompt_prefills_in_chunks_between_steps(engine, references):
    """A 700-token prompt joins a running request one 64-token chunk at a time, the running row stepping between
    chunks; both lossless."""
    ids, ref = references[0]
    long_ids = (engine.encode("Repeat after me. " + "The quick brown fox jumps over the lazy dog. " * 70, chat=False))[
        :700
    ]
    long_ref = engine.target.model.generate(
        torch.tensor([long_ids]),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=engine.tokenizer.pad_token_id,
    )[0, len(long_ids) :].tolist()
    batch = Batch(engine.target, engine.draft, engine.block_size, slots=2, policy=engine.policy)
    short, long = request(engine, ids, PROMPTS[0][2]), Request(long_ids, 16)
    out, chunks, steps_between = {short: batch.add(short), long: []}, 0, 0
    while not out[long]:
        out[long] += batch.add(long)
        chunks += 1
        assert long.prefilled == min(chunks * BLOCK, len(long_ids))
        if not out[long] and short in batch.ready:
            out[short] += batch.step()[short]  # the running row advances while the long prompt goes in
            steps_between += 1
        if short.stats.finish_reason and short in batch.rows:
            batch.remove(short)
    assert chunks == -(-len(long_ids) // BLOCK) and steps_between >= 5
    while batch.ready:
        for r, tokens in batch.step().items():
            out[r] += tokens
        for r in [r for r in batch.rows if r.stats.finish_reason]:
            batch.remove(r)
    assert out[short] == ref and out[long] == long_ref


def test_the_engine_loop_prefills_a_long_prompt_a_budget_at_a_time_between_steps(engine, references):
    """Through the server's engine loop, a 1,100-token prompt joining a running request goes in at most PREFILL_TOKENS
    computed tokens between two steps (canonical 64-token chunks, several per iteration); both outputs lossless."""
    from trtllm_dflash.engine.scheduler import PREFILL_TOKENS

    long_ids = engine.encode("Repeat after me. " + "The quick brown fox jumps over the lazy dog. " * 110, chat=False)[
        :1100
    ]
    long_ref = engine.target.model.generate(
        torch.tensor([long_ids]),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=engine.tokenizer.pad_token_id,
    )[0, len(long_ids) :].tolist()
    long, prefilled = Request(long_ids, 12), []
    scheduler = engine.scheduler(2, 1200, on_step=lambda m: prefilled.append(long.prefilled), prefix_cache_tokens=0)
    try:
        ids, ref = references[0]
        short = scheduler.submit(request(engine, ids, PROMPTS[0][2]))
        first = next(short.tokens())[0]  # running before the long prompt arrives
        handle = scheduler.submit(long)
        out = {
            "short": first + [t for tokens, _ in short.tokens() for t in tokens],
            "long": [t for tokens, _ in handle.tokens() for t in tokens],
        }
    finally:
        scheduler.stop()
    assert out == {"short": ref, "long": long_ref}
    partial = sorted({p for p in prefilled if 0 < p < len(long_ids)})
    assert 2 <= len(partial) <= -(-len(long_ids) // (PREFILL_TOKENS - BLOCK)), (
        "over a few iterations, steps between them"
    )
    assert all(b - a <= PREFILL_TOKENS for a, b in zip([0] + partial, partial + [len(long_ids)]))


def test_running_row_leaving_between_a_long_prompts_chunks(engine, references):
    """A 1,100-token prompt goes in chunk by chunk while two requests run; one of them leaves after the first chunk.
    The prompt must not take the leaver's slot among the running rows (it used to, and the next step failed every
    row); all three outputs stay their batch-1 outputs."""
    long_ids = engine.encode("Repeat after me. " + "The quick brown fox jumps over the lazy dog. " * 110, chat=False)[
        :1100
    ]
    long_ref = engine.target.model.generate(
        torch.tensor([long_ids]),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=engine.tokenizer.pad_token_id,
    )[0, len(long_ids) :].tolist()
    batch = Batch(engine.target, engine.draft, engine.block_size, slots=3, policy=BlockPolicy(engine.block_size))
    leaver, stayer, long = (
        request(engine, references[1][0], 24),
        request(engine, references[0][0], 40),
        Request(long_ids, 12),
    )
    out = {leaver: batch.add(leaver), stayer: batch.add(stayer), long: []}
    assert batch.add(long) == []  # the first chunk
    for r, tokens in batch.step().items():
        out[r] += tokens
    batch.remove(leaver)  # its client went away
    assert batch.rows[0] is stayer and batch.rows[1] is long
    while not out[long]:
        out[long] += batch.add(long)
        if not out[long] and stayer in batch.ready:
            out[stayer] += batch.step()[stayer]
        if stayer.stats.finish_reason and stayer in batch.rows:
            batch.remove(stayer)
    while batch.ready:
        for r, tokens in batch.step().items():
            out[r] += tokens
        for r in [r for r in batch.rows if r.stats.finish_reason]:
            batch.remove(r)
    assert out[stayer] == references[0][1] and out[long] == long_ref
    assert 0 < len(out[leaver]) < len(references[1][1]) and out[leaver] == references[1][1][: len(out[leaver])]


def test_bf16_rows_reading_whole_slots_see_only_their_own_positions(target_dir):
    """bf16 rows of one query attend over their slots' whole capacity while it is at most 4x their keys
    (SlotKVCache.begin). Slot 0 first held a longer request whose K/V stays past the new row's end: every layout of a
    step (one row, rows of one token, one long row, rows padded) gives bit for bit the logits it gives over a clean
    cache, and, with several rows (the same kernels either way), those of a cache too large for the whole read
    (capacity 2048: attention reads only the keys before each step's last position)."""
    from trtllm_dflash.models.target import TargetModel

    bf16 = TargetModel.load(target_dir, torch.bfloat16)
    text = "The history of the bicycle begins in the early nineteenth century, when inventors in Europe tried many designs. "
    prompts = [bf16.tokenizer(text * 4 + tail)["input_ids"] for tail in ("Cats", "Dogs and", "The first", "Why")]
    assert all(64 < len(p) < 128 for p in prompts)

    def logits(rows, capacity: int, stale: bool):
        cache = bf16.new_cache(4, capacity)
        if stale:
            bf16.forward(torch.tensor([bf16.tokenizer(text * 9)["input_ids"]]), 0, cache, capture=False, first_slot=0)
        for i, p in enumerate(prompts):
            bf16.forward(torch.tensor([p]), 0, cache, capture=False, first_slot=i)
        return bf16.forward_rows(rows, [len(p) for p in prompts[: len(rows)]], cache, capture=False)[0]

    for lengths in ([1], [1, 1, 1, 1], [1, 5, 1, 1], [3, 1, 4, 2]):
        rows = [[11 + j for j in range(k)] for k in lengths]
        whole = logits(rows, 256, stale=True)
        assert torch.equal(whole, logits(rows, 256, stale=False)), lengths
        if len(rows) > 1:
            assert torch.equal(whole, logits(rows, 2048, stale=False)), lengths


@pytest.mark.skipif(bf16_gemm.variant() is None, reason="needs our bf16 kernels (AVX-512 BF16 or AVX2 alone)")
def test_bf16_dflash_writes_what_bf16_plain_decoding_writes_alone_and_batched(target_dir):
    """Where our bf16 kernels run, a token's logits do not depend on the forward it is in: the linears and a step's
    attention (slot_attention.h) each take one fixed order per token. So bf16 DFlash, alone with full blocks and in
    a batch whose rows verify blocks of every length, lookup guesses and single tokens side by side, writes exactly
    what bf16 plain decoding writes (the shipped draft, the real target; on AVX2 alone with its int8 weights). With AMX, forwards of more than
    `TILE_ROWS` rows take oneDNN's tile kernel, so there this holds alone, not batched (and a lookup row's block stays
    within TILE_ROWS alone, where it could reach 1 + lookup.MAX_GUESSES)."""
    from trtllm_dflash.models.target import TargetModel

    bf16 = TargetModel.load(target_dir, torch.bfloat16)
    assert bf16.attention is not None
    draft = load_draft(DRAFTS_DIR / "smollm2-135m", torch.bfloat16)
    draft.pack(int8=True)  # as the engine packs it: int8 weights where the kernel takes them (AVX2 alone)
    bf16.set_taps(draft.config.target_layer_ids)
    engine = DFlashEngine(bf16, draft, draft.config.block_size, speculation="fixed")
    plain = DFlashEngine(bf16, None, 1)
    ids = [engine.encode(prompt, chat) for prompt, chat, _ in PROMPTS]
    want = [[t for step, _ in plain.stream(i, max_new_tokens=n) for t in step] for i, (_, _, n) in zip(ids, PROMPTS)]
    alone = [[t for step, _ in engine.stream(i, max_new_tokens=n) for t in step] for i, (_, _, n) in zip(ids, PROMPTS)]
    assert alone == want
    if bf16_gemm.tiles():
        return
    policy = CyclingPolicy(engine.block_size)
    # as in a server's model process: prompts of WIDE_TOKENS tokens or more prefilled on two threads, steps on one;
    # our kernels split their work by blocks of outputs, so the threads change no sum
    batch = Batch(
        bf16,
        draft,
        engine.block_size,
        slots=len(PROMPTS),
        policy=policy,
        threads=(1, 2),
        prefix=shared_prefix(engine.tokenizer, bf16.max_positions),
    )  # and the template's head prefilled once
    reqs = [request(engine, i, n) for i, (_, _, n) in zip(ids, PROMPTS)]
    out, threads = [], torch.get_num_threads()
    try:
        for r in reqs:
            while not (first := batch.add(r)):
                pass
            out.append(list(first))
        while batch.ready:
            for r, tokens in batch.step().items():
                out[reqs.index(r)] += tokens
            for r in [r for r in batch.rows if r.stats.finish_reason]:
                batch.remove(r)
    finally:
        torch.set_num_threads(threads)
    assert policy.mixed_steps > 3 and policy.looked_steps > 0
    assert max(len(i) for i in ids) >= WIDE_TOKENS > min(len(i) for i in ids), "prompts prefilled both ways"
    assert out == want


def test_the_shared_head_is_the_templates_and_none_where_a_template_refuses_a_lone_turn(engine):
    import copy

    head = shared_prefix(engine.tokenizer, engine.target.max_positions)
    assert all(engine.encode(text)[: len(head)] == head for text, chat, _ in PROMPTS if chat)
    assert engine.tokenizer.decode(head).endswith("user\n")  # the user turn's opening, not the start of its content
    refusing = copy.deepcopy(engine.tokenizer)
    refusing.chat_template = "{{ raise_exception('Conversation roles must alternate system/user/assistant') }}"
    assert shared_prefix(refusing, engine.target.max_positions) == []
    refusing.chat_template = None
    assert shared_prefix(refusing, engine.target.max_positions) == []


def test_a_row_that_decoded_plainly_drafts_from_the_context_it_would_have_built_step_by_step(engine, references):
    """The draft's context K/V of a row that decoded plainly past the feature log's part limit (request.MAX_PARTS, where
    the log joins its parts), taken in at once when it drafts, is what a row taking its features in at every step
    holds; and the log never holds more than its limit of forwards' outputs."""
    ids, _ = references[2]
    steps = MAX_PARTS + 10
    rows = []
    for each_step in (True, False):
        batch = Batch(engine.target, engine.draft, engine.block_size)
        proposer = batch.proposers[-1]
        req = Request(ids, steps + 1)
        while not batch.add(req):
            pass
        for _ in range(steps):
            batch.step([1])
            assert len(req.features.parts) <= MAX_PARTS
            if each_step:
                with torch.inference_mode():  # as a drafting step calls it (Batch.step)
                    proposer.update_context([req], [0])
        assert req.features.tokens == (0 if each_step else req.start)
        with torch.inference_mode():
            proposer.update_context([req], [0])
        assert req.features.tokens == 0 and batch.dcache.lengths[0] == req.start == len(ids) + steps
        rows.append((batch.dcache.k[:, 0, :, : req.start], batch.dcache.v[:, 0, :, : req.start]))
    (k1, v1), (k2, v2) = rows
    torch.testing.assert_close(k1, k2)
    torch.testing.assert_close(v1, v2)
