"""Makes this folder the package `trtllm_dflash.build_configs` (pyproject.toml maps it), so a wheel ships the recipes."""
