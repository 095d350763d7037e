"""`trtdflash build`: target + draft -> a self-contained, servable output directory (see core.py)."""

from trtllm_dflash.deploy.core import BuildOptions, Plan, make_plan, read_build, run_build

__all__ = ["BuildOptions", "Plan", "make_plan", "read_build", "run_build"]
