"""Training data: prompts answered by the target itself (greedy, deployment chat template), on disk as jsonl.

Each record is {"source", "key", "input_ids", "loss_mask"}: prompt + response token ids, with
loss_mask 1 over the response (including its end-of-turn token). The file is appended batch by
batch and flushed, so an interrupted generation resumes where it stopped (records are keyed).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import random
import re
import sysconfig
import time
from pathlib import Path

import torch

from ..data import CODE_COMPLETE_TEMPLATE, answers_card, answers_records, gsm8k_records, magpie_card, magpie_records
from ..errors import DFlashError
from ..sampling import greedy


def gsm8k_prompts() -> list[tuple[str, str]]:
    return [(f"gsm8k:{i}", r["question"]) for i, r in enumerate(gsm8k_records())]


_INTEGER = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d.,]\d)|(?<![\d.,])\d+(?![\d.,]\d)")


def perturb_numbers(text: str, rng: random.Random) -> str:
    """Each integer >= 2 moved to another value within x0.5..x1.5 (decimals, 0 and 1 kept): a new question in the same style."""

    def swap(m: re.Match) -> str:
        n = int(m.group().replace(",", ""))
        if n < 2:
            return m.group()
        lo, hi = max(2, n // 2), max(3, n * 3 // 2)
        v = rng.choice([x for x in range(lo, hi + 1) if x != n]) if hi - lo < 10_000 else rng.randint(lo, hi)
        return f"{v:,}" if "," in m.group() else str(v)

    return _INTEGER.sub(swap, text)


def gsm8k_variant_prompts() -> list[tuple[str, str]]:
    """GSM8K train questions (never the held-out ones) with their numbers changed: more math in GSM8K's style once
    every original question is answered. Deterministic per question."""
    return [
        (f"gsm8k-var:{i}", perturb_numbers(r["question"], random.Random(f"gsm8k-var:{i}")))
        for i, r in enumerate(gsm8k_records())
    ]


# Read after the stdlib, in this order; append only, so the keys of answered prompts stay stable. All but the six
# doctest-rich libraries of the `train` extra (more HumanEval-shaped stubs) come with our dependencies.
CODE_PACKAGES = (
    "networkx",
    "sympy",
    "numpy",
    "mpmath",
    "matplotlib",
    "jinja2",
    "click",
    "more_itertools",
    "toolz",
    "boltons",
    "sortedcontainers",
    "scipy",
    "pandas",
    "torch",
)


def _installed_code_packages() -> dict[str, Path]:
    """Root directory of each CODE_PACKAGES library that is installed, in CODE_PACKAGES order."""
    specs = {name: importlib.util.find_spec(name) for name in CODE_PACKAGES}
    return {name: Path(spec.origin).parent for name, spec in specs.items() if spec is not None and spec.origin}


def _package_roots() -> list[tuple[str, Path]]:
    """(key prefix, root) of the stdlib, then of the installed CODE_PACKAGES: stdlib keys stay stable."""
    return [("", Path(sysconfig.get_paths()["stdlib"]))] + [
        (f"site:{n}/", r) for n, r in _installed_code_packages().items()
    ]


def code_package_versions() -> dict[str, str]:
    """Versions of the libraries the code sources read: the data card records them."""
    dists = importlib.metadata.packages_distributions()
    return {name: importlib.metadata.version(dists[name][0]) for name in _installed_code_packages() if name in dists}


@functools.cache
def _library_functions() -> tuple[tuple[str, str, str], ...]:
    """(key suffix, signature, docstring) of documented public functions with arguments in the stdlib, then CODE_PACKAGES.

    Cached: both code sources read it, and parsing every file takes over a minute with every CODE_PACKAGES library
    installed (74-90 s, AMD EPYC Zen 3, 2026-11-28).
    """
    out = []
    for prefix, root in _package_roots():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root)
            if any(
                p in ("test", "tests", "testing", "idlelib", "site-packages", "lib2to3", "turtledemo")
                for p in rel.parts
            ):
                continue
            try:
                tree = ast.parse(f.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):  # module functions and class methods
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                    continue
                doc = (ast.get_docstring(node) or "").strip()
                if not doc or not [a for a in node.args.args if a.arg not in ("self", "cls")]:
                    continue
                out.append((f"{prefix}{rel}:{node.name}", f"{node.name}({ast.unparse(node.args)})", doc))
    return tuple(out)


def code_prompts() -> list[tuple[str, str]]:
    """Coding tasks derived from public library functions (signature + first docstring line), never HumanEval.

    Half ask in prose, half in HumanEval's completion style, so the draft sees both phrasings.
    """
    seen, out = set(), []  # first usable occurrence of each name
    for key, sig, doc in _library_functions():
        line = doc.splitlines()[0].strip().rstrip(".")
        if len(line) < 15 or (name := sig.split("(")[0]) in seen:
            continue
        seen.add(name)
        if len(out) % 2 == 0:
            out.append((f"code:{key}", f"Write a Python function `{sig}` that does the following: {line}."))
        else:
            out.append((f"code:{key}", CODE_COMPLETE_TEMPLATE.format(code=f'def {sig}:\n    """{line}."""\n')))
    return out


def doctest_stub(sig: str, doc: str, max_examples: int = 2) -> str | None:
    """A HumanEval-shaped stub: signature, first docstring paragraph, up to max_examples doctests that call the
    function (with their expected output); None when the docstring has no such example."""
    name = sig.split("(")[0]
    lines = [x.strip() for x in doc.splitlines()]
    desc = " ".join(lines[: (lines + [""]).index("")])
    examples, i = [], 0
    while i < len(lines) and len(examples) < max_examples:
        single = i + 1 >= len(lines) or not lines[i + 1].startswith("...")  # no multi-line statements
        if lines[i].startswith(">>> ") and f"{name}(" in lines[i] and single:
            out = [lines[i]]
            while i + 1 < len(lines) and lines[i + 1] and not lines[i + 1].startswith(">>>") and len(out) < 4:
                i += 1
                out.append(lines[i])
            examples.append(out)
        i += 1
    if not examples or len(desc) < 15 or len(desc) > 400:
        return None
    body = "\n".join(f"    {x}" for ex in examples for x in ex)
    return f'def {sig}:\n    """{desc}\n\n{body}\n    """\n'


def docstring_prompts() -> list[tuple[str, str]]:
    """HumanEval-style completion tasks (description + doctest examples) from library functions, never HumanEval."""
    seen, out = set(), []
    for key, sig, doc in _library_functions():
        stub = None if (name := sig.split("(")[0]) in seen else doctest_stub(sig, doc)
        if stub:
            seen.add(name)
            out.append((f"docstring:{key}", CODE_COMPLETE_TEMPLATE.format(code=stub)))
    return out


def magpie_prompts() -> list[tuple[str, str]]:
    """Chat questions SmolLM2-135M-Instruct wrote itself (Magpie, train/magpie.py), shipped in the package; never MT-Bench."""
    return [(r["key"], r["question"]) for r in magpie_records()]


# Tasks a chat user sets, rather than questions asked (what the magpie questions are): writing, role-play, reasoning,
# extraction and rewriting, explaining, the humanities. A 135M target steered by a system message writes stories
# instead of asking for them, so the tasks are templates over the magpie topics; none is taken from MT-Bench.
INSTRUCT_TEMPLATES = (
    "Write a short poem about {topic}.",
    "Write a short story in which a character discovers something surprising about {topic}.",
    "Draft an email to a colleague proposing a new project related to {topic}.",
    "Write the opening paragraph of a blog post about {topic} for complete beginners.",
    "Write a persuasive paragraph on why more people should pay attention to {topic}.",
    "Write a product description for a new gadget that helps with {topic}.",
    "Write a short speech for a community event about {topic}.",
    "Write a friendly letter to a pen pal describing your interest in {topic}.",
    "Imagine you are a famous expert on {topic}. Introduce yourself and share your best piece of advice.",
    "Pretend you are a tour guide leading visitors through a museum of {topic}. Describe the first room.",
    "You are a customer support agent for a company that works in {topic}. Answer a customer who is unhappy with a late order.",
    "Act as a teacher starting the first lesson of a course on {topic}. What do you say to the class?",
    "Write a short dialogue between two friends who disagree about {topic}.",
    "Imagine it is the year 2100. Describe how {topic} has changed.",
    "A friend says that {topic} is a waste of time. Give a reasoned reply.",
    "What are the strongest arguments for and against spending public money on {topic}?",
    "Describe a common mistake beginners make with {topic}, explain why it happens and how to avoid it.",
    "Suppose a small town wants to get better at {topic} with a budget of $10,000. How should it spend the money, and why?",
    "Explain the basics of {topic} to a ten-year-old.",
    "Explain three common misconceptions about {topic}.",
    "Describe the science behind one everyday aspect of {topic}.",
    "Give a step-by-step plan for someone who wants to get started with {topic} this month.",
    "Compare two different approaches to {topic} and recommend one.",
    "List five questions a journalist might ask an expert on {topic}, each with a short answer.",
    "Summarize the most important ideas about {topic} in exactly three sentences.",
    "Describe how {topic} has changed over the last hundred years.",
    "What role has {topic} played in different cultures around the world?",
    "Discuss two ethical questions raised by {topic}.",
    "Write a riddle whose answer has to do with {topic}, then give the answer.",
    'Rewrite this sentence so it sounds formal and professional: "honestly {topic} is kinda cool and u should try it".',
    'Extract the day, time, place and cost from this note and give them as JSON: "The {topic} club meets every '
    'Tuesday at 6:30 pm in room 12 of the library; membership is $15 a month."',
    "Create a one-week schedule for practising {topic}, with one short activity per day.",
    # Stage 18: a second set, again none taken from MT-Bench (tests/test_train.py checks the overlap).
    "Write a haiku about {topic}, then explain the image it uses.",
    "Write a limerick about someone who takes {topic} far too seriously.",
    "Write a diary entry from the point of view of a person trying {topic} for the first time.",
    "Write a short news report announcing a surprising discovery in {topic}.",
    "Write a thank-you note to a mentor who taught you about {topic}.",
    "Write a motivational message for a team that is struggling with {topic}.",
    "Write a cover letter for a job that involves {topic}.",
    "Write a review of an imaginary book about {topic}.",
    "Write a short fable with a moral that involves {topic}.",
    "Write the script of a thirty-second radio advertisement for a course on {topic}.",
    "Write a social media post inviting people to a free workshop on {topic}.",
    "Write an encouraging reply to a student who failed an exam on {topic}.",
    "You are a detective who solves cases using knowledge of {topic}. Describe how you cracked your latest case.",
    "Pretend you are a grandparent telling a grandchild what {topic} was like when you were young.",
    "You are the host of a podcast about {topic}. Introduce today's episode and your guest.",
    "Act as a job interviewer for a role in {topic}. Ask your first three questions and explain why you ask them.",
    "You are a robot who has just learned about {topic}. Describe what you find confusing about humans.",
    "Play the role of a coach giving a pep talk before a competition in {topic}.",
    "Give the pros and cons of learning {topic} online rather than in person.",
    "Is it better to learn {topic} alone or in a group? Argue for one side.",
    "What would happen if nobody in the world knew anything about {topic}? Think it through step by step.",
    "Rank three skills that matter most for {topic} and justify the ranking.",
    "Someone claims that anyone can master {topic} in a week. Evaluate the claim.",
    "Describe a realistic problem someone could face with {topic} and walk through how to solve it.",
    "Give an analogy that makes {topic} easy to understand, and say where the analogy breaks down.",
    "Explain {topic} in two paragraphs: the first for a child, the second for an expert.",
    "Define five key terms someone needs to know about {topic}.",
    "What are the biggest open questions about {topic} today?",
    "Explain how {topic} connects to mathematics.",
    "Describe the history of {topic} as a short timeline of key moments.",
    "How could technology make {topic} easier for people with disabilities?",
    "What is the environmental impact of {topic}, and how could it be reduced?",
    "Summarize the advice you would give someone about {topic} as a bulleted list of five points.",
    "Write a frequently-asked-questions section for a website about {topic}, with four questions and answers.",
    "Create a short quiz of four multiple-choice questions about {topic}, with the correct answers marked.",
    "Make a packing or shopping checklist for someone getting into {topic}.",
    'Turn these notes into a clear paragraph: "{topic} - started last year - hard at first - now enjoy it - want to teach others".',
    'Correct the grammar of this sentence and explain each fix: "me and him has been learning {topic} since three years".',
    'From this sentence, list every person and what they did as JSON: "Maria taught Tom about {topic} while Ana took '
    'notes and Ben made tea."',
    "Translate the main idea of {topic} into a short explanation with no technical words at all.",
    "Write a Python function that could help someone keep track of their progress in {topic}, and explain it.",
    "Design a simple table for recording data about {topic}, and explain each column.",
    "A class of 24 students is split into groups of 4 to study {topic}. How many groups are there, and how many "
    "handouts are needed if each group gets 3?",
    "A course on {topic} costs $40 a month, or $400 for a year paid upfront. Which is cheaper over a year, and by how much?",
    "Plan a one-day trip or event themed around {topic}, hour by hour.",
    "Write a short debate opening statement arguing that schools should teach {topic}.",
    "Describe {topic} using all five senses.",
    "Give three creative project ideas that combine {topic} with art or music.",
)


def instruct_prompts() -> list[tuple[str, str]]:
    """INSTRUCT_TEMPLATES over the magpie topics; keys are stable (template index, topic index) as either list grows."""
    from .magpie import TOPICS

    return [
        (f"instruct:{i}:{j}", template.format(topic=topic))
        for i, template in enumerate(INSTRUCT_TEMPLATES)
        for j, topic in enumerate(TOPICS)
    ]


def known_answers(
    target, sources: tuple[str, ...], prompts: list[tuple[str, str]] | None = None, max_new_tokens: int | None = None
) -> dict[str, list[int]]:
    """Answers the data phase need not generate again: the packaged greedy answers (the magpie chat set's and
    train/answers.py's) of the model `target` is (same embedding fingerprint); none for another model.

    A train/answers.py answer counts only for the prompt it answered: its key's prompt in `prompts` must hash the same
    (the code sources' prompts follow the installed libraries' docstrings). An answer cut short by its own token
    limit counts only where `max_new_tokens` cuts it at least as short."""
    from .answers import prompt_hash
    from .magpie import target_fingerprint

    fingerprint, names = target_fingerprint(target), source_names(sources)
    complete = lambda r: r["finished"] or max_new_tokens is None or len(r["answer_ids"]) >= max_new_tokens  # noqa: E731
    out = {}
    if "magpie" in names and magpie_card()["target_fingerprint"] == fingerprint:
        out.update((r["key"], r["answer_ids"]) for r in magpie_records() if complete(r))
    if prompts is not None and answers_card()["target_fingerprint"] == fingerprint:
        hashes = {key: prompt_hash(p) for key, p in prompts}
        out.update(
            (r["key"], r["answer_ids"])
            for r in answers_records()
            if r["key"].split(":")[0] in names and hashes.get(r["key"]) == r["prompt_hash"] and complete(r)
        )
    return out


SOURCES = {
    "gsm8k": gsm8k_prompts,
    "gsm8k-var": gsm8k_variant_prompts,
    "code": code_prompts,
    "docstring": docstring_prompts,
    "magpie": magpie_prompts,
    "instruct": instruct_prompts,
}


def source_spec(spec: str) -> tuple[str, int | None]:
    """A `--data` entry, SOURCE or SOURCE:N (its first N prompts) -> (SOURCE, N or None)."""
    name, colon, cap = spec.partition(":")
    if name not in SOURCES:
        raise DFlashError(f"Unknown --data source {name!r}; choose from {', '.join(SOURCES)}.")
    if colon and not (cap.isdigit() and int(cap) > 0):
        raise DFlashError(
            f"--data {spec}: after the colon comes how many of the source's prompts to take, a positive integer."
        )
    return name, int(cap) if colon else None


def source_names(specs) -> set[str]:
    return {source_spec(s)[0] for s in specs}


def load_prompts(sources: tuple[str, ...], seed: int = 0) -> list[tuple[str, str]]:
    """Shuffle each source (SOURCE or SOURCE:N, `source_spec`), then interleave them, so every prefix of the dataset
    is a balanced mix.

    Each source's order depends only on the seed and its name, so its first N prompts are the same in any mix: the
    ones the packed answers (train/answers.py) answer."""
    specs = [source_spec(s) for s in sources]
    if len({name for name, _ in specs}) < len(specs):
        raise DFlashError(f"--data names a source twice ({', '.join(sources)}); give each once, with its count if any.")
    lists = []
    for name, cap in specs:
        items = SOURCES[name]()
        random.Random(f"{seed}:{name}").shuffle(items)
        lists.append(items[:cap])
    return interleave(lists)


def interleave(lists: list[list]) -> list:
    out = []
    for i in range(max(map(len, lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


def remaining_prompts(prompts: list[tuple[str, str]], done: set[str]) -> list[tuple[str, str]]:
    """Unanswered prompts, re-interleaved by source, so what remains stays a balanced mix when a source grew."""
    by_source: dict[str, list] = {}
    for p in prompts:
        if p[0] not in done:
            by_source.setdefault(p[0].split(":")[0], []).append(p)
    return interleave(list(by_source.values()))


def read_dataset(path: Path) -> list[dict]:
    """Records of a dataset file, up to a torn last line (killed mid-write)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def features_path(data_path: Path) -> Path:
    return data_path.with_suffix(".features.bin")


def read_features(data_path: Path, width: int) -> torch.Tensor:
    """All feature rows of a dataset as one memory-mapped bf16 tensor [rows, width]."""
    import numpy as np

    raw = np.memmap(
        features_path(data_path), dtype=np.int16, mode="c"
    )  # copy-on-write: torch wants a writable buffer; nothing writes
    return torch.from_numpy(raw[: raw.size // width * width].reshape(-1, width)).view(torch.bfloat16)


@torch.inference_mode()
def greedy_batch(
    target, prompts: list[list[int]], *, layer_ids: list[int], max_new_tokens: int, eos: set[int], pick=None
):
    """Greedy answers of a batch of prompts, and the tapped features [len(prompt + answer), n_sel*H] (bf16) of each.

    `pick` (last-position logits [rows, V] -> next ids [rows]) replaces the argmax: the magpie source samples
    its questions with it.

    The deployment's own forward (`TargetModel.forward` over a static per-slot cache): each prompt prefilled into its
    slot, then one token per live row a step, each row attending to its own positions only; when rows end, the live
    ones move down to the first slots. HF's loop over a static cache attended over the whole cache every step
    (benchmarks/bench_datagen.py). The answer keeps its end token; its features row is zeros (never fed back, training
    never reads it).
    """
    n = len(prompts)
    pick = pick or greedy
    cache = target.new_cache(slots=n, capacity=max(map(len, prompts)) + max_new_tokens)
    per_row: list[list[torch.Tensor]] = []
    answers: list[list[int]] = [[] for _ in range(n)]
    with target.tapped(layer_ids):
        last = []
        for i, p in enumerate(prompts):
            logits, feats = target.forward(torch.tensor([p]), 0, cache, capture=True, logits_to_keep=1, first_slot=i)
            per_row.append([feats[0].to(torch.bfloat16)])
            last.append(logits[0, -1])
        nxt = pick(torch.stack(last))
        rows, pos = list(range(n)), [len(p) for p in prompts]  # per slot: its prompt, the position of its next token
        for step in range(max_new_tokens):
            for slot, t in enumerate(nxt.tolist()):
                answers[rows[slot]].append(t)
            live = [slot for slot, t in enumerate(nxt.tolist()) if t not in eos]
            if step + 1 == max_new_tokens or not live:
                break
            if len(live) < len(rows):  # live rows move down to the first slots: a forward's rows are contiguous slots
                for dst, src in enumerate(live):
                    if dst != src:
                        cache.move(src, dst, pos[src])
                rows, pos, nxt = [rows[s] for s in live], [pos[s] for s in live], nxt[live]
            logits, feats = target.forward(nxt[:, None], pos, cache, capture=True)  # [rows, 1, V], [rows, 1, n_sel*H]
            for slot, f in enumerate(feats[:, 0].to(torch.bfloat16)):
                per_row[rows[slot]].append(f[None])
            pos = [p + 1 for p in pos]
            nxt = pick(logits[:, -1])
    return answers, [torch.cat(f + [f[0].new_zeros(1, f[0].shape[-1])]) for f in per_row]


@torch.inference_mode()
def forward_features(target, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Tapped features [len(ids), n_sel*H] (bf16) of one forward over a prompt and an answer known already: the
    deployment's forward into a one-slot cache (in bf16 on one thread, 310 against 381 ms for HF's decoder over 252
    tokens; Intel Xeon with AMX, 2026-11-27, informal)."""
    with target.tapped(layer_ids):
        _, feats = target.forward(torch.tensor([ids]), 0, target.new_cache(1, len(ids)), capture=True, logits_to_keep=1)
    return feats[0].to(torch.bfloat16)


def generate_dataset(
    target,
    prompts: list[tuple[str, str]],
    path: Path,
    *,
    layer_ids: list[int],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    time_budget: float | None = None,
    progress=None,
    answers: dict[str, list[int]] | None = None,
) -> dict:
    """Answer prompts with the target (greedy, batched) and append records to `path`.

    A prompt whose key is in `answers` keeps that answer (cut at max_new_tokens) and only needs one forward for
    its features; the others are generated in full batches as they accumulate (the rest at the end).

    The tapped features of every token are captured during generation itself (it computes them anyway)
    and appended to `features_path(path)` as bf16 rows; a record's "feat_offset" is its first row and
    it has one row per token. Prompts whose key is already in the file are skipped (resume).
    Stops after `time_budget` seconds. Returns {"records", "response_tokens", "seconds"} of this call.
    """
    from ..runtime import DFlashEngine

    path.parent.mkdir(parents=True, exist_ok=True)
    records = read_dataset(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # drops a torn last line
    offset = records[-1]["feat_offset"] + len(records[-1]["input_ids"]) if records else 0
    feat_path = features_path(path)
    with open(feat_path, "ab") as ff:
        ff.truncate(offset * len(layer_ids) * target.hidden_size * 2)  # rows of a batch whose records never got written
    done = {r["key"] for r in records}
    todo = remaining_prompts(prompts, done)
    engine = DFlashEngine(target, None, 1)  # its encode() is the deployment's prompt formatting
    answers = answers or {}
    t0, n_rec, n_tok = time.perf_counter(), 0, 0
    pending: list[tuple[str, list[int]]] = []  # unanswered prompts wait for a full batch: a step costs about the same
    # for 8 rows as for 64, so a few new prompts in a batch of known answers would pay a whole generation each

    def generate(rows):
        answers_, feats_ = greedy_batch(
            target,
            [ids for _, ids in rows],
            layer_ids=layer_ids,
            max_new_tokens=max_new_tokens,
            eos=engine.eos_token_ids,
        )
        return [(key, ids, answer, feat) for (key, ids), answer, feat in zip(rows, answers_, feats_)]

    with open(path, "a") as f, open(feat_path, "ab") as ff:

        def write(rows):
            nonlocal offset, n_rec, n_tok
            lines = []
            for key, prompt_ids, resp, _ in rows:
                lines.append(
                    json.dumps(
                        {
                            "source": key.split(":")[0],
                            "key": key,
                            "feat_offset": offset,
                            "input_ids": prompt_ids + resp,
                            "loss_mask": [0] * len(prompt_ids) + [1] * len(resp),
                        }
                    )
                )
                offset += len(prompt_ids) + len(resp)
                n_rec, n_tok = n_rec + 1, n_tok + len(resp)
            ff.write(torch.cat([feat for *_, feat in rows]).view(torch.int16).numpy().tobytes())
            ff.flush()  # rows before records: a record on disk always has its rows
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            if progress:
                progress(
                    f"generated {len(prompts) - len(todo) + n_rec}/{len(prompts)} records, {n_tok} response tokens, "
                    f"{n_tok / (time.perf_counter() - t0):.0f} tok/s"
                )

        for i in range(0, len(todo), batch_size):
            if time_budget is not None and time.perf_counter() - t0 > time_budget:
                break
            ready = []
            for key, prompt in todo[i : i + batch_size]:
                ids = engine.encode(prompt)
                if key in answers:
                    resp = answers[key][:max_new_tokens]
                    ready.append((key, ids, resp, forward_features(target, ids + resp, layer_ids)))
                else:
                    pending.append((key, ids))
            if len(pending) >= batch_size:
                ready += generate(pending[:batch_size])
                pending = pending[batch_size:]
            if ready:
                write(ready)
        if pending:
            write(generate(pending))
    return {"records": n_rec, "response_tokens": n_tok, "seconds": time.perf_counter() - t0}


def _asks_for_more(before: dict, sources: tuple[str, ...], minutes: float | None, num_samples: int | None) -> bool:
    """Whether a request for the data phase goes beyond the one a finished phase met: a new source, a larger time
    budget or sample cap (None = unlimited)."""
    more = lambda new, old: old is not None and (new is None or new > old)  # noqa: E731
    return (
        bool(set(sources) - set(before["sources"]))
        or more(minutes, before["minutes"])
        or more(num_samples, before["num_samples"])
    )


def prepare_data(
    target,
    sources: tuple[str, ...],
    out_dir: Path,
    *,
    layer_ids: list[int],
    num_samples: int | None,
    minutes: float | None,
    max_new_tokens: int,
    batch_size: int,
    seed: int = 0,
    progress=None,
    frozen: bool = False,
) -> dict:
    """The data phase of train-draft: answer prompts into out_dir/data.jsonl, then mark it done in data.json.

    Resumable: a rerun continues an unfinished phase (answered prompts are skipped) and skips a finished one, unless
    it asks for more (a new source, more minutes or samples): then the phase continues where it stopped, so a later
    stage grows its data with the same command. `frozen` (training has begun on these records) refuses to grow them.
    """
    meta_path, data_path = out_dir / "data.json", out_dir / "data.jsonl"
    meta = (
        json.loads(meta_path.read_text())
        if meta_path.is_file()
        else {"sources": list(sources), "target_layer_ids": list(layer_ids), "seconds": 0.0, "done": False}
    )
    if meta["target_layer_ids"] != list(layer_ids):
        raise DFlashError(
            f"{out_dir} holds data captured at target layers {meta['target_layer_ids']}, not {list(layer_ids)}; use another --output."
        )
    before = meta.get("request")  # None in a data.json written before requests were recorded: such data never grows
    if meta["done"] and before is not None and _asks_for_more(before, sources, minutes, num_samples):
        if frozen:
            raise DFlashError(
                f"{out_dir} holds a training run over its {len(read_dataset(data_path))} records, which more data would "
                "reorder; to train on more data, copy data.json, data.jsonl and data.features.bin into a new --output "
                f"and pass --init-from {out_dir / 'draft'}."
            )
        meta["done"] = False
        if progress:
            progress(
                f"The data phase continues: asked for {', '.join(sources)}, {minutes or 'unlimited'} minutes, "
                f"{num_samples or 'all'} samples ({meta['seconds'] / 60:.1f} minutes spent so far)."
            )
    meta["sources"] += [s for s in sources if s not in meta["sources"]]  # a later stage may add sources
    if not meta["done"] or before is None:  # what a finished phase met; a rerun asking for more continues it
        meta["request"] = {"sources": list(meta["sources"]), "minutes": minutes, "num_samples": num_samples}
    if not meta["done"]:
        prompts = load_prompts(sources, seed)[:num_samples]
        budget = None if minutes is None else max(0.0, minutes * 60 - meta["seconds"])
        known = known_answers(target, sources, prompts, max_new_tokens)
        r = generate_dataset(
            target,
            prompts,
            data_path,
            layer_ids=layer_ids,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            time_budget=budget,
            progress=progress,
            answers=known,
        )
        meta["seconds"] += r["seconds"]
        meta.update(
            done=True,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            dtype=str(target.dtype).removeprefix("torch."),
        )
        if {"code", "docstring"} & source_names(sources):
            meta["code_packages"] = {**meta.get("code_packages", {}), **code_package_versions()}
        if "magpie" in source_names(sources):
            card = magpie_card()
            meta["magpie"] = {
                "card": {
                    k: card[k] for k in ("target", "target_fingerprint", "dtype", "settings", "sampling", "stats")
                },
                "answers": "the packaged greedy answers" if known else "generated in this data phase",
            }
        packed = [k for k in known if not k.startswith("magpie:")]
        if packed:
            card = answers_card()
            meta["packed_answers"] = {
                "card": {k: card[k] for k in ("target", "target_fingerprint", "dtype", "max_new_tokens")},
                "prompts": len(packed),
            }
    records = read_dataset(data_path)
    if not records:
        raise DFlashError(f"No training records in {data_path}; raise --num-samples or the data time budget.")
    meta["records"] = {s: sum(r["source"] == s for r in records) for s in sorted({r["source"] for r in records})}
    meta["response_tokens"] = sum(sum(r["loss_mask"]) for r in records)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def answer_tokens(
    target,
    sources: tuple[str, ...],
    *,
    per_source: int,
    max_new_tokens: int,
    batch_size: int,
    seed: int = 0,
    progress=None,
) -> list[list[int]]:
    """The target's greedy answers to `per_source` prompts of each source (the packaged chat answers where the target
    wrote them), formatted as the deployment formats prompts: what a draft vocabulary counts."""
    from ..runtime import DFlashEngine

    engine = DFlashEngine(target, None, 1)
    out = []
    for source in sources:
        prompts = load_prompts((source,), seed)[:per_source]
        known = known_answers(target, (source,), prompts, max_new_tokens)
        todo = [p for key, p in prompts if key not in known]
        out += [known[key][:max_new_tokens] for key, _ in prompts if key in known]
        for i in range(0, len(todo), batch_size):
            ids = [engine.encode(p) for p in todo[i : i + batch_size]]
            answers, _ = greedy_batch(
                target, ids, layer_ids=[0], max_new_tokens=max_new_tokens, eos=engine.eos_token_ids
            )
            out += answers
            if progress:
                progress(f"{source}: answered {min(i + batch_size, len(todo))}/{len(todo)} prompts")
    return out
