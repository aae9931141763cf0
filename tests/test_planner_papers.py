"""Published numbers the planner's formulas reproduce from published inputs: Megatron-LM 2021
(Narayanan et al.), ZeRO 2020 (Rajbhandari et al.), Korthikanti et al. 2022, PaLM 2022, ZB 2023,
and the Llama 3 parameter counts plait's presets must match."""

import pytest

from plait.config import PRESETS, ModelConfig
from plait.planner.costs import (ModelDims, hardware_flops_per_token, megatron_hardware_flops,
                                 megatron_model_flops, megatron_param_count, model_flops_per_token,
                                 param_count, training_days)
from plait.planner.memory import PRECISIONS, state_bytes

# Narayanan et al. 2021, Table 1: (params in B, heads, hidden, layers, achieved TFLOP/s per GPU, % of peak)
MEGATRON_TABLE_1 = [(1.7, 24, 2304, 24, 137, 44), (3.6, 32, 3072, 30, 138, 44), (7.5, 32, 4096, 36, 142, 46),
                    (18.4, 48, 6144, 40, 135, 43), (39.1, 64, 8192, 48, 138, 44), (76.1, 80, 10240, 60, 140, 45),
                    (145.6, 96, 12288, 80, 148, 47), (310.1, 128, 16384, 96, 155, 50),
                    (529.6, 128, 20480, 105, 163, 52), (1008.0, 160, 25600, 128, 163, 52)]


@pytest.mark.parametrize("params,heads,hidden,layers,tflops,pct", MEGATRON_TABLE_1)
def test_megatron_table_1(params, heads, hidden, layers, tflops, pct):
    """Parameter counts from the shapes (V = 51200, s = 2048), and % of the A100's 312 TFLOP/s."""
    d = ModelDims.gpt(layers, hidden, heads)
    assert megatron_param_count(d) / 1e9 == pytest.approx(params, abs=0.051)
    assert param_count(d) == pytest.approx(megatron_param_count(d) + 2 * hidden)  # + final LayerNorm
    assert round(tflops / 312 * 100) == pct


def test_megatron_flops_formula_is_6n_plus_attention():
    """72 B s l h^2 (1 + s/6h + V/12lh) (no recomputation) is PaLM's 6N + 12LHQT for a GPT model
    with f = 4h up to biases and norms; with full recomputation 96 B s l h^2 (1 + s/6h + V/16lh)."""
    for layers, hidden, heads in ((96, 12288, 96), (128, 25600, 160), (24, 2304, 24)):
        d = ModelDims.gpt(layers, hidden, heads)
        tokens = 1536 * 2048
        assert model_flops_per_token(d) * tokens == pytest.approx(megatron_model_flops(d, 1536), rel=2e-3)
        assert hardware_flops_per_token(d, "full") * tokens == pytest.approx(megatron_hardware_flops(d, 1536), rel=2e-3)


def test_megatron_training_time_estimates():
    """Narayanan et al. 2021 sec. 5.1: GPT-3 175B on 300B tokens with 1024 A100s at 140 TFLOP/s:
    34 days; the 1T model on 450B tokens with 3072 A100s at 163 TFLOP/s: 84 days (8 T P / n X)."""
    assert round(training_days(300e9, 175e9, 1024, 140e12)) == 34
    assert round(training_days(450e9, 1.008e12, 3072, 163e12)) == 84


def test_megatron_1t_iteration_flops():
    """The 1T model (l=128, h=25600, V=51200, s=2048, B=3072) does 96 B s l h^2 (1 + s/6h + V/16lh)
    = 5.14e19 FLOPs per iteration; at 163 TFLOP/s on 3072 GPUs (502 PFLOP/s aggregate, Table 1)
    an iteration takes ~103 s."""
    d = ModelDims.gpt(128, 25600, 160)
    f = megatron_hardware_flops(d, 3072)
    assert f == pytest.approx(5.139e19, rel=1e-3)
    assert 163e12 * 3072 / 1e15 == pytest.approx(502, abs=1.5)
    assert f / (163e12 * 3072) == pytest.approx(102.6, abs=0.2)


def test_zero_paper_table_1():
    """Rajbhandari et al. 2020, Table 1 (K = 12), per-device GB: 7.5B on 4/16/64/256/1024 devices
    for P_os, P_os+g, P_os+g+p; 128B and 1T on 1024 devices."""
    rows = {4: (52.5, 41.3, 30.0), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47),
            1024: (30.1, 15.1, 0.12)}
    p = PRECISIONS["mixed"]
    for n, row in rows.items():
        got = tuple(state_bytes(7.5e9, z, n, p).total / 1e9 for z in (1, 2, 3))
        assert got == pytest.approx(row, abs=0.051)
    assert state_bytes(128e9, 2, 1024, p).total / 1e9 == pytest.approx(258, abs=0.3)
    assert state_bytes(128e9, 3, 1024, p).total / 1e9 == pytest.approx(2.0)
    assert state_bytes(1e12, 2, 1024, p).total / 1e9 == pytest.approx(2014, abs=0.5)
    assert state_bytes(1e12, 3, 1024, p).total / 1e9 == pytest.approx(15.6, abs=0.05)


def test_korthikanti_530b_speedup():
    """Korthikanti et al. 2022: the 530B model at 54.2% MFU instead of 42.1% with full recomputation
    is 29% faster (same model FLOPs, so time scales as 1 / MFU)."""
    assert round((54.2 / 42.1 - 1) * 100) == 29


def test_palm_540b_mfu():
    """PaLM (Chowdhery et al. 2022), Table 3: 540B (L=118, H=48, Q=256, T=2048, d=18432) trains at
    238.3K tokens/s on 6144 TPU v4 chips (275 TFLOP/s bf16): 46.2% MFU with 6N + 12LHQT."""
    n = 540.35e9
    flops = 6 * n + 12 * 118 * 48 * 256 * 2048
    assert 238.3e3 * flops / (6144 * 275e12) == pytest.approx(0.462, abs=0.0005)


def test_llama3_parameter_counts():
    """plait's presets have Meta's Llama 3 counts: 8.03B, 70.55B, 405.85B (and 1.24B for 3.2-1B)."""
    want = {"8b": 8_030_261_248, "70b": 70_553_706_496, "405b": 405_853_388_800, "1b": 1_235_814_400}
    for name, n in want.items():
        assert param_count(ModelDims.from_config(ModelConfig(**PRESETS[name]))) == n
