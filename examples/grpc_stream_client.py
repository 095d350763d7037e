"""Stream a completion from a `trtdflash serve` deployment with nothing but tritonclient and numpy.

    python examples/grpc_stream_client.py --url 127.0.0.1:8001 --prompt "Write a haiku about GPUs."

The tensor names are those of Triton's TensorRT-LLM ensemble; the batch dimension comes first
(max_batch_size > 0), so every input has shape [1, 1]. The dflash model is decoupled, so requests
go over the gRPC stream even when `stream` is false (then one response holds the whole text).
"""

import argparse
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name, array, datatype):
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--prompt", default="Write a haiku about GPUs.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()

    inputs = [
        tensor("text_input", np.array([[args.prompt.encode()]], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([[args.max_tokens]], dtype=np.int32), "INT32"),
        tensor("stream", np.array([[True]], dtype=bool), "BOOL"),
        tensor("temperature", np.array([[args.temperature]], dtype=np.float32), "FP32"),
        # TensorRT-LLM's meaning: top_k 0 and top_p 0 (the defaults) are greedy whatever the temperature
        tensor("top_p", np.array([[args.top_p]], dtype=np.float32), "FP32"),
    ]
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ensemble", inputs, request_id="1", enable_empty_final_response=True)
    last = None
    while True:
        result, error = responses.get()
        if error is not None:
            sys.exit(f"error: {error}")
        if result.get_response().outputs:
            print(result.as_numpy("text_output")[0][0].decode(), end="", flush=True)
            last = result
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    if last is not None:
        print(
            f"\n[{last.as_numpy('num_output_tokens')[0][0]} tokens, acceptance length {last.as_numpy('acceptance_length')[0][0]:.2f}, "
            f"{last.as_numpy('total_accepted_draft_tokens')[0][0]}/{last.as_numpy('total_draft_tokens')[0][0]} drafts accepted]",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
