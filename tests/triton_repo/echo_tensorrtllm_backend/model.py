"""A stand-in for TensorRT-LLM's C++ `tensorrtllm` backend, for tests/triton_repo/test_trtllm_repository.py:
a Python-based Triton backend (a backend directory `tensorrtllm/` holding this model.py) that loads
our generated `tensorrt_llm` model as it is and answers like the real backend's shapes, without an
engine: decoupled, one final response per request whose `output_ids` [1, 1, tokens] are the request's
own `input_ids` (an echo, so that the ensemble's text comes back through the tokenizer models
unchanged) and `sequence_length` [1, 1] their count."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(1, 1, -1)
            length = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().reshape(1, 1)
            outputs = [
                pb_utils.Tensor("output_ids", ids[:, :, : int(length[0, 0])].astype(np.int32)),
                pb_utils.Tensor("sequence_length", length.astype(np.int32)),
            ]
            sender.send(
                pb_utils.InferenceResponse(output_tensors=outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )
        return None
