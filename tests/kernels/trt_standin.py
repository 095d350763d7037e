"""TensorRT's native module stood in for, so that the real `tensorrt.plugin` package runs on a CPU machine.

The `tensorrt-cu12-bindings` wheel ships TensorRT's Python plugin API as plain Python (`tensorrt_bindings/plugin/`:
register, impl, autotune and their validators) beside `tensorrt.so`, which needs libnvinfer. `install()` puts a
module named `tensorrt` in sys.modules whose package path is the wheel's folder, so `import tensorrt.plugin`
loads the wheel's own sources unchanged while `tensorrt.so` is never loaded. The stand-in provides only what
those sources touch at import and at a non-lazy `register` (TensorRT 10.6 to 11.4), and a registry that keeps
the creators; anything else raises AttributeError.
"""

import enum
import importlib.util
import sys
import types


class PluginRegistry:
    """`trt.get_plugin_registry()`: what `register` calls."""

    def __init__(self):
        self.creators = {}

    def register_creator(self, creator, namespace):
        self.creators[(creator.name, creator.plugin_version, namespace)] = creator
        return True

    def get_creator(self, name, version, namespace):
        return self.creators.get((name, version, namespace))


class PluginField:
    def __init__(self, name, data=None, type=None):
        self.name, self.data, self.type = name, data, type


class Logger:
    WARNING, ERROR, INFO, VERBOSE, INTERNAL_ERROR = range(5)

    def __init__(self, *args):
        pass

    def log(self, severity, message):
        pass


class Dims(tuple):
    MAX_DIMS = 8


def _enum(name: str, members: str):
    return enum.Enum(name, [(m, i) for i, m in enumerate(members.split())])


def install() -> types.ModuleType:
    """Replace any `tensorrt` in sys.modules by the stand-in over the installed bindings wheel; returns it."""
    folder = importlib.util.find_spec("tensorrt_bindings").submodule_search_locations[0]
    trt = types.ModuleType("tensorrt")
    trt.__path__ = [folder]
    trt.DataType = _enum("DataType", "FLOAT HALF INT8 INT32 BOOL UINT8 FP8 BF16 INT64 INT4 FP4 E8M0")
    trt.TensorFormat = _enum(
        "TensorFormat", "LINEAR CHW2 HWC8 CHW4 CHW16 CHW32 DHWC8 CDHW32 HWC DLA_LINEAR DLA_HWC4 HWC16 DHWC"
    )
    trt.DimensionOperation = _enum("DimensionOperation", "SUM PROD MAX MIN SUB EQUAL LESS FLOOR_DIV CEIL_DIV")
    trt.PluginFieldType = _enum(
        "PluginFieldType", "FLOAT16 FLOAT32 FLOAT64 INT8 INT16 INT32 CHAR DIMS UNKNOWN BF16 INT64 FP8 INT4 FP4"
    )
    trt.TensorRTPhase = _enum("TensorRTPhase", "BUILD RUNTIME")
    trt.QuickPluginCreationRequest = _enum(
        "QuickPluginCreationRequest", "UNKNOWN PREFER_JIT PREFER_AOT STRICT_JIT STRICT_AOT"
    )
    for name in (
        "IPluginV3",
        "IPluginV3QuickCore",
        "IPluginV3QuickBuild",
        "IPluginV3QuickRuntime",
        "IPluginV3QuickAOTBuild",
        "IPluginCreatorV3Quick",
        "ISymExpr",
        "IDimensionExpr",
        "ITensor",
        "PluginTensorDesc",
        "DynamicPluginTensorDesc",
    ):
        setattr(trt, name, type(name, (), {"__init__": lambda self, *a, **k: None}))
    trt.Logger, trt.Dims, trt.PluginField, trt.PluginFieldCollection = Logger, Dims, PluginField, list
    trt.float32, trt.float16, trt.bfloat16, trt.int32, trt.int64 = (
        trt.DataType[n] for n in ("FLOAT", "HALF", "BF16", "INT32", "INT64")
    )
    registry = PluginRegistry()
    trt.get_plugin_registry = lambda: registry
    for name in [n for n in sys.modules if n == "tensorrt" or n.startswith("tensorrt.")]:
        del sys.modules[name]
    sys.modules["tensorrt"] = trt
    return trt


class BuilderRecord:
    """What build_engine asked of the builder stand-in."""

    network_flags = None
    profiles: list = []
    built = False


def install_builder(trt: types.ModuleType) -> type[BuilderRecord]:
    """TensorRT 11's builder surface as our drafter build uses it: strongly typed networks only, so `BuilderFlag`
    has no precision members (FP16, BF16, INT8 were removed); parsing and building are recorded, not run."""
    record = BuilderRecord
    record.network_flags, record.profiles, record.built = None, [], False
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", [("STRONGLY_TYPED", 0)])
    members = ["GPU_FALLBACK", "REFIT", "DISABLE_TIMING_CACHE", "VERSION_COMPATIBLE", "EXCLUDE_LEAN_RUNTIME"]
    trt.BuilderFlag = enum.IntEnum("BuilderFlag", [(m, i) for i, m in enumerate(members)])

    class Profile:
        def set_shape(self, name, low, opt, high):
            record.profiles.append((name, low, opt, high))

    class Config:
        def set_flag(self, flag):
            pass

        def add_optimization_profile(self, profile):
            pass

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            record.network_flags = flags
            return object()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            record.built = True
            return b"plan"

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            return True

    trt.Builder, trt.OnnxParser = Builder, OnnxParser
    return record
