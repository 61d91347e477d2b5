"""``fleetserve tokenizer MODEL --out DIR``: a Hugging Face tokenizer folder for a model.

Benchmark clients (guidellm, aiperf, ``vllm bench serve``) load the served
model's tokenizer with ``transformers.AutoTokenizer.from_pretrained`` to build
prompts of N tokens and count output tokens. The built-in models use the
engine's byte tokenizer, which has no Hugging Face files of its own; this
command writes them (:func:`~fleetserve.runtime.engine.tokenizer.export_hf_tokenizer`):
the folder encodes and decodes exactly as the engine does. Needs neither torch
nor ``tokenizers``: it copies package data.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console


def cmd_tokenizer(args: argparse.Namespace, console: Console) -> int:
    from fleetserve.runtime.engine.tokenizer import HF_TOKENIZER_FILES, export_hf_tokenizer

    out = export_hf_tokenizer(args.model, args.out).resolve()
    model = args.model
    console.print(
        f"wrote the byte tokenizer of {model} to {out} ({', '.join(HF_TOKENIZER_FILES)})\n"
        "use it with (the rest of each command as usual):\n"
        "  guidellm run --backend kind=openai_http,target=http://HOST:PORT,"
        f"model={model} --tokenizer kind=hf_auto,model={out} ...  (guidellm 0.8)\n"
        f"  aiperf profile --url http://HOST:PORT --model {model} --tokenizer {out} ...\n"
        f"  vllm bench serve --base-url http://HOST:PORT --model {model} --tokenizer {out} ...\n"
        f"or in Python: transformers.AutoTokenizer.from_pretrained({str(out)!r})",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def add_tokenizer_parser(sub: Any) -> None:
    """The ``tokenizer`` subcommand."""
    p = sub.add_parser(
        "tokenizer",
        help="write a Hugging Face tokenizer folder for a built-in model (for benchmark clients)",
        description="Write the byte tokenizer of a built-in model (or of a checkpoint folder "
        "without a tokenizer.json) as a Hugging Face tokenizer folder: tokenizer.json, "
        "tokenizer_config.json, special_tokens_map.json. AutoTokenizer.from_pretrained(DIR) "
        "loads it offline; give DIR to aiperf (--tokenizer DIR), vllm bench serve "
        "(--tokenizer DIR) or guidellm 0.8 (--tokenizer kind=hf_auto,model=DIR).",
    )
    p.add_argument(
        "model", metavar="MODEL", help="built-in model (tiny-llama-a, ...) or checkpoint folder"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (created)")
    p.set_defaults(func=cmd_tokenizer)
