"""`benchmarks/torch_profile.py`, run for real on the CPU on the demo draft-LM engine: a
report per (method, batch) with its wall time, how its forwards ran (eager here: no
graphs on a CPU) and torch.profiler's table of host ops; the forward counting is undone
after the run."""

from __future__ import annotations

from pathlib import Path

from benchmarks.torch_profile import main
from runtime import model_runner
from runtime.cuda_graphs import CudaGraphs


def test_a_report_per_run(engines: dict[str, Path], tmp_path: Path) -> None:
    real_run, real_forward = CudaGraphs.run, model_runner.forward
    out = tmp_path / "profile.txt"
    main(["--engine", str(engines["draft-lm"]), "--device", "cpu", "--runs", "ar:1", "sd:2", "--max-tokens", "6",
          "--out", str(out)])  # fmt: skip
    report = out.read_text()
    assert report.startswith(f"# {engines['draft-lm']} on the CPU")
    for run in ("== ar batch 1: ", "== sd batch 2: "):
        section = report.split(run)[1].split("==")[0]
        steps = int(section.split(" steps,")[0].split()[-1])
        eager = int(section.split("eager: no graphs")[0].split("\n")[-1])
        assert steps >= 2 and eager >= steps, section  # a target forward a step at least (the draft LM's besides)
        assert "Self CPU time total" in section
    assert CudaGraphs.run is real_run and model_runner.forward is real_forward
