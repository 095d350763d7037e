"""Makes this folder the package `trtllm_dflash.triton_repo` (pyproject.toml maps it), so a wheel ships the templates."""
