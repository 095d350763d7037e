"""Makes this folder the package `trtllm_dflash.plugins` (pyproject.toml maps it), so a wheel ships the plugin sources."""
