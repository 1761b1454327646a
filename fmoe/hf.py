"""Hugging Face checkpoints in and out: released MoE models as fmoe Transformers, exactly.

    model, cfg = fmoe.hf.from_pretrained("path/to/Qwen3-30B-A3B")    # a local folder
    fmoe.hf.save_pretrained(model, "out/hf")                            # config.json + safetensors

A folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). Supported `model_type`s: FAMILIES (mixtral, qwen2_moe,
qwen3_moe, olmoe). Each family has one table: its config mapping (`config_to_fmoe`, which
refuses what fmoe does not build: a sliding window, clipped qkv, ...) and its key map (HF
key <-> fmoe parameter, with the layout change: HF linear weights [out, in] are
transposed to fmoe's [in, out]; the per-expert matrices are stacked into [E, H, F] /
[E, F, H] and split back on export; the router stays float32).

Routing: HF's softmax routers take the top-k of softmax(logits) and, with norm_topk_prob
(Mixtral always), renormalise the k weights: fmoe's default softmax routing (softmax over
the k chosen logits) is that; without it, fmoe's pre_softmax (weights not renormalised).

Loading reads the safetensors files tensor by tensor with the `safetensors` library (an
expert stack is filled expert by expert): the checkpoint is never in memory twice. Into a
model whose parameters are DTensors (fmoe.parallel.parallelize, e.g. built on the meta
device and materialised), each rank copies its own block of each tensor as it is read.

Export writes the same keys, dtypes and config back: a model loaded and saved again gives
files bit-identical to the originals (`from_pretrained` keeps the HF config on the model,
`model.hf_config`); a model of fmoe's own is written with `model_type=` one of FAMILIES
and a config built from its TransformerConfig.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

import torch

from fmoe.model import Transformer, TransformerConfig


# ------------------------------------------------------------------------------ configs
def _get(hf: dict, *names, default=None):
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    return default


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported for {hf.get('model_type')} (plain RoPE only)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _refuse(hf: dict, field: str, ok: Callable[[object], bool], what: str) -> None:
    if field in hf and not ok(hf[field]):
        raise ValueError(f"config.json: {field} = {hf[field]!r} is not supported ({what})")


def _common(hf: dict, n_experts: int) -> dict:
    """The Llama-like fields every family shares."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act = {hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    _refuse(hf, "sliding_window", lambda v: not v or not hf.get("use_sliding_window", True), "no sliding-window attention yet")
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=_get(hf, "num_key_value_heads", default=heads), head_dim=_get(hf, "head_dim", default=hf["hidden_size"] // heads),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_base=_rope_theta(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        n_experts=n_experts, k=hf["num_experts_per_tok"], score="softmax", expert_bias=False, mtp_depth=0,
    )


def _mixtral(hf: dict) -> dict:
    n = hf["num_local_experts"]
    return dict(_common(hf, n), ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0, n_shared=0)


def _qwen_moe_layers(hf: dict) -> tuple[int, ...]:
    """Qwen's rule: block i is MoE unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _qwen2_moe(hf: dict) -> dict:
    shared = hf.get("shared_expert_intermediate_size") or 0
    return dict(_common(hf, hf["num_experts"]), ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"],
                moe_layers=_qwen_moe_layers(hf), n_shared=0, shared_ffn=shared, shared_gate=bool(shared),
                pre_softmax=not hf.get("norm_topk_prob", False), qkv_bias=bool(hf.get("qkv_bias", True)))


def _qwen3_moe(hf: dict) -> dict:
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Qwen3-MoE's attention here")
    return dict(_common(hf, _get(hf, "num_experts", "num_local_experts")), ffn_expert=hf["moe_intermediate_size"],
                ffn_dense=hf["intermediate_size"], moe_layers=_qwen_moe_layers(hf), n_shared=0,
                pre_softmax=not hf.get("norm_topk_prob", False), qk_norm="head")


def _olmoe(hf: dict) -> dict:
    _refuse(hf, "clip_qkv", lambda v: v is None, "clipped q/k/v are not built")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in OLMoE's attention here")
    return dict(_common(hf, hf["num_experts"]), ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0,
                n_shared=0, pre_softmax=not hf.get("norm_topk_prob", False), qk_norm="proj")


# ------------------------------------------------------------------------------ key maps
@dataclasses.dataclass(frozen=True)
class Tensor:
    """One fmoe parameter and where it lives in the HF checkpoint: `keys` (one, or one per
    expert to stack along dim 0), each transposed when `transpose` (HF's [out, in] linear
    weights), or a [1, H] row when `row`."""

    keys: tuple[str, ...]
    transpose: bool = False
    stacked: bool = False
    row: bool = False


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: config.json -> TransformerConfig kwargs, the key map, and the
    names HF uses for its MoE block and its experts' three matrices (gate, up, down)."""

    config_to_fmoe: Callable[[dict], dict]
    moe: str
    experts: tuple[str, str, str]
    architecture: str


FAMILIES = {
    "mixtral": Family(_mixtral, "block_sparse_moe", ("w1", "w3", "w2"), "MixtralForCausalLM"),
    "qwen2_moe": Family(_qwen2_moe, "mlp", ("gate_proj", "up_proj", "down_proj"), "Qwen2MoeForCausalLM"),
    "qwen3_moe": Family(_qwen3_moe, "mlp", ("gate_proj", "up_proj", "down_proj"), "Qwen3MoeForCausalLM"),
    "olmoe": Family(_olmoe, "mlp", ("gate_proj", "up_proj", "down_proj"), "OlmoeForCausalLM"),
}


def key_map(family: Family, cfg: TransformerConfig) -> dict[str, Tensor]:
    """Every fmoe parameter name -> its Tensor in the HF checkpoint, in HF's key order."""
    out = {"embed": Tensor(("model.embed_tokens.weight",))}
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        attn = p + "self_attn."
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            out[q + "attn." + ours] = Tensor((f"{attn}{theirs}.weight",), transpose=True)
        if cfg.qkv_bias:
            for ours, theirs in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                out[q + "attn." + ours] = Tensor((f"{attn}{theirs}.bias",))
        if cfg.qk_norm is not None:
            out[q + "attn.q_norm"] = Tensor((attn + "q_norm.weight",))
            out[q + "attn.k_norm"] = Tensor((attn + "k_norm.weight",))
        out[q + "attn_norm.weight"] = Tensor((p + "input_layernorm.weight",))
        out[q + "mlp_norm.weight"] = Tensor((p + "post_attention_layernorm.weight",))
        mlp = p + family.moe + "."
        if cfg.is_moe(i):
            out[q + "mlp.router"] = Tensor((mlp + "gate.weight",))
            for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.experts):
                out[q + "mlp.experts." + ours] = Tensor(tuple(f"{mlp}experts.{e}.{theirs}.weight" for e in range(cfg.n_experts)),
                                                        transpose=True, stacked=True)
            if cfg.shared_size:
                for ours, theirs in zip(("w_gate", "w_up", "w_down"), ("gate_proj", "up_proj", "down_proj")):
                    out[q + "mlp.shared." + ours] = Tensor((f"{mlp}shared_expert.{theirs}.weight",), transpose=True)
                if cfg.shared_gate:
                    out[q + "mlp.shared_gate"] = Tensor((mlp + "shared_expert_gate.weight",), row=True)
        else:
            for ours, theirs in zip(("w_gate", "w_up", "w_down"), ("gate_proj", "up_proj", "down_proj")):
                out[q + "mlp." + ours] = Tensor((f"{p}mlp.{theirs}.weight",), transpose=True)
    out["norm.weight"] = Tensor(("model.norm.weight",))
    if not cfg.tie_embeddings:
        out["head"] = Tensor(("lm_head.weight",))
    return out


# ------------------------------------------------------------------------------ files
def _weight_files(path: Path) -> dict[str, Path]:
    """HF key -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} has no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def read_config(path) -> tuple[dict, TransformerConfig]:
    """(config.json as a dict, the TransformerConfig it maps to); ValueError naming the
    field for an unknown model_type or an option fmoe does not build."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} has no config.json")
    hf = json.loads(file.read_text())
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of {', '.join(FAMILIES)}")
    return hf, TransformerConfig(**FAMILIES[model_type].config_to_fmoe(hf))


def _copy_into(param: torch.Tensor, full: torch.Tensor, name: str, key: str) -> None:
    """Write the full value into param (its own block, for a DTensor)."""
    from fmoe.model import copy_full_value

    if tuple(param.shape) != tuple(full.shape):
        raise ValueError(f"checkpoint: {key} gives {name} the shape {tuple(full.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        copy_full_value(param, full.to(param.dtype))


def load_weights(model: Transformer, path, *, model_type: str) -> None:
    """Read the checkpoint in `path` into model's parameters (see the module docstring): a
    whole model, one parallelized over ranks (each rank its own blocks), or a pipeline
    chunk (its own parameters only). ValueError naming the key for a missing key or a
    shape mismatch."""
    path = Path(path)
    family = FAMILIES[model_type]
    files = _weight_files(path)
    params = dict(model.named_parameters())
    from safetensors import safe_open

    handles: dict[Path, object] = {}
    try:
        def read(key: str) -> torch.Tensor:
            if key not in files:
                raise ValueError(f"checkpoint: missing key {key!r} in {str(path)!r}")
            file = files[key]
            if file not in handles:
                handles[file] = safe_open(file, "pt")
            return handles[file].get_tensor(key)

        chunk = getattr(model, "pipeline_chunk", None)
        for name, spec in key_map(family, model.cfg).items():
            if name not in params and chunk is not None:
                continue  # held by another pipeline stage
            if name not in params:
                raise ValueError(f"model: has no parameter {name!r} for checkpoint key {spec.keys[0]!r}")
            if spec.stacked:
                full = None
                for e, key in enumerate(spec.keys):
                    t = read(key)
                    t = t.t() if spec.transpose else t
                    if full is None:
                        full = torch.empty((len(spec.keys), *t.shape), dtype=torch.float32)
                    if tuple(t.shape) != tuple(full.shape[1:]):
                        raise ValueError(f"checkpoint: {key} has shape {tuple(t.shape)} (as [in, out]), its other experts {tuple(full.shape[1:])}")
                    full[e] = t
            else:
                t = read(spec.keys[0])
                full = t.t() if spec.transpose else t
                full = full.reshape(-1) if spec.row else full
            _copy_into(params[name], full, name, spec.keys[0])
    finally:
        handles.clear()


def from_pretrained(path, **options) -> tuple[Transformer, TransformerConfig]:
    """A Transformer (float32, on the CPU) with the weights of the HF folder `path`.

    options: TransformerConfig fields to set on top of the mapped config (e.g. impl="torch",
    ac="full", mtp_depth is not loaded). Returns (model, cfg); model.hf_config keeps
    config.json for save_pretrained."""
    hf, cfg = read_config(path)
    if options:
        cfg = dataclasses.replace(cfg, **options)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.reset_parameters(seed=0)  # everything the checkpoint does not hold (expert biases, MTP)
    load_weights(model, path, model_type=hf["model_type"])
    model.hf_config = hf
    return model, cfg


def hf_config(cfg: TransformerConfig, model_type: str) -> dict:
    """A config.json for an fmoe model of one of FAMILIES (the fields the mapping reads)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: expected one of {', '.join(FAMILIES)}, got {model_type!r}")
    hf = dict(architectures=[FAMILIES[model_type].architecture], model_type=model_type, vocab_size=cfg.vocab_size,
              hidden_size=cfg.hidden, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
              num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              rope_parameters={"rope_theta": cfg.rope_base, "rope_type": "default"}, tie_word_embeddings=cfg.tie_embeddings,
              num_experts_per_tok=cfg.k, dtype="float32")
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
    if model_type == "mixtral":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert)
    elif model_type == "olmoe":
        hf.update(num_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, norm_topk_prob=not cfg.pre_softmax)
    else:
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if i not in moe],
                  norm_topk_prob=not cfg.pre_softmax)
        if model_type == "qwen2_moe":
            hf.update(shared_expert_intermediate_size=cfg.shared_size, qkv_bias=cfg.qkv_bias)
    back = TransformerConfig(**FAMILIES[model_type].config_to_fmoe(hf))
    mismatch = {f.name: (getattr(cfg, f.name), getattr(back, f.name)) for f in dataclasses.fields(TransformerConfig)
                if f.name not in ("impl", "ac", "init_std", "ffn_dense", "n_dense", "n_shared", "moe_layers", "capacity_factor",
                                  "capacity_policy", "yarn_original_max_positions")
                and getattr(cfg, f.name) != getattr(back, f.name)}
    layers_differ = [cfg.is_moe(i) for i in range(cfg.n_layers)] != [back.is_moe(i) for i in range(cfg.n_layers)]
    if mismatch or layers_differ or cfg.capacity_factor is not None or cfg.shared_size != back.shared_size:
        raise ValueError(f"model: its config has no {model_type} equivalent: {mismatch or 'MoE layers / shared experts / capacity'}")
    return hf


def save_pretrained(model: Transformer, path, *, model_type: Optional[str] = None) -> Path:
    """Write `model` as an HF folder: config.json (the loaded one when the model came from
    from_pretrained, else hf_config(cfg, model_type)) and model.safetensors, in the
    checkpoint's layout (module docstring). Parameters that are DTensors are gathered
    (call on every rank; rank 0 writes). Returns path."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    hf = getattr(model, "hf_config", None)
    if hf is None or (model_type is not None and model_type != hf.get("model_type")):
        if model_type is None:
            raise ValueError("model_type: needed for a model not loaded with from_pretrained (one of " + ", ".join(FAMILIES) + ")")
        hf = hf_config(model.cfg, model_type)
    family = FAMILIES[hf["model_type"]]
    params = dict(model.named_parameters())
    dtype = getattr(torch, hf.get("dtype") or hf.get("torch_dtype") or "float32")
    tensors = {}
    for name, spec in key_map(family, model.cfg).items():
        p = params[name].detach()
        full = p.full_tensor() if isinstance(p, DTensor) else p
        full = full.to("cpu")
        if spec.stacked:
            for e, key in enumerate(spec.keys):
                tensors[key] = (full[e].t() if spec.transpose else full[e]).contiguous().to(dtype)
        elif spec.row:
            tensors[spec.keys[0]] = full.reshape(1, -1).contiguous().to(dtype)
        else:
            tensors[spec.keys[0]] = (full.t() if spec.transpose else full).contiguous().to(dtype)
    path = Path(path)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path
