"""The engine's non-MoE Triton kernels (paged attention, fused elementwise ops, the dense gemv) and their launchers; the MoE kernels live in the top-level moe_kernels package."""
