"""HuggingFace Llama checkpoints in and out: config.json + safetensors <-> plait names and config.

Works without `transformers` installed (only `safetensors` is needed). plait's RoPE uses the same
rotate-half layout as HF Llama, so weights map one to one with no permutation.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
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
_AGAIN = "download the model again (a plait export: run `plait hf export` again)"
"""The fix for a damaged file of an HF folder: a download or copy cut short, or an edit gone wrong."""


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


def tokenizer_of(path: str | Path, vocab_size: int, field: str = "--checkpoint"):
    """The tokenizer of an HF folder: its tokenizer.json, or bytes where plait's export said so (or
    the vocabulary is bytes' 256); None when the folder does not say (it was taken for bytes, and
    `generate` decoded a 32k model's ids as garbage, silently)."""
    from plait.tokenizer import ByteTokenizer, HFTokenizer

    p = Path(path)
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(p / "tokenizer.json")
    if _read_json(p / "config.json", path, field).get(BYTE_LEVEL) == "bytes" or vocab_size == 256:
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


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _read_json(f: Path, path: str | Path, field: str) -> dict:
    """The JSON object in file `f` of the folder `path`; a file that is not one (cut short, not JSON,
    an array...) is one line naming `field`, not a JSONDecodeError or AttributeError traceback."""
    try:
        c = json.loads(f.read_bytes())  # bytes: json finds the UTF encoding itself
    except OSError as e:
        raise bad_value(field, str(path), f"has a {f.name} that cannot be read ({e.strerror or e}); make it "
                        "readable by this user") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both
        raise bad_value(field, str(path), f"{f.name} is not valid JSON ({e}): the file is damaged or cut short; "
                        f"{_AGAIN}") from None
    if not isinstance(c, dict):
        raise bad_value(field, str(path), f"{f.name} holds {_JSON_KINDS.get(type(c), 'a value')}, not the JSON object "
                        f"a {f.name} is: the file is damaged; {_AGAIN}")
    return c


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
"""The keys of every Llama config.json (transformers writes them all); the others have defaults."""


def _setting(c: dict, key: str, path, field: str, default=None, whole: bool = True, file: str = "config.json"):
    """`c[key]`, a positive whole number (or any positive number), `default` where absent or null; a
    value of another kind is one line, not a TypeError traceback (or a string model built)."""
    v = c.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or not 0 < v < math.inf:
        kind = "positive whole number" if whole else "positive number"
        raise bad_value(field, str(path), f"{file} has {key} = {v!r} where a {kind} belongs: the file is damaged "
                        f"or was edited wrongly; correct it, or {_AGAIN}")
    return v


def config_from_hf(path: str | Path, field: str = "--hf") -> ModelConfig:
    """The model config.json describes, checked as far as plait builds it: a damaged folder (config.json
    or tokenizer.json cut short, a key missing or of another kind) is one line naming `field`."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise bad_value(field, str(path), "holds no config.json; give a HuggingFace Llama model folder")
    c = _read_json(p / "config.json", path, field)
    if c.get("model_type") not in ("llama", None):
        raise bad_value(field, str(path), f"is a {c.get('model_type')!r} model; plait loads Llama-architecture models")
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias") or c.get("mlp_bias"):
        raise bad_value(field, str(path), "uses biases or a non-SiLU activation, which plait's Llama does not have")
    missing = [k for k in _REQUIRED if c.get(k) is None]  # a null one too
    if missing:
        raise bad_value(field, str(path), f"config.json lacks {', '.join(map(repr, missing))}, which every Llama "
                        f"config.json has: the file is damaged or not a model's config; {_AGAIN}")
    n = {k: _setting(c, k, path, field) for k in _REQUIRED}
    heads = n["num_attention_heads"]
    if _setting(c, "head_dim", path, field) not in (None, n["hidden_size"] // heads):
        raise bad_value(field, str(path), f"has head_dim {c['head_dim']} != hidden_size/heads; not supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise bad_value(field, str(path), f"config.json has rope_parameters/rope_scaling = {rope!r} where an object "
                        f"belongs: the file is damaged or was edited wrongly; correct it, or {_AGAIN}")
    # rope_theta beside rope_parameters (transformers 4.x) or inside it (5.x); null counts as absent
    theta = _setting(c, "rope_theta", path, field, None, whole=False) or _setting(
        rope, "rope_theta", path, field, 10000.0, whole=False, file="config.json's rope_parameters")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise bad_value(field, str(path), f"uses RoPE type {kind!r}; plait supports default and llama3")
    tie = c.get("tie_word_embeddings", False)
    if not isinstance(tie, (bool, type(None))):  # bool("false") is True: a string tied the weights
        raise bad_value(field, str(path), f"config.json has tie_word_embeddings = {tie!r} where true or false "
                        f"belongs: the file is damaged or was edited wrongly; correct it, or {_AGAIN}")
    m = ModelConfig(preset="custom", vocab_size=n["vocab_size"], dim=n["hidden_size"],
                    n_layers=n["num_hidden_layers"], n_heads=heads,
                    n_kv_heads=_setting(c, "num_key_value_heads", path, field, heads), ffn_dim=n["intermediate_size"],
                    max_seq_len=_setting(c, "max_position_embeddings", path, field, 2048),
                    rope_theta=float(theta),
                    norm_eps=float(_setting(c, "rms_norm_eps", path, field, 1e-5, whole=False)),
                    tie_embeddings=bool(tie),
                    init_std=float(_setting(c, "initializer_range", path, field, 0.02, whole=False)))
    if kind == "llama3":
        where = "config.json's rope_parameters"
        gone = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if rope.get(k) is None]
        if gone:
            raise bad_value(field, str(path), f"{where} (rope_type llama3) lacks {', '.join(map(repr, gone))}: the "
                            f"file is damaged; {_AGAIN}")
        m.rope_scaling = float(_setting(rope, "factor", path, field, whole=False, file=where))
        m.rope_low_freq_factor = float(_setting(rope, "low_freq_factor", path, field, whole=False, file=where))
        m.rope_high_freq_factor = float(_setting(rope, "high_freq_factor", path, field, whole=False, file=where))
        m.rope_original_max_len = _setting(rope, "original_max_position_embeddings", path, field, file=where)
    _check_tokenizer_file(p, field)
    return m


def _check_tokenizer_file(p: Path, field: str) -> None:
    """A tokenizer.json that `tokenizers` cannot read, said under `field`. Checked here, where every
    command passes the field the user gave (`tokenizer_of`'s callers do not): `HFTokenizer`'s own
    line named --tokenizer, a flag the user never gave. Costs a second read of the file (~0.3 s for
    a 128k vocabulary), small beside the weights."""
    f = p / "tokenizer.json"
    if not f.is_file():
        return
    try:
        from tokenizers import Tokenizer
    except ImportError:  # `tokenizer_of` says to install it
        return
    try:
        Tokenizer.from_file(str(f))
    except Exception as e:  # the library raises a plain Exception on a bad file
        raise bad_value(field, str(p), f"has a tokenizer.json the tokenizers library cannot read ({e}): the file "
                        f"is damaged or cut short; {_AGAIN}") from None


def _weight_files(path: str | Path, field: str) -> list[Path]:
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, path, field).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise bad_value(field, str(path), f"{index.name} has no \"weight_map\" of tensor names to file names: "
                            f"the file is damaged; {_AGAIN}")
        files = [p / f for f in sorted(set(weight_map.values()))]
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


def _damaged(f: Path, path, field: str, e: Exception) -> UserError:
    """What to say of a safetensors file the library refused (SafetensorError, OSError): was a
    traceback from inside safetensors."""
    if isinstance(e, OSError):
        return bad_value(field, str(path), f"has a {f.name} that cannot be read ({e.strerror or e}); make it "
                         "readable by this user")
    try:
        with open(f, "rb") as fh:
            lfs = fh.read(64).startswith(b"version https://git-lfs")
    except OSError:
        lfs = False
    if lfs:  # a clone without git-lfs holds pointers: a common way to get a "model" of 130 bytes
        return bad_value(field, str(path), f"has a {f.name} that is a Git LFS pointer, not the weights: run "
                         "`git lfs pull` in the folder, or download the model again")
    return bad_value(field, str(path), f"has a {f.name} that safetensors cannot read ({e}): the file is damaged "
                     f"or cut short; {_AGAIN}")


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
        try:
            fh = safe_open(str(f), framework="pt")  # reads and checks the header, and the file's size
        except (SafetensorError, OSError) as e:
            raise _damaged(f, path, field, e) from None
        with fh:
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
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError) as e:  # changed since checked: still one line
            raise _damaged(f, path, field, e) from None
        for name, t in tensors.items():
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
    if not out.exists() and not out.parent.is_dir():  # a typo built a tree of folders, silently
        raise bad_value("--out", str(out), f"its folder {out.parent} does not exist; create it first")
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
