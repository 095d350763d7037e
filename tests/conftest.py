"""Shared fixtures: the real SmolLM2-135M target (converted once into the cache) and small real drafts."""

import hashlib
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under its interpreter on these CPU machines; triton reads this when a kernel is decorated, so it is
# set before any test imports the drafting kernel (whichever test folder happens to import it first).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.models.checkpoint import save_draft
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import DRAFTS_DIR, resolve_target

SMOL_MASK_ID = 16  # <empty_output>: a special token chat never produces


@pytest.fixture(scope="session")
def target_dir():
    return resolve_target("smollm2-135m", progress=lambda m: None)


@pytest.fixture(scope="session")
def target(target_dir):
    return TargetModel.load(target_dir)


def make_random_draft(target: TargetModel, path, num_layers=2, block_size=16, seed=0, **overrides):
    cfg = DraftConfig.for_target(
        target.text_config,
        vocab_rows=target.vocab_rows,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=SMOL_MASK_ID,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = DFlashDraftModel(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    save_draft(model, path, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def random_draft_dir(target, tmp_path_factory):
    return make_random_draft(target, tmp_path_factory.mktemp("drafts") / "random")


@pytest.fixture(scope="session")
def quantized(request):
    """quantized(quant, role="target", kv_cache_quant="none", offload=False) -> a `trtdflash convert` output of the
    SmolLM2 target or the packaged draft, calibrated on 2 chat samples. Each is converted once and kept in pytest's
    cache, keyed by the converter's source and ModelOpt's version: the conversion tests and the runtime tests read the
    same checkpoints (a clean run converts 7 times, where the two modules' own sets took 12), and only the first run
    pays."""
    import modelopt

    from trtllm_dflash.convert import ConvertOptions, convert_checkpoint

    src = sorted((Path(__file__).parents[1] / "trtllm_dflash" / "convert").glob("*.py"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in src) + modelopt.__version__.encode()).hexdigest()[:12]
    root = request.config.cache.mkdir("quantized-smollm2")

    def get(quant: str, role: str = "target", kv_cache_quant: str = "none", offload: bool = False) -> Path:
        out = root / f"{role}-{quant}-kv-{kv_cache_quant}{'-offload' if offload else ''}-{key}"
        if not (out / "hf_quant_config.json").is_file():
            model = "smollm2-135m" if role == "target" else str(DRAFTS_DIR / "smollm2-135m")
            convert_checkpoint(
                ConvertOptions(
                    model=model,
                    quant=quant,
                    output=out,
                    role=role,
                    kv_cache_quant=kv_cache_quant,
                    calib_data="chat",
                    calib_samples=2,
                    offload=offload,
                ),
                progress=lambda m: None,
            )
        return out

    return get


@pytest.fixture
def one_thread():
    """One torch thread for the test (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TRTLLM_BLOCK = 4  # the block of the TensorRT-LLM deployment below (max_draft_len 3)


@pytest.fixture(scope="session")
def trtllm_deployment(target_dir, tmp_path_factory):
    """A TensorRT-LLM deployment of the local SmolLM2 target and the shipped draft, built once for the session."""
    from trtllm_dflash.deploy import BuildOptions, run_build

    out = tmp_path_factory.mktemp("trtllm") / "smollm2-trtllm"
    options = BuildOptions(
        output=out,
        target=str(target_dir),
        draft="smollm2-135m",
        backend="trtllm",
        block_size=TRTLLM_BLOCK,
        max_seq_len=256,
        max_batch_size=2,
    )
    return run_build(options, progress=lambda m: None)
