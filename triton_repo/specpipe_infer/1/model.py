"""Non-streaming front of the specpipe model, for Triton's HTTP and gRPC `infer`.

Triton refuses `infer` on decoupled models, and the engine model must be decoupled to
stream. This model is not decoupled: each request is checked here (the same checks as
the engine model, against the engine's config and tokenizer) and forwarded (BLS) to the
engine model named by the `target_model` parameter with `stream = false`; its single
FINAL response is returned. It holds no weights, so several instances can wait on
requests concurrently at no memory cost; the engine batches them (Triton's TensorRT-LLM
repository pairs `tensorrt_llm_bls` with `tensorrt_llm` the same way). Input is checked
before forwarding because BLS responses lose their error code (INVALID_ARG would come
back as INTERNAL).

Cancellation: this Triton cannot cancel a BLS request, so the engine request carries a
Triton request id of our own; while its responses arrive (on a helper thread), the client's
request is checked for cancellation (gRPC cancel or deadline) every CANCEL_POLL_S, and on
cancellation a `cancel_request_id` control request naming that id stops it in the engine.
(Triton does not signal HTTP clients that disconnect from a non-streaming request.)
"""

import json
import queue
import sys
import threading
import uuid
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

CANCEL_POLL_S = 0.1
"""How often a waiting request checks whether its client cancelled it."""


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        if params["project_root"] not in sys.path:
            sys.path.insert(0, params["project_root"])  # the stub ignores PYTHONPATH
        from triton_repo.inputs import AdmissionCheck

        self.check = AdmissionCheck.for_engine(params["engine_dir"])
        self.target = params["target_model"]
        self.inputs = [i["name"] for i in config["input"] if i["name"] != "stream"]  # always false here
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._forward(request) for request in requests]

    def _forward(self, request: Any) -> Any:
        def get(name: str) -> Any:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        problem = self.check(get)
        if problem is not None:
            error = pb_utils.TritonError(problem, pb_utils.TritonError.INVALID_ARG)
            return pb_utils.InferenceResponse(output_tensors=[], error=error)
        tensors = [t for name in self.inputs if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None]
        tensors.append(pb_utils.Tensor("stream", np.array([False])))
        request_id = f"specpipe-infer-{uuid.uuid4().hex}"
        bls = pb_utils.InferenceRequest(
            model_name=self.target, inputs=tensors, requested_output_names=self.outputs, request_id=request_id
        )
        responses: queue.Queue[Any] = queue.Queue()

        def receive() -> None:
            try:
                for response in bls.exec(decoupled=True):
                    responses.put(response)
            except Exception as e:  # handed to the waiting thread
                responses.put(e)
            responses.put(None)

        threading.Thread(target=receive, name="specpipe-infer-bls", daemon=True).start()
        final, cancelled = None, False
        while True:
            try:
                item = responses.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                if not cancelled and request.is_cancelled():
                    cancelled = True
                    self._cancel(request_id)
                continue
            if item is None:
                break
            if isinstance(item, Exception):
                return pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(str(item), pb_utils.TritonError.INTERNAL)
                )
            if item.has_error():
                return pb_utils.InferenceResponse(output_tensors=[], error=item.error())
            if item.output_tensors():
                final = item
        if cancelled:
            error = pb_utils.TritonError("cancelled by the client", pb_utils.TritonError.CANCELLED)
            return pb_utils.InferenceResponse(output_tensors=[], error=error)
        if final is None:
            error = pb_utils.TritonError(f"{self.target} sent no output", pb_utils.TritonError.INTERNAL)
            return pb_utils.InferenceResponse(output_tensors=[], error=error)
        return pb_utils.InferenceResponse(output_tensors=final.output_tensors())

    def _cancel(self, request_id: str) -> None:
        """Stop the engine's request `request_id` (its FINAL then ends the wait)."""
        inputs = [
            pb_utils.Tensor("text_input", np.array([b""], dtype=np.object_)),
            pb_utils.Tensor("cancel_request_id", np.array([request_id.encode()], dtype=np.object_)),
        ]
        control = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=[])
        for _ in control.exec(decoupled=True):
            pass
