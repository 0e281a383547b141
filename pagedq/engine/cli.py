"""The engine's commands (`python -m pagedq.engine generate ...`): they need only the engine's dependencies and
import nothing of pagedq/worker/. The `pagedq` command (pagedq/worker/cli/main.py) registers them next to the queue's
commands."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


class StrictArgumentParser(argparse.ArgumentParser):
    """Every pagedq parser: abbreviated flags are refused (`--max-token 5` must not pass for `--max-tokens`).
    Sub-commands inherit the class, since argparse builds subparsers with the type of their parent."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def package_version() -> str:
    try:
        return importlib.metadata.version("pagedq")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def register_commands(commands: argparse._SubParsersAction) -> None:
    """Add `generate` to a command group (the `pagedq` command, pagedq/worker/cli/main.py, adds it next to the
    queue's commands and the benchmarks' group, pagedq/bench/cli.py)."""
    from pagedq.engine.options import add_engine_arguments

    generate = commands.add_parser("generate", help="generate offline for prompts given on the command line")
    generate.add_argument("prompts", nargs="+", help="prompts, one argument each")
    generate.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    generate.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate per prompt at most (default 64)"
    )
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    generate.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template")
    add_engine_arguments(generate)
    generate.set_defaults(func=_generate)


def build_parser(prog: str = "python -m pagedq.engine") -> argparse.ArgumentParser:
    """The engine's own commands, for a GPU box without the queue stack (the `pagedq` command adds the queue's)."""
    parser = StrictArgumentParser(prog=prog, description="paged-KV LLM engine: offline generation")
    parser.add_argument("--version", action="version", version=f"pagedq {package_version()}")
    register_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def _generate(args: argparse.Namespace) -> int:
    from pagedq.engine import LLM, SamplingParams
    from pagedq.engine.options import engine_kwargs_from
    from pagedq.engine.startup import freeze_startup_objects

    llm = LLM(args.model, **engine_kwargs_from(args))
    freeze_startup_objects()
    prompts = args.prompts
    if args.chat:
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for prompt, output in zip(args.prompts, llm.generate(prompts, params)):
        print(
            f"### {prompt}\n{output.outputs[0].text}\n[{output.outputs[0].finish_reason}, "
            f"{len(output.outputs[0].token_ids)} tokens]"
        )
    return 0


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; the errors a bad setting raises become one line and exit status 2."""
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedq: error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
