"""The `pagedq` command. Engine commands need only the engine's dependencies; queue commands come from worker/."""

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


def build_parser() -> argparse.ArgumentParser:
    from engine import bench

    parser = StrictArgumentParser(prog="pagedq", description="LLM inference worker over a paged KV cache")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate offline for prompts given on the command line")
    generate.add_argument("prompts", nargs="+", help="prompts, one argument each")
    generate.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    generate.add_argument("--max-tokens", type=int, default=64,
                          help="tokens to generate per prompt at most (default 64)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    generate.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template")
    bench.add_engine_arguments(generate)
    generate.set_defaults(func=_generate)

    bench_parser = commands.add_parser("bench", help="benchmarks against baselines measured in the same run")
    benches = bench_parser.add_subparsers(dest="bench", required=True)
    throughput = benches.add_parser("throughput", help="engine vs transformers generate, output tokens/s")
    bench.add_arguments(throughput)
    throughput.set_defaults(func=bench.main)
    host = benches.add_parser("host", help="host time the device waits through per decode step, async vs sync")
    from engine import bench_host

    bench_host.add_arguments(host)
    host.set_defaults(func=bench_host.main)
    kernels_bench = benches.add_parser("kernels", help="Triton kernels: bandwidth and TFLOP/s (CUDA)")
    kernels_bench.set_defaults(func=_bench_kernels)

    try:
        from worker import cli as worker_cli
    except ImportError as error:  # the engine must work without the queue stack installed
        _register_missing_worker(commands, benches, error)
    else:
        worker_cli.register(commands)
        worker_cli.register_bench(benches)
    return parser


def _register_missing_worker(commands, benches, error: ImportError) -> None:
    def explain(_args) -> int:
        print(f"this command needs the worker extras (pip install 'pagedq[worker]'): {error}", file=sys.stderr)
        return 2

    for name in ("worker", "demo", "bulk", "status", "dlq"):
        commands.add_parser(name, help="(needs pagedq[worker])").set_defaults(func=explain)
    benches.add_parser("worker", help="(needs pagedq[worker])").set_defaults(func=explain)


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.bench import engine_kwargs_from
    from engine.startup import freeze_startup_objects

    llm = LLM(args.model, **engine_kwargs_from(args))
    freeze_startup_objects()
    prompts = args.prompts
    if args.chat:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for prompt, output in zip(args.prompts, llm.generate(prompts, params)):
        print(f"### {prompt}\n{output.outputs[0].text}\n[{output.outputs[0].finish_reason}, "
              f"{len(output.outputs[0].token_ids)} tokens]")
    return 0


def _bench_kernels(args: argparse.Namespace) -> int:
    from kernels import bench as kernels_bench

    return kernels_bench.main([])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = args.func
    try:  # with the queue stack installed, start-up mistakes read as one line plus a JSON log line
        from worker.startup_errors import with_readable_errors
    except ImportError:  # engine only: the plain fallback below
        pass
    else:
        func = with_readable_errors(func)
    try:
        return int(func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedq: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
