"""How long a training step leaves the GPU idle: the host's share of a step, which no kernel model
prices. At every step boundary the host waits for the GPU (the loss read back for logging, the
gradient norm for clipping), so the next step's first kernels start a launch later; inside the step
it issues the data's copy, the optimizer's few launches and the hooks between compiled blocks. On
plait's runs this is a few milliseconds a step whatever the model (4-6 ms on H100 and H200 for 1b
and 8b, 3-4 ms at 32k tokens): a constant per step, 2% of a 250 ms step and 6% of an 80 ms one.

Measured on plait's own one-GPU step (the trainer's build and engine, its loss read back each step
as a logging loop does) under torch.profiler: the window from the first kernel to the last less
the union of kernel intervals (`plait.gpu_time.split`), per step. `plait bench calibrate` stores it
in the hardware profile (`step_gap_s`); the planner adds it to every step it prices.
"""

from __future__ import annotations


def measure(dev, preset: str = "1b", micro_batch: int = 2, seq: int = 2048, warmup: int = 3,
            steps: int = 5) -> dict:
    """{"seconds": idle per step, "gaps": the longest idle stretches, and what was run}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from plait.config import build_config
    from plait.gpu_time import kernels_of, split
    from plait.parallel.build import parallelize

    cuda = dev.type == "cuda"
    cfg = build_config({"model": {"preset": preset, "max_seq_len": max(seq, 64)},
                        "train": {"lr": 1e-4, "warmup_steps": 0, "micro_batch": micro_batch}})
    par = parallelize(cfg, None, dev, torch.bfloat16 if cuda else torch.float32, compile=cuda)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (micro_batch, seq), generator=g).to(dev) for _ in range(2))

    def step():
        return par.runner.step([(x, y)], 1e-4)[0].item()  # read back, as a loop that logs the loss does

    for _ in range(warmup):
        step()
    got = {"idle_ms": 0.0, "gaps": []}  # a CPU runs its kernels on the host: nothing waits for it
    if cuda:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(dev)
        got = split(kernels_of(prof), steps)
    par.close()
    return {"seconds": got["idle_ms"] / 1e3, "model": preset, "micro_batch": micro_batch, "seq": seq,
            "steps": steps, "gaps": [list(x) for x in got["gaps"][:4]]}
