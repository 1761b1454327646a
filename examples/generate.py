"""Sample from a trained model: an fmoe run (its out_dir, or one checkpoint) or a Hugging Face folder.

    python examples/generate.py out/train_moe --prompt="def " --tokens=200            # greedy
    python examples/generate.py out/train_moe --prompt="import " --temperature=0.8 --top_p=0.9 --seed=1
    python examples/generate.py path/to/qwen3_moe --prompt="Hello"   # needs its tokenizer.json (`tokenizers`)
    python examples/generate.py path/to/qwen3_moe --prompt_ids=1,2,3 # or token ids, printed as ids

An fmoe run is rebuilt from its config.json (the model knobs and vocab_size the loop wrote)
and the newest complete checkpoint's weights (fmoe.train.checkpoint.load_model); a run on
the embedded corpus or a text directory speaks bytes (fmoe.train.data.encode_text /
decode_text). An HF folder is loaded with fmoe.hf.from_pretrained. Decoding: greedy with
--temperature=0, else softmax(logits / temperature) restricted to the smallest set of
tokens whose probability reaches --top_p (nucleus sampling), from a generator seeded by
--seed. The prompt runs once, then each new token alone against the keys and values of
the tokens before it (Transformer.decode with a KVCache of prompt + --tokens tokens).
Generation stops after --tokens new tokens or at the end-of-document token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from fmoe.model import Transformer, TransformerConfig


def load_run(path: Path) -> tuple[Transformer, dict]:
    """The model of an fmoe run directory (or of one of its checkpoints) and the run's config."""
    from fmoe.train import checkpoint

    run_dir = path if (path / "config.json").is_file() else path.parent
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"path: {str(path)!r} is neither an fmoe run directory (config.json) nor a checkpoint inside one")
    run = json.loads((run_dir / "config.json").read_text())
    knobs = dict(run["config"]["model"], vocab_size=run["vocab_size"])
    if knobs.get("moe_layers") is not None:
        knobs["moe_layers"] = tuple(knobs["moe_layers"])
    model = Transformer(TransformerConfig(**{**knobs, "impl": "torch"}))
    checkpoint.load_model(path, model=model)
    return model, run


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], *, tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos: Optional[int] = None) -> list[int]:
    """prompt + up to `tokens` new token ids (module docstring). ValueError for an empty
    prompt, a negative number of tokens or temperature, or top_p outside (0, 1]."""
    if not prompt:
        raise ValueError("prompt: expected at least one token")
    if tokens < 0:
        raise ValueError(f"tokens: expected >= 0 new tokens, got {tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p}")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    device = model.embed.device
    cache = model.kv_cache(len(prompt) + tokens)
    logits = model.decode(torch.tensor(prompt, device=device), cache)[-1].cpu()
    for step in range(tokens):
        if step:
            logits = model.decode(torch.tensor([ids[-1]], device=device), cache)[-1].cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix reaching top_p
            sorted_p = sorted_p * keep
            nxt = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
        ids.append(nxt)
        if eos is not None and nxt == eos:
            break
    return ids


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path, help="an fmoe run directory or checkpoint, or a Hugging Face folder")
    parser.add_argument("--prompt", default="", help="text (bytes for fmoe's byte runs; the folder's tokenizer for HF)")
    parser.add_argument("--prompt_ids", default="", help="comma-separated token ids instead of --prompt")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    encode = decode = None
    try:
        if (args.path / "config.json").is_file() and "model_type" in json.loads((args.path / "config.json").read_text()):
            import fmoe.hf

            model, cfg = fmoe.hf.from_pretrained(args.path, impl="torch")
            eos = model.hf_config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
            if (args.path / "tokenizer.json").is_file():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(args.path / "tokenizer.json"))
                encode, decode = (lambda s: tok.encode(s).ids), tok.decode
        else:
            from fmoe.train.data import EOS, decode_text, encode_text

            model, run = load_run(args.path)
            eos = None
            if not str(run["config"].get("data", "")).endswith((".bin", ".npy")):  # bytes: the stdlib corpus or text files
                encode, decode, eos = (lambda s: encode_text(s).tolist()), decode_text, EOS
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"path: {err}")
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    elif encode is not None:
        prompt = encode(args.prompt) or [eos if eos is not None else 0]
    else:
        sys.exit("--prompt_ids: this model has no tokenizer here (no tokenizer.json, or a token-file run); give token ids")
    try:
        ids = generate(model, prompt, tokens=args.tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos=eos)
    except ValueError as err:
        sys.exit(str(err))
    new = ids[len(prompt):]
    print(decode(ids) if decode is not None and not args.prompt_ids else ",".join(map(str, new)))


if __name__ == "__main__":
    main(sys.argv[1:])
