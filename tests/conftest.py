"""Shared fixtures: a small fixed corpus and a micro model config that trains in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import plait.launch
from plait.config import build_config
from plait.prepare import prepare
from plait.tokenizer import ByteTokenizer

# The compiled tests check what plait hands the compiler (graphs and their breaks, partitions,
# recomputation, deferred weight gradients, FP8 casts kept), which is the same whatever instructions
# inductor then writes for this CPU (a GPU runs Triton kernels instead). Scalar C++ compiles ~20%
# faster than vectorized C++ (the compiled CP tests: 46 -> 36 s). Set before torch._inductor reads
# its configuration, so every worker and subprocess inherits it; a value given outside wins.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Workers of this session trace and compile often (the activation measurements of tensor and context
# parallelism, every compiled run): the fork server imports the compiler once for all of them, where
# each worker took ~1.1 s of CPU importing it on its first trace. Launches from a fresh interpreter
# (the subprocess tests, a user's `plait train`) keep plait's own preload. Not where CUDA is: there
# the server importing the compiler asked CUDA for its devices, and every worker it forked then failed
# "Cannot re-initialize CUDA in forked subprocess" on its first compile (dynamo saves the CUDA RNG).
if not torch.cuda.is_available():
    plait.launch.PRELOAD += ["torch._inductor.compile_fx", "torch._dynamo.repro.after_dynamo", "functorch.compile",
                             "sympy.tensor.tensor"]

MICRO_MODEL = {"preset": "custom", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4,
               "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 64}


WORDS = ("data", "step", "loss", "rank", "grad", "param", "shard", "bucket", "mesh", "layer", "token",
         "batch", "size", "value", "index", "count", "total", "model", "state", "block")


def synthetic_source(seed: int, functions: int) -> str:
    """Python-looking text from a fixed seed: a corpus that never changes when plait's code does, so
    tolerances measured on it stay valid (rounding noise depends on the data)."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(functions):
        name, a, b = rng.sample(WORDS, 3)
        lines.append(f"def {name}_{rng.randrange(100)}({a}, {b}={rng.randrange(10)}):")
        for _ in range(rng.randrange(2, 6)):
            x, y = rng.sample(WORDS, 2)
            op = rng.choice(["+", "-", "*", "//", "%"])
            lines.append(f"    {x} = {y} {op} {rng.randrange(1, 64)}")
        lines.append(f"    return {rng.choice(WORDS)}\n")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A byte-level corpus of 40 synthetic source files (~250 KB, no downloads, fixed forever)."""
    root = tmp_path_factory.mktemp("data")
    src = root / "src"
    src.mkdir()
    for i in range(40):
        (src / f"module_{i:02d}.py").write_text(synthetic_source(i, 60))
    out = root / "corpus"
    prepare([str(src)], out, ByteTokenizer(), val_fraction=0.2, quiet=True)
    return out


def micro_config(data: Path, out: Path, **sections):
    """A Config for a ~0.1M-parameter model; `sections` = {"train": {...}, ...} overrides."""
    raw = {"model": dict(MICRO_MODEL),
           "data": {"path": str(data)},
           "train": {"steps": 6, "micro_batch": 4, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                     "eval_every": 0, "eval_batches": 2, "out": str(out), "progress": False,
                     "tensorboard": False, "sample_tokens": 0, "compile": "off", "device": "cpu"}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return build_config(raw)


# The default job (test_default_job.py) is the suite's longest test: `plait train` as a user runs
# it, 200 real steps, ~3.5 minutes of both cores. The other tests leave about a quarter of the
# cores idle (they wait on spawns, rendezvous, timeouts), so the job starts in its own process when
# the session begins, at the lowest priority, and its test runs last and waits for it. Where the
# cores never idle it runs at the end, as before.
DEFAULT_JOB = pytest.StashKey()


def _background() -> None:
    """In the job's process before it starts: the lowest priority, and (Linux) killed with the session's
    process, whatever ends it. Its own process group keeps signals the tests send to groups away from
    it; it stays in pytest's session, since Linux's autogroup scheduler shares the CPU between sessions
    as equals whatever their nice values (a session of its own took half the cores from the tests)."""
    os.nice(19)
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@pytest.hookimpl(trylast=True)  # after `-k` / `-m` have deselected what they deselect
def pytest_collection_modifyitems(session, config, items):
    job = [it for it in items if it.nodeid.endswith("test_default_job.py::test_default_job_learns")]
    if not job or config.option.collectonly:
        return
    items[:] = [it for it in items if it not in job] + job
    import subprocess
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="plait-default-job-"))
    err = open(root / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", "--out", str(root / "run"),
                             "--train.progress", "false"], stdout=err, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, process_group=0, preexec_fn=_background)
    err.close()
    config.stash[DEFAULT_JOB] = (proc, root)
    from fault_runs import BACKGROUND

    BACKGROUND.add(proc.pid)  # the leftover-process checks leave it alone


def pytest_unconfigure(config):
    proc, root = config.stash.get(DEFAULT_JOB, (None, None))
    if proc is not None:
        if proc.poll() is None:  # the session ended first (-x, a Ctrl-C): no process outlives it
            proc.kill()
            proc.wait()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def default_job(request):
    """(the `plait train` process started with the session, its folder): see DEFAULT_JOB."""
    return request.config.stash[DEFAULT_JOB]
