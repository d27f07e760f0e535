"""The one template tool of the repository generators (triton_repo/repository.py and
triton_repo/trtllm_repository.py): `string.Template` files with `${name}` placeholders.

A placeholder left unfilled would reach Triton as literal text and fail at load time far
from its cause (or, in a string parameter, silently become a wrong value), so a missing
field is an error here, naming the template and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from string import Template


def render_template(path: Path, fields: Mapping[str, object]) -> str:
    """`path`'s text with every `${name}` replaced by `str(fields[name])`; ValueError on a
    placeholder `fields` does not fill or one that is malformed."""
    template = Template(path.read_text())
    try:
        return template.substitute({k: str(v) for k, v in fields.items()})
    except KeyError as e:
        raise ValueError(f"{path}: no value for placeholder ${{{e.args[0]}}}") from None
    except ValueError as e:
        raise ValueError(f"{path}: malformed placeholder ({e})") from None


def pbtxt_string(value: str) -> str:
    """Escape for a double-quoted protobuf text-format string (a path or setting may hold
    quotes or backslashes)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
