"""`trtdflash build --draft-engine`: the drafter as ONNX (attention = one TensorRT plugin node) and its TensorRT engine.

The ONNX graph is the draft's inference forward (`DFlashDraftModel.draft_block`) plus the target's LM head:
    inputs   noise_embedding [b, Q, H] float, positions [b, Q] int64, ctx_k / ctx_v [L, b, nkv, C, hd] float,
             ctx_lens [b] int64   (b and C dynamic, Q = the block size)
    output   logits [b, Q, vocab]
Each layer's attention is one node `trtdflash::block_attention` (the torch custom op of trtllm_dflash/kernels/attention.py,
translated by torch's dynamo ONNX exporter through `custom_translation_table`) with int attributes `causal`,
`window` (0 = none) and `plugin_namespace="trtdflash"`, which is how TensorRT's ONNX parser finds the plugin of
plugins/tensorrt_plugin.py. The export is checked before it is written: onnxruntime evaluates the graph with the
custom node run by the reference (an onnxruntime-extensions Python op) and must reproduce the torch logits.
The engine is built only where TensorRT and a GPU exist; elsewhere the build writes the ONNX and says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels import attention

OUT_DIR = "draft_engine"
ONNX_FILE = "drafter.onnx"
ENGINE_FILE = "drafter.engine"
INPUTS = ("noise_embedding", "positions", "ctx_k", "ctx_v", "ctx_lens")
OUTPUTS = ("logits",)
DOMAIN, OP_NAME = attention.OP.split(
    "::"
)  # ONNX domain "trtdflash", op_type "block_attention" = the TensorRT plugin's id
MAX_CONTEXT = 1 << 17  # upper bound declared for the dynamic context dimension
ONNX_EXTRA = "pip install 'trtllm-dflash[onnx]'"


class Drafter(nn.Module):
    """What the drafter engine computes: one block per row over ragged context caches -> draft logits."""

    def __init__(self, draft: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.draft, self.lm_head = draft, lm_head

    def forward(self, noise_embedding, positions, ctx_k, ctx_v, ctx_lens):
        hidden = self.draft.draft_block(noise_embedding, positions, ctx_k, ctx_v, ctx_lens)
        return self.draft.compute_logits(hidden, self.lm_head)


def example_inputs(config, block_size: int, batch: int = 2, generator: torch.Generator | None = None) -> tuple:
    """Random inputs of the graph's shapes; rows span an empty context to a full one (ragged)."""
    cap = 3 * block_size + 5  # not 0/1 and no other dimension's size, so the exporter keeps it symbolic
    lens = torch.linspace(0, cap, batch).round().long()
    shape = (config.num_hidden_layers, batch, config.num_key_value_heads, cap, config.head_dim)
    return (
        torch.randn(batch, block_size, config.hidden_size, generator=generator),
        lens[:, None] + torch.arange(block_size),
        torch.randn(shape, generator=generator),
        torch.randn(shape, generator=generator),
        lens,
    )


def _onnx_block_attention():
    """The translation of the custom op: one node in the plugin's domain (schema registered once, so onnxscript
    can type it)."""
    try:
        import onnx
        import onnxscript
        from onnx.defs import OpSchema
    except ImportError:
        raise DFlashError(f"Writing the ONNX drafter needs onnx and onnxscript; {ONNX_EXTRA}.") from None
    if not onnx.defs.has(OP_NAME, 1, DOMAIN):
        p, attr = OpSchema.FormalParameter, OpSchema.Attribute
        onnx.defs.register_schema(
            OpSchema(
                OP_NAME,
                DOMAIN,
                1,
                doc=attention.block_attention.__doc__,
                inputs=[p(n, "T") for n in ("q", "k", "v", "ctx_k", "ctx_v")] + [p("ctx_lens", "I")],
                outputs=[p("out", "T")],
                type_constraints=[
                    ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "attention dtype"),
                    ("I", ["tensor(int32)", "tensor(int64)"], "context lengths"),
                ],
                attributes=[
                    attr("causal", OpSchema.AttrType.INT, "1: causal inside the block"),
                    attr("window", OpSchema.AttrType.INT, "sliding window, 0 = none"),
                    attr("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                    attr("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version"),
                ],
            )
        )
    node = getattr(onnxscript.values.Opset(DOMAIN, 1), OP_NAME)

    def translate(q, k, v, ctx_k, ctx_v, ctx_lens, causal: bool = False, window: int = 0):
        return node(
            q,
            k,
            v,
            ctx_k,
            ctx_v,
            ctx_lens,
            causal=int(causal),
            window=int(window),
            plugin_namespace=DOMAIN,
            plugin_version="1",
        )

    return translate


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level, log.level = log.level, logging.ERROR
    try:
        yield
    finally:
        log.level = level


def export_drafter(drafter: Drafter, path: Path, block_size: int) -> Path:
    """Write the ONNX drafter (weights as external data beside it: a large LM head exceeds protobuf's 2 GB)."""
    config = drafter.draft.config
    args = example_inputs(config, block_size, generator=torch.Generator().manual_seed(0))
    batch, ctx = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("context", min=1, max=MAX_CONTEXT)
    dynamic = ({0: batch}, {0: batch}, {1: batch, 3: ctx}, {1: batch, 3: ctx}, {0: batch})
    translate = _onnx_block_attention()
    with torch.no_grad(), warnings.catch_warnings(), _quiet("torch.onnx"):
        warnings.simplefilter("ignore")  # exporter chatter (deprecations, axis renames) is not the user's business
        program = torch.onnx.export(
            drafter.eval(),
            args,
            dynamo=True,
            input_names=list(INPUTS),
            output_names=list(OUTPUTS),
            dynamic_shapes=dynamic,
            custom_translation_table={torch.ops.trtdflash.block_attention.default: translate},
            verbose=False,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)
    return path


_ORT_OP = []  # the onnxruntime-extensions op is registered process-wide, once


def onnxruntime_session(path: Path):
    """An onnxruntime session on the ONNX drafter whose custom node runs the reference block attention."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError:
        raise DFlashError(
            f"Evaluating the ONNX drafter needs onnxruntime and onnxruntime-extensions; {ONNX_EXTRA}."
        ) from None
    if not _ORT_OP:
        f32, i64, text = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64, PyCustomOpDef.dt_string

        @onnx_op(
            op_type=attention.OP,
            inputs=[f32] * 5 + [i64],
            outputs=[f32],
            attrs={"causal": i64, "window": i64, "plugin_namespace": text, "plugin_version": text},
        )
        def reference(q, k, v, ctx_k, ctx_v, ctx_lens, causal=0, window=0, plugin_namespace="", plugin_version=""):
            t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v, ctx_k, ctx_v, ctx_lens)]
            return attention.block_attention_reference(*t, bool(causal), int(window) or None).numpy()

        _ORT_OP.append(reference)
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def max_abs_error(drafter: Drafter, session, inputs: tuple) -> tuple[float, float]:
    """(max |onnx - torch| logit error, max |torch logit|) on the given inputs."""
    with torch.no_grad():
        expected = drafter(*inputs)
    got = session.run(list(OUTPUTS), {name: t.numpy() for name, t in zip(INPUTS, inputs)})[0]
    return float((torch.from_numpy(got) - expected).abs().max()), float(expected.abs().max())


def load_lm_head(target_dir: Path) -> nn.Linear:
    """The target's LM head from its safetensors (the tied embedding when there is no separate head), fp32."""
    from safetensors import safe_open

    found = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
                    found[name.rsplit(".", 2)[-2]] = (f, name)
    key = "lm_head" if "lm_head" in found else "embed_tokens" if "embed_tokens" in found else None
    if key is None:
        raise DFlashError(
            f"Target {target_dir} has neither lm_head.weight nor embed_tokens.weight; the drafter needs the LM head."
        )
    f, name = found[key]
    with safe_open(f, "pt") as st:
        weight = st.get_tensor(name)
    if not weight.is_floating_point() or weight.element_size() < 2:
        raise DFlashError(
            f"Target {target_dir} stores its LM head quantized ({weight.dtype}); export the drafter from the unquantized target."
        )
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight.data = weight.float()
    return head


def write_drafter(
    draft_dir: Path, target_dir: Path, out: Path, block_size: int, progress: Callable[[str], None]
) -> Path:
    """Export the drafter and verify it with onnxruntime (reference custom node) before anything uses it."""
    from trtllm_dflash.models.checkpoint import load_draft

    drafter = Drafter(load_draft(draft_dir), load_lm_head(target_dir)).eval()
    path = export_drafter(drafter, out / ONNX_FILE, block_size)
    inputs = example_inputs(drafter.draft.config, block_size, batch=3, generator=torch.Generator().manual_seed(1))
    err, scale = max_abs_error(drafter, onnxruntime_session(path), inputs)
    if err > 1e-4 * max(scale, 1.0):
        raise DFlashError(
            f"The exported drafter's logits differ from torch's by {err:.2e}; this is a bug, please report it."
        )
    progress(f"ONNX drafter verified with onnxruntime: max logit error {err:.1e} (logits up to {scale:.1f}).")
    (out / "drafter.json").write_text(
        json.dumps(
            {
                "inputs": list(INPUTS),
                "outputs": list(OUTPUTS),
                "block_size": block_size,
                "plugin": attention.OP,
                "num_hidden_layers": drafter.draft.config.num_hidden_layers,
                "num_key_value_heads": drafter.draft.config.num_key_value_heads,
                "head_dim": drafter.draft.config.head_dim,
                "hidden_size": drafter.draft.config.hidden_size,
            },
            indent=2,
        )
        + "\n"
    )
    return path


def tensorrt_available() -> bool:
    """TensorRT's Python package and a CUDA device: what building the engine needs."""
    return importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


def build_engine(out: Path, dtype: str, max_batch: int, max_context: int, progress: Callable[[str], None]) -> Path:
    """Parse the ONNX drafter with TensorRT (the plugin registered first) and write the serialized engine.

    Written against TensorRT 10's and 11's Python API (`trt.Builder`, `trt.OnnxParser`, optimization profiles,
    `build_serialized_network`); runs only on a GPU host. The network is strongly typed: TensorRT 11 removed weak
    typing and its precision flags (`BuilderFlag.BF16` among them), so the ONNX graph's types are the engine's.
    """
    import tensorrt as trt

    from trtllm_dflash.plugins import tensorrt_plugin  # noqa: F401  registers trtdflash::block_attention

    meta = json.loads((out / "drafter.json").read_text())
    q, layers, nkv, hd, h = (
        meta["block_size"],
        meta["num_hidden_layers"],
        meta["num_key_value_heads"],
        meta["head_dim"],
        meta["hidden_size"],
    )
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(out / ONNX_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise DFlashError(f"TensorRT could not parse {out / ONNX_FILE}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    opt_b, opt_c = max(1, max_batch // 2), max(1, max_context // 2)
    for name, dims in (
        ("noise_embedding", lambda b, c: (b, q, h)),
        ("positions", lambda b, c: (b, q)),
        ("ctx_k", lambda b, c: (layers, b, nkv, c, hd)),
        ("ctx_v", lambda b, c: (layers, b, nkv, c, hd)),
        ("ctx_lens", lambda b, c: (b,)),
    ):
        profile.set_shape(name, dims(1, 1), dims(opt_b, opt_c), dims(max_batch, max_context))
    config.add_optimization_profile(profile)
    progress(f"Building the TensorRT drafter engine (batch <= {max_batch}, context <= {max_context}, {dtype})...")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise DFlashError(
            "TensorRT failed to build the drafter engine; rerun with a smaller --max-batch-size or --max-seq-len."
        )
    (out / ENGINE_FILE).write_bytes(bytes(plan))
    return out / ENGINE_FILE


def steps(opts, src, hashes: dict[str, str], max_batch: int, progress: Callable[[str], None]) -> list:
    """The build steps of --draft-engine: the verified ONNX drafter, and the engine where TensorRT can build it."""
    from importlib import metadata

    from trtllm_dflash.deploy.steps import PlannedFile, Step
    from trtllm_dflash.models import draft as draft_module
    from trtllm_dflash.resolve import sha256_file

    if src is None or src.draft_dir is None:
        raise DFlashError(
            "--draft-engine exports a local draft with its target's LM head; pass --target DIR and a draft "
            "(--draft DIR or the preset's), not --no-draft or a preset the GPU host downloads."
        )
    versions = {}
    for pkg in ("torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-extensions"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    key = {
        "draft": {p.name: hashes[str(p)] for p in src.draft_files},
        "target": {p.name: hashes[str(p)] for p in src.target_files if p.suffix == ".safetensors"},
        "block_size": src.block_size,
        "versions": versions,
        "code": {Path(m.__file__).name: sha256_file(Path(m.__file__)) for m in (attention, draft_module)}
        | {"draft_engine.py": sha256_file(Path(__file__))},
    }

    def export(tmp: Path, progress):
        write_drafter(src.draft_dir, src.target_dir, tmp / OUT_DIR, src.block_size, progress)

    out = [
        Step(
            "draft_onnx",
            f"export the drafter to ONNX ({attention.OP} as a TensorRT plugin node) and verify it with onnxruntime",
            [],
            key,
            export,
            writes=OUT_DIR,
        )
    ]
    if not tensorrt_available():
        progress(
            "--draft-engine: TensorRT or a GPU is missing here, so this build writes the ONNX drafter only; build on a "
            "GPU host with TensorRT (and triton) for draft_engine/drafter.engine."
        )
        return out
    dtype, max_context = opts.dtype, src.max_seq_len

    def engine(tmp: Path, progress):
        build_engine(tmp / OUT_DIR, dtype, max_batch, max_context, progress)

    out.append(
        Step(
            "draft_engine",
            "build the TensorRT drafter engine with the block-attention plugin",
            [PlannedFile(f"{OUT_DIR}/{ENGINE_FILE}", 0)],
            key | {"dtype": dtype, "max_batch": max_batch, "max_context": max_context},
            engine,
        )
    )
    return out
