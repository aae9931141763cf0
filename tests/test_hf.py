"""HuggingFace interop: plait's logits equal transformers', export round-trips exactly."""

import pytest
import torch

from plait.hf import config_from_hf, load_hf_weights, save_hf
from plait.model import build_model

transformers = pytest.importorskip("transformers")

CASES = {
    "untied": dict(tie_word_embeddings=False, rope_scaling=None),
    "tied-llama3-rope": dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_and_export_round_trips(case, tmp_path):
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  rope_theta=10000.0, **CASES[case])
    hf_model = transformers.LlamaForCausalLM(hc).eval()
    hf_model.save_pretrained(tmp_path / "hf")

    cfg = config_from_hf(tmp_path / "hf")
    model = build_model(cfg, seed=0)
    model.load_state_dict(load_hf_weights(tmp_path / "hf", cfg), strict=False)
    model.eval()
    x = torch.randint(0, 151, (2, 120))
    with torch.no_grad():
        diff = (hf_model(x).logits - model(x)).abs().max().item()
    assert diff <= 1e-5, diff

    save_hf(dict(model.named_parameters()), cfg, tmp_path / "export")
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    a, b = hf_model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert again.config.tie_word_embeddings == hc.tie_word_embeddings


def test_sharded_export_and_load(tmp_path, monkeypatch):
    import plait.hf
    from plait.config import ModelConfig

    monkeypatch.setattr(plait.hf, "MAX_SHARD_BYTES", 20_000)  # force several shards + an index
    cfg = ModelConfig(preset="custom", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                      tie_embeddings=False)
    model = build_model(cfg, seed=1)
    save_hf(dict(model.named_parameters()), cfg, tmp_path / "x")
    assert (tmp_path / "x" / "model.safetensors.index.json").is_file()
    back = load_hf_weights(tmp_path / "x", config_from_hf(tmp_path / "x"))
    assert all(torch.equal(back[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_exported_weights_get_the_usual_file_mode(tmp_path, monkeypatch, umask, mode):
    """Other users of a shared machine read the export as they read any file of its owner's."""
    import os

    import plait.hf
    from plait.config import ModelConfig

    cfg = ModelConfig(preset="custom", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    model = build_model(cfg, seed=1)
    old = os.umask(umask)
    try:
        save_hf(dict(model.named_parameters()), cfg, tmp_path / "one")
        monkeypatch.setattr(plait.hf, "MAX_SHARD_BYTES", 20_000)
        save_hf(dict(model.named_parameters()), cfg, tmp_path / "sharded")
    finally:
        os.umask(old)
    files = [tmp_path / "one" / "model.safetensors", *sorted((tmp_path / "sharded").glob("*.safetensors"))]
    assert len(files) > 2
    assert {f: f.stat().st_mode & 0o777 for f in files} == {f: mode for f in files}
    assert (tmp_path / "one" / "config.json").stat().st_mode & 0o777 == mode


def test_an_out_that_cannot_be_the_export_folder_is_one_line(tmp_path, capsys):
    """--out naming a file was a NotADirectoryError traceback, and a taken --out was only found
    after the checkpoint had loaded (minutes for a large model): both are one line, before it."""
    from plait.cli import main
    from plait.config import ModelConfig
    from plait.errors import UserError

    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    cfg = ModelConfig(preset="custom", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    with pytest.raises(UserError, match="is a file; give a new folder"):
        save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "file")
    for out, needle in (("file", "is a file; give a new folder"), ("full", "exists and is not empty"),
                        # a typo in --out built the missing folders, silently
                        ("typo/hf", f"its folder {tmp_path / 'typo'} does not exist; create it first")):
        # no checkpoint there at all: the --out line comes first, so nothing was loaded
        assert main(["hf", "export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out = '{tmp_path / out}': {needle}" in err, err


def test_an_hf_folder_that_does_not_say_its_tokenizer_is_not_read_as_bytes(tmp_path, capsys):
    """Without tokenizer.json a folder was taken for bytes whatever its vocabulary: `generate` printed
    a 300-token model's ids as garbage. plait's own byte-level export says it is bytes."""
    from plait.cli import main
    from plait.config import ModelConfig
    from plait.hf import mark_byte_level

    cfg = ModelConfig(preset="custom", vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.model").write_bytes(b"sentencepiece")
    assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tokenizer.json (its sentencepiece tokenizer.model plait does not " \
                                   "read), and its vocabulary of 300 is not bytes'" in err, err
    mark_byte_level(tmp_path / "m")  # what `plait hf export` writes for a byte-level run
    assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--max-new-tokens", "2"]) == 0
