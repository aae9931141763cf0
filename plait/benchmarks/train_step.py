"""Single-GPU training-step throughput: plait against HF transformers' LlamaForCausalLM.

Same config, same batch, same card, same run. Each (preset, variant) runs in its own process so
memory peaks and compile caches do not leak between them. Variants:
  plait          plait's step (bf16 params, fp32 masters, compiled blocks, fused chunked loss)
  plait-eager    the same without torch.compile
  hf             LlamaForCausalLM, fp32 weights + bf16 autocast, SDPA attention, fused AdamW
  hf-compile     the same under torch.compile
  plait-fp8-R    plait with --train.fp8 R (R = tensorwise or rowwise)
  plait-ao-R     plait's step with torchao's Float8Linear (recipe R) in the blocks instead of plait's
                 own FP8 matmuls: the maintained library, measured against them
  plait-RC       plait with --train.recompute RC (selective or full)
MFU = tokens/s x (6N + 12·L·H·Q·T) / peak, with the same N for every variant.

  plait bench train --presets 125m,1b --seq 2048 --micro-batch 125m=16,1b=8 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HELP = "single-GPU training step: plait vs HF transformers (eager and compiled)"


def _hf_step_fn(cfg, micro_batch, seq, compiled):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.hf import hf_config_dict

    d = hf_config_dict(cfg, torch.float32)
    d.pop("architectures"), d.pop("model_type"), d.pop("torch_dtype")
    hc = LlamaConfig(**d)
    hc._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hc).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if compiled else model
    V = cfg.vocab_size

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _torchao_fp8(model, recipe, device):
    """Stands in for `plait.fp8.apply_fp8`: torchao's Float8Linear over the same block linears."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mine = {id(lin) for lin in model.block_linears()}
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: id(mod) in mine)


def _plait_step_fn(cfg, micro_batch, seq, compiled, variant="plait"):
    import torch

    import plait.fp8
    from plait.config import Config
    from plait.parallel.build import parallelize

    full = Config()
    full.model = cfg
    for part in variant.split("-")[1:]:
        if part in ("selective", "full"):
            full.train.recompute = part
        elif part in ("tensorwise", "rowwise"):
            full.train.fp8 = part
        elif part not in ("fp8", "ao", "eager"):  # a typo must not run bf16 under an FP8 name
            raise SystemExit(f"variant {variant!r}: unknown part {part!r}")
    if "-ao-" in variant:
        plait.fp8.apply_fp8 = _torchao_fp8  # parallelize imports it at call time
    # one device: the trainer's own build, engine and step
    par = parallelize(full, None, torch.device("cuda"), torch.bfloat16, compile=compiled)

    def step(x, y):
        return par.runner.step([(x, y)], 1e-4)[0]

    return step


def profile(step, x, y, top: int = 30) -> None:
    """Print the kernels that take the most GPU time over 3 steps (to stderr, after the result)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(x, y)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70),
          file=sys.stderr)


def child(preset: str, variant: str, micro_batch: int, seq: int, steps: int, warmup: int,
          with_profile: bool = False, n_layers: int = 0) -> dict:
    import torch

    from plait.config import build_config
    from plait.metrics import flops_per_token, peak_flops

    over = {"n_layers": n_layers} if n_layers else {}
    cfg = build_config({"model": {"preset": preset, "max_seq_len": max(seq, 2048), **over}}).model
    torch.manual_seed(0)
    t_build = time.perf_counter()
    compiled = not variant.endswith("eager") and variant != "hf"
    step = (_plait_step_fn(cfg, micro_batch, seq, compiled, variant) if variant.startswith("plait")
            else _hf_step_fn(cfg, micro_batch, seq, compiled))
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq), device="cuda")
    y = torch.randint(0, cfg.vocab_size, (micro_batch, seq), device="cuda")
    for _ in range(warmup):
        step(x, y)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t_build
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step(x, y)
        loss.item()  # what a training loop that logs every step pays too
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    if with_profile:
        profile(step, x, y)
    tok_s = micro_batch * seq / med
    fpt = flops_per_token(cfg, seq)
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    return {"preset": preset, "n_layers": cfg.n_layers, "params": sum(p.numel() for p in _params(cfg)),
            "variant": variant, "micro_batch": micro_batch, "seq_len": seq,
            "step_s_median": med, "step_s_min": times[0], "tokens_per_s": tok_s,
            "mfu": tok_s * fpt / peak if peak else None, "flops_per_token": fpt,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9, "warmup_and_compile_s": warm_s,
            "loss": float(loss)}


def _params(cfg):
    import torch

    from plait.model import Transformer

    with torch.device("meta"):
        return list(Transformer(cfg).parameters())


def add_arguments(ap) -> None:
    ap.add_argument("--presets", default="125m,1b")
    ap.add_argument("--variants", default="plait,hf,hf-compile")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", default="8", help="one value, or preset=value pairs: 125m=16,1b=8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--n-layers", type=int, default=0, help="override the presets' layer count (0: keep)")
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="print a kernel-time table per variant (stderr)")
    ap.add_argument("--child", nargs=3, metavar=("PRESET", "VARIANT", "MB"), help=argparse.SUPPRESS)


def run(a) -> int:
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], int(a.child[2]), a.seq, a.steps, a.warmup,
                                           a.profile, a.n_layers)))
        return 0
    import torch

    mb = dict(kv.split("=") for kv in a.micro_batch.split(",")) if "=" in a.micro_batch else {}
    rows = []
    for preset in a.presets.split(","):
        for variant in a.variants.split(","):
            m = int(mb.get(preset, a.micro_batch if not mb else 8))
            cmd = [sys.executable, "-m", "plait.benchmarks.train_step", "--child", preset, variant, str(m),
                   "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--n-layers", str(a.n_layers)]
            cmd += ["--profile"] if a.profile else []
            r = subprocess.run(cmd, capture_output=True, text=True)
            if a.profile:
                print(r.stderr[-12000:], file=sys.stderr)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(line[-1][7:]) if line else {"preset": preset, "variant": variant, "micro_batch": m,
                                                          "error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    from plait.planner.recorded import RUNTIME_MARKS

    result = {"benchmark": "train_step", **RUNTIME_MARKS, "card": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'preset':6} {'variant':20} {'mb':>3} {'tok/s':>9} {'MFU':>6} {'mem GB':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:6} {r['variant']:20} {r['micro_batch']:>3} ERROR {r['error']}")
        else:
            print(f"{r['preset']:6} {r['variant']:20} {r['micro_batch']:>3} {r['tokens_per_s']:>9.0f} "
                  f"{100 * r['mfu']:>5.1f}% {r['peak_mem_gb']:>7.1f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
