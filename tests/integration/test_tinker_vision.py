"""Images on the Tinker surface, through the real tinker 0.38 SDK (tests/tinker_env.py) and a
real `posttrain serve --model NAME=DIR` of a tiny random-init Qwen3-VL with its image processor
(tests/vision_models.py): forward logprobs of image+text datums equal transformers' own
forward, LoRA SFT lowers the loss, forward_backward_custom sees the same logprobs, and a wrong
expected_tokens or a corrupt PNG is refused with the datum and chunk named; compute_logprobs of
the image prompt equals the forward at its text positions, and samples drawn after it carry
the logprobs a prefill of prompt + sample gives."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ServerProcess
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

sys.path.insert(0, str(Path(__file__).parents[1]))
import vision_models as vm  # noqa: E402

CLIENT = Path(__file__).parent / "tinker_native" / "vision_client.py"
MODEL = "Qwen/Qwen3-VL-tiny-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("tinker-vision")
    model_dir = vm.build_qwen3_vl(root / "model")
    proc = ServerProcess.started(root, "--model", f"{MODEL}={model_dir}")
    yield proc, model_dir
    proc.stop()


def processed(model_dir: Path, data: bytes) -> dict[str, torch.Tensor]:
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return dict(
        processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    )


def expected_logprobs(
    model_dir: Path, data: bytes, before: list[int], after: list[int]
) -> list[float]:
    out = processed(model_dir, data)
    count = int(out["image_grid_thw"].prod()) // vm.MERGE**2
    full = [*before, vm.VISION_START, *[vm.IMAGE_TOKEN] * count, vm.VISION_END, *after]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([full[:-1]])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=out["pixel_values"],
            image_grid_thw=out["image_grid_thw"],
            mm_token_type_ids=(ids == vm.IMAGE_TOKEN).to(torch.int32),
        ).logits[0]
    # Inside the image the SDK datum's targets are 0 (weight 0): score those, as the server does.
    targets = [0 if t == vm.IMAGE_TOKEN else t for t in full[1:]]
    logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(targets)[:, None])
    return logprobs[:, 0].tolist()


def test_image_datums_train_through_the_sdk_and_match_transformers(tinker_python, served, tmp_path):
    server, model_dir = served
    images = {"a": vm.png(64, 48, seed=1), "b": vm.png(40, 72, seed=2)}
    counts = {}
    for name, data in images.items():
        (tmp_path / f"{name}.png").write_bytes(data)
        counts[name] = int(processed(model_dir, data)["image_grid_thw"].prod()) // vm.MERGE**2
    (tmp_path / "tokens.json").write_text(json.dumps(counts))
    done = subprocess.run(
        [tinker_python, str(CLIENT), "train", server.base_url, MODEL, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={"TINKER_TELEMETRY": "0", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{server.log()[-3000:]}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    expected = [
        expected_logprobs(model_dir, images["a"], [1, 5, 6], [7, 8, 9, 10]),
        expected_logprobs(model_dir, images["b"], [1, 11], [12, 13, 14, 15, 16]),
    ]
    for forward, reference in zip(seen["forward"], expected, strict=True):
        assert forward == pytest.approx(reference, abs=1e-5)
    assert seen["losses"][-1] < seen["losses"][0], seen["losses"]
    # The custom loss saw the same logprobs as the built-in cross-entropy's first step.
    assert seen["custom_loss"] == pytest.approx(seen["losses"][0], rel=1e-5)
    # compute_logprobs of the image prompt: forward's logprobs at every text target (forward
    # scores target 0 inside the image, compute_logprobs the placeholders).
    full_a = [1, 5, 6, vm.VISION_START, *[vm.IMAGE_TOKEN] * counts["a"], vm.VISION_END, 7, 8, 9]
    scored = seen["scored"]
    assert scored[0] is None and len(scored) == len(full_a)
    for i in range(len(full_a) - 1):
        if full_a[i + 1] != vm.IMAGE_TOKEN:
            assert scored[i + 1] == pytest.approx(seen["forward"][0][i], abs=1e-5)
    # Sampling after the image prompt: two samples, each's logprobs as a prefill scores them.
    assert len(seen["samples"]) == 2
    for drawn in seen["samples"]:
        assert drawn["logprobs"] == pytest.approx(drawn["rescored"], abs=1e-5)
    assert "data[1].model_input" in seen["wrong_count"] and "chunk 1" in seen["wrong_count"]
    assert f"expected_tokens is {counts['a'] + 1}" in seen["wrong_count"]
    assert "data[1].model_input" in seen["corrupt"] and "not a readable png" in seen["corrupt"]
