"""GPU check of the block-attention kernel, for an operator on an NVIDIA GPU host (CI has no GPU).

    pip install 'trtllm-dflash[kernels]'        # a CUDA torch usually brings its own matching triton
    python examples/gpu_kernel_check.py [--quick]

1. Correctness: `torch.ops.trtdflash.block_attention` on CUDA (the fused Triton kernel) against the reference
   (masks + SDPA, the CPU implementation, run here on the GPU) on the attention shapes of the published drafts
   z-lab/Qwen3-8B-DFlash-b16 (32/8 heads, head_dim 128, block 16) and z-lab/gpt-oss-120b-DFlash (64/8 heads,
   head_dim 64, block 10; plus the target's causal 128-token sliding window), ragged batches, fp32 and bf16.
2. Speed: the kernel against the composed path (masks + concatenated K/V + SDPA, what the reference does), and
   its split-KV launch (the context in slices, merged) against one slice at batch 1 and 4 with long contexts.
3. With TensorRT installed: the plugin `trtdflash::block_attention` (plugins/tensorrt_plugin.py) in a one-layer
   engine against the reference.
Prints one PASS/FAIL line per check and the times; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from trtllm_dflash.kernels.attention import block_attention, block_attention_reference

# name, query heads, KV heads, head dim, block size, causal, window
DRAFTS = [
    ("qwen3-8b-b16", 32, 8, 128, 16, False, None),
    ("gpt-oss-120b", 64, 8, 64, 10, False, None),
    ("gpt-oss-120b swa128", 64, 8, 64, 10, True, 128),
]


def inputs(nh, nkv, hd, q, lens, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, cap = len(lens), max(max(lens), 1)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
    return (
        rnd(b, q, nh, hd).transpose(1, 2),
        rnd(b, nkv, q, hd),
        rnd(b, nkv, q, hd),
        rnd(b, nkv, cap, hd),
        rnd(b, nkv, cap, hd),
        torch.tensor(lens, device="cuda", dtype=torch.int32),
    )


def within_tolerance(out, args, causal, window) -> tuple[bool, float]:
    """fp32: 1e-4 (same products, other summation order; no TF32 in the kernel). bf16: u = 2^-8 per rounding of the
    probabilities and of the output -> |err| <= u * (|exact| + max|v|) + 1e-3 against the fp32 result on the same inputs."""
    exact = block_attention_reference(*(a.float() if a.is_floating_point() else a for a in args), causal, window)
    err = (out.float() - exact).abs()
    if out.dtype == torch.float32:
        return bool((err <= 1e-4).all()), float(err.max())
    v_max = max(args[2].float().abs().max(), args[4].float().abs().max())
    return bool((err <= 2.0**-8 * (exact.abs() + v_max) + 1e-3).all()), float(err.max())


def time_ms(fn, reps=50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check_kernel(quick: bool) -> bool:
    ok = True
    shapes = [(1, [0]), (4, [1, 63, 200, 1000]), (16, [int(x) for x in torch.randint(0, 4096, (16,)).tolist()])]
    if not quick:
        shapes.append((64, [int(x) for x in torch.randint(0, 16384, (64,)).tolist()]))
    for name, nh, nkv, hd, q, causal, window in DRAFTS:
        for dtype in (torch.float32, torch.bfloat16):
            for b, lens in shapes:
                args = inputs(nh, nkv, hd, q, lens, dtype)
                good, err = within_tolerance(block_attention(*args, causal, window), args, causal, window)
                ok &= good
                print(
                    f"{'PASS' if good else 'FAIL'} kernel {name} {str(dtype)[6:]} b={b} max_ctx={max(lens)}: max err {err:.2e}"
                )
    print("\nspeed (bf16, median ms): kernel vs composed masks + SDPA")
    for name, nh, nkv, hd, q, causal, window in DRAFTS:
        for b, ctx in ((1, 2048), (8, 4096), (32, 8192)):
            args = inputs(nh, nkv, hd, q, [ctx] * b, torch.bfloat16)
            fused = time_ms(lambda: block_attention(*args, causal, window))
            composed = time_ms(lambda: block_attention_reference(*args, causal, window))
            print(
                f"  {name:22s} b={b:3d} ctx={ctx:5d}: kernel {fused:7.3f} ms, composed {composed:7.3f} ms, x{composed / fused:.2f}"
            )
    print(
        "\nsplit KV (bf16, median ms): the slices the launcher chooses against one program per KV head and query tile"
    )
    from trtllm_dflash.plugins.block_attention import block_attention as kernel
    from trtllm_dflash.plugins.block_attention import context_splits, launch_config

    for name, nh, nkv, hd, q, causal, window in DRAFTS:
        for b, ctx in ((1, 2048), (1, 16384), (4, 16384)):
            args = inputs(nh, nkv, hd, q, [ctx] * b, torch.bfloat16)
            n = context_splits(args[0], args[1], args[3], window or 0, launch_config(args[0], args[1]))
            good, err = within_tolerance(kernel(*args, causal, window or 0), args, causal, window)
            ok &= good
            split = time_ms(lambda: kernel(*args, causal, window or 0))
            one = time_ms(lambda: kernel(*args, causal, window or 0, num_splits=1))
            print(
                f"  {'PASS' if good else 'FAIL'} {name:22s} b={b} ctx={ctx:5d}: {n:2d} slices {split:7.3f} ms, one {one:7.3f} ms, "
                f"x{one / split:.2f} (max err {err:.2e})"
            )
    return ok


def check_tensorrt_plugin() -> bool:
    """One plugin layer in a TensorRT engine (TensorRT 10 API), run on torch buffers, against the reference."""
    import tensorrt as trt
    import tensorrt.plugin as trtp
    from trtllm_dflash.plugins import tensorrt_plugin  # noqa: F401  registers trtdflash::block_attention

    ok = True
    for name, nh, nkv, hd, q, causal, window in DRAFTS:
        args = inputs(nh, nkv, hd, q, [0, 77, 300], torch.float32)
        args = tuple(a.contiguous() for a in args[:5]) + (args[5],)
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        names = ("q", "k", "v", "ctx_k", "ctx_v", "ctx_lens")
        tensors = [
            network.add_input(n, trt.DataType.INT32 if n == "ctx_lens" else trt.DataType.FLOAT, tuple(a.shape))
            for n, a in zip(names, args)
        ]
        layer = network.add_plugin(
            trtp.op.trtdflash.block_attention(*tensors, causal=int(causal), window=int(window or 0))
        )
        layer.get_output(0).name = "out"
        network.mark_output(layer.get_output(0))
        plan = builder.build_serialized_network(network, builder.create_builder_config())
        engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
        context = engine.create_execution_context()
        out = torch.empty(args[0].shape, device="cuda")
        for n, a in zip(names, args):
            context.set_tensor_address(n, a.data_ptr())
        context.set_tensor_address("out", out.data_ptr())
        stream = torch.cuda.Stream()
        context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        good, err = within_tolerance(out, args, causal, window)
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} tensorrt plugin {name} fp32: max err {err:.2e}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the largest batch")
    quick = parser.parse_args().quick
    if not torch.cuda.is_available():
        print(
            "FAIL no CUDA device: this check runs on an NVIDIA GPU host (the CPU tests cover the kernel under the interpreter)."
        )
        return 1
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = check_kernel(quick)
    if importlib.util.find_spec("tensorrt") is not None:
        ok &= check_tensorrt_plugin()
    else:
        print("SKIP tensorrt plugin: TensorRT is not installed")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
