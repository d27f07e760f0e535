"""The demo model's corpus: the Python standard library's own non-test `.py` files.

Every machine of this kind has the same interpreter, so the text needs no download; a
manifest (relative path, sha256, split) pins exactly which files were used, and
`verify_manifest` refuses to train when the local files differ, so `make model` either
reproduces the committed model's data or says why it cannot.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).parent / "data" / "stdlib_manifest.json"
HELDOUT_EVERY = 40  # ~2.5% of files, chosen by a hash of the path (not by size or order)
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


@dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the stdlib root
    sha256: str
    split: str  # "train" | "test"


STDLIB_ROOT_ENV = "SPECPIPE_STDLIB_ROOT"
"""Where the manifest's files are when this interpreter is another Python (e.g. a GPU
machine with 3.12): a copy of the held-out files, paths kept."""


def stdlib_root() -> Path:
    return Path(os.environ.get(STDLIB_ROOT_ENV) or sysconfig.get_paths()["stdlib"])


def _split_of(rel: str) -> str:
    h = int(hashlib.sha256(rel.encode()).hexdigest(), 16)
    return "test" if h % HELDOUT_EVERY == 0 else "train"


def scan(root: Path) -> list[CorpusFile]:
    """All non-test `.py` files under `root`, sorted by path."""
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(CorpusFile(str(rel), hashlib.sha256(p.read_bytes()).hexdigest(), _split_of(str(rel))))
    return files


def write_manifest(files: list[CorpusFile], path: Path = MANIFEST) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "python": sys.version.split()[0],
        "root": "sysconfig stdlib",
        "files": [f.__dict__ for f in files],
    }
    path.write_text(json.dumps(doc, indent=0) + "\n")


def load_manifest(path: Path = MANIFEST) -> list[CorpusFile]:
    return [CorpusFile(**f) for f in json.loads(path.read_text())["files"]]


def verify_manifest(files: list[CorpusFile], root: Path) -> None:
    """Raise with the differing files if the local stdlib does not match the manifest."""
    bad = []
    for f in files:
        p = root / f.path
        if not p.is_file():
            bad.append(f"missing {p}")
        elif hashlib.sha256(p.read_bytes()).hexdigest() != f.sha256:
            bad.append(f"changed {p}")
    if bad:
        shown = "\n  ".join(bad[:10])
        raise RuntimeError(
            f"{len(bad)} corpus file(s) differ from {MANIFEST} (this interpreter is Python "
            f"{sys.version.split()[0]}):\n  {shown}\nRun with the Python the manifest names, "
            "or regenerate the manifest with `python -m training.corpus --write-manifest`."
        )


def read_texts(files: list[CorpusFile], root: Path, split: str) -> list[str]:
    return [(root / f.path).read_text(encoding="utf-8", errors="replace") for f in files if f.split == split]


def heldout_prompts(count: int, root: Path | None = None) -> list[str]:
    """`count` prompts of varied length cut from the held-out files (never trained on):
    prompt i is 3 + 4*(i mod 5) lines of held-out file i mod n_files, starting at line
    17*i mod the file's length. Deterministic wherever the manifest verifies."""
    root = root or stdlib_root()
    files = [f for f in load_manifest() if f.split == "test"]
    verify_manifest(files, root)
    texts = [(root / f.path).read_text(encoding="utf-8").splitlines(keepends=True) for f in files]
    prompts = []
    for i in range(count):
        lines = texts[i % len(texts)]
        start = (17 * i) % max(1, len(lines) - 20)
        prompts.append("".join(lines[start : start + 3 + 4 * (i % 5)]))
    return prompts


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write-manifest", action="store_true", help="rescan the stdlib and rewrite the manifest")
    args = ap.parse_args()
    root = stdlib_root()
    if args.write_manifest:
        write_manifest(scan(root))
    files = load_manifest()
    verify_manifest(files, root)
    size = sum((root / f.path).stat().st_size for f in files)
    n_test = sum(f.split == "test" for f in files)
    print(f"{len(files)} files ({n_test} held out), {size / 1e6:.1f} MB, root {root}")


if __name__ == "__main__":
    main()
