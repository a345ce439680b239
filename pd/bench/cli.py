"""`pd-bench SUBCOMMAND ...`: benchmarks that start what they measure and print figures.

Each subcommand lives in its own module `pd.bench.<name>` (`-` spelled `_`) exposing
`add_arguments(parser)` and `run(args) -> int`. Only the chosen one is imported (several import
torch, seconds of a start that a bad flag should not wait for).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "engine": "decode tokens/s at 1, 8 and 32 streams per quantization, against the read bound",
    "transfer": "KV pull throughput: ours vs bare NIXL vs memcpy",
    "router": "router overhead vs direct, at concurrency 1 and 64",
    "tracker": "the router's stream tracker (migration), CPU a stream by how its events are read",
    "pd": "a mixed load on one co-located worker vs a prefill/decode pair",
    "serve": "open-loop serving benchmark of any OpenAI endpoint: goodput, SLOs, plots",
    "plan": "the P:D split and TPs with the best goodput per GPU, on a simulated cluster",
    "elastic": "the planner vs a fixed split vs HPA v2 under a changing load, simulated GPUs",
    "plan-check": "the planner's model against simulated worker processes, at a few rates",
    "routing": "routing policies and decode-local prefill on a multi-turn load (2 P + 1 D)",
    "sampling": "the sampler's ms per step for greedy, temperature, top-k, top-p and min-p",
    "multihost": "P, D and router in network namespaces: KV-link latency, then a cut mid-pull",
    "stall": "the worst /health wait while 1, 4 and 7 MiB prompts arrive at a worker",
    "fanout": "n = 8 against 8 separate requests of one prompt through router + P + D",
    "kernels": "every candidate linear kernel timed at the model's shapes on this CPU (issue 24)",
    "soak": "fault soak: router + P + D under streaming load, each worker killed and restarted",
    "quality": "greedy agreement with a reference server, perplexity, multiple-choice accuracy",
    "priority-overload": "priority classes vs --no-priority at 2x capacity, simulated P + D (issue 45)",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pd-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen_name = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name != chosen_name:
            continue
        module_name = f"pd.bench.{name.replace('-', '_')}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue
        module.add_arguments(p)
        p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    chosen = getattr(args, "_module", None)
    if chosen is None:
        parser.error(f"benchmark {args.command!r} is not available in this build")
    return chosen.run(args)


if __name__ == "__main__":
    sys.exit(main())
