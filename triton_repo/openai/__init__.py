"""OpenAI-compatible HTTP API (FastAPI + uvicorn) forwarding to Triton over gRPC streaming:
`python -m triton_repo.openai` (`__main__.py`), the app (`app.py`), request shapes
(`protocol.py`), response shapes (`responses.py`), the gRPC side (`triton_backend.py`), chat
templates (`chat.py`), and a subprocess launcher for tests and benchmarks (`launch.py`)."""
