"""Shared fixtures: the real SmolLM2-135M target (converted once into the cache) and small real drafts."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.models.checkpoint import save_draft
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import resolve_target

SMOL_MASK_ID = 16  # <empty_output>: a special token chat never produces


@pytest.fixture(scope="session")
def target_dir():
    return resolve_target("smollm2-135m", progress=lambda m: None)


@pytest.fixture(scope="session")
def target(target_dir):
    return TargetModel.load(target_dir)


def make_random_draft(target: TargetModel, path, num_layers=2, block_size=16, seed=0, **overrides):
    cfg = DraftConfig.for_target(target.text_config, vocab_rows=target.vocab_rows, num_layers=num_layers,
                                 block_size=block_size, mask_token_id=SMOL_MASK_ID)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = DFlashDraftModel(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    save_draft(model, path, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def random_draft_dir(target, tmp_path_factory):
    return make_random_draft(target, tmp_path_factory.mktemp("drafts") / "random")


@pytest.fixture
def one_thread():
    """One torch thread for the test (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
