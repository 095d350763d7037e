"""Our kernels: the draft's block attention as one torch custom op (`attention`), and the CPU's bf16 matrix kernels
(C++ sources, their loader `bf16_gemm`, and the packed weights they multiply, `packed`)."""
