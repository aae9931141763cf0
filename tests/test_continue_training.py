"""Continuing a model as an ML engineer does: a tokenizer.json from elsewhere, an HF folder to start
from, an export back to transformers, a resume with other flags. Each case here trained, exported or
resumed a wrong model without a word, or ended in a traceback, before."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import MICRO_MODEL
from plait.cli import main
from plait.config import ModelConfig
from plait.data import TokenData
from plait.hf import save_hf, write_special_tokens
from plait.model import build_model
from plait.prepare import prepare
from plait.tokenizer import HFTokenizer, same_tokenizer, train_bpe

pytest.importorskip("tokenizers")
WORDS = ["plait", "shard", "token", "mesh", "rank", "batch", "loss", "layer"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A trained BPE tokenizer.json and texts to prepare with it."""
    root = tmp_path_factory.mktemp("bpe")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 30)) for _ in range(60)]
    src = root / "src"
    src.mkdir()
    for i, t in enumerate(texts):
        (src / f"{i}.txt").write_text(t + "\n")
    return train_bpe(texts, 300, root / "tok.json"), src


def _run_args(data, out, steps=2, model=None, extra=()):
    args = ["train", "--out", str(out), "--steps", str(steps), "--data.path", str(data), "--train.micro_batch", "2",
            "--train.seq_len", "16", "--train.eval_batches", "1", "--train.eval_every", "0", "--train.progress",
            "false", "--train.sample_tokens", "0", "--train.compile", "off", "--train.tensorboard", "false",
            "--train.device", "cpu", *extra]
    for k, v in (model or {}).items():
        args += [f"--model.{k}", str(v)]
    return args


def _one_line(capfd) -> str:
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_tokenizer_with_gaps_in_its_ids_sizes_the_vocabulary_by_its_largest_id(bpe, tmp_path):
    """A count of tokens gave 300 for a file whose end-of-text token sits at id 1500: the data then
    told the model 300 rows, and a tensor-parallel run dropped every id past them in silence."""
    tok, src = bpe
    d = json.loads(tok.path.read_text())
    eos = next(a for a in d["added_tokens"] if a["content"] == "<|endoftext|>")
    old = eos["id"]
    eos["id"] = 1500
    d["model"]["vocab"] = {k: (1500 if v == old else v) for k, v in d["model"]["vocab"].items()}
    (tmp_path / "gaps.json").write_text(json.dumps(d))
    gaps = HFTokenizer(tmp_path / "gaps.json")
    assert gaps.eos_id == 1500 and gaps.vocab_size == 1501
    prepare([str(src)], tmp_path / "d", gaps, val_fraction=0.2, quiet=True)
    assert TokenData(tmp_path / "d").vocab_size == 1501


def test_a_tokenizer_file_rewritten_by_transformers_is_still_the_same_tokenizer(bpe, tmp_path):
    """transformers' save_pretrained adds a post-processor and reorders keys; the ids of every text
    stay the same, and the check compared the file's bytes, so it refused the data."""
    tok, src = bpe
    prepare([str(src)], tmp_path / "d", tok, val_fraction=0.2, quiet=True)
    d = json.loads(tok.path.read_text())
    d["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (tmp_path / "resaved.json").write_text(json.dumps(dict(reversed(list(d.items()))), indent=4))
    data = TokenData(tmp_path / "d")
    assert same_tokenizer(HFTokenizer(tmp_path / "resaved.json"), data)
    # older files write each merge as "a b", newer ones as ["a", "b"]: one tokenizer
    d["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]]
    (tmp_path / "old-merges.json").write_text(json.dumps(d))
    assert same_tokenizer(HFTokenizer(tmp_path / "old-merges.json"), data)
    # and a mix of folders prepared with the two files is one vocabulary
    from plait.config import DataConfig
    from plait.data import open_data

    prepare([str(src)], tmp_path / "d2", HFTokenizer(tmp_path / "resaved.json"), val_fraction=0.2, quiet=True)
    assert len(open_data(DataConfig(mix=f"{tmp_path / 'd'}:0.5,{tmp_path / 'd2'}:0.5")).parts) == 2
    d["model"]["vocab"]["zzz_new"] = 299  # another id for a text: another tokenizer
    (tmp_path / "other.json").write_text(json.dumps(d))
    assert not same_tokenizer(HFTokenizer(tmp_path / "other.json"), data)


def test_an_export_names_its_end_of_text_token_for_transformers(bpe, tmp_path):
    """Without eos_token_id in config.json transformers assumed Llama 2's 2 (and bos 1): ordinary
    tokens here, so its generate never stopped at the real end."""
    transformers = pytest.importorskip("transformers")
    tok, _ = bpe
    cfg = ModelConfig(preset="custom", vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
    out = save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "x")
    tok.save_to(out)
    write_special_tokens(out, tok)
    hc = transformers.AutoConfig.from_pretrained(out)
    assert hc.eos_token_id == tok.eos_id != 2 and hc.bos_token_id is None
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "<|endoftext|>"


def test_byte_level_runs_export_no_end_token_and_refuse_to_continue_a_model_of_another_vocabulary(
        corpus, tmp_path, capfd):
    """A byte-level run's export says it has no end-of-text id (null, not transformers' 2). An HF
    folder without tokenizer.json continued on byte data trained garbage in silence; now refused."""
    run = tmp_path / "r"
    assert main(_run_args(corpus, run, model=MICRO_MODEL)) == 0
    assert main(["hf", "export", "--checkpoint", str(run), "--out", str(tmp_path / "x")]) == 0
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert c["eos_token_id"] is None and c["bos_token_id"] is None and c["plait_tokenizer"] == "bytes"

    cfg = ModelConfig(preset="custom", vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
    save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "hf300")
    capfd.readouterr()
    new = tmp_path / "new"
    assert main(_run_args(corpus, new, extra=["--train.init_from", str(tmp_path / "hf300")])) == 2
    assert f"data.path = '{corpus}': was prepared as bytes, but the weights in {tmp_path / 'hf300'} (vocabulary 300)" \
        in _one_line(capfd)
    assert not new.exists()


def test_an_hf_folder_without_safetensors_is_refused_before_the_run_folder_is_made(bpe, tmp_path, capfd):
    tok, src = bpe
    prepare([str(src)], tmp_path / "d", tok, val_fraction=0.2, quiet=True)
    cfg = ModelConfig(preset="custom", vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      ffn_dim=48, tie_embeddings=False)
    hf = save_hf({k: v for k, v in build_model(cfg, seed=1).named_parameters() if k != "output.weight"}, cfg,
                 tmp_path / "hf")
    tok.save_to(hf)
    new = tmp_path / "new"
    assert main(_run_args(tmp_path / "d", new, extra=["--train.init_from", str(hf)])) == 2
    assert "lacks tensors ['lm_head.weight']" in _one_line(capfd)  # the name the folder would hold
    # a tensor of another shape than config.json makes was cropped to fit, in silence
    c = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(c, intermediate_size=40)))
    assert main(_run_args(tmp_path / "d", new, extra=["--train.init_from", str(hf)])) == 2
    assert "holds model.layers.0.mlp.down_proj.weight of shape [32, 48] where its config.json makes [32, 40]" \
        in _one_line(capfd)
    (hf / "config.json").write_text(json.dumps(c))
    # an index naming a shard the folder lacks (a FileNotFoundError traceback)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}}))
    assert main(_run_args(tmp_path / "d", new, extra=["--train.init_from", str(hf)])) == 2
    assert "has an index naming model-00002-of-00002.safetensors, which the folder does not hold" in _one_line(capfd)
    (hf / "model.safetensors.index.json").unlink()
    (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
    assert main(_run_args(tmp_path / "d", new, extra=["--train.init_from", str(hf)])) == 2
    assert "has no model.safetensors (or index) (its pytorch_model.bin plait does not read)" in _one_line(capfd)
    assert not new.exists()


def test_data_larger_than_the_continued_weights_vocabulary_names_the_data(bpe, corpus, tmp_path, capfd):
    """With init_from the weights fix the vocabulary: the line said to raise model.vocab_size, which
    the next command then refused."""
    tok, src = bpe
    prepare([str(src)], tmp_path / "d", tok, val_fraction=0.2, quiet=True)
    cfg = ModelConfig(preset="custom", vocab_size=280, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
    hf = save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "hf")
    (hf / "config.json").write_text(json.dumps(dict(json.loads((hf / "config.json").read_text()), plait_tokenizer="x")))
    capfd.readouterr()
    assert main(_run_args(tmp_path / "d", tmp_path / "new", extra=["--train.init_from", str(hf)])) == 2
    # (the folder has no tokenizer.json: the run would say that it cannot check the data's, once it starts)
    assert f"has a vocabulary of {tok.vocab_size}, larger than the 280 of the weights in {hf}; prepare the data " \
           "with their tokenizer" in _one_line(capfd)


def test_resume_keeps_where_the_run_came_from_and_says_what_changes_its_function(corpus, tmp_path, capfd,
                                                                               monkeypatch):
    src = tmp_path / "src"
    assert main(_run_args(corpus, src, model=MICRO_MODEL)) == 0
    run = tmp_path / "r"
    monkeypatch.chdir(tmp_path)  # a relative init_from, saved absolute: a resume from elsewhere finds it
    assert main(_run_args(corpus, run, steps=2, extra=["--train.init_from", "src", "--checkpoint.every", "1"])) == 0
    assert f'init_from = "{src}"' in (run / "config.toml").read_text()
    monkeypatch.chdir(corpus)
    capfd.readouterr()
    # another init_from on a resume changed nothing but the run's record of where it came from
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--train.init_from", str(tmp_path)]) == 2
    assert f"but the run in {run} continues from its own checkpoint (it started from {src})" in _one_line(capfd)
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--train.init_from", str(src),
                 "--model.rope_theta", "500.0"]) == 0
    assert "model.rope_theta = 500.0 (trained with 10000.0) from what step_00000002 was trained" in capfd.readouterr().err
    # a damaged config.toml: the config is the newest valid checkpoint's anyway
    (run / "config.toml").write_text("garbage = [\n")
    (run / "checkpoints" / "step_00000003" / "manifest.json").write_text('{"step": 3')
    assert main(["train", "--out", str(run), "--resume", "--steps", "4"]) == 0
    err = capfd.readouterr().err
    assert "resuming with the config saved in " + str(run / "checkpoints" / "step_00000002") in err


def test_generate_refuses_a_tokenizer_larger_than_the_model(bpe, tmp_path, capfd):
    tok, _ = bpe
    cfg = ModelConfig(preset="custom", vocab_size=270, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
    hf = save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "hf")
    tok.save_to(hf)
    assert main(["generate", "--checkpoint", str(hf), "--prompt", "shard", "--max-new-tokens", "2"]) == 2
    assert f"has a tokenizer of {tok.vocab_size} tokens for a model of vocabulary 270" in _one_line(capfd)


def test_eval_says_when_its_windows_outnumber_the_held_out_tokens(corpus, tmp_path, capsys):
    run = tmp_path / "r"
    assert main(_run_args(corpus, run, model=MICRO_MODEL)) == 0
    held = TokenData(corpus).splits["val"].tokens
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--batches", "1", "--batch-size", "1", "--seq-len", "8"]) == 0
    assert "held-out" not in capsys.readouterr().out
    many = held // (4 * 64) + 1
    assert main(["eval", "--checkpoint", str(run), "--batches", str(many), "--batch-size", "4", "--seq-len", "64"]) == 0
    assert f"windows drawn from {held:,} held-out tokens, some scored more than once" in capsys.readouterr().out


def test_prepare_counts_the_empty_documents_it_leaves_out(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": b}) for b in ("one text", None, "", "  ", "two")))
    assert main(["data", "prepare", "--input", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "d"),
                 "--text-field", "body"]) == 0
    assert "2 documents from 1 file(s) (0 skipped; 3 empty document(s) left out)" in capsys.readouterr().err


def test_an_hf_folder_whose_tokenizer_outgrows_its_model_is_named(bpe, tmp_path, capfd):
    """Its own tokenizer (1 more token than the model has rows) used to be blamed on the data."""
    tok, src = bpe
    prepare([str(src)], tmp_path / "d", tok, val_fraction=0.2, quiet=True)
    cfg = ModelConfig(preset="custom", vocab_size=tok.vocab_size - 1, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      ffn_dim=48)
    hf = save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path / "hf")
    tok.save_to(hf)
    assert main(_run_args(tmp_path / "d", tmp_path / "new", extra=["--train.init_from", str(hf)])) == 2
    assert f"train.init_from = '{hf}': has a tokenizer of {tok.vocab_size} tokens for a model of vocabulary " \
           f"{tok.vocab_size - 1}" in _one_line(capfd)


def test_a_requeue_naming_the_same_folders_otherwise_changes_nothing(corpus, tmp_path, capfd, monkeypatch):
    """The same command again (SLURM's requeue) with relative paths said "the command line changes
    data.path '/abs/corpus' -> 'corpus'". An emptied config.toml took the defaults; and a resumed
    run's config.toml, given back with --config into a new folder, asked for a checkpoint there."""
    monkeypatch.chdir(corpus.parent)
    assert main(_run_args(corpus.name, tmp_path / "r", steps=2, model=MICRO_MODEL, extra=["--resume", "auto"])) == 0
    capfd.readouterr()
    assert main(_run_args(corpus.name, tmp_path / "r", steps=3, model=MICRO_MODEL, extra=["--resume", "auto"])) == 0
    line = next(x for x in capfd.readouterr().err.splitlines() if "resuming with the config" in x)
    assert line.endswith("the command line changes train.steps 2 -> 3"), line
    assert f'path = "{corpus}"' in (tmp_path / "r" / "config.toml").read_text()
    assert '# resume = "auto"  (this start resumed the run' in (tmp_path / "r" / "config.toml").read_text()
    assert main(["train", "--config", str(tmp_path / "r" / "config.toml"), "--out", str(tmp_path / "again"),
                 "--steps", "1"]) == 0
    (tmp_path / "r" / "config.toml").write_text("")
    capfd.readouterr()
    assert main(["train", "--out", str(tmp_path / "r"), "--resume", "--steps", "4"]) == 0
    assert "resuming with the config saved in " + str(tmp_path / "r" / "checkpoints" / "step_00000003") \
        in capfd.readouterr().err


def test_a_corpus_of_empty_documents_says_so(tmp_path, capsys):
    (tmp_path / "e.jsonl").write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)))
    assert main(["data", "prepare", "--input", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "d")]) == 2
    assert "holds 3 document(s), all of them empty" in capsys.readouterr().err
