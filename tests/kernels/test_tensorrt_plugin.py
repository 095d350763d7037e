"""Our TensorRT plugin registers through TensorRT's own `tensorrt.plugin` validation (register, autotune, impl), from
the `tensorrt-cu12-bindings` wheel the README names, with only the native module stood in for (trt_standin.py)."""

import importlib
import json
import sys
from importlib.metadata import version

import pytest
import trt_standin  # beside this file (pytest puts the folder on sys.path)

PLUGIN_MODULE = "trtllm_dflash.plugins.tensorrt_plugin"


@pytest.fixture
def trt():
    saved = {n: m for n, m in sys.modules.items() if n == "tensorrt" or n.startswith("tensorrt.") or n == PLUGIN_MODULE}
    sys.modules.pop(PLUGIN_MODULE, None)
    yield trt_standin.install()
    for name in [n for n in sys.modules if n == "tensorrt" or n.startswith("tensorrt.") or n == PLUGIN_MODULE]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_the_block_attention_plugin_passes_tensorrts_validator(trt):
    assert version("tensorrt-cu12-bindings") == "11.4.0.106"
    plugin = importlib.import_module(PLUGIN_MODULE)
    creator = trt.get_plugin_registry().get_creator("block_attention", "1", "trtdflash")
    assert creator is not None and plugin.PLUGIN_ID == "trtdflash::block_attention"
    import tensorrt.plugin as trtp

    descs = [trtp.TensorDesc() for _ in range(6)]
    combos = plugin._formats(*descs, outputs=(trtp.TensorDesc(),))
    assert len(combos) == 1 and isinstance(combos[0], trtp.AutoTuneCombination)


def test_the_validator_is_real(trt):
    """String annotations (what `from __future__ import annotations` makes) and a bare `-> list` are refused."""
    import tensorrt.plugin as trtp

    def shape(q: "trtp.TensorDesc", causal: "int") -> "trtp.TensorDesc":
        return q.like()

    with pytest.raises((TypeError, ValueError)):
        trtp.register("check::strings")(shape)

    @trtp.register("check::formats")
    def shape_ok(q: trtp.TensorDesc, causal: int) -> trtp.TensorDesc:
        return q.like()

    def formats(q, outputs) -> list:
        return []

    with pytest.raises(ValueError, match="Return types can only be AutoTuneCombination or List"):
        trtp.autotune("check::formats")(formats)


def test_the_drafter_engine_is_built_strongly_typed_as_tensorrt_11_requires(trt, tmp_path):
    """TensorRT 11 removed weak typing and BuilderFlag.BF16: the drafter's network asks for STRONGLY_TYPED and sets no
    precision flag (with the old code, `trt.BuilderFlag.BF16` raised here as it would on a TensorRT 11 host)."""
    from trtllm_dflash.deploy.draft_engine import ENGINE_FILE, build_engine

    record = trt_standin.install_builder(trt)
    meta = {"block_size": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32}
    (tmp_path / "drafter.json").write_text(json.dumps(meta))
    assert build_engine(tmp_path, "bf16", 4, 64, progress=lambda m: None) == tmp_path / ENGINE_FILE
    assert record.network_flags == 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) and record.built
    assert ("ctx_k", (2, 1, 2, 1, 8), (2, 2, 2, 32, 8), (2, 4, 2, 64, 8)) in record.profiles
