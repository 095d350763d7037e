"""Triton `preprocessing`: prompt text -> token ids with the same chat template and checks as `trtdflash generate`.

Bad requests (non-UTF-8 text, empty prompt, prompt or max_tokens beyond max_seq_len) get an error
response of their own; other requests in the same batch are unaffected.
"""

import sys
from pathlib import Path

# A GPU deployment carries the trtllm_dflash its models import in python/ beside triton_repo/ (NVIDIA's container has
# no such package); the python backend's stub runs its interpreter isolated, so PYTHONPATH cannot add it.
_CARRIED = Path(__file__).resolve().parents[3] / "python"
if _CARRIED.is_dir():
    sys.path.insert(0, str(_CARRIED))

import numpy as np
import triton_python_backend_utils as pb_utils

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import local_or_id
from trtllm_dflash.text import encode_prompt


def _param(args_config: dict, key: str) -> str:
    return args_config["parameters"][key]["string_value"]


class TritonPythonModel:
    def initialize(self, args):
        import json

        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        here = Path(args["model_repository"])
        self.tokenizer = AutoTokenizer.from_pretrained(local_or_id(_param(config, "tokenizer_dir"), here))
        self.chat = _param(config, "apply_chat_template").lower() == "true"
        self.max_seq_len = int(_param(config, "max_seq_len"))
        self.template_kwargs = json.loads(_param(config, "chat_template_kwargs"))

    def _one(self, request):
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
        if query.shape[0] != 1:
            raise DFlashError(
                f"Send one prompt per request (text_input of shape [1, 1]); got a batch of {query.shape[0]}."
            )
        raw = query.reshape(-1)[0]
        try:
            prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise DFlashError("text_input is not valid UTF-8; send the prompt as UTF-8 text.") from None
        max_tokens = int(out_len.reshape(-1)[0])
        if not 1 <= max_tokens <= self.max_seq_len:
            raise DFlashError(
                f"max_tokens must be between 1 and {self.max_seq_len} (this repository's max_seq_len), got {max_tokens}."
            )
        chat = pb_utils.get_input_tensor_by_name(request, "APPLY_CHAT_TEMPLATE")
        chat = self.chat if chat is None else bool(chat.as_numpy().reshape(-1)[0])
        ids = encode_prompt(self.tokenizer, prompt, chat, self.max_seq_len, self.template_kwargs)
        if len(ids) + max_tokens > self.max_seq_len:
            raise DFlashError(
                f"The prompt is {len(ids)} tokens and max_tokens is {max_tokens}, which exceeds max_seq_len {self.max_seq_len}; "
                f"ask for at most {self.max_seq_len - len(ids)} tokens."
            )
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("INPUT_ID", np.array([ids], dtype=np.int32)),
                pb_utils.Tensor("OUT_REQUEST_OUTPUT_LEN", np.array([[max_tokens]], dtype=np.int32)),
            ]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except DFlashError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return responses
