"""Sampling distributions and the speculative acceptance rule (lossless in distribution)."""

from __future__ import annotations

import torch

from trtllm_dflash.config import SamplingParams


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> argmax ids [...] (the first maximum on ties, as torch.argmax). ATen's argmax on CPU reduces
    the last dim one element at a time, which in bf16 is slower than casting to fp32 first
    (docs/performance.md#greedy-argmax). bf16 logits on CPU take our kernel's vectorized one where it runs
    (kernels/argmax.h), else the exact cast to fp32."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
        from trtllm_dflash.kernels import bf16_gemm

        kernel = bf16_gemm.kernel()
        if kernel is not None:
            return kernel.argmax(logits)
    return logits.float().argmax(-1) if logits.dtype in (torch.bfloat16, torch.float16) else logits.argmax(-1)


def sampling_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution the target samples from: temperature, then top-k, then top-p."""
    scores = logits.float() / sp.temperature
    if 0 < sp.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sp.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sp.top_p  # smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """probs [n, V] -> ids [n]."""
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def rejection_sample(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """Standard speculative sampling over a chain.

    drafts [k] proposed ids; p [k+1, V] target distributions at the block positions; q [k, V] the
    draft distributions they were sampled from.
    Accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection resample from
    normalize(max(p_j - q_j, 0)); after a full accept the bonus comes from p_k.
    Returns (number accepted, bonus token).
    """
    k = drafts.shape[0]
    idx = torch.arange(k)
    p_d = p[idx, drafts]
    q_d = q[idx, drafts]
    u = torch.rand(k, generator=gen)
    ok = (u * q_d < p_d).int()  # u < p/q without dividing by zero
    a = int(ok.cumprod(0).sum())
    if a == k:
        return a, int(sample(p[k : k + 1], gen))
    residual = (p[a] - q[a]).clamp_min_(0.0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[a]
    return a, int(sample(residual[None], gen))
