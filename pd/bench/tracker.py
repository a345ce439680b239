"""`pd-bench tracker`: what `Tracker.feed` (pd/router/migrate.py) costs a relayed stream, by how
the stream's events arrive in reads.

The stub D's 32-token stream with its `: pd-ids` lines (completion and chat, each with and
without a usage chunk), fed in three shapes: `one` event a read (a worker writing each token as
it comes, read as it comes), `coalesced` (reads of 1, 3, 5, 7 and 9 events, then the rest: what
`pd-bench router` mostly gives the router at c=1, where the stub writes its events back to back),
and the `whole` stream in one read. Prints the CPU microseconds a stream (process time, the best
of `--rounds`). For a count the machine's load does not move, run one shape under callgrind:
the feeding loop runs inside `functools.reduce`, so that callgrind counts it alone:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null --toggle-collect=functools_reduce \\
        python -m pd.bench.tracker --shape cmpl:coalesced --streams 100
    # "Collected" / 100 = instructions a stream
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

from pd.bench.stub_worker import StubWorker
from pd.router.migrate import Tracker

SHAPES = ("one", "coalesced", "whole")
KINDS = ("cmpl", "cmpl+usage", "chat", "chat+usage")
COALESCED = (1, 3, 5, 7, 9)  # events a read, then the rest in one


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        help="KIND:SHAPE (KIND one of cmpl, cmpl+usage, chat, chat+usage; SHAPE one of one, "
        "coalesced, whole): feed only that, --streams times, and print nothing (for callgrind)",
    )
    p.add_argument("--streams", type=int, default=300, help="streams a round (default: 300)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the best kept (default: 5)")


def reads(kind: str, shape: str) -> list[bytes]:
    """The stub D's stream of `kind`, cut into the reads of `shape`."""
    chat, usage = kind.startswith("chat"), kind.endswith("+usage")
    body: dict = {"prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 32}
    if chat:
        body = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": 32}
    stub = StubWorker("decode", chunks=32, record=False)
    events = stub._events(chat, body, usage, True)[0]
    if shape == "one":
        return list(events)
    if shape == "whole":
        return [b"".join(events)]
    assert shape == "coalesced", shape
    out, at = [], 0
    for n in COALESCED:
        out.append(b"".join(events[at : at + n]))
        at += n
    return [*out, b"".join(events[at:])]


def _feed(chunks: list[bytes], streams: int) -> None:
    def one(acc: None, _: int) -> None:
        track = Tracker(None)  # type: ignore[arg-type]  # (no worker: nothing migrates)
        for chunk in chunks:
            track.feed(chunk)

    functools.reduce(one, range(streams), None)


def run(args: argparse.Namespace) -> int:
    if args.shape:
        kind, _, shape = args.shape.partition(":")
        if kind not in KINDS or shape not in SHAPES:
            raise SystemExit(f"--shape: KIND:SHAPE, KIND in {KINDS}, SHAPE in {SHAPES}")
        _feed(reads(kind, shape), args.streams)
        return 0
    print(f"{'us a stream':14}" + "".join(f"{s:>12}" for s in SHAPES))
    for kind in KINDS:
        best = {s: float("inf") for s in SHAPES}
        for _ in range(args.rounds):
            for s in SHAPES:  # interleaved: drift hits every shape alike
                chunks = reads(kind, s)
                t = time.process_time()
                _feed(chunks, args.streams)
                best[s] = min(best[s], (time.process_time() - t) / args.streams * 1e6)
        print(f"{kind:14}" + "".join(f"{best[s]:>12.1f}" for s in SHAPES))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pd-bench tracker", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
