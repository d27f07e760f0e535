"""Engine builder: checkpoints -> validated engine directories.

NOTE: this regular package shadows PyPA's `build` when commands run from the repository
root (`python -m build.engine`), because the current directory comes first on sys.path.
"""
