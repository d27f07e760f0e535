"""The engine runtime: engine dirs, decoding strategies, sampling and verification."""

import sys

from runtime import native_policy

# the load-aware policy compiled with mypyc, where it is built for these sources (`make setup`)
native_policy.activate(__path__)
# (imported afresh where asked for, so that `python -m runtime.native_policy` runs it without runpy's warning)
del sys.modules["runtime.native_policy"], native_policy
