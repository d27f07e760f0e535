"""Sources of the TensorRT-LLM Triton repository that `triton_repo.trtllm_repository` writes:
the four models' config.pbtxt templates and `tokenizer_models.py` (the preprocessing and
postprocessing models' code)."""
