"""The ONNX drafter: attention is one TensorRT-plugin node per layer, and onnxruntime, running that node with the
reference, reproduces the torch drafter's logits (on shapes other than the export's: batch and context are dynamic)."""

import subprocess
import sys

import onnx
import torch
from conftest import make_random_draft

from trtllm_dflash.deploy import draft_engine as de
from trtllm_dflash.kernels import attention
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.resolve import resolve_draft


def check_graph(path, config):
    nodes = [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == de.OP_NAME]
    assert len(nodes) == config.num_hidden_layers and all(n.domain == "trtdflash" for n in nodes)
    for i, n in enumerate(nodes):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs == {
            "causal": int(config.layer_is_causal(i)),
            "window": config.layer_window(i) or 0,
            "plugin_namespace": b"trtdflash",
            "plugin_version": b"1",
        }


def logit_error(drafter, session, batch, lens, cap, seed):
    c = drafter.draft.config
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    shape = (c.num_hidden_layers, batch, c.num_key_value_heads, cap, c.head_dim)
    args = (
        torch.randn(batch, c.block_size, c.hidden_size, generator=g),
        lens[:, None] + torch.arange(c.block_size),
        torch.randn(shape, generator=g),
        torch.randn(shape, generator=g),
        lens,
    )
    return de.max_abs_error(drafter, session, args)


def test_shipped_drafter_round_trips_through_onnxruntime(target_dir, tmp_path):
    """The shipped SmolLM2 draft with the real target's LM head."""
    out = tmp_path / "draft_engine"
    de.write_drafter(resolve_draft(None, "smollm2-135m"), target_dir, out, 8, progress=lambda m: None)
    drafter = de.Drafter(load_draft(resolve_draft(None, "smollm2-135m")), de.load_lm_head(target_dir)).eval()
    check_graph(out / de.ONNX_FILE, drafter.draft.config)
    session = de.onnxruntime_session(out / de.ONNX_FILE)
    assert [i.name for i in session.get_inputs()] == list(de.INPUTS)
    for batch, lens, cap in [(1, [0], 1), (4, [5, 0, 64, 31], 64)]:  # batch and context differ from the export's
        err, scale = logit_error(drafter, session, batch, lens, cap, seed=batch)
        assert err <= 1e-4 * scale, (batch, err, scale)


def test_sliding_window_drafter_carries_its_rules(target, target_dir, tmp_path):
    """A draft with a causal sliding-window layer: the node's attributes carry the rule and the logits still match."""
    path = make_random_draft(
        target,
        tmp_path / "swa",
        num_layers=2,
        block_size=8,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
    )
    out = tmp_path / "draft_engine"
    de.write_drafter(path, target_dir, out, 8, progress=lambda m: None)
    drafter = de.Drafter(load_draft(path), de.load_lm_head(target_dir)).eval()
    check_graph(out / de.ONNX_FILE, drafter.draft.config)
    err, scale = logit_error(drafter, de.onnxruntime_session(out / de.ONNX_FILE), 3, [0, 4, 40], 40, seed=3)
    assert err <= 1e-4 * scale


def test_build_draft_engine_without_tensorrt_writes_the_onnx_only(tmp_path):
    """The CLI plans the export step and, with no TensorRT here, says the engine is built on a GPU host."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtllm_dflash.cli",
            "build",
            "--output",
            str(tmp_path / "b"),
            "--draft-engine",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "draft_onnx" in out.stderr and "TensorRT or a GPU is missing here" in out.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtllm_dflash.cli",
            "build",
            "--output",
            str(tmp_path / "c"),
            "--draft-engine",
            "--no-draft",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--draft-engine" in bad.stderr and "Traceback" not in bad.stderr


def test_plugin_id_is_the_op_name():
    """torch op, ONNX node (domain::op_type) and TensorRT plugin id are one name."""
    assert attention.OP == f"{de.DOMAIN}::{de.OP_NAME}" == "trtdflash::block_attention"
