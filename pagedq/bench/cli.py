"""The benchmarks' commands: `pagedq bench ...` (the queue's own benches are added there by pagedq/worker/cli/main.py)
and `python -m pagedq.bench ...`, the engine's and the kernels' benches on a GPU box without the queue stack. Each
compares against a baseline measured in the same run."""

from __future__ import annotations

import argparse
import sys

from pagedq.engine.cli import StrictArgumentParser, package_version, run_command


def register_benches(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add the `bench` group (throughput, host, ngram, structured, kernels, lora); returns it for the queue's."""
    bench_parser = commands.add_parser("bench", help="benchmarks against baselines measured in the same run")
    benches = bench_parser.add_subparsers(dest="bench", required=True)
    add_engine_benches(benches)
    return benches


def add_engine_benches(benches: argparse._SubParsersAction) -> None:
    from pagedq.bench.engine.args import add_host_arguments, add_ngram_arguments, add_throughput_arguments

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
    # Its flags are pagedq/bench/kernels.py's own (that module imports torch, this parser must not): handed over
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
    lora = benches.add_parser("lora", help="LoRA adapters mixed in one batch vs the base model and transformers + PEFT")
    _add_lora_arguments(lora)
    lora.set_defaults(func=_bench_lora)


def build_parser(prog: str = "python -m pagedq.bench") -> argparse.ArgumentParser:
    """The engine's and kernels' benches alone (`pagedq bench` adds the queue's)."""
    parser = StrictArgumentParser(prog=prog, description="pagedq's engine and kernel benchmarks")
    parser.add_argument("--version", action="version", version=f"pagedq {package_version()}")
    add_engine_benches(parser.add_subparsers(dest="bench", required=True))
    return parser


def _bench_throughput(args: argparse.Namespace) -> int:
    from pagedq.bench.engine import (
        throughput as bench,  # torch: only once a bench runs, so building the parser stays torch-free
    )

    return bench.main(args)


def _bench_host(args: argparse.Namespace) -> int:
    from pagedq.bench.engine import host as bench_host

    if args.sampling == "json":  # structured outputs: pagedq/bench/engine/structured_host.py
        from pagedq.bench.engine import structured_host

        return structured_host.main(args)
    return bench_host.main(args)


def _bench_ngram(args: argparse.Namespace) -> int:
    from pagedq.bench.engine import ngram as bench_ngram

    return bench_ngram.main(args)


def _add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedq.bench.engine.structured import add_arguments  # torch is imported by its functions only

    add_arguments(parser)


def _bench_structured(args: argparse.Namespace) -> int:
    from pagedq.bench.engine import structured as bench_structured

    return bench_structured.main(args)


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedq.bench.engine.lora import add_arguments  # torch is imported by its functions only

    add_arguments(parser)


def _bench_lora(args: argparse.Namespace) -> int:
    from pagedq.bench.engine import lora as bench_lora

    return bench_lora.main(args)


def _bench_kernels(args: argparse.Namespace) -> int:
    from pagedq.bench import kernels as kernels_bench

    return kernels_bench.main(args.kernel_args)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
