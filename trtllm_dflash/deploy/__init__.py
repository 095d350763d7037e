"""`trtdflash build`: target + draft -> a self-contained, servable output directory (see core.py).

The names below load on first use: a deployment's Triton model imports `trtllm_dflash.deploy.trtllm.llm_steps` from
the carried copy of the package, which has no Triton templates or recipes, so importing this package must not load
the build machinery."""

import importlib

_EXPORTS = {"BuildOptions": "options", "Plan": "core", "make_plan": "core", "read_build": "core", "run_build": "core"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
