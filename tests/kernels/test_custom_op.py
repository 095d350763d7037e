"""`torch.ops.trtdflash.block_attention`: one call site for every device, with the reference on CPU; the draft runs
through it, and greedy DFlash through it is token-identical to the composed (masks + SDPA, one request at a time) path."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.batch import speculative_stream
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels import attention
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.models.draft import DFlashDraftModel, dflash_attention_mask
from trtllm_dflash.resolve import resolve_draft


def inputs(b=3, nh=6, nkv=2, q=8, hd=64, c=40, lens=(0, 17, 40)):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, q, nh, hd, generator=g).transpose(1, 2),
        torch.randn(b, nkv, q, hd, generator=g),
        torch.randn(b, nkv, q, hd, generator=g),
        torch.randn(b, nkv, c, hd, generator=g),
        torch.randn(b, nkv, c, hd, generator=g),
        torch.tensor(lens),
    )


class OpCalls(TorchDispatchMode):
    """Counts dispatches of the block-attention op (observes the real calls, replaces nothing)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.trtdflash.block_attention.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal,window", [(False, None), (True, 5), (False, 100)])
def test_cpu_op_is_the_reference(causal, window):
    args = inputs()
    assert torch.equal(
        attention.block_attention(*args, causal, window), attention.block_attention_reference(*args, causal, window)
    )


def test_op_registration_passes_opcheck_and_compiles():
    """Schema, fake (meta) implementation and dispatch are consistent, and torch.compile captures the op in one graph."""
    args = inputs()
    result = torch.library.opcheck(torch.ops.trtdflash.block_attention.default, (*args, True, 7))
    assert set(result.values()) == {"SUCCESS"}, result
    compiled = torch.compile(
        lambda *a: attention.block_attention(*a, causal=True, window=7), fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(*args), attention.block_attention_reference(*args, True, 7))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.trtdflash.block_attention(*(mode.from_tensor(a) for a in args), False, 0)
    assert fake.shape == args[0].shape


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: (a[0][:, :5],) + a[1:], "not a multiple"),
        (lambda a: a[:3] + (a[3][..., :32],) + a[4:], "ctx_k"),
        (lambda a: a[:5] + (a[5].float(),), "ctx_lens"),
        (lambda a: (a[0].double(),) + a[1:], "one dtype"),
    ],
)
def test_bad_shapes_are_one_clear_error(change, message):
    with pytest.raises(DFlashError, match=message):
        attention.block_attention(*change(inputs()))


def test_window_must_be_positive():
    with pytest.raises(DFlashError, match="window must be at least 1"):
        attention.block_attention(*inputs(), window=0)


class ComposedDraft(DFlashDraftModel):
    """The path before the op: each request alone, its context sliced to its length, masks + SDPA per layer
    (`dflash_attention_mask`, the rule training uses; no mask where a layer sees everything)."""

    def draft_block(self, noise_embedding, positions, ctx_k, ctx_v, ctx_lens):
        c, q_len, rows = self.config, noise_embedding.shape[1], []
        for i, n in enumerate(ctx_lens.tolist()):
            q_pos = torch.arange(n, n + q_len)[None]
            k_pos = torch.arange(n + q_len)[None]
            k_block = torch.cat([torch.full((n,), -1), torch.zeros(q_len, dtype=torch.long)])[None]
            masks = [
                None
                if not (c.layer_is_causal(j) or c.layer_window(j))
                else dflash_attention_mask(
                    q_pos,
                    torch.full_like(q_pos, n),
                    torch.zeros_like(q_pos),
                    k_pos,
                    k_block,
                    c.layer_is_causal(j),
                    c.layer_window(j),
                )
                for j in range(c.num_hidden_layers)
            ]
            rows.append(
                self.forward(
                    noise_embedding[i : i + 1],
                    positions[i : i + 1],
                    ctx_k[:, i : i + 1, :, :n],
                    ctx_v[:, i : i + 1, :, :n],
                    masks,
                )
            )
        return torch.cat(rows)


@pytest.fixture(scope="module")
def shipped(target):
    draft = load_draft(resolve_draft(None, "smollm2-135m"))
    target.set_taps(draft.config.target_layer_ids)
    composed = ComposedDraft(draft.config)
    composed.load_state_dict(draft.state_dict())
    return draft, composed.eval()


def test_ragged_draft_block_matches_the_composed_path(shipped):
    """Real weights, three rows with contexts 0, 13 and 40: same hidden states, same draft tokens."""
    draft, composed = shipped
    c = draft.config
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([0, 13, 40])
    x = torch.randn(3, c.block_size, c.hidden_size, generator=g)
    pos = lens[:, None] + torch.arange(c.block_size)
    ck = torch.randn(c.num_hidden_layers, 3, c.num_key_value_heads, 40, c.head_dim, generator=g)
    cv = torch.randn_like(ck)
    with torch.no_grad(), OpCalls() as seen:
        got = draft.draft_block(x, pos, ck, cv, lens)
    assert seen.calls == c.num_hidden_layers  # one op call per layer for the whole ragged batch
    with torch.no_grad():
        want = composed.draft_block(x, pos, ck, cv, lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "prompt,chat", [("Write a Python function that reverses a string.", True), ("The capital of France is", False)]
)
def test_greedy_dflash_through_the_op_is_token_identical(target, shipped, prompt, chat):
    """Same tokens and the same acceptance at every draft position, i.e. the same draft proposals each step."""
    draft, composed = shipped
    ids = DFlashEngine(target, draft, draft.config.block_size).encode(prompt, chat)
    runs = []
    for model in (draft, composed):
        stats = GenerationStats()
        with OpCalls() as seen:
            tokens = [
                t
                for chunk in speculative_stream(
                    target, model, ids, 40, model.config.block_size, SamplingParams(), frozenset(), stats
                )
                for t in chunk
            ]
        runs.append((tokens, list(stats.accepted_per_position), stats.steps, seen.calls))
    (tokens, accepted, steps, calls), (ref_tokens, ref_accepted, ref_steps, ref_calls) = runs
    assert tokens == ref_tokens and len(tokens) == 40
    assert accepted == ref_accepted and steps == ref_steps
    assert calls > 0 and ref_calls == 0  # the runtime went through the op; the baseline did not
