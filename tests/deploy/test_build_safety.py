"""`trtdflash build` under faults: killed mid-way (SIGKILL, SIGINT), two builds of one output at once, a full disk,
an interrupted swap, a manifest that points outside the build. The output is always the previous complete build or
absent, and the next run recovers."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtllm_dflash.cli import main
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.deploy.core import read_build
from trtllm_dflash.errors import DFlashError

# A real build in a child process that signals itself when a step starts: `at` "[2/" = the first step has written its files.
# SIGINT gets Python's handler back: a job a shell starts in the background (`cmd &`, as CI may be) inherits it ignored.
CHILD = """
import os, signal, sys, time
from pathlib import Path
from trtllm_dflash.deploy import BuildOptions, run_build
signal.signal(signal.SIGINT, signal.default_int_handler)
out, draft, sig, at, batch, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
def progress(m):
    print(m, flush=True)
    if m.startswith(at):
        if sig:
            os.kill(os.getpid(), sig)
            raise SystemExit(f"signal {sig} did not stop the build")
        Path(gate + ".started").touch()
        while not Path(gate).exists():  # hold the build (and its lock) until the test opens the gate
            time.sleep(0.05)
run_build(BuildOptions(output=Path(out), draft=draft, max_seq_len=512, max_batch_size=batch), progress=progress)
"""


def child(out, draft, sig=0, at="[2/", batch=4, gate=""):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(draft), str(int(sig)), at, str(batch), str(gate)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def build(out, draft, batch=4, progress=None):
    return run_build(
        BuildOptions(output=out, draft=str(draft), max_seq_len=512, max_batch_size=batch),
        progress=progress or (lambda m: None),
    )


def siblings(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_sigkill_mid_build_leaves_no_output_and_the_next_run_recovers(random_draft_dir, tmp_path):
    out = tmp_path / "build"
    proc = child(out, random_draft_dir, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    assert not out.exists()  # absent, not half-written
    assert any(n.startswith(".build.tmp") for n in siblings(tmp_path))  # what the killed build left
    msgs = []
    build(out, random_draft_dir, progress=msgs.append)
    assert any(m.startswith("Cleaned up after an interrupted build") for m in msgs)
    assert siblings(tmp_path) == ["build"] and read_build(out)["steps"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_interrupted_rebuild_keeps_the_previous_complete_build(random_draft_dir, tmp_path, sig):
    out = tmp_path / "build"
    build(out, random_draft_dir, batch=2)
    before = (out / "manifest.json").read_text()
    proc = child(out, random_draft_dir, sig, batch=3)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert (out / "manifest.json").read_text() == before
    assert "max_batch_size: 2" in (out / "triton_repo/ensemble/config.pbtxt").read_text()
    if sig == signal.SIGINT:  # Python unwinds: the build removes its own temporary directory and lock
        assert siblings(tmp_path) == ["build"]
    build(out, random_draft_dir, batch=3)
    assert "max_batch_size: 3" in (out / "triton_repo/ensemble/config.pbtxt").read_text()
    assert siblings(tmp_path) == ["build"]


def test_a_second_build_of_the_same_output_is_refused_while_the_first_runs(random_draft_dir, tmp_path):
    out, gate = tmp_path / "build", tmp_path / "gate"
    first = child(out, random_draft_dir, at="[2/", gate=gate)
    deadline = time.monotonic() + 300
    while not gate.with_name("gate.started").exists():
        assert first.poll() is None and time.monotonic() < deadline, (
            first.stderr.read() if first.poll() is not None else "timeout"
        )
        time.sleep(0.05)
    with pytest.raises(DFlashError) as e:
        build(out, random_draft_dir, batch=5)
    assert str(e.value) == (
        f"Another build (process {first.pid}) is writing {out} right now; wait for it to finish or pick "
        "another output directory."
    )
    r = CliRunner().invoke(
        main, ["build", "--draft", str(random_draft_dir), "--output", str(out), "--max-seq-len", "512"]
    )
    assert r.exit_code == 2 and "Another build" in r.output and "Traceback" not in r.output
    gate.touch()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert read_build(out)["options"]["max_batch_size"] == 4  # the first build's, whole
    build(out, random_draft_dir, batch=5)  # the lock is free again
    assert read_build(out)["options"]["max_batch_size"] == 5


def test_a_full_disk_is_one_sentence_and_leaves_the_previous_build(random_draft_dir, tmp_path, monkeypatch):
    """The environment fails, not the build: the manifest write gets half its bytes on disk, then ENOSPC."""
    out = tmp_path / "build"
    build(out, random_draft_dir)
    before = (out / "manifest.json").read_text()
    real_write = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        if self.name == "manifest.json":
            real_write(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    r = CliRunner().invoke(
        main,
        [
            "build",
            "--draft",
            str(random_draft_dir),
            "--output",
            str(out),
            "--max-seq-len",
            "512",
            "--max-batch-size",
            "3",
        ],
    )
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: the disk is full (No space left on device writing ") and "manifest.json" in last
    assert (out / "manifest.json").read_text() == before
    assert siblings(tmp_path) == ["build"]  # the partial manifest went with the temporary directory


def test_a_swap_interrupted_between_its_renames_is_put_back(random_draft_dir, tmp_path):
    """Where the filesystem cannot exchange two directories, replace_dir parks the old build for a moment; a kill
    then leaves no output at all, and the next run puts the parked build back before anything else."""
    out = tmp_path / "build"
    build(out, random_draft_dir)
    manifest = (out / "manifest.json").read_text()
    out.rename(tmp_path / ".build.old4242")
    (tmp_path / ".build.tmp4242" / "checkpoints").mkdir(parents=True)
    msgs = []
    build(out, random_draft_dir, progress=msgs.append)
    assert "Cleaned up after an interrupted build" in msgs[0] and "up to date" in msgs[-1]  # the parked build, intact
    assert (out / "manifest.json").read_text() == manifest
    assert siblings(tmp_path) == ["build"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: m["steps"]["tokenizer"]["outputs"].update({"../../../etc/passwd": {"size": 1, "sha256": "x"}}),
            "leaves that directory",
        ),
        (lambda m: m["serve"].update(model_repository="/etc"), "leaves that directory"),
        (lambda m: m.update(steps=[]), "is damaged or was edited (steps are malformed)"),
        (lambda m: m.update(format=99), "is damaged or was edited (format 99, expected 1)"),
    ],
    ids=["output-escapes", "repository-absolute", "steps-malformed", "format"],
)
def test_a_manifest_is_input_too(random_draft_dir, tmp_path, edit, message):
    out = tmp_path / "build"
    build(out, random_draft_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    for action in (lambda: read_build(out), lambda: build(out, random_draft_dir, batch=3)):
        with pytest.raises(DFlashError, match=message.replace("(", r"\(").replace(")", r"\)")):
            action()
    assert not (tmp_path / "etc").exists()


MANIFEST = {
    "format": 1,
    "options": {"target": "smollm2-135m"},
    "resolved": {"max_seq_len": 512},
    "serve": {"model_repository": "triton_repo", "model": "ensemble"},
    "steps": {"tokenizer": {"key": "k", "outputs": {"tokenizer/tokenizer.json": {"size": 1, "sha256": "x"}}}},
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    top=st.dictionaries(st.sampled_from(sorted(MANIFEST)), JSON_VALUES, max_size=2),
    serve=st.dictionaries(st.sampled_from(["model_repository", "model"]), JSON_VALUES, max_size=2),
    output=st.one_of(
        st.text(max_size=30), st.sampled_from(["../x", "/etc/passwd", "a/../../b", "", "ok/f", "a\0b", "."])
    ),
)
def test_fuzz_manifests_are_read_or_refused_in_one_sentence(tmp_path_factory, top, serve, output):
    out = tmp_path_factory.getbasetemp() / "fuzzbuild"
    out.mkdir(exist_ok=True)
    manifest = json.loads(json.dumps(MANIFEST)) | top
    if isinstance(manifest.get("serve"), dict):
        manifest["serve"].update(serve)
    if isinstance(manifest.get("steps"), dict) and isinstance(manifest["steps"].get("tokenizer"), dict):
        manifest["steps"]["tokenizer"]["outputs"] = {output: {"size": 1}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    try:
        got = read_build(out)
    except DFlashError as e:
        assert "\n" not in str(e)
    else:  # what is accepted names only paths inside the build
        for rel in [got["serve"]["model_repository"], *(r for step in got["steps"].values() for r in step["outputs"])]:
            assert (out / rel).resolve().is_relative_to(out.resolve())


def test_an_output_that_cannot_be_written_is_one_sentence(random_draft_dir):
    r = CliRunner().invoke(main, ["build", "--draft", str(random_draft_dir), "--output", "/sys/trtdflash-test/build"])
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and last.endswith("/sys/trtdflash-test; check the path and its permissions.")
