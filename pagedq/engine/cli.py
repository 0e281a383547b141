"""The engine's commands (`python -m pagedq.engine generate|bench ...`): they need only the engine's dependencies and
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


def register_commands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add `generate` and `bench throughput|host|kernels` to a command group; returns the `bench` group, where
    the queue's CLI (pagedq/worker/cli/main.py) adds its own benches."""
    from pagedq.engine.bench.args import add_host_arguments, add_ngram_arguments, add_throughput_arguments
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

    bench_parser = commands.add_parser("bench", help="benchmarks against baselines measured in the same run")
    benches = bench_parser.add_subparsers(dest="bench", required=True)
    throughput = benches.add_parser("throughput", help="engine vs transformers generate, output tokens/s")
    add_throughput_arguments(throughput)
    throughput.set_defaults(func=_bench_throughput)
    host = benches.add_parser("host", help="host time the device waits through per decode step, async vs sync")
    add_host_arguments(host)
    host.set_defaults(func=_bench_host)
    ngram = benches.add_parser("ngram", help="the n-gram proposer's cost per step vs scanning each history")
    add_ngram_arguments(ngram)
    ngram.set_defaults(func=_bench_ngram)
    structured = benches.add_parser("structured", help="structured outputs: compile, mask fill, e2e tok/s")
    _add_structured_arguments(structured)
    structured.set_defaults(func=_bench_structured)
    # Its flags are pagedq/kernels/bench.py's own (that module imports torch, this parser must not): handed over
    # as given.
    kernels_bench = benches.add_parser(
        "kernels",
        help="kernels: bandwidth and TFLOP/s on CUDA; the CPU attention path next to SDPA with --device cpu "
        "(flags: pagedq bench kernels --help)",
        add_help=False,
        prefix_chars="+",
    )
    kernels_bench.add_argument("kernel_args", nargs="*", help="the kernel benchmark's flags, as it reads them")
    kernels_bench.set_defaults(func=_bench_kernels)
    return benches


def build_parser(prog: str = "python -m pagedq.engine") -> argparse.ArgumentParser:
    """The engine's own commands, for a GPU box without the queue stack (the `pagedq` command adds the queue's)."""
    parser = StrictArgumentParser(prog=prog, description="paged-KV LLM engine: offline generation and benchmarks")
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


def _bench_throughput(args: argparse.Namespace) -> int:
    from pagedq.engine.bench import (
        throughput as bench,  # torch: only once a bench runs, so building the parser stays torch-free
    )

    return bench.main(args)


def _bench_host(args: argparse.Namespace) -> int:
    from pagedq.engine.bench import host as bench_host

    if args.sampling == "json":  # structured outputs: pagedq/engine/bench/structured_host.py
        from pagedq.engine.bench import structured_host

        return structured_host.main(args)
    return bench_host.main(args)


def _bench_ngram(args: argparse.Namespace) -> int:
    from pagedq.engine.bench import ngram as bench_ngram

    return bench_ngram.main(args)


def _add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedq.engine.bench.structured import add_arguments  # torch is imported by its functions only

    add_arguments(parser)


def _bench_structured(args: argparse.Namespace) -> int:
    from pagedq.engine.bench import structured as bench_structured

    return bench_structured.main(args)


def _bench_kernels(args: argparse.Namespace) -> int:
    from pagedq.kernels import bench as kernels_bench

    return kernels_bench.main(args.kernel_args)


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
