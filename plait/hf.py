"""HuggingFace Llama checkpoints in and out: config.json + safetensors <-> plait names and config.

Works without `transformers` installed (only `safetensors` is needed). plait's RoPE uses the same
rotate-half layout as HF Llama, so weights map one to one with no permutation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plait.config import ModelConfig
from plait.errors import UserError, bad_value

_LAYER_MAP = {  # HF suffix under model.layers.{i}. -> plait suffix under layers.{i}.
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
}
_TOP_MAP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight"}
MAX_SHARD_BYTES = 5 * 1024**3


def hf_to_plait_name(name: str) -> str | None:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        suffix = ".".join(parts[3:])
        if suffix in _LAYER_MAP:
            return f"layers.{parts[2]}.{_LAYER_MAP[suffix]}"
    return None


def plait_to_hf_name(name: str) -> str:
    for hf, pl in _TOP_MAP.items():
        if name == pl:
            return hf
    _, i, *rest = name.split(".")
    inverse = {v: k for k, v in _LAYER_MAP.items()}
    return f"model.layers.{i}.{inverse['.'.join(rest)]}"


BYTE_LEVEL = "plait_tokenizer"
"""config.json's key (value "bytes") that `plait hf export` writes for a byte-level model, which has
no tokenizer.json: a folder without one is then byte-level by its own say, not by a guess."""


def mark_byte_level(out: Path) -> None:
    path = Path(out) / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **{BYTE_LEVEL: "bytes"}), indent=1))


def write_special_tokens(out: Path, tokenizer) -> None:
    """Name the tokenizer's end- and start-of-document ids in the export's config.json (null where
    it has none, as bytes): without them transformers assumes Llama 2's 1 and 2, ordinary tokens of
    other vocabularies, and its `generate` never stops at the real end. With a tokenizer.json, a
    tokenizer_config.json names the same tokens for `AutoTokenizer`."""
    eos, bos = getattr(tokenizer, "eos_id", None), getattr(tokenizer, "bos_id", None)
    path = Path(out) / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), bos_token_id=bos, eos_token_id=eos), indent=1))
    if getattr(tokenizer, "path", None):
        names = {"bos_token": tokenizer.token(bos), "eos_token": tokenizer.token(eos)}
        (Path(out) / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in names.items() if v is not None}}, indent=1))


def tokenizer_of(path: str | Path, vocab_size: int):
    """The tokenizer of an HF folder: its tokenizer.json, or bytes where plait's export said so (or
    the vocabulary is bytes' 256); None when the folder does not say (it was taken for bytes, and
    `generate` decoded a 32k model's ids as garbage, silently)."""
    from plait.tokenizer import ByteTokenizer, HFTokenizer

    p = Path(path)
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(p / "tokenizer.json")
    if json.loads((p / "config.json").read_text()).get(BYTE_LEVEL) == "bytes" or vocab_size == 256:
        return ByteTokenizer()
    return None


def no_tokenizer(path: str | Path, vocab_size: int, field: str = "--checkpoint") -> UserError:
    """What a command that needs text says of an HF folder `tokenizer_of` found no tokenizer in."""
    p = Path(path)
    has = " (its sentencepiece tokenizer.model plait does not read)" if (p / "tokenizer.model").is_file() else ""
    return bad_value(field, str(path), f"has no tokenizer.json{has}, and its vocabulary of {vocab_size} is not "
                     "bytes': add the model's tokenizer.json (transformers' AutoTokenizer.save_pretrained writes one)")


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def config_from_hf(path: str | Path, field: str = "--hf") -> ModelConfig:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise bad_value(field, str(path), "holds no config.json; give a HuggingFace Llama model folder")
    c = json.loads((p / "config.json").read_text())
    if c.get("model_type") not in ("llama", None):
        raise bad_value(field, str(path), f"is a {c.get('model_type')!r} model; plait loads Llama-architecture models")
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias") or c.get("mlp_bias"):
        raise bad_value(field, str(path), "uses biases or a non-SiLU activation, which plait's Llama does not have")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise bad_value(field, str(path), f"has head_dim {c['head_dim']} != hidden_size/heads; not supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise bad_value(field, str(path), f"uses RoPE type {kind!r}; plait supports default and llama3")
    m = ModelConfig(preset="custom", vocab_size=c["vocab_size"], dim=c["hidden_size"],
                    n_layers=c["num_hidden_layers"], n_heads=heads,
                    n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
                    max_seq_len=c.get("max_position_embeddings", 2048), rope_theta=float(theta),
                    norm_eps=c.get("rms_norm_eps", 1e-5), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                    init_std=c.get("initializer_range", 0.02))
    if kind == "llama3":
        m.rope_scaling = float(rope["factor"])
        m.rope_low_freq_factor = float(rope["low_freq_factor"])
        m.rope_high_freq_factor = float(rope["high_freq_factor"])
        m.rope_original_max_len = int(rope["original_max_position_embeddings"])
    return m


def _weight_files(path: str | Path, field: str) -> list[Path]:
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        files = [p / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        gone = [f.name for f in files if not f.is_file()]
        if gone:  # was a FileNotFoundError traceback from the loader
            raise bad_value(field, str(path), f"has an index naming {', '.join(gone[:3])}, which the folder does not "
                            "hold; copy the whole model folder")
        return files
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    has = " (its pytorch_model.bin plait does not read)" if any(p.glob("pytorch_model*.bin")) else ""
    raise bad_value(field, str(path), f"has no model.safetensors (or index){has}; save the model with safetensors "
                    "(transformers' save_pretrained writes it)")


def _check_names(path, names, cfg: ModelConfig, field: str) -> None:
    missing = sorted(_expected_names(cfg) - set(names))
    if missing:
        raise bad_value(field, str(path), f"lacks tensors {[plait_to_hf_name(n) for n in missing[:3]]}; it does not "
                        "match its config.json")


def check_hf_weights(path: str | Path, cfg: ModelConfig, field: str = "--hf") -> None:
    """That the folder's safetensors hold every tensor `cfg` needs, in the shapes its config.json
    makes, from their headers alone (no tensor is read): said before a run starts, not by its workers
    after its folder was made (a tensor of another shape was cropped to fit, in silence)."""
    from safetensors import safe_open

    from plait.model import Transformer

    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in Transformer(cfg).named_parameters()}
    names = []
    for f in _weight_files(path, field):
        with safe_open(str(f), framework="pt") as fh:
            for hf_name in fh.keys():
                name = hf_to_plait_name(hf_name)
                if name is None:
                    continue
                names.append(name)
                shape = tuple(fh.get_slice(hf_name).get_shape())
                if name in want and shape != want[name]:
                    raise bad_value(field, str(path), f"holds {hf_name} of shape {list(shape)} where its config.json "
                                    f"makes {list(want[name])}: the weights and config.json do not match")
    _check_names(path, names, cfg, field)


def load_hf_weights(path: str | Path, cfg: ModelConfig, field: str = "--hf") -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint renamed to plait names (dtype as stored), checked first
    (`check_hf_weights`: every tensor there, in its shape)."""
    check_hf_weights(path, cfg, field)
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(path, field):
        for name, t in load_file(str(f)).items():
            plait_name = hf_to_plait_name(name)
            if plait_name is not None:
                out[plait_name] = t
    if cfg.tie_embeddings:
        out.pop("output.weight", None)
    return out


def _expected_names(cfg: ModelConfig) -> set[str]:
    names = {"embed.weight", "norm.weight"} | ({"output.weight"} if not cfg.tie_embeddings else set())
    for i in range(cfg.n_layers):
        names |= {f"layers.{i}.{v}" for v in _LAYER_MAP.values()}
    return names


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling > 0:
        rope = {"rope_type": "llama3", "factor": cfg.rope_scaling, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len, "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std,
        # both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x reads rope_parameters
        "rope_theta": cfg.rope_theta, "rope_scaling": rope if cfg.rope_scaling > 0 else None,
        "rope_parameters": rope, "torch_dtype": str(dtype).replace("torch.", ""),
    }


def check_new_folder(out: str | Path) -> Path:
    """`out` as a Path, or one line if it cannot be the new export folder (`plait hf export` asks
    before loading the checkpoint: a mistyped --out should not cost a large model's load)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise bad_value("--out", str(out), "is a file; give a new folder")
    if out.exists() and any(out.iterdir()):
        raise bad_value("--out", str(out), "exists and is not empty; choose a new folder")
    return out


def save_hf(weights: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path,
            dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and safetensors (sharded with an index above 5 GiB) to a new folder."""
    out = check_new_folder(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise bad_value("--out", str(out), f"cannot be created ({e.strerror}); choose a writable folder") from None
    tensors = {plait_to_hf_name(n): t.detach().to(dtype).contiguous() for n, t in weights.items()
               if not (n == "output.weight" and cfg.tie_embeddings)}
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=1))
    for f in out.glob("*.safetensors"):
        # safetensors writes a private temporary file (mode 0600) and renames it: other users of a
        # shared machine could not read the weights. Give them the mode any new file gets here.
        f.chmod(0o666 & ~_umask())
    return out


def _umask() -> int:
    """This process's umask (reading it means setting it: put it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
