"""Agents in a closed loop on one engine, operations joining a running generation vs whole
batches, in one process: the scheduling gain of continuous batching alone (a benchmark, not a
timed test; issue 30).

`bench/stream.py --sections agents` runs the same kind of loop through the server against an
older tree, so its ratio holds this scheduling gain and every engine speed-up since. Here both
ways run on the same engine, driven by one thread (no HTTP, no polling threads), so the ratio is
the scheduling rule's alone:

- **whole batches** (the sampler before continuous batching): the operations queued when a
  generation starts run in it to its end; those that become due meanwhile wait for the next.
  In a closed loop every agent's next operation is due when the batch ends.
- **joining**: an engine `sample_stream`; an operation due joins the running decode at the next
  block boundary, and leaves when its row finishes.

N agents each run --turns one-sample operations one after another: a fresh prompt of
--prompt-tokens random ids and a `max_tokens` drawn uniformly from --agent-tokens (EOS ends a
row sooner), seeded by (agent, turn), temperature 1. Both ways get the same requests, and a
seeded sequence's tokens do not depend on what shares its pass, so both return the same tokens
(the run counts the operations that do), except where a draw lands on a boundary of the
cumulative distribution within the rounding of the logits, which depends on a matrix product's
row count: the two tokens drawn there are then neighbours in the vocabulary (the inverse CDF
runs in token-id order), and the run lists each such first difference. On the built-in model's
99 tokens none shows in thousands of draws; a near-uniform random 32,000-token model shows some.

Printed per agent count: ops/s and tokens/s while all agents run (until the first agent's last
result; after it fewer agents remain, a finite run's ramp-down, which a running RL loop never
has) and over the whole run, median latency, for each way, and joining / whole batches; medians
over --reps repetitions, the two ways alternated.

    OMP_NUM_THREADS=1 python bench/closed_loop.py          # tiny and qwen3-40m, CPU
    python bench/closed_loop.py --quick                    # a smoke run
    OMP_NUM_THREADS=1 python bench/closed_loop.py --models host-bound --block-steps 8 \
        --agents 32 --turns 3 8 --agent-tokens 16 160 --prompt-tokens 256 --reps 3

`host-bound` is a 28-layer Qwen3 (the Qwen3-0.6B depth) 64 wide: on the CPU its steps cost
their dispatch, whatever the rows, as the 0.6B model's eager steps did on an H200 (88 ms a
step against 0.57 ms of memory traffic; docs/benchmarks.md); with `--block-steps 8` (the
accelerator's decode blocks) it stands in for gpu_check's `agents` section on this machine.

`--static` runs every way on static passes (the GPU's default decode, CUDA graphs there,
eager here) and adds a third way, "append": joins as they ran beside static passes before
they took padding rows and prefill steps, each appending its rows (a new layout: on CUDA a
capture) after an eager prefill pass (engine/generate/padding_joins.py, prefill_graph.py).
Every way counts the layouts it made and its eager prefill passes: what a GPU pays per
capture and per eager pass is in docs/benchmarks.md, so the counts give its cost there.

bench/gpu_check.py runs `compare` on the Qwen3-0.6B shape on a GPU (its `agents` section).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.generate import (  # noqa: E402
    joining_pass,
    joins,
    padding_joins,
    prefill_graph,
    sampler,
)
from posttrain.engine.generate.decode_graph import DecodeStep  # noqa: E402
from posttrain.engine.generate.prefill_graph import PrefillStep  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.types import LoraConfig, SampleRequest, SampleResult, SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Done:
    """One finished operation of an agent: when it was submitted and finished (perf_counter),
    the tokens it sampled."""

    agent: int
    turn: int
    submitted: float
    finished: float
    sequence: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return len(self.sequence)

    @property
    def latency(self) -> float:
        return self.finished - self.submitted


class Finished(Protocol):
    """What the rates below read of a finished operation (Done here, bench/stream.py's Op)."""

    submitted: float
    finished: float
    tokens: int


def completed_rate(ops: Sequence[Finished]) -> float:
    """Operations completed per second: ops / (last result - first submit)."""
    return len(ops) / (max(o.finished for o in ops) - min(o.submitted for o in ops))


def saturated(per_agent: Sequence[Sequence[Finished]]) -> tuple[float, float]:
    """(operations/s, tokens/s) completed while every agent still had an operation in flight:
    from the first submit until the first agent's last result. After it fewer clients remain
    (a finite benchmark's ramp-down, which a running RL loop never has), so the sampler is no
    longer saturated; a sampler that completes every batch at once has no ramp-down."""
    start = min(ops[0].submitted for ops in per_agent)
    end = min(ops[-1].finished for ops in per_agent)
    done = [o for ops in per_agent for o in ops if o.finished <= end]
    return len(done) / (end - start), sum(o.tokens for o in done) / (end - start)


def agent_requests(
    agents: int, turns: int, token_range: tuple[int, int], prompt_tokens: int, vocab: int
) -> list[list[SampleRequest]]:
    """Each agent's operations in order, the same for every way and repetition."""
    low, high = token_range
    requests = []
    for agent in range(agents):
        rng = random.Random(1_000_003 + agent)
        own = []
        for turn in range(turns):
            prompt = tuple(rng.randrange(1, vocab) for _ in range(prompt_tokens))
            params = SamplingParams(
                max_tokens=rng.randint(low, high), temperature=1.0, seed=10_000 * agent + turn
            )
            own.append(SampleRequest((prompt,), 1, params))
        requests.append(own)
    return requests


def _sequence(results: list[SampleResult]) -> tuple[int, ...]:
    ((sequence,),) = [result.sequences for result in results]
    return tuple(sequence.tokens)


def whole_batches(
    engine: LocalEngine, resource: str, session: str, requests: list[list[SampleRequest]]
) -> list[Done]:
    """Every due operation in one `sample_batch`, run to its end; the next turns are due then."""
    start = time.perf_counter()
    due = {agent: (0, start) for agent in range(len(requests))}
    done = []
    while due:
        batch = sorted(due.items())
        items = [(session, requests[agent][turn]) for agent, (turn, _) in batch]
        results = engine.sample_batch(resource, items)
        now = time.perf_counter()
        due = {}
        for (agent, (turn, submitted)), result in zip(batch, results, strict=True):
            done.append(Done(agent, turn, submitted, now, _sequence(result)))
            if turn + 1 < len(requests[agent]):
                due[agent] = (turn + 1, now)
    return done


def joining(
    engine: LocalEngine, resource: str, session: str, requests: list[list[SampleRequest]]
) -> list[Done]:
    """A sample stream: every due operation joins at the next block boundary, and an agent's
    next turn is due as soon as its operation's row finishes."""
    stream = engine.sample_stream(resource, session)
    start = time.perf_counter()
    due = [(agent, 0, start) for agent in range(len(requests))]
    running: dict[int, tuple[int, int, float]] = {}
    done = []
    try:
        while due or running:
            if due:
                items = [(session, requests[a][t]) for a, t, _ in due]
                # A pool of one row per agent (the most that ever run), ample memory assumed.
                ids = stream.admit(items, row_limit=len(requests), spare_bytes=1 << 62)
                running.update(zip(ids, due, strict=True))
                due = []
            if stream.running_rows():  # every row may have ended on its first token
                stream.block()
            finished = stream.take_finished()
            now = time.perf_counter()
            for item, results in finished:
                agent, turn, submitted = running.pop(item)
                done.append(Done(agent, turn, submitted, now, _sequence(results)))
                if turn + 1 < len(requests[agent]):
                    due.append((agent, turn + 1, now))
    finally:
        stream.close()
    return done


def joining_apart(
    engine: LocalEngine, resource: str, session: str, requests: list[list[SampleRequest]]
) -> list[Done]:
    """`joining` with each join's prompts prefilled in a pass of their own before the block,
    instead of in the block's first decode pass (engine/generate/joining_pass.py)."""
    from gpu_check_common import switched  # bench/: this script's folder

    with switched(joining_pass, JOIN_IN_DECODE_PASS=False):
        return joining(engine, resource, session, requests)


def joining_appending(
    engine: LocalEngine, resource: str, session: str, requests: list[list[SampleRequest]]
) -> list[Done]:
    """`joining` beside static passes as it was before joins took padding rows: every join
    appends its rows (a new layout, on CUDA a new capture) instead of taking the padding rows
    of the running layout where they fit (engine/generate/padding_joins.py), and runs an eager
    prefill pass instead of its bucket's PrefillStep (engine/generate/prefill_graph.py)."""
    from gpu_check_common import switched  # bench/: this script's folder

    with (
        switched(padding_joins, JOIN_INTO_PADDING=False),
        switched(prefill_graph, JOIN_PREFILL_STEPS=False),
    ):
        return joining(engine, resource, session, requests)


RUNS: dict[str, Callable[..., list[Done]]] = {
    "whole": whole_batches,
    "joining": joining,
    "apart": joining_apart,
    "append": joining_appending,
}
WAYS = ("whole", "joining")  # --prefill-apart adds "apart", --static "append"


@dataclass
class Blocks:
    """The decode blocks a run's generations ran (whole batches and joining alike: both are
    sampler.Decoding blocks), the rows each held when it started, and their time: where the
    two ways' times differ, in how many blocks and in what a block costs."""

    count: int = 0
    rows: int = 0
    seconds: float = 0.0
    layouts: int = 0  # static passes' layouts made (DecodeSteps): on CUDA, graph captures
    prefills: int = 0  # prefill passes run eagerly (a first batch's, or joins' without a step)
    prefill_steps: int = 0  # joins' prefills through a PrefillStep (on CUDA, replayed)

    def report(self) -> dict[str, float]:
        return {
            "layouts": self.layouts,
            "prefills": self.prefills,
            "prefill_steps": self.prefill_steps,
            "blocks": self.count,
            "rows_per_block": self.rows / self.count,
            "block_ms": self.seconds / self.count * 1e3,
        }


@contextmanager
def counting(blocks: Blocks) -> Iterator[None]:
    """Count every sampler.Decoding block run inside the `with` into `blocks`, every static
    layout made, and the prefills run eagerly and through PrefillSteps."""
    original = sampler.Decoding.block
    made = DecodeStep.__init__

    def layout(step: DecodeStep, *args, **kwargs) -> None:
        blocks.layouts += 1
        made(step, *args, **kwargs)

    eager_prefill, stepped = joins.prefill, PrefillStep.run

    def prefill(*args, **kwargs):
        blocks.prefills += 1
        return eager_prefill(*args, **kwargs)

    def prefill_step(step: PrefillStep, *args):
        blocks.prefill_steps += 1
        return stepped(step, *args)

    def block(decoding: sampler.Decoding) -> None:
        blocks.rows += len(decoding.batch.live) if decoding.batch is not None else 0
        start = time.perf_counter()
        original(decoding)
        blocks.seconds += time.perf_counter() - start
        blocks.count += 1

    from gpu_check_common import switched  # bench/: this script's folder

    with (
        switched(sampler.Decoding, block=block),
        switched(DecodeStep, __init__=layout),
        switched(joins, prefill=prefill),
        switched(PrefillStep, run=prefill_step),
    ):
        yield


def rates(done: list[Done]) -> dict[str, float]:
    """ops/s and tokens/s while all agents run and over the whole run; latency median."""
    per_agent = [[d for d in done if d.agent == a] for a in sorted({d.agent for d in done})]
    ops_s, tokens_s = saturated(per_agent)  # each agent's in turn order: done is in time order
    whole_run_ops_s = completed_rate(done)
    return {
        "ops_s": ops_s,
        "tokens_s": tokens_s,
        "whole_run_ops_s": whole_run_ops_s,
        "whole_run_tokens_s": whole_run_ops_s * statistics.mean(d.tokens for d in done),
        "latency_median_s": statistics.median(d.latency for d in done),
    }


def differences(
    whole: dict[tuple[int, int], tuple[int, ...]], joining: dict[tuple[int, int], tuple[int, ...]]
) -> dict[str, object]:
    """How many operations returned the same tokens both ways, and where each other one first
    differs: (agent, turn, token index, token of whole batches, token joining)."""
    first = []
    for key, mine in sorted(whole.items()):
        theirs = joining[key]
        if mine != theirs:
            at = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            pair = (mine[at] if at < len(mine) else None, theirs[at] if at < len(theirs) else None)
            first.append([*key, at, *pair])
    return {
        "ops": len(whole),
        "same_tokens_ops": len(whole) - len(first),
        "same_tokens": not first,
        "first_differences": first,
        "differences_are_neighbours": all(
            a is not None and b is not None and abs(a - b) == 1 for *_, a, b in first
        ),
    }


def compare(
    engine: LocalEngine,
    resource: str,
    session: str,
    requests: list[list[SampleRequest]],
    reps: int,
    ways: tuple[str, ...] = WAYS,
) -> dict:
    """The ways `reps` times, alternated: each way's median rates, joining / whole, and whether
    the two returned the same tokens for every operation; with "apart" in `ways`, joining /
    apart too (the gain of prefilling joins inside the decode pass); with "append", joining /
    append (the gain of joins into a static layout's padding rows, and its layouts made)."""
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    tokens: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}
    for _ in range(reps):
        for way in ways:
            blocks = Blocks()
            with counting(blocks):
                done = RUNS[way](engine, resource, session, requests)
            runs[way].append(rates(done) | blocks.report())
            tokens[way] = {(d.agent, d.turn): d.sequence for d in done}
    out: dict[str, object] = {}
    for way in ways:
        for key in runs[way][0]:
            out[f"{way}_{key}"] = statistics.median(r[key] for r in runs[way])
    for key in ("ops_s", "tokens_s", "whole_run_ops_s", "blocks", "block_ms"):
        out[f"joining_over_whole_{key}"] = out[f"joining_{key}"] / out[f"whole_{key}"]
    out.update(differences(tokens["whole"], tokens["joining"]))
    if "apart" in ways:
        for key in ("ops_s", "tokens_s", "whole_run_ops_s"):
            out[f"joining_over_apart_{key}"] = out[f"joining_{key}"] / out[f"apart_{key}"]
        apart = differences(tokens["apart"], tokens["joining"])
        out["apart_same_tokens_ops"] = apart["same_tokens_ops"]
    if "append" in ways:
        for key in ("ops_s", "tokens_s", "whole_run_ops_s", "layouts", "block_ms"):
            # (No layout at all on dynamic passes, where the ways are the same: a ratio of 1.)
            below = out[f"append_{key}"] or 1
            out[f"joining_over_append_{key}"] = (out[f"joining_{key}"] or 1) / below
        append = differences(tokens["append"], tokens["joining"])
        out["append_same_tokens_ops"] = append["same_tokens_ops"]
    out["tokens_per_op"] = statistics.mean(len(t) for t in tokens["whole"].values())
    return out


def line(agents: int, turns: int, token_range: tuple[int, int], row: dict) -> str:
    low, high = token_range
    text = (
        f"{agents:3d} agents x {turns} turns ({low}-{high} new tokens, {row['tokens_per_op']:.0f}"
        f" per op): while all run {row['whole_ops_s']:6.2f} -> {row['joining_ops_s']:6.2f} ops/s"
        f" ({row['joining_over_whole_ops_s']:.2f}x), tokens/s"
        f" {row['joining_over_whole_tokens_s']:.2f}x; whole run"
        f" {row['joining_over_whole_whole_run_ops_s']:.2f}x; latency median"
        f" {row['whole_latency_median_s'] * 1e3:.0f} -> {row['joining_latency_median_s'] * 1e3:.0f}"
        f" ms; same tokens: {same(row)}"
        f"\n    decode blocks whole -> joining {row['whole_blocks']:.0f} ->"
        f" {row['joining_blocks']:.0f} ({row['joining_over_whole_blocks']:.2f}x) of"
        f" {row['whole_rows_per_block']:.1f} -> {row['joining_rows_per_block']:.1f} rows,"
        f" {row['whole_block_ms']:.1f} -> {row['joining_block_ms']:.1f} ms a block"
        f" ({row['joining_over_whole_block_ms']:.2f}x)"
    )
    if "apart_ops_s" in row:
        text += (
            f"\n    prefill inside the decode pass / apart: ops/s {row['apart_ops_s']:6.2f} ->"
            f" {row['joining_ops_s']:6.2f} ({row['joining_over_apart_ops_s']:.2f}x), whole run"
            f" {row['joining_over_apart_whole_run_ops_s']:.2f}x, latency median"
            f" {row['apart_latency_median_s'] * 1e3:.0f} ->"
            f" {row['joining_latency_median_s'] * 1e3:.0f} ms; same tokens"
            f" {row['apart_same_tokens_ops']} of {row['ops']} ops"
        )
    if "append_ops_s" in row:
        text += (
            f"\n    static layouts made (on CUDA: graph captures) whole {row['whole_layouts']:.0f},"
            f" joining {row['joining_layouts']:.0f}, joins appending {row['append_layouts']:.0f};"
            f" eager prefill passes whole {row['whole_prefills']:.0f}, joining"
            f" {row['joining_prefills']:.0f} (+ {row['joining_prefill_steps']:.0f} through"
            f" prefill steps), appending {row['append_prefills']:.0f}; joining / appending:"
            f" ops/s {row['joining_over_append_ops_s']:.2f}x, ms a block"
            f" {row['joining_over_append_block_ms']:.2f}x; same tokens"
            f" {row['append_same_tokens_ops']} of {row['ops']} ops"
        )
    return text


def same(row: dict) -> str:
    if row["same_tokens"]:
        return "yes"
    kind = "neighbouring ids" if row["differences_are_neighbours"] else "NOT neighbours"
    return (
        f"{row['same_tokens_ops']} of {row['ops']} ops (the others first differ at"
        f" {[d[2] for d in row['first_differences']]}, {kind})"
    )


def model_dir(name: str, scratch: Path) -> tuple[Path, int]:
    """(HF directory, vocabulary) of --models `name`."""
    if name == "tiny":
        return BUILTIN_MODEL_DIR, json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())[
            "vocab_size"
        ]
    from forward_backward import QWEN3_40M, write_model  # bench/: this script's folder

    directory = scratch / name
    if name == "host-bound":
        from gpu_check_common import build_model

        build_model(directory, HOST_BOUND, torch.device("cpu"), torch.float32)
        return directory, HOST_BOUND["vocab_size"]
    assert name == "qwen3-40m", name
    write_model(directory)
    return directory, QWEN3_40M["vocab_size"]


# The Qwen3-0.6B depth at a width where a CPU step costs its dispatch (see the docstring).
HOST_BOUND = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=28,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    tie_word_embeddings=True,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-40m"])
    parser.add_argument("--agents", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--turns", type=int, nargs="+", default=[8])
    parser.add_argument(
        "--agent-tokens", type=int, nargs=2, default=[8, 256], metavar=("LOW", "HIGH")
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--block-steps", type=int, default=None, help="decode passes per block (CPU: 1)"
    )
    parser.add_argument(
        "--prefill-apart",
        action="store_true",
        help="also run joining with each join prefilled in a pass of its own (joining / apart)",
    )
    parser.add_argument(
        "--static",
        action="store_true",
        help="static decode passes (the GPU default's, eager on the CPU), and joins that always"
        " append beside them (joining / append: layouts made)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, small, 1 rep")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.models, args.agents, args.turns, args.reps = ["tiny"], [3], [2], 1
        args.agent_tokens = [2, 8]
    token_range = (args.agent_tokens[0], args.agent_tokens[1])
    ways = (*WAYS, *(["apart"] if args.prefill_apart else []), *(["append"] if args.static else []))
    sampler.CPU_STATIC_DECODE = args.static
    if args.block_steps is not None:
        sampler.CPU_BLOCK_STEPS = args.block_steps
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads"
        f" {torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.2f};"
        f" {args.prompt_tokens} prompt tokens, decode blocks of {sampler.CPU_BLOCK_STEPS},"
        f" {'static' if args.static else 'dynamic'} passes,"
        f" medians of {args.reps}, ways alternated",
        flush=True,
    )
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="closed-loop-") as scratch:
        for name in args.models:
            directory, vocab = model_dir(name, Path(scratch))
            model_id = BUILTIN_MODEL_ID if name == "tiny" else name
            engine = LocalEngine(EngineConfig(device="cpu"), {model_id: directory})
            engine.load_resource("r", model_id, muon_scaling=None)
            engine.create_session("r", "s", LoraConfig(rank=8, alpha=16, seed=1))
            warm = agent_requests(2, 1, (2, 4), args.prompt_tokens, vocab)
            compare(engine, "r", "s", warm, 1)  # untimed warm-up of both ways
            print(f"\n{name}:", flush=True)
            rows = []
            for turns in args.turns:
                for agents in args.agents:
                    requests = agent_requests(agents, turns, token_range, args.prompt_tokens, vocab)
                    row = {"agents": agents, "turns": turns}
                    row |= compare(engine, "r", "s", requests, args.reps, ways)
                    rows.append(row)
                    print(line(agents, turns, token_range, row), flush=True)
            report[name] = {"agent_tokens": list(token_range), "rows": rows}
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
