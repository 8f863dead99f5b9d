"""The operation-level sections of bench/gpu_check.py: eight LoRA adapters sampled in one batch
vs one at a time, a stream of one-sample operations, agents in a closed loop (joining vs whole
batches), and weights-sync latency (LoRA and full weight). Each times whole engine calls, as the
scheduler makes them."""

from __future__ import annotations

import statistics
import time

from gpu_check_common import random_tokens, seconds, switched, sync, timed

from posttrain.config import SchedulerConfig
from posttrain.engine.generate import generator as generators
from posttrain.engine.generate import sampler
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.service.scheduling.sample_streams import stream_rows
from posttrain.types import SampleRequest, SamplingParams

ADAPTERS = 8  # sessions a0..a7 on resource r (gpu_check.setup makes them)
STREAM_OPS = 32
# A sample stream's pool as the server reserves it by default (its row limit, memory permitting:
# service/scheduling/sample_streams.py): a stream's static layouts hold placeholder rows within it.
POOL_ROWS = stream_rows(SchedulerConfig())


def _tokens(results) -> int:
    return sum(len(s.tokens) for per_item in results for r in per_item for s in r.sequences)


def measure_multi_lora(engine: LocalEngine, args, device, generator, vocab) -> dict:
    """One sample operation per adapter (--lora-prompts prompts x --samples, --lora-tokens new
    tokens): the 8 in one engine.sample_batch, the same 8 requests all on one adapter in one
    call (what routing 8 adapters costs), and the 8 one call at a time. Generated tokens/s."""
    params = SamplingParams(max_tokens=args.lora_tokens, temperature=1.0, seed=11)

    def requests() -> list[SampleRequest]:
        return [
            SampleRequest(
                tuple(random_tokens(generator, args.prompt_tokens, vocab) for _ in range(n)),
                args.samples,
                params,
            )
            for n in [args.lora_prompts] * ADAPTERS
        ]

    def batched(ops) -> int:
        return _tokens(engine.sample_batch("r", [(f"a{i}", op) for i, op in enumerate(ops)]))

    def one_adapter(ops) -> int:
        return _tokens(engine.sample_batch("r", [("a0", op) for op in ops]))

    def one_at_a_time(ops) -> int:
        return sum(_tokens(engine.sample_batch("r", [(f"a{i}", op)])) for i, op in enumerate(ops))

    batched(requests())  # warm-ups: the batch's and one operation's shapes
    engine.sample_batch("r", [("a0", requests()[0])])
    rates: dict[str, list[float]] = {"batched": [], "one_adapter": [], "one_at_a_time": []}
    for _ in range(args.lora_repeats):
        ops = requests()
        for way, fn in (
            ("batched", batched),
            ("one_adapter", one_adapter),
            ("one_at_a_time", one_at_a_time),
        ):
            elapsed, tokens = seconds(lambda: fn(ops), device)  # noqa: B023
            rates[way].append(tokens / elapsed)
    report = {
        "multi_lora_shape": f"{ADAPTERS} adapters x {args.lora_prompts} prompts x"
        f" {args.prompt_tokens} tokens x {args.samples} samples x {args.lora_tokens} new tokens",
    }
    for way, values in rates.items():
        report[f"multi_lora_{way}_tokens_per_s"] = statistics.median(values)
    for way in ("one_at_a_time", "one_adapter"):
        report[f"multi_lora_batched_over_{way}"] = statistics.median(
            b / o for b, o in zip(rates["batched"], rates[way], strict=True)
        )
    return report


def measure_stream(engine: LocalEngine, args, device, generator, vocab) -> dict:
    """A stream of one-sample operations (one prompt, one sample, --stream-tokens new tokens)
    at the level main has: one operation alone per engine.sample_batch (what a stream gets when
    each is run as it comes), 32 in one call (the ceiling a stream can reach: every operation
    shares every pass), as operations/s; and, where posttrain.engine.generate.sample_stream
    exists, a SampleStream that admits one operation per decode block, 32 in all, run until
    the last finishes (operations/s and each operation's median latency), on session s0 and,
    where the multi_lora section made them, on the 8 adapters in turn."""
    params = SamplingParams(max_tokens=args.stream_tokens, temperature=1.0, seed=13)

    def op() -> SampleRequest:
        return SampleRequest((random_tokens(generator, args.prompt_tokens, vocab),), 1, params)

    def ops_per_s(count: int) -> float:
        items = [("s0", op()) for _ in range(count)]
        elapsed, _ = seconds(lambda: engine.sample_batch("r", items), device)
        return count / elapsed

    ops_per_s(1), ops_per_s(STREAM_OPS)  # warm-ups
    alone = [ops_per_s(1) for _ in range(args.repeats)]
    together = [ops_per_s(STREAM_OPS) for _ in range(args.repeats)]
    report: dict[str, object] = {
        "stream_shape": f"one-sample operations of {args.prompt_tokens} prompt tokens x"
        f" {args.stream_tokens} new tokens",
        "stream_one_op_ops_per_s": statistics.median(alone),
        f"stream_{STREAM_OPS}_batched_ops_per_s": statistics.median(together),
        f"stream_{STREAM_OPS}_batched_over_one_op": statistics.median(together)
        / statistics.median(alone),
    }
    try:
        from posttrain.engine.generate.sample_stream import SampleStream
    except ImportError as exc:
        report["stream_join"] = f"skipped: {exc} (SampleStream is not in this tree)"
        return report
    resource, session = engine._session("r", "s0")

    def joined(count: int, sessions=(session,)) -> tuple[float, list[float]]:
        stream = SampleStream(engine.config, resource, resource.loaded.model)
        stream.reserve_rows(POOL_ROWS)  # the server's pool, by default and room permitting
        admitted_at: dict[int, float] = {}
        latencies: list[float] = []
        sync(device)
        start = time.perf_counter()
        while len(admitted_at) < count or stream.running:
            if len(admitted_at) < count:
                turn = sessions[len(admitted_at) % len(sessions)]  # the sessions in turn
                (item,) = stream.admit([(turn, op())])
                admitted_at[item] = time.perf_counter()
            stream.block()
            finished = stream.take_finished()
            if finished:
                sync(device)
            now = time.perf_counter()
            latencies.extend(now - admitted_at[item] for item, _ in finished)
        assert len(latencies) == count, (len(latencies), count)
        return count / (time.perf_counter() - start), latencies

    from closed_loop import Blocks, counting  # bench/: this script's folder

    joined(2)  # warm-up
    blocks = Blocks()
    with counting(blocks):  # its layouts (captures with graphs) and eager prefill passes
        rate, latencies = joined(STREAM_OPS)  # one run: 32 + a generation's blocks
    report |= {f"stream_join_{key}": value for key, value in blocks.report().items()}
    report["stream_join_ops_per_s"] = rate
    report["stream_join_op_latency_s"] = statistics.median(latencies)
    report["stream_join_over_one_op"] = report["stream_join_ops_per_s"] / statistics.median(alone)
    # The same stream sampling the 8 adapters in turn (the multi_lora section's sessions, where
    # it made them): many LoRA sessions in one stream, each join on an adapter of its own.
    names = [f"a{index}" for index in range(ADAPTERS)]
    if all(name in resource.sessions for name in names):
        blocks = Blocks()
        with counting(blocks):
            rate, latencies = joined(STREAM_OPS, [engine._session("r", n)[1] for n in names])
        report |= {f"stream_adapters_{key}": value for key, value in blocks.report().items()}
        report["stream_adapters_ops_per_s"] = rate
        report["stream_adapters_op_latency_s"] = statistics.median(latencies)
    return report


def measure_agents(engine: LocalEngine, args, vocab) -> dict:
    """--agents agents in a closed loop (bench/closed_loop.py) on session s0, each running
    --agent-turns one-sample operations of --prompt-tokens prompt tokens and up to
    --agent-tokens new ones, one after another: operations joining the running generation vs
    whole batches (the sampler before continuous batching), one run each after a warm-up.
    The issue's throughput target on a device whose decode step costs about the same at 1 and
    at 64 rows. Both ways run twice: with the default decode (static passes in CUDA graphs,
    where a join takes the padding rows of the running layout when it fits, and otherwise
    changes the layout, captured again; `agents_joining_over_append_*` compares with joins
    that always append, and `agents_*_layouts` counts the captures) and with dynamic passes
    (`--cuda-graphs off`; keys `agents_eager_*`), and `agents_graphs_over_eager_*` compares
    each way's ops/s across the two. Dynamic passes carry the joining prompts in a block's
    first decode pass (engine/generate/joining_pass.py); they also run with each join's
    prefill in a pass of its own (`agents_eager_joining_over_apart_*`)."""
    from closed_loop import agent_requests, compare  # bench/: this script's folder

    low, high = args.agent_tokens
    warm = agent_requests(2, 1, (2, 4), args.prompt_tokens, vocab)
    compare(engine, "r", "s0", warm, 1)
    requests = agent_requests(args.agents, args.agent_turns, (low, high), args.prompt_tokens, vocab)
    ways = ("whole", "joining", "append")
    report = {
        f"agents_{key}": value
        for key, value in compare(engine, "r", "s0", requests, 1, ways).items()
    }
    with switched(sampler, STATIC_DECODE=False):  # the engine's cuda_graphs is off: dynamic
        eager = compare(engine, "r", "s0", requests, 1, ("whole", "joining", "apart"))
    report |= {f"agents_eager_{key}": value for key, value in eager.items()}
    for way in ("whole", "joining"):
        report[f"agents_graphs_over_eager_{way}_ops_s"] = (
            report[f"agents_{way}_ops_s"] / eager[f"{way}_ops_s"]
        )
    report["agents_shape"] = (
        f"{args.agents} agents x {args.agent_turns} turns, {args.prompt_tokens} prompt tokens +"
        f" {low}-{high} new tokens each"
    )
    return report


def measure_weights_sync(engine: LocalEngine, args, device) -> dict:
    """Latency of `publish`: the LoRA session's trainer adapter copied to its generator, and
    the full-weight session's whole model copied to its generator copy."""
    report: dict[str, object] = {}
    version = iter(range(10, 10_000))
    for key, resource, session in (("", "r", "s0"), ("_full", "f", "fw")):
        engine.publish(resource, session, version=next(version))  # warm-up
        elapsed = timed(
            lambda r=resource, s=session: engine.publish(r, s, version=next(version)),
            max(5, args.repeats),
            device,
        )
        served = generators.parameters(*engine._session(resource, session))
        size = sum(p.numel() * p.element_size() for _, p in served)
        report[f"weights_sync{key}_ms"] = elapsed * 1e3
        report[f"weights_sync{key}_bytes"] = size
        report[f"weights_sync{key}_gb_per_s"] = size / elapsed / 1e9
    return report
