"""`python -m dvi_lite generate --model smollm2 --method pld --prompt "..." --show`: one answer, and where each token
came from.

With --show the text is coloured by origin (course/token_view.py: accepted draft tokens, the target's corrections
and bonus tokens), followed by a legend and τ. When the output is not a terminal (a pipe, a file) the text stays
plain and only the summary line follows it. A model with a chat template gets the prompt as a user message
(--raw: as a raw continuation). Method options go after colons, as in the bench: --method sps:K=4.
"""
from __future__ import annotations

import argparse
import sys

from dvi_lite.commands import prog, run_or_usage_error
from dvi_lite.core.registry import METHODS


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("generate"), description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", required=True, help="the question (or, with --raw, the text to continue)")
    ap.add_argument("--method", default="ar", help="one of: " + ", ".join(sorted(METHODS)) +
                    "; options after colons, e.g. sps:K=4")
    ap.add_argument("--model", default=None, help="course (default), smollm2, or a local checkpoint folder")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 on CPU)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as raw text")
    ap.add_argument("--show", action="store_true", help="colour each token by where it came from, with τ")
    return ap


def run(args: argparse.Namespace, out=None) -> str:
    """Load, generate once, and return what to print."""
    from dvi_lite.core.generate import generate, has_chat_template
    from dvi_lite.course.token_view import ansi, summary
    from dvi_lite.measure.timing import check_method, parse_spec
    from dvi_lite.models.loading import load_model

    name, opts = parse_spec(args.method)
    check_method(name, "--method")
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    prompt = args.prompt if args.raw or not has_chat_template(tok) else [{"role": "user", "content": args.prompt}]
    res = generate(model, tok, prompt, method=name, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, **opts)
    out = out or sys.stdout
    if args.show and out.isatty():
        return ansi(tok, res)
    return res.text + ("\n\n" + summary(res) if args.show else "")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    print(run_or_usage_error(ap, run, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
