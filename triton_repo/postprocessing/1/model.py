"""Triton `postprocessing`: text delta + DFlash statistics -> the user-facing outputs.

Why no detokenization here: Triton runs this step once per streamed response and keeps no state
between them, so it cannot know the previous tokens that decide whether a piece starts with a space
or completes a multi-byte character. The dflash model owns one IncrementalDetokenizer per request
and sends correct text deltas; this step passes them through as `text_output`.

It is also the first place that learns a client has left an ensemble stream (see
trtllm_dflash/serving/cancel.py) and tells the dflash model to stop.
"""

import sys
from pathlib import Path

# A GPU deployment carries the trtllm_dflash its models import in python/ beside triton_repo/ (NVIDIA's container has
# no such package); the python backend's stub runs its interpreter isolated, so PYTHONPATH cannot add it.
_CARRIED = Path(__file__).resolve().parents[3] / "python"
if _CARRIED.is_dir():
    sys.path.insert(0, str(_CARRIED))

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serving import cancel, protocol

PASS_THROUGH = [protocol.post_name(t.name) for t in protocol.ENGINE_OUTPUTS if t.name != protocol.CANCEL_KEY]
CANCEL_KEY = protocol.post_name(protocol.CANCEL_KEY)[0]


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():  # answer normally anyway: an error here leaves the ensemble request in flight
                cancel.mark_cancelled(
                    pb_utils.get_input_tensor_by_name(request, CANCEL_KEY).as_numpy().reshape(-1)[0].decode()
                )
            outputs = [
                pb_utils.Tensor(dst, pb_utils.get_input_tensor_by_name(request, src).as_numpy())
                for src, dst in PASS_THROUGH
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
