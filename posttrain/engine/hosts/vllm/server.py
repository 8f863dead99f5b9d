"""One vLLM server process: a `--generators vllm` replica of a model resource
(hosts/vllm/engine.py drives it). Started from the vLLM venv's interpreter
(`--vllm-python`) as `python -m vllm.entrypoints.openai.api_server` on a free loopback port,
health-checked until it answers, spoken to over HTTP, stopped with its whole process group
(vLLM runs its engine core and worker as children).

What the server is started with, and why:
- `--enable-scale-out`: the token-in/token-out endpoint /inference/v1/generate, whose choices
  carry per-token `weight_versions` (policy_segments come from them).
- `--enable-lora --max-loras --max-lora-rank`: one adapter per LoRA session, up to the
  resource's session limit and the server's largest rank; VLLM_ALLOW_RUNTIME_LORA_UPDATING for
  /v1/load_lora_adapter (republished in place with `load_inplace`).
- VLLM_SERVER_DEV_MODE: /collective_rpc (full-weight reloads, hosts/vllm/worker_extension.py),
  /pause, /resume and /update_weight_version.
- `--worker-extension-cls`: the reload hook; PYTHONPATH holds the directory above the posttrain
  package so the vLLM venv imports that one module (and the package's empty `__init__`s).
- `--enable-prompt-tokens-details`: usage.prompt_tokens_details.cached_tokens, which becomes
  each sequence's prompt_cache_hit_tokens.
- `--max-num-seqs` MAX_NUM_SEQS: set, so a prompt's sequences are split into requests the
  server takes (it refuses `n` past it).
- On the CPU `--no-enable-chunked-prefill`, with a token budget of at least a whole context:
  vLLM 0.32 rewinds a seeded request's generator when a step prefilled only part of its prompt,
  which a CPU generator cannot do (`set_offset`: "CPU Generator does not use offset"), and the
  engine dies; prompts of more tokens than a step's budget (2048 by default) came in parts.

Imports: errors (httpx).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from posttrain.errors import EngineFailure, GeneratorReplicaDied

EXTENSION = "posttrain.engine.hosts.vllm.worker_extension.PosttrainWeights"
PACKAGE_PARENT = Path(__file__).resolve().parents[4]  # the directory holding `posttrain/`
SERVED_NAME = "base"  # the base model's name on the server; adapters go by session id
START_TIMEOUT_S = 900.0  # a cold start on a loaded 2-core machine takes minutes
CALL_TIMEOUT_S = 3600.0
# Sequences a server decodes at once (--max-num-seqs); a request asks for at most that many
# (hosts/vllm/requests.py `parts`).
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class ServerSpec:
    """What one replica serves and how it may grow."""

    python: Path
    model_path: Path
    dtype: str  # "float32" | "bfloat16"
    max_model_len: int
    max_loras: int
    max_lora_rank: int
    log_path: Path
    # On a GPU the trainer shares the device: vLLM may take this fraction of it (its default,
    # 0.9, would leave the trainer nothing). None on the CPU.
    gpu_memory_utilization: float | None = None

    @property
    def on_cpu(self) -> bool:
        return self.gpu_memory_utilization is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]  # (host, port) of an AF_INET socket
        return port


class VllmServer:
    """A started vLLM server process, labelled for the errors that name it."""

    def __init__(self, spec: ServerSpec, label: str) -> None:
        self.spec = spec
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is larger
        command = [
            str(spec.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model_path), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", spec.dtype,
            "--max-model-len", str(spec.max_model_len), "--seed", "0",
            "--enable-lora", "--max-loras", str(spec.max_loras),
            "--max-lora-rank", str(spec.max_lora_rank),
            "--enable-scale-out", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--worker-extension-cls", EXTENSION, "--max-num-seqs", str(MAX_NUM_SEQS),
        ]  # fmt: skip
        if spec.on_cpu:  # whole prompts per step: see the module's docstring
            budget = max(spec.max_model_len, 2048)
            command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
        else:
            command += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_path.open("ab") as log:
            # A session of its own: stop() ends the engine core and workers with it.
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._http = httpx.Client(base_url=self.url, timeout=CALL_TIMEOUT_S)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once /health answers 200; raise naming the server, with its log's end, if
        it exits or does not answer in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise EngineFailure(f"{self.label} exited while starting:\n{self.log_tail()}")
            try:
                if self._http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineFailure(f"{self.label} did not start in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.spec.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def died(self) -> GeneratorReplicaDied:
        code = self.process.poll()
        how = "is not answering" if code is None else f"exited with code {code}"
        return GeneratorReplicaDied(
            f"{self.label} (vLLM server, pid {self.pid}) {how}; a new one starts with the next"
            " sample"
        )

    def call(self, path: str, body: Any = None, *, params: dict[str, str] | None = None) -> Any:
        """POST `body` as JSON; the reply's JSON (its text if not JSON). A dead server raises
        GeneratorReplicaDied; a refusal raises EngineFailure with vLLM's words."""
        try:
            reply = self._http.post(path, json=body, params=params)
        except httpx.HTTPError as exc:
            if self.alive:
                time.sleep(0.5)  # a server that is going down closes its socket first
            if not self.alive or isinstance(exc, httpx.ConnectError):
                raise self.died() from exc
            raise EngineFailure(f"{self.label}: {path} failed: {exc}") from exc
        if reply.status_code >= 500 and not self.alive:
            raise self.died()
        if reply.status_code >= 400:
            said = f"{self.label}: {path} answered {reply.status_code}: {reply.text[:1000]}"
            if reply.status_code >= 500:
                said += f"\nits log ({self.spec.log_path}) ends:\n{self.log_tail(1500)}"
            raise EngineFailure(said)
        if "json" not in reply.headers.get("content-type", ""):
            return reply.text or None  # the LoRA routes answer in plain text
        return reply.json()

    def stop(self) -> None:
        """End the server and its children (TERM, then KILL after 10 s)."""
        self._http.close()
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break  # the whole group is gone
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                try:  # the leader went; children that outlive it get the KILL
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
