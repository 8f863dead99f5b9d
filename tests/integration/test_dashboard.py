"""The dashboard page, its JSON, and /metrics, against a real server driven by the SDK.

The browser tests run Debian's headless `chromium` over the live page: after a few training
steps the rendered DOM must list the session and hold a loss chart with one point per step,
numbered from 1 and valued per token as the SDK loop printed it, with titled axes.
It skips, saying why, only where no chromium binary exists (.ci/run installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, open_session, sft_sample
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
NUM_STEPS = 3
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def batch() -> list[dict]:
    samples = []
    for prompt, answer in [("<|im_start|>12+34=", "46\n"), ("<|im_start|>7+8=", "15\n")]:
        prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False)
        answer_ids = TOKENIZER.encode(answer, add_special_tokens=False)
        samples.append(sft_sample(prompt_ids + answer_ids + [0], len(prompt_ids)))
    return samples


def num_targets(samples: list[dict]) -> int:
    """The answer tokens the loss counts (weight 1): what examples/sft.py divides by."""
    return sum(w != 0 for s in samples for w in s["loss_fn_inputs"]["weights"]["data"])


@pytest.fixture(scope="module")
def trained(shared_server) -> Iterator[tuple[str, str, list[float]]]:
    """(base_url, session_id, losses) after NUM_STEPS cross-entropy steps and one sample."""
    resources, session = open_session(
        shared_server.base_url, lora_config={"rank": 4, "seed": 3}, display_name="dash<b>test"
    )
    losses = []
    for _ in range(NUM_STEPS):
        result = session.trainer.forward_backward(samples=batch(), loss={"type": "cross_entropy"})
        losses.append(result.loss)
        session.trainer.optim_step(adam_params={"learning_rate": 1e-2})
    prompt = TOKENIZER.encode("<|im_start|>1+1=", add_special_tokens=False)
    session.generator.sample(
        {"chunks": [{"encoded_text": {"tokens": prompt}}]},
        num_samples=2,
        sampling_params={"max_tokens": 3, "seed": 1},
    )
    yield shared_server.base_url, session.session_id, losses
    session.stop()
    resources.stop()


def get(base_url: str, path: str, key: str = API_KEY) -> httpx.Response:
    return httpx.get(f"{base_url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_page_and_assets_are_served_from_the_package(shared_server):
    page = httpx.get(f"{shared_server.base_url}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "/dashboard/dashboard.js" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN
    script = httpx.get(f"{shared_server.base_url}/dashboard/dashboard.js", timeout=10)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "/v1/dashboard/overview" in script.text
    assert httpx.get(f"{shared_server.base_url}/dashboard/secret.py").status_code == 404


def test_overview_lists_resource_session_and_operations(trained):
    base_url, session_id, _ = trained
    body = get(base_url, "/v1/dashboard/overview").json()
    session = next(s for s in body["sessions"] if s["id"] == session_id)
    assert session["step"] == NUM_STEPS
    assert session["status"] == "TRAINING_SESSION_STATUS_RUNNING"
    assert session["lora_rank"] == 4
    assert any(r["id"] == session["model_resources_id"] for r in body["model_resources"])
    mine = [op for op in body["operations"] if op["session_id"] == session_id]
    kinds = [op["kind"] for op in mine]
    # Newest first: the sample came last; 3 forward-backwards and 3 optim-steps before it.
    assert kinds[0] == "sample"
    assert kinds.count("forward-backward") == NUM_STEPS
    assert kinds.count("optim-step") == NUM_STEPS
    assert all(op["status"] == "TRAINING_OPERATION_STATUS_COMPLETED" for op in mine)


def test_series_has_one_point_per_step_with_the_reported_losses(trained):
    base_url, session_id, losses = trained
    body = get(base_url, f"/v1/dashboard/sessions/{session_id}/series").json()
    points = body["points"]
    # Numbered as the SDK loop numbers its steps: the first optim-step is step 1.
    assert [p["step"] for p in points] == list(range(1, NUM_STEPS + 1))
    assert [p["loss"] for p in points] == pytest.approx(losses)
    assert points[0]["metrics"]["loss:sum"] == pytest.approx(losses[0])
    # Per token: the summed loss over the answer tokens, as examples/sft.py prints it.
    per_token = [loss / num_targets(batch()) for loss in losses]
    assert [p["loss_per_token"] for p in points] == pytest.approx(per_token)
    # "46\n" and "15\n", each with its end-of-text: 8 loss tokens, the count the server used.
    assert num_targets(batch()) == 8 == points[0]["metrics"]["valid_tokens:sum"]


def test_overview_operations_carry_the_per_token_loss(trained):
    base_url, session_id, losses = trained
    body = get(base_url, "/v1/dashboard/overview").json()
    mine = [op for op in body["operations"] if op["session_id"] == session_id]
    fb = [op for op in reversed(mine) if op["kind"] == "forward-backward"]  # oldest first
    assert [op["loss"] for op in fb] == pytest.approx(losses)
    per_token = [loss / num_targets(batch()) for loss in losses]
    assert [op["loss_per_token"] for op in fb] == pytest.approx(per_token)
    assert all(op["loss_per_token"] is None for op in mine if op["kind"] != "forward-backward")


def test_dashboard_json_needs_a_key_and_hides_unknown_sessions(trained):
    base_url, _, _ = trained
    assert httpx.get(f"{base_url}/v1/dashboard/overview").status_code == 401
    missing = get(base_url, "/v1/dashboard/sessions/ts-nope/series")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "session_id"


def metric_value(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{{{re.escape(wanted)}}} (\S+)$" if labels else rf"^{name} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_operations_tokens_and_sessions(shared_server):
    base_url = shared_server.base_url
    before = httpx.get(f"{base_url}/metrics").text
    resources, session = open_session(base_url, lora_config={"rank": 2})
    samples = batch()
    session.trainer.forward_backward(samples=samples, loss={"type": "cross_entropy"})
    session.trainer.forward_backward(samples=samples, loss={"type": "cross_entropy"})
    session.trainer.optim_step()
    response = httpx.get(f"{base_url}/metrics")
    after = response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    fb = {"kind": "forward-backward", "status": "completed"}
    assert metric_value(after, "posttrain_operations", **fb) == (
        metric_value(before, "posttrain_operations", **fb) + 2
    )
    assert metric_value(after, "posttrain_operations_finished_total", **fb) == (
        metric_value(before, "posttrain_operations_finished_total", **fb) + 2
    )
    opt = {"kind": "optim-step"}
    assert metric_value(after, "posttrain_operation_duration_seconds_count", **opt) == (
        metric_value(before, "posttrain_operation_duration_seconds_count", **opt) + 1
    )
    # Tokens of a forward-backward are its samples' input tokens.
    num_tokens = sum(len(s["model_input"]["chunks"][0]["encoded_text"]["tokens"]) for s in samples)
    tokens = {"kind": "forward-backward"}
    assert metric_value(after, "posttrain_tokens_total", **tokens) == (
        metric_value(before, "posttrain_tokens_total", **tokens) + 2 * num_tokens
    )
    assert metric_value(after, "posttrain_tokens_per_second", **tokens) > 0
    # Sessions by status, over all users: /metrics is unauthenticated, so it names no ids.
    assert resources.model_resources_id not in after and session.session_id not in after
    running, stopped = {"status": "running"}, {"status": "stopped"}
    assert metric_value(after, "posttrain_sessions", **running) == (
        metric_value(before, "posttrain_sessions", **running) + 1
    )
    assert metric_value(after, "posttrain_queue_depth") == 0
    session.stop()
    resources.stop()
    final = httpx.get(f"{base_url}/metrics").text
    assert metric_value(final, "posttrain_sessions", **running) == metric_value(
        before, "posttrain_sessions", **running
    )
    assert metric_value(final, "posttrain_sessions", **stopped) == (
        metric_value(before, "posttrain_sessions", **stopped) + 1
    )


@pytest.fixture
def browser_profile(tmp_path: Path) -> Path:
    return tmp_path / "chromium-profile"


def run_chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_headless_chromium_renders_session_and_loss_chart(trained, browser_profile, tmp_path):
    base_url, session_id, _ = trained
    # The virtual-time budget lets the page's fetches and first refreshes finish before the
    # DOM is dumped.
    dom = run_chromium(
        browser_profile, "--virtual-time-budget=8000", "--dump-dom", f"{base_url}/"
    ).stdout
    assert f'data-session="{session_id}"' in dom
    assert "dash&lt;b&gt;test" in dom  # the display name is text, not markup
    assert f"Session {session_id}" in dom
    match = re.search(r'class="chart" data-metric="loss" data-points="(\d+)"', dom)
    assert match and int(match.group(1)) == NUM_STEPS, dom[-3000:]
    assert "<polyline" in dom
    shot = tmp_path / "dashboard.png"
    run_chromium(
        browser_profile,
        "--virtual-time-budget=8000",
        "--window-size=1280,1400",
        f"--screenshot={shot}",
        f"{base_url}/?session={session_id}",
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def header_cells(dom: str, table: str) -> dict[str, bool]:
    """{column title: shown} of a table's header row in the dumped DOM."""
    head = re.search(rf'<table id="{table}">.*?</thead>', dom, re.S)
    assert head, table
    cells = re.findall(r"<th([^>]*)>(.*?)</th>", head.group(0))
    return {title: "hidden" not in attrs for attrs, title in cells}


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_the_page_reads_like_the_sdk_loop(trained, browser_profile):
    """Per-token losses as printed, steps from 1, titled axes, plurals, empty columns hidden."""
    base_url, session_id, losses = trained
    dom = run_chromium(
        browser_profile,
        "--virtual-time-budget=8000",
        "--dump-dom",
        f"{base_url}/?session={session_id}",
    ).stdout
    chart = re.search(r'<div class="chart" data-metric="loss"[^>]*>.*?</svg>', dom, re.S)
    assert chart, dom[-3000:]
    loss_chart = chart.group(0)
    assert 'data-mode="per-token"' in loss_chart and f'data-steps="1-{NUM_STEPS}"' in loss_chart
    assert "<h3>loss per token</h3>" in loss_chart
    assert ">optimizer step</text>" in loss_chart and ">loss per token</text>" in loss_chart
    # The first step is labelled on the x axis, and no step 0 exists.
    ticks = re.findall(r'<text class="tick"[^>]*text-anchor="middle">(\d+)</text>', loss_chart)
    assert ticks[0] == "1" and "0" not in ticks, ticks
    # Each step's tooltip carries the per-token loss as examples/sft.py prints it (step N,
    # loss / answer tokens to 4 decimals).
    shown = re.findall(r"<title>step (\d+): loss/token (\S+),", loss_chart)
    per_token = [f"{loss / num_targets(batch()):.4f}" for loss in losses]
    assert shown == [(str(i + 1), v) for i, v in enumerate(per_token)]
    summed = run_chromium(
        browser_profile,
        "--virtual-time-budget=8000",
        "--dump-dom",
        f"{base_url}/?session={session_id}&loss=sum",
    ).stdout
    chart = re.search(r'<div class="chart" data-metric="loss"[^>]*>.*?</svg>', summed, re.S)
    assert chart and 'data-mode="sum"' in chart.group(0), summed[-3000:]
    assert ">loss, summed over tokens</text>" in chart.group(0)
    # The y axis spans each mode's own values: per token, then summed (8 times larger here).
    per_token_values = [loss / num_targets(batch()) for loss in losses]
    for svg_text, values in ((loss_chart, per_token_values), (chart.group(0), losses)):
        y_ticks = [float(t) for t in re.findall(r'text-anchor="end">([^<]+)</text>', svg_text)]
        assert y_ticks and all(0.5 * min(values) <= t <= 1.5 * max(values) for t in y_ticks)
    # Every metric chart has both axes titled.
    assert dom.count('class="axis-label"') == 2 * dom.count('class="chart"')
    # "2 sessions", "1 session": the count decides the noun.
    count, noun = re.search(r'<span id="status" class="muted">(\d+) (sessions?),', dom).groups()
    assert noun == ("session" if count == "1" else "sessions")
    title = re.search(r'<h2 id="session-title">(.*?)</h2>', dom).group(1)
    assert f"{NUM_STEPS} optimizer steps, {NUM_STEPS} forward-backward results" in title
    # A column nobody filled is hidden; one that holds a value for any row is not.
    assert header_cells(dom, "resources")["expires"] is True  # the READY resource's expiry
    assert header_cells(dom, "sessions")["name"] is True  # this session has a name
    assert header_cells(dom, "operations")["error"] is False  # no operation failed
    assert header_cells(dom, "operations")["loss/token"] is True


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_with_keys_configured_the_page_asks_for_a_key(tmp_path, browser_profile):
    locked = ServerProcess(tmp_path / "data", tmp_path / "server.log", ("--api-key", "s3cret"))
    locked.start()
    try:
        assert get(locked.base_url, "/v1/dashboard/overview", key="s3cret").status_code == 200
        dom = run_chromium(
            browser_profile, "--virtual-time-budget=5000", "--dump-dom", f"{locked.base_url}/"
        ).stdout
    finally:
        locked.stop()
    assert '<form id="key-form">' in dom, dom[:2000]  # `hidden` removed after the 401
    assert "the server wants an API key" in dom
