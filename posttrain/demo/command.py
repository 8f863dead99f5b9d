"""`posttrain demo`: flags, the local server, the progress bar and the closing report.

Importing this module is cheap (no SDK, no torch, no transformers): the CLI imports it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, TextIO

from posttrain.config import BUILTIN_MODEL_ID, BUILTIN_MODELS
from posttrain.demo.loop import QUICK, DemoConfig, StepRecord, require_sdk, run_demo
from posttrain.demo.server import INTERRUPTED_STOP_TIMEOUT_S, STOP_TIMEOUT_S, LocalServer

if TYPE_CHECKING:
    from tqdm import tqdm

DEFAULT_OUT = Path("posttrain-demo")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default=None, help="a running server (omitted: start one on a free port)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"GRPO steps (default {DemoConfig().rl_steps}, --quick {QUICK.rl_steps})",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where the plot and logs go (%(default)s)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a shortened run ({QUICK.warmup_steps} warm-up and {QUICK.rl_steps} GRPO steps)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data, LoRA and sampling")
    parser.add_argument(
        "--model",
        choices=tuple(BUILTIN_MODELS),
        default=BUILTIN_MODEL_ID,
        help="the built-in base model to train (%(default)s)",
    )


class ProgressBar:
    """Progress over both phases, the step's numbers beside it: one tqdm bar on a terminal,
    one line per step elsewhere (in a pipe or a file the bar's carriage-return redraws would
    pile up on one line). `stream`: where it writes, stderr by default."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.done = 0
        self.bar: tqdm[NoReturn] | None = None  # a bar over no iterable (total only)
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True)

    def __call__(self, record: StepRecord, total: int) -> None:
        if record.phase == "warmup":
            description = "warm-up (cross-entropy)"
            postfix = f"loss/token={record.loss:.3f} tok/s={record.tokens_per_s:.0f}"
        else:
            description = "GRPO"
            kl = f"{record.kl:.3f}" if record.kl is not None else "-"
            postfix = (
                f"reward={record.reward:.3f} loss={record.loss:+.4f} kl={kl} "
                f"tok/s={record.tokens_per_s:.0f}"
            )
        self.done += 1
        if self.bar is None:
            print(f"{description}: step {self.done}/{total} {postfix}", file=self.stream)
            self.stream.flush()
            return
        self.bar.set_description(description)
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def demo_config(args: argparse.Namespace) -> DemoConfig:
    """The DemoConfig the flags ask for."""
    config = QUICK if args.quick else DemoConfig()
    config = replace(config, seed=args.seed, base_model=args.model)
    if args.steps is not None:
        if args.steps < 1:
            sys.exit("posttrain demo: --steps must be at least 1")
        config = replace(config, rl_steps=args.steps)
    return config


def stop_on_interrupt(server: LocalServer | None, out_dir: Path) -> None:
    """On Ctrl-C (SIGINT) or SIGTERM: stop the server this demo started, say so in one line,
    and exit 130 at once. Unwinding instead would run the SDK's session cleanups against a
    server that is going away (each retried for seconds) and print their tracebacks; the
    steps so far are already in steps.jsonl, and a server given by --base-url expires the
    demo's idle sessions itself."""

    def interrupted(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut this short
        stopped = "stopped the demo and its server" if server else "stopped the demo"
        if server is not None:
            server.close(INTERRUPTED_STOP_TIMEOUT_S)
        sys.stdout.flush()
        sys.stderr.write(f"\nposttrain demo: interrupted; {stopped} (steps so far: {out_dir})\n")
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)


def run_demo_command(args: argparse.Namespace) -> None:
    require_sdk()
    from posttrain.demo.report import closing_text, write_outputs

    config = demo_config(args)
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    api_key = os.environ.get("TOGETHER_API_KEY", "local-key")
    stop_on_interrupt(None, out_dir)
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            print("starting posttrain serve with the built-in models ...", file=sys.stderr)
            server = LocalServer(data_dir=None, log_path=out_dir / "server.log", extra_args=())
            stack.callback(server.close, STOP_TIMEOUT_S)
            stop_on_interrupt(server, out_dir)
            server.wait_until_healthy()
            base_url = server.base_url
        print(
            f"server {base_url} (dashboard: {base_url}/)\n"
            f"model: {config.base_model}\n"
            f"task: two-digit addition, reward 1 for the exact answer\n"
            f"warm-up: {config.warmup_steps} cross-entropy steps x {config.warmup_batch_size} "
            f"problems; GRPO: {config.rl_steps} steps x {config.prompts_per_step} prompts x "
            f"{config.group_size} samples; LoRA rank {config.lora_rank}",
            file=sys.stderr,
        )
        progress = ProgressBar(config.warmup_steps + config.rl_steps)
        try:
            result = run_demo(base_url, api_key, config, out_dir, on_step=progress)
        finally:
            progress.close()
    paths = write_outputs(result, out_dir)
    print(closing_text(result, paths))
