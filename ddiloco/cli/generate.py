"""`ddiloco generate`: loads a `ddiloco export` directory and prints text sampled from a prompt.

Owns: loading an export into the model it names (checked against the model's own tensor names and
shapes) and byte-level sampling with the model's ``logits``. The built-in transformer reads bytes,
so a prompt is its UTF-8 bytes and the output is decoded back (invalid sequences as U+FFFD).
Exit status: 0 printed; 1 the export cannot be loaded; 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np

BYTE_VOCAB = 256


class GenerateError(Exception):
    """The export cannot be loaded or sampled from (exit status 1)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", required=True, help="a directory written by `ddiloco export`")
    parser.add_argument("--prompt", required=True, help="text to continue (UTF-8, at least one byte)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens (bytes) to generate")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 always takes the most likely token")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed prints the same text")


def load_export(model_dir: pathlib.Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Returns (model, params as jax arrays, config.json) for an export directory."""
    from safetensors import SafetensorError
    from safetensors import numpy as st_numpy

    from ddiloco import models  # jax: imported when needed, so `--help` stays fast

    try:
        config = json.loads((model_dir / "config.json").read_text())
        name, model_config = config["model_name"], config["model_config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GenerateError(f"{model_dir}/config.json is missing or not a `ddiloco export` config: {exc!r}") from None
    try:
        model = models.get_model(name, model_config)
    except ValueError as exc:
        raise GenerateError(f"{model_dir}/config.json names a model this version cannot build: {exc}") from None
    try:
        arrays = st_numpy.load_file(model_dir / "model.safetensors")
    except (OSError, SafetensorError) as exc:
        raise GenerateError(f"{model_dir}/model.safetensors cannot be read: {exc}") from None
    expected = {spec.name: tuple(spec.shape) for spec in model.tensor_specs()}
    got = {k: tuple(v.shape) for k, v in arrays.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise GenerateError(f"{model_dir}/model.safetensors does not match model {name!r}: missing {missing}, "
                            f"unexpected {extra}, wrong shape {wrong}")
    import jax.numpy as jnp

    params = {k: jnp.asarray(v, dtype=jnp.float32) for k, v in arrays.items()}
    return model, params, config


def sample(model: Any, params: dict[str, Any], prompt: list[int], *, max_new_tokens: int, temperature: float,
           seed: int) -> list[int]:
    """Continues `prompt` by `max_new_tokens` tokens; deterministic for a given seed."""
    import jax

    window_len = model.seq_len
    # One compiled shape: the context is right-padded to seq_len. Causal attention makes the
    # logits at the last real position independent of the padding after it.
    logits_fn = jax.jit(model.logits)
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        context = tokens[-window_len:]
        window = np.zeros((1, window_len), dtype=np.int32)
        window[0, :len(context)] = context
        row = np.asarray(logits_fn(params, window)[0, len(context) - 1], dtype=np.float64)
        if temperature == 0:
            tokens.append(int(np.argmax(row)))
            continue
        scaled = row / temperature
        probs = np.exp(scaled - scaled.max())
        tokens.append(int(rng.choice(row.size, p=probs / probs.sum())))
    return tokens[len(prompt):]


def run(args: argparse.Namespace) -> int:
    def fail(message: str, status: int) -> int:
        print(f"ddiloco generate: {message}", file=sys.stderr)
        return status

    if args.max_new_tokens < 0:
        return fail(f"--max-new-tokens {args.max_new_tokens}: use 0 or more", 2)
    if not args.temperature >= 0:
        return fail(f"--temperature {args.temperature}: use 0 (greedy) or more", 2)
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        return fail("--prompt is empty: the model needs at least one byte to continue", 2)
    model_dir = pathlib.Path(args.model_dir)
    if not model_dir.is_dir():
        return fail(f"--model-dir {model_dir} is not a directory (write one with `ddiloco export`)", 2)
    try:
        model, params, _ = load_export(model_dir)
        if model.vocab_size != BYTE_VOCAB or not hasattr(model, "logits"):
            raise GenerateError(f"model {model.name!r} (vocab {model.vocab_size}) is not a byte-level model with "
                                "logits(): generate only samples byte-level models")
    except GenerateError as exc:
        return fail(str(exc), 1)
    new = sample(model, params, list(prompt), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 seed=args.seed)
    sys.stdout.write((prompt + bytes(new)).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
