"""Refresh tests/triton_repo/upstream_trtllm_keys.json: what Triton's TensorRT-LLM backend declares
and reads, for tests/triton_repo/test_trtllm_repository.py to diff our repository against.

    .venv/bin/python tests/triton_repo/upstream_trtllm_keys.py TRITON_BACKEND_DIR --repo OWNER/NAME --commit SHA

TRITON_BACKEND_DIR: a TensorRT-LLM checkout's triton_backend/ (or the root of a
triton-inference-server/tensorrtllm_backend checkout from before May 2025, same layout); --repo and
--commit are recorded as the source (--prefix: the directory's path inside that repository). It reads

- all_models/inflight_batcher_llm/{tensorrt_llm,preprocessing,postprocessing}/config.pbtxt: each
  model's parameter keys and its inputs and outputs (data type, dims, optional);
- inflight_batcher_llm/src/model_instance_state.cc and model_state.cc: every `GetParameter<T>("key")`
  of the engine model, with its C++ type and whether it sits inside a `try` block (a read outside
  one fails the model's load when the key is absent);

and keeps the file's hand-written "not_to_set" entries (keys the backend reads only to warn or refuse).
Then run the tests: a failure names each key or tensor upstream has and our templates lack.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("upstream_trtllm_keys.json")
MODELS = ("tensorrt_llm", "preprocessing", "postprocessing")
CONFIG = "all_models/inflight_batcher_llm/{model}/config.pbtxt"
SOURCES = ("inflight_batcher_llm/src/model_instance_state.cc", "inflight_batcher_llm/src/model_state.cc")


def _block(text: str, keyword: str) -> str:
    """The body of `keyword [ ... ]` (brackets balanced)."""
    start = re.search(rf"^{keyword}\s*\[", text, re.M)
    if start is None:
        return ""
    depth, i = 1, start.end()
    while depth:
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        i += 1
    return text[start.end() : i - 1]


def _tensors(body: str) -> dict[str, dict[str, Any]]:
    """name -> {data_type, dims, optional} of every `{ name: ... }` entry; a `${placeholder}` data
    type is kept as written."""
    tensors = {}
    for entry in re.findall(r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", body):
        name = re.search(r'name:\s*"(\w+)"', entry)
        if name is None:
            continue
        data_type = re.search(r"data_type:\s*(\S+)", entry)
        dims = re.search(r"dims:\s*\[([^\]]*)\]", entry)
        tensors[name.group(1)] = {
            "data_type": data_type.group(1) if data_type else "",
            "dims": [int(d) for d in dims.group(1).replace(",", " ").split()] if dims else [],
            "optional": bool(re.search(r"optional:\s*true", entry)),
        }
    return tensors


def read_config(path: Path) -> dict[str, Any]:
    """A config.pbtxt template's parameter keys (in file order) and tensors; commented-out lines skipped."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    return {
        "parameters": re.findall(r'^parameters\s*:?\s*\{\s*key:\s*"(\w+)"', text, re.M),
        "inputs": _tensors(_block(text, "input")),
        "outputs": _tensors(_block(text, "output")),
    }


def _guarded(lines: list[str], index: int) -> bool:
    """Whether line `index` sits in a `try { ... }` block: walk out through the enclosing blocks
    (Allman braces, as clang-format writes them) and look at each block's opening line."""
    indent = len(lines[index]) - len(lines[index].lstrip())
    for i in range(index - 1, 0, -1):
        line = lines[i]
        if line.strip() == "{" and len(line) - len(line.lstrip()) < indent:
            if lines[i - 1].strip() == "try":
                return True
            indent = len(line) - len(line.lstrip())
            if indent == 0:
                return False
    return False


def read_backend(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """key -> {type, guarded} for every parameter the backend's sources read."""
    reads: dict[str, dict[str, Any]] = {}
    for path in paths:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for cpp_type, arg in re.findall(r"GetParameter<(.+?)>\((\"\w+\"|\w+)\)", line):
                if arg.startswith('"'):
                    key = arg.strip('"')
                else:  # a variable: its latest assignment above
                    assigned = [m for ln in lines[:i] for m in re.findall(rf'\b{arg}\s*=\s*"(\w+)"', ln)]
                    if not assigned:
                        continue  # GetParameter's own definitions (`name`)
                    key = assigned[-1]
                reads.setdefault(key, {"type": cpp_type, "guarded": _guarded(lines, i)})
    return dict(sorted(reads.items()))


def dump(value: Any, indent: int = 0) -> str:
    """JSON with one line per leaf object or list (a tensor, a read, a key list), readable in diffs."""
    flat = json.dumps(value)
    if not isinstance(value, dict) or all(not isinstance(v, dict) for v in value.values()):
        return flat
    pad = " " * (indent + 1)
    items = [f"{pad}{json.dumps(k)}: {dump(v, indent + 1)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def refresh(backend_dir: Path, repo: str, commit: str, prefix: str) -> dict[str, Any]:
    old = json.loads(DATA.read_text()) if DATA.is_file() else {}
    paths = {f"{model}_config": CONFIG.format(model=model) for model in MODELS} | {Path(s).stem: s for s in SOURCES}
    return {
        "_about": old.get("_about", ""),
        "sources": {name: {"repo": repo, "path": f"{prefix}{path}", "commit": commit} for name, path in paths.items()},
        "models": {model: read_config(backend_dir / CONFIG.format(model=model)) for model in MODELS},
        "backend_reads": read_backend([backend_dir / s for s in SOURCES]),
        "not_to_set": old.get("not_to_set", {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend_dir", type=Path, help="TensorRT-LLM's triton_backend/ directory")
    ap.add_argument("--repo", default="NVIDIA/TensorRT-LLM")
    ap.add_argument("--commit", required=True, help="the checkout's commit, recorded as the source")
    ap.add_argument("--prefix", default="triton_backend/", help="backend_dir's path in --repo")
    ap.add_argument("--out", type=Path, default=DATA)
    args = ap.parse_args(argv)
    data = refresh(args.backend_dir, args.repo, args.commit, args.prefix)
    args.out.write_text(dump(data) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
