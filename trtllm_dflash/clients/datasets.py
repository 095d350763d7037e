"""Categorised prompt sets for `trtdflash bench --dataset`: SPEED-Bench's files, read as NVIDIA's harness reads them,
and our own built-in set in the same record shape, so every path runs without downloads (`builtin_records`: 11
categories named as SPEED-Bench's qualitative domains, three prompts each that we wrote, some of two turns).

SPEED-Bench (NVIDIA/Model-Optimizer `examples/specdec_bench`, a2fbac7) ships its records with the text of sources
that forbid redistribution replaced by a placeholder; its `prepare_data.py --dataset speed --config C` fetches them
and writes `data/speed/<C>/test.parquet`. We read that file (or any parquet file or folder of them) and never ship the
dataset itself. A record: `question_id`, `category` (the domain in `qualitative`, the entropy band in the
`throughput_*` configs), `sub_category`, `turns` (the user's messages, in order), `source`, `src_id`, `difficulty`,
`multiturn`. `select` is the harness's `_stratified_select` (datasets/speed.py): round-robin over categories in the
order they first appear, so `--num-requests` keeps every category in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.errors import DFlashError

CONFIGS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k", "throughput_32k")
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"  # specdec_bench speed.py
FIELDS = {  # column -> its type in SPEED-Bench's schema
    "question_id": str,
    "category": str,
    "sub_category": str,
    "turns": list,
    "source": str,
    "src_id": str,
    "difficulty": str,
    "multiturn": bool,
}
PREPARE = "python prepare_data.py --dataset speed --config {config} (NVIDIA/Model-Optimizer examples/specdec_bench)"


@dataclass(frozen=True)
class Record:
    question_id: str
    category: str
    turns: tuple[str, ...]  # the user's messages; each next one follows the model's own answer to the last
    sub_category: str = ""
    source: str = ""
    src_id: str = ""
    difficulty: str = ""
    multiturn: bool = False


def parquet_files(data: Path, config: str) -> list[Path]:
    """What `--data` names: prepare_data.py's output folder (DATA/speed/<config>/test.parquet, or DATA/<config>/),
    a folder of parquet files, or one file."""
    data = Path(data).expanduser()
    for folder in (data / "speed" / config, data / config, data):
        if folder.is_dir() and (files := sorted(folder.rglob("*.parquet"))):
            return files
    if data.is_file():
        return [data]
    raise DFlashError(
        f"--data {data}: no SPEED-Bench parquet file there (looked for speed/{config}/test.parquet); write it with "
        f"{PREPARE.format(config=config)}."
    )


def _record(row: dict, where: str, config: str) -> Record:
    for name, kind in FIELDS.items():
        if name not in row:
            raise DFlashError(f"{where}: no '{name}' field; SPEED-Bench records have {', '.join(FIELDS)}.")
        value = row[name]
        if not isinstance(value, kind) or (kind is list and not all(isinstance(t, str) for t in value)):
            want = "a list of strings" if kind is list else {str: "a string", bool: "a boolean"}[kind]
            raise DFlashError(f"{where}: '{name}' must be {want}, got {type(value).__name__}.")
    if not row["turns"] or not all(row["turns"]):
        raise DFlashError(f"{where}: 'turns' holds an empty message.")
    if any(t.startswith(PLACEHOLDER) for t in row["turns"]):
        raise DFlashError(
            f"{where} still holds SPEED-Bench's placeholder instead of its text; fetch the data with "
            f"{PREPARE.format(config=config)}."
        )
    return Record(
        row["question_id"],
        row["category"],
        tuple(row["turns"]),
        row["sub_category"],
        row["source"],
        row["src_id"],
        row["difficulty"],
        row["multiturn"],
    )


def read_speed_bench(data: Path, config: str = "qualitative") -> list[Record]:
    """Every record of the SPEED-Bench files `--data` names, checked field by field (one sentence on the first bad one)."""
    if config not in CONFIGS:
        raise DFlashError(f"--config must be one of {', '.join(CONFIGS)}, got {config!r}.")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DFlashError("Reading SPEED-Bench's parquet files needs pyarrow: pip install pyarrow.") from None
    import pyarrow

    records = []
    for path in parquet_files(data, config):
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, pyarrow.ArrowException) as e:
            raise DFlashError(f"--data {path} is not a readable parquet file ({e}).") from None
        records += [_record(row, f"--data {path}, row {i}", config) for i, row in enumerate(rows)]
    if not records:
        raise DFlashError(f"--data {data} holds no records.")
    return records


def select(records: Sequence[Record], n: int | None, categories: Sequence[str] = ()) -> list[Record]:
    """The records of `categories` (all where empty), then `n` of them as specdec_bench's `_stratified_select` picks
    them: the i-th record of each category in turn (categories in order of first appearance), an exhausted category
    skipped, until n; all of them, in file order, where n is None or not below their number."""
    if categories:
        present = dict.fromkeys(r.category for r in records)
        if missing := [c for c in categories if c not in present]:
            raise DFlashError(f"--category {missing[0]!r} is not in the data; it has {', '.join(present)}.")
        records = [r for r in records if r.category in categories]
    if n is None or n >= len(records):
        return list(records)
    by_category: dict[str, list[Record]] = {}
    for r in records:
        by_category.setdefault(r.category, []).append(r)
    if len(by_category) == 1:
        return list(records[:n])
    picked: list[Record] = []
    for i in range(max(map(len, by_category.values()))):
        for rows in by_category.values():
            if i < len(rows):
                picked.append(rows[i])
                if len(picked) == n:
                    return picked
    return picked


def builtin_records() -> list[Record]:
    """Our own categorised prompts (package data bench-builtin/records.jsonl), in SPEED-Bench's record shape."""
    import json
    from importlib import resources

    text = (resources.files("trtllm_dflash.data") / "bench-builtin" / "records.jsonl").read_text(encoding="utf-8")
    return [
        _record(json.loads(line), f"bench-builtin line {i}", "qualitative")
        for i, line in enumerate(text.splitlines(), 1)
    ]
