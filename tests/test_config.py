"""The config system: presets, TOML, overrides, validation messages."""

import dataclasses

import pytest

from plait.config import PRESETS, Config, build_config, field_docs, load_toml, merge, parse_overrides
from plait.errors import UserError
from plait.validate import validate_config


def test_defaults_are_valid_and_every_field_documented():
    cfg = validate_config(build_config())
    assert cfg.model.preset == "tiny"
    for section in dataclasses.fields(Config):
        cls = type(getattr(cfg, section.name))
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, f"undocumented field in [{section.name}]"


def test_preset_then_explicit_fields_win():
    cfg = build_config({"model": {"preset": "1b", "n_layers": 2}})
    assert cfg.model.dim == PRESETS["1b"]["dim"] and cfg.model.n_layers == 2
    assert cfg.model.vocab_size == 128256


def test_overrides_parse_and_coerce():
    raw = parse_overrides(["--train.steps", "20", "--train.lr=1e-3", "--parallel.allow_cross_node_tp", "true",
                           "--model.tie-embeddings", "false"])
    cfg = build_config(raw)
    assert cfg.train.steps == 20 and cfg.train.lr == 1e-3 and cfg.parallel.allow_cross_node_tp is True
    assert cfg.model.tie_embeddings is False


def test_toml_then_cli_override(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\npreset = "small"\n[train]\nsteps = 7\nseq_len = 128\n')
    raw = merge(load_toml(f), parse_overrides(["--train.steps", "9"]))
    cfg = build_config(raw)
    assert (cfg.model.preset, cfg.train.steps, cfg.train.seq_len) == ("small", 9, 128)
    again = build_config(merge(load_toml(f), {}))
    assert build_config(__import__("tomllib").loads(again.to_toml())).to_dict() == again.to_dict()


def test_a_folder_given_as_config_is_named_a_folder(tmp_path):
    # it exists: "no such file" sent the user looking for a typo
    with pytest.raises(UserError) as e:
        load_toml(tmp_path)
    assert str(e.value) == f"--config = {str(tmp_path)!r}: is a folder, not a file; give the path of a TOML config (a .toml file)"
    (tmp_path / "config.toml").write_text("[train]\nsteps = 3\n")  # a run folder: the file it holds is named
    with pytest.raises(UserError) as e:
        load_toml(tmp_path)
    assert str(e.value).endswith(f"is a folder, not a file; give the path of a TOML config such as {tmp_path / 'config.toml'}")


@pytest.mark.parametrize("raw, needle", [
    ({"train": {"stepz": 3}}, "did you mean 'steps'"),
    ({"trian": {"steps": 3}}, "did you mean 'train'"),
    ({"train": {"steps": "many"}}, "train.steps = 'many': expected an integer"),
    ({"model": {"preset": "huge"}}, "model.preset = 'huge'"),
    ({"model": {"dim": 100, "n_heads": 3}}, "model.n_heads = 3: must divide model.dim = 100"),
    ({"model": {"n_kv_heads": 3}}, "model.n_kv_heads = 3: must divide model.n_heads = 8"),
    ({"train": {"seq_len": 4096}}, "train.seq_len = 4096: exceeds model.max_seq_len"),
    ({"train": {"dtype": "fp8"}}, "train.dtype = 'fp8'"),
    ({"parallel": {"zero": 4}}, "parallel.zero = 4"),
    ({"parallel": {"overlap_ctas": 100}}, "parallel.overlap_ctas = 100: give 0 (NCCL's choice) or a count of 1-64"),
    ({"parallel": {"overlap_ctas": 8, "zero": 3}}, "parallel.overlap_ctas = 8: it budgets DDP's all-reduce only"),
    ({"parallel": {"zero3_cast_once": True, "zero": 2}}, "parallel.zero3_cast_once = True: it keeps ZeRO-3's cast shard"),
    ({"train": {"min_lr": 1.0}}, "train.min_lr = 1.0"),
    # NaN passed `value < 0`: the run trained with a NaN learning rate to a NaN loss
    ({"train": {"lr": "nan"}}, "train.lr = nan: must be zero or more"),
    ({"model": {"norm_eps": float("nan")}}, "model.norm_eps = nan: must be a positive number"),
    # a user's: each got past every check, then failed in the first batch (numpy's generator) or
    # divided by zero building RoPE's table - or trained a model other than the one described
    ({"train": {"seed": -1}}, "train.seed = -1: must be an integer from 0 to 9223372036854775807"),
    ({"train": {"seed": 2**70}}, f"train.seed = {2**70}: must be an integer from 0"),
    ({"model": {"rope_scaling": 8.0, "rope_low_freq_factor": 0.0}}, "model.rope_low_freq_factor = 0.0: must be a "
     "positive number"),
    ({"model": {"rope_high_freq_factor": "nan"}}, "model.rope_high_freq_factor = nan: must be a positive number"),
    ({"model": {"rope_original_max_len": 0}}, "model.rope_original_max_len = 0: must be a positive number"),
    ({"model": {"rope_scaling": 8.0, "rope_low_freq_factor": 4.0}}, "model.rope_high_freq_factor = 4.0: must "
     "exceed model.rope_low_freq_factor = 4.0"),
])
def test_bad_input_is_one_line_naming_field_and_fix(raw, needle):
    with pytest.raises(UserError) as e:
        validate_config(build_config(raw))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_override_syntax_errors():
    with pytest.raises(UserError, match="--section.key VALUE"):
        parse_overrides(["steps", "3"])
    with pytest.raises(UserError, match="needs a value"):
        parse_overrides(["--train.steps"])


@pytest.mark.parametrize("arg, field", [("--profile-steps", "--train.profile_steps"),
                                        ("--stage_layers=3,1", "--parallel.stage_layers"),
                                        ("--micro-batch", "--train.micro_batch")])
def test_a_field_without_its_section_is_named(arg, field):
    # `--profile-steps 2:3` said only that overrides look like --section.key VALUE, not which one it meant
    with pytest.raises(UserError, match=f"did you mean {field}\\?"):
        parse_overrides([arg, "2:3"])


@pytest.mark.parametrize("dim", [64, 66, 72, 100, 96, 130])
@pytest.mark.parametrize("heads, kv", [(3, 1), (5, 1), (8, 4), (12, 4), (7, 2)])
def test_a_suggested_head_count_passes_the_checks_after_it(dim, heads, kv):
    """The head count an error suggests (with the KV head count it needs, where it names one) makes
    a valid model: `--model.dim 100` once suggested 10 heads, which the next check refused for 4
    KV heads."""
    import re

    from plait.validate import validate_model

    m = build_config({"model": {"dim": dim, "n_heads": heads, "n_kv_heads": kv}}).model
    try:
        validate_model(m)
        return
    except UserError as e:
        msg = str(e)
    if not msg.startswith("model.n_heads"):
        return
    found = re.search(r"e\.g\. (\d+)(?: with model\.n_kv_heads (\d+))?\)", msg)
    assert found, msg
    m.n_heads, m.n_kv_heads = int(found[1]), int(found[2] or kv)
    validate_model(m)
