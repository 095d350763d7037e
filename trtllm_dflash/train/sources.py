"""Prompt sources for a draft's training data (`--data NAME[:COUNT]`): each a list of (key, prompt), none from a
hub, and the answers the package already holds for some of them."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import random
import re
import sysconfig
from pathlib import Path

from trtllm_dflash.data import (
    CODE_COMPLETE_TEMPLATE,
    answers_card,
    answers_records,
    gsm8k_records,
    magpie_card,
    magpie_records,
)
from trtllm_dflash.errors import DFlashError


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
    installed (docs/performance.md#library-functions-cache).
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
    from trtllm_dflash.train.magpie import TOPICS

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
    from trtllm_dflash.train.records import prompt_hash, target_fingerprint

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
