"""The grammar child: a process that compiles clients' constraints so that none can crash a worker.

`python -m pd.worker.text.grammar_child --memory-mb M --stack-bytes S` reads frames on stdin and
answers on stdout (a frame: 4-byte big-endian length, then UTF-8 JSON):

1. setup `{"tokenizer": tokenizer.json text, "n_vocab": int, "eos": [ids]}` -> `{"ready": true}`;
2. each `{"kind": ..., "spec": ...}` -> `{"grammar": llguidance's grammar text}` once it compiled
   (the matcher built and its first mask computed) on a thread of `S` bytes of stack, or
   `{"error": why}` for a constraint that does not compile.

Its address space may grow by `M` MiB past its size once started (RLIMIT_AS), and it dies with
its parent. A grammar that
overflows the stack or the memory kills this process only: the worker's `GrammarPool` answers
that request 400 and starts another child. The worker then builds the matcher itself from the
grammar text, on a thread of the same stack size (`stack_threads`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import struct
import sys
from typing import IO, Any

import llguidance
import numpy as np

from pd.worker.text.grammar_source import GrammarError, build_matcher, grammar_text, new_tokenizer
from pd.worker.text.stack_threads import GRAMMAR_STACK_BYTES, StackThreads

_LENGTH = struct.Struct(">I")


def read_frame(f: IO[bytes]) -> Any | None:
    """The next message, or None at the end of the stream."""
    head = f.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    body = f.read(n)
    if len(body) < n:
        return None
    return json.loads(body)


def frame(msg: Any) -> bytes:
    body = json.dumps(msg).encode()
    return _LENGTH.pack(len(body)) + body


def compile_checked(tok: llguidance.LLTokenizer, words: int, kind: str, spec: str) -> str:
    """The constraint's grammar text, once a matcher for it was built and gave its first mask."""
    grammar = grammar_text(kind, spec)
    m = build_matcher(tok, grammar)
    row = np.zeros(words, np.int32)
    m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return grammar


def _address_space() -> int:
    """This process's virtual size, in bytes (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    return 0


def _die_with_parent() -> None:
    try:  # Linux: PR_SET_PDEATHSIG, SIGKILL when the worker goes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-mb", type=int, required=True)
    ap.add_argument("--stack-bytes", type=int, default=GRAMMAR_STACK_BYTES)
    args = ap.parse_args(argv)
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything else written to stdout goes to the worker's log, not the frames
    inp = sys.stdin.buffer
    setup = read_frame(inp)
    if setup is None:
        return
    words = (int(setup["n_vocab"]) + 31) // 32
    threads = StackThreads(1, args.stack_bytes, "pd-grammar-child")
    tok = threads.submit(
        new_tokenizer, setup["tokenizer"], int(setup["n_vocab"]), list(setup["eos"])
    ).result()
    del setup
    # The cap is what a compile may take beyond the child's own size once started.
    limit = _address_space() + (args.memory_mb << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(
        resource.RLIMIT_AS, (limit, limit if hard == resource.RLIM_INFINITY else hard)
    )
    out.write(frame({"ready": True}))
    while (msg := read_frame(inp)) is not None:
        try:
            grammar = threads.submit(
                compile_checked, tok, words, str(msg["kind"]), str(msg["spec"])
            ).result()
            reply: dict[str, Any] = {"grammar": grammar}
        except GrammarError as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply = {"error": f"compiling it needs more than {args.memory_mb} MiB", "spent": True}
        out.write(frame(reply))


if __name__ == "__main__":
    main()
