"""Triton entry point of the specpipe model (copied into generated model repositories).

The Python-backend stub does not pass PYTHONPATH on to the model, so the project root
comes from the model's `project_root` parameter (written by `triton_repo.repository`);
everything else lives in the project: `triton_repo/serving_model.py`.
"""

import json
import sys
from typing import Any

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = json.loads(args["model_config"]).get("parameters", {})
        root = params.get("project_root", {}).get("string_value", "")
        if not root:
            raise pb_utils.TritonModelException("parameter project_root is missing: regenerate the repository")
        if root not in sys.path:
            sys.path.insert(0, root)
        from triton_repo.serving_model import SpecpipeModel

        self.model = SpecpipeModel(args, pb_utils)

    def execute(self, requests: list[Any]) -> None:
        self.model.execute(requests)

    def finalize(self) -> None:
        self.model.finalize()
