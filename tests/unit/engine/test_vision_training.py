"""Image chunks through training on a tiny random-init Qwen3-VL, dense and MoE
(tests/vision_models.py):

- forward logprobs of image+text samples, one alone and two of different lengths and images in
  one padded pass, equal transformers' own forward (its processor's pixel_values and
  image_grid_thw, mm_token_type_ids) at every position, image positions included;
- the image is read: another image changes the text positions' logprobs;
- LoRA SFT on image+text lowers the loss, and adapts the language model only (the vision tower
  and merger hold no adapters); full-weight SFT lowers it too;
- two images of different sizes in one prompt: forward equals transformers, samples the forward;
- text prompts sample on the model, their logprobs equal a forward pass's; so do image
  prompts (two images of one size in one request, two samples each) and their prompt logprobs;
- the prefix cache keys image prompts by their images' bytes: a repeated image prompt hits and
  samples the same, another image of the same size reuses only the text before it;
- the submit check: a wrong expected_tokens, corrupt bytes, a JPEG named png, an image past the
  pixel limit and a placeholder id in a text chunk are InvalidRequests naming the sample and
  the chunk, and the sample is left as it was."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

sys.path.insert(0, str(Path(__file__).parents[2]))
import vision_models as vm  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.images import checked_images, checked_prompt_images  # noqa: E402
from posttrain.errors import InvalidRequest  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    ImageInput,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
MAX_PIXELS = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return vm.build_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl") / "m")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": model_dir})
    engine.load_resource("r", "m", muon_scaling=None)
    return engine


def placeholders(model_dir: Path, data: bytes) -> tuple[dict[str, torch.Tensor], int]:
    """transformers' processor output for one image, and its placeholder count."""
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    image = Image.open(io.BytesIO(data)).convert("RGB")
    out = processor(images=[image], return_tensors="pt")
    return dict(out), int(out["image_grid_thw"].prod()) // vm.MERGE**2


def image_sample(
    model_dir: Path, data: bytes, before: list[int], after: list[int], *, chunk: int = 1
) -> tuple[TrainingSample, list[int]]:
    """A cross-entropy sample over before + <vision_start> image <vision_end> + after, the
    image's positions held by 0s as the API leaves them; and the full token sequence with
    the placeholders in place."""
    _, count = placeholders(model_dir, data)
    head = [*before, vm.VISION_START]
    sequence = [*head, *[0] * count, vm.VISION_END, *after]
    full = [*head, *[vm.IMAGE_TOKEN] * count, vm.VISION_END, *after]
    sample = TrainingSample(
        tokens=tuple(sequence[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in full[1:]),
            "weights": tuple(0.0 if t == vm.IMAGE_TOKEN else 1.0 for t in full[1:]),
        },
        images=(ImageInput(len(head), count, chunk, data, "png"),),
    )
    return sample, full


def transformers_logprobs(model_dir: Path, data: bytes, full: list[int]) -> torch.Tensor:
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    out, _ = placeholders(model_dir, data)
    ids = torch.tensor([full[:-1]])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=out["pixel_values"],
            image_grid_thw=out["image_grid_thw"],
            mm_token_type_ids=(ids == vm.IMAGE_TOKEN).to(torch.int32),
        ).logits[0]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(full[1:])[:, None])[:, 0]


def forward_logprobs(
    engine: LocalEngine, model_dir: Path, samples: tuple[TrainingSample, ...], session: str
) -> list[torch.Tensor]:
    checked = checked_images(model_dir, samples, max_image_pixels=MAX_PIXELS)
    request = ForwardBackwardRequest(
        checked, CE, True, return_loss_fn_outputs=True, report_all_logprobs=True
    )
    result = forward_backward(engine, "r", session, request)
    assert result.loss_fn_outputs is not None
    return [torch.tensor(values) for values in result.loss_fn_outputs]


def test_image_logprobs_equal_transformers_forward(engine, model_dir):
    engine.create_session("r", "exact", LoraConfig(rank=4, alpha=8, seed=1))
    first, second = vm.png(64, 48, seed=1), vm.png(40, 72, seed=2)
    a, full_a = image_sample(model_dir, first, [1, 5, 6], [7, 8, 9, 10])
    b, full_b = image_sample(model_dir, second, [1, 11], [12, 13, 14, 15, 16, 17, 18, 19])
    alone = forward_logprobs(engine, model_dir, (a,), "exact")[0]
    together = forward_logprobs(engine, model_dir, (a, b), "exact")
    expected_a = transformers_logprobs(model_dir, first, full_a)
    expected_b = transformers_logprobs(model_dir, second, full_b)
    torch.testing.assert_close(alone, expected_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(together[0], expected_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(together[1], expected_b, rtol=0, atol=1e-5)
    # The image is read: another image moves the logprobs after it.
    other, _ = image_sample(model_dir, vm.png(64, 48, seed=9), [1, 5, 6], [7, 8, 9, 10])
    moved = forward_logprobs(engine, model_dir, (other,), "exact")[0]
    assert (moved[-4:] - alone[-4:]).abs().max() > 1e-4
    engine.drop_session("r", "exact")


def test_moe_image_logprobs_equal_transformers_forward(tmp_path):
    model_dir = vm.build_qwen3_vl(tmp_path / "moe", moe=True)
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": model_dir})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "moe", LoraConfig(rank=4, alpha=8, seed=1))
    data = vm.png(64, 48, seed=1)
    sample, full = image_sample(model_dir, data, [1, 5, 6], [7, 8, 9, 10])
    ours = forward_logprobs(engine, model_dir, (sample,), "moe")[0]
    torch.testing.assert_close(
        ours, transformers_logprobs(model_dir, data, full), rtol=0, atol=1e-5
    )
    # LoRA covers the experts of the language model.
    assert any(
        ".language_model." in n and "experts" in n for n in engine._resources["r"].lora.layers
    )


def test_lora_sft_on_images_lowers_the_loss_and_adapts_the_language_model_only(engine, model_dir):
    engine.create_session("r", "sft", LoraConfig(rank=4, alpha=8, seed=1))
    samples = tuple(
        image_sample(model_dir, vm.png(64, 48, seed=k), [1, 5 + k], [20 + k, 30 + k, 40])[0]
        for k in range(2)
    )
    checked = checked_images(model_dir, samples, max_image_pixels=MAX_PIXELS)
    step = OptimStepRequest(adam=AdamParams(learning_rate=5e-2, weight_decay=0.0))
    losses = []
    for _ in range(4):
        result = forward_backward(engine, "r", "sft", ForwardBackwardRequest(checked, CE))
        losses.append(result.loss)
        engine.optim_step("r", "sft", step)
    assert losses[-1] < losses[0] - 0.5, losses
    lora = engine._resources["r"].lora
    adapted = [name for name in lora.layers if name != lora.head_name]  # train_unembed's head
    assert adapted and all(".language_model." in name for name in adapted), sorted(adapted)
    engine.drop_session("r", "sft")


def test_full_weight_sft_on_images_lowers_the_loss(engine, model_dir):
    engine.create_session("r", "full", None)
    samples = tuple(
        image_sample(model_dir, vm.png(64, 48, seed=k), [1, 5 + k], [20 + k, 30 + k, 40])[0]
        for k in range(2)
    )
    checked = checked_images(model_dir, samples, max_image_pixels=MAX_PIXELS)
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-2, weight_decay=0.0))
    losses = []
    for _ in range(3):
        losses.append(
            forward_backward(engine, "r", "full", ForwardBackwardRequest(checked, CE)).loss
        )
        engine.optim_step("r", "full", step)
    assert losses[-1] < losses[0] - 0.5, losses
    engine.drop_session("r", "full")


def test_text_sampling_on_a_vision_language_model_matches_its_forward(engine, model_dir):
    engine.create_session("r", "text", LoraConfig(rank=4, alpha=8, seed=1))
    prompt = (1, 5, 6, 7)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    request = SampleRequest(prompts=(prompt,), num_samples=2, sampling_params=params)
    (result,) = sample(engine, "r", "text", request)
    for sequence in result.sequences:
        tokens = (*prompt, *sequence.tokens)
        scored = TrainingSample(
            tokens=tokens[:-1],
            loss_fn_inputs={
                "target_tokens": tuple(float(t) for t in tokens[1:]),
                "weights": (1.0,) * (len(tokens) - 1),
            },
        )
        (forward,) = forward_logprobs(engine, model_dir, (scored,), "text")
        assert sequence.logprobs is not None
        torch.testing.assert_close(
            forward[len(prompt) - 1 :], torch.tensor(sequence.logprobs), rtol=0, atol=1e-5
        )
    engine.drop_session("r", "text")


def test_image_prompts_sample_with_logprobs_equal_a_forward_pass(engine, model_dir):
    """Two prompts whose images have one size (equal tokens, told apart by their bytes),
    two samples each: every sampled and prompt logprob equals the training forward's."""
    engine.create_session("r", "images", LoraConfig(rank=4, alpha=8, seed=1))
    prompts, images = [], []
    for seed in (1, 2):
        scored, full = image_sample(model_dir, vm.png(64, 48, seed=seed), [1, 5, 6], [7, 8])
        (placed,) = checked_images(model_dir, (scored,), max_image_pixels=MAX_PIXELS)
        prompts.append(tuple(full))
        images.append(placed.images)
    assert prompts[0] == prompts[1]
    # The random model samples its placeholder often; as the last token it is a target only,
    # never an input of the scoring forward.
    params = SamplingParams(
        max_tokens=4, temperature=1.0, seed=11, stop_token_ids=(vm.IMAGE_TOKEN,)
    )
    request = SampleRequest(
        prompts=tuple(prompts),
        num_samples=2,
        sampling_params=params,
        prompt_logprobs=True,
        prompt_images=tuple(images),
    )
    results = sample(engine, "r", "images", request)
    assert results[0].prompt_logprobs != results[1].prompt_logprobs  # the images differ
    for prompt, prompt_images, result in zip(prompts, images, results, strict=True):
        for sequence in result.sequences:
            tokens = (*prompt, *sequence.tokens)
            scored = TrainingSample(
                tokens=tokens[:-1],
                loss_fn_inputs={
                    "target_tokens": tuple(float(t) for t in tokens[1:]),
                    "weights": (1.0,) * (len(tokens) - 1),
                },
                images=prompt_images,
            )
            (forward,) = forward_logprobs(engine, model_dir, (scored,), "images")
            assert sequence.logprobs is not None and result.prompt_logprobs is not None
            torch.testing.assert_close(
                forward[len(prompt) - 1 :], torch.tensor(sequence.logprobs), rtol=0, atol=1e-5
            )
            torch.testing.assert_close(
                forward[: len(prompt) - 1],
                torch.tensor(result.prompt_logprobs[1:]),
                rtol=0,
                atol=1e-5,
            )
    engine.drop_session("r", "images")


def assert_sampled_as_forward(
    engine: LocalEngine,
    model_dir: Path,
    prompt: tuple[int, ...],
    images: tuple[ImageInput, ...],
    sequence: SampledSequence,
    session: str,
) -> None:
    tokens = (*prompt, *sequence.tokens)
    scored = TrainingSample(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
        images=images,
    )
    (forward,) = forward_logprobs(engine, model_dir, (scored,), session)
    assert sequence.logprobs is not None
    torch.testing.assert_close(
        forward[len(prompt) - 1 :], torch.tensor(sequence.logprobs), rtol=0, atol=1e-5
    )


def test_the_prefix_cache_keys_image_prompts_by_their_bytes(engine, model_dir):
    """A repeated image prompt prefills from the cache and samples the same; the same tokens
    with another image of that size reuse only the text before the image."""
    engine.create_session("r", "cached", LoraConfig(rank=4, alpha=8, seed=1))
    prompts = {}
    for seed in (1, 2):
        scored, full = image_sample(model_dir, vm.png(64, 48, seed=seed), [1, 5, 6], [7, 8])
        (placed,) = checked_images(model_dir, (scored,), max_image_pixels=MAX_PIXELS)
        prompts[seed] = (tuple(full), placed.images)
    params = SamplingParams(
        max_tokens=4, temperature=1.0, seed=11, stop_token_ids=(vm.IMAGE_TOKEN,)
    )

    def sampled(seed: int) -> SampleResult:
        prompt, images = prompts[seed]
        request = SampleRequest(
            prompts=(prompt,), num_samples=2, sampling_params=params, prompt_images=(images,)
        )
        (result,) = sample(engine, "r", "cached", request)
        return result

    first, again = sampled(1), sampled(1)
    prompt, images = prompts[1]
    assert [s.prompt_cache_hit_tokens for s in first.sequences] == [0, 0]
    assert [s.prompt_cache_hit_tokens for s in again.sequences] == [len(prompt) - 1] * 2
    for fresh, cached in zip(first.sequences, again.sequences, strict=True):
        assert cached.tokens == fresh.tokens
        assert cached.logprobs == pytest.approx(fresh.logprobs, abs=1e-6)
        assert_sampled_as_forward(engine, model_dir, prompt, images, cached, "cached")
    other = sampled(2)
    image_start = images[0].offset
    assert [s.prompt_cache_hit_tokens for s in other.sequences] == [image_start] * 2
    for sequence in other.sequences:
        assert_sampled_as_forward(engine, model_dir, *prompts[2], sequence, "cached")
    engine.drop_session("r", "cached")


def test_two_images_in_one_prompt_train_and_sample_as_transformers(engine, model_dir):
    """A prompt with two images of different sizes: forward logprobs equal transformers'
    (both images' embeddings and M-RoPE positions), and sampled logprobs the forward's."""
    engine.create_session("r", "two", LoraConfig(rank=4, alpha=8, seed=1))
    first, second = vm.png(64, 48, seed=3), vm.png(40, 72, seed=4)
    out_1, count_1 = placeholders(model_dir, first)
    out_2, count_2 = placeholders(model_dir, second)
    head = [1, 5, vm.VISION_START]
    middle = [vm.VISION_END, 6, 7, vm.VISION_START]
    tail = [vm.VISION_END, 8, 9, 10]
    full = [*head, *[vm.IMAGE_TOKEN] * count_1, *middle, *[vm.IMAGE_TOKEN] * count_2, *tail]
    second_at = len(head) + count_1 + len(middle)
    images = (
        ImageInput(len(head), count_1, 1, first, "png"),
        ImageInput(second_at, count_2, 3, second, "png"),
    )
    scored = TrainingSample(
        tokens=tuple(full[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in full[1:]),
            "weights": (1.0,) * (len(full) - 1),
        },
        images=images,
    )
    (ours,) = forward_logprobs(engine, model_dir, (scored,), "two")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([full[:-1]])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=torch.cat([out_1["pixel_values"], out_2["pixel_values"]]),
            image_grid_thw=torch.cat([out_1["image_grid_thw"], out_2["image_grid_thw"]]),
            mm_token_type_ids=(ids == vm.IMAGE_TOKEN).to(torch.int32),
        ).logits[0]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(full[1:])[:, None])
    torch.testing.assert_close(ours, expected[:, 0], rtol=0, atol=1e-5)

    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop_token_ids=(vm.IMAGE_TOKEN,))
    request = SampleRequest(
        prompts=(tuple(full),), num_samples=2, sampling_params=params, prompt_images=(images,)
    )
    (result,) = sample(engine, "r", "two", request)
    for sequence in result.sequences:
        assert_sampled_as_forward(engine, model_dir, tuple(full), images, sequence, "two")
    engine.drop_session("r", "two")


def refused(model_dir: Path, sample: TrainingSample, *, max_pixels: int = MAX_PIXELS) -> str:
    with pytest.raises(InvalidRequest) as caught:
        checked_images(model_dir, (sample,), max_image_pixels=max_pixels)
    assert caught.value.param == "samples[0].model_input"
    return caught.value.message


def test_bad_images_are_refused_naming_the_chunk(model_dir):
    data = vm.png(64, 48, seed=1)
    sample, _ = image_sample(model_dir, data, [1, 5, 6], [7, 8], chunk=3)
    image = sample.images[0]
    wrong = TrainingSample(
        tokens=sample.tokens,
        loss_fn_inputs=sample.loss_fn_inputs,
        images=(ImageInput(image.offset, image.num_tokens - 1, 3, data, "png"),),
    )
    message = refused(model_dir, wrong)
    assert "chunk 3" in message and f"{image.num_tokens} tokens" in message
    assert f"expected_tokens is {image.num_tokens - 1}" in message

    def with_image(data: bytes, image_format: str = "png") -> TrainingSample:
        placed = ImageInput(image.offset, image.num_tokens, 3, data, image_format)
        return TrainingSample(sample.tokens, sample.loss_fn_inputs, images=(placed,))

    assert "chunk 3" in refused(model_dir, with_image(data[:40]))
    assert "not a readable png" in refused(model_dir, with_image(b"not an image"))
    jpeg = io.BytesIO()
    Image.open(io.BytesIO(data)).save(jpeg, format="JPEG")
    assert "not png" in refused(model_dir, with_image(jpeg.getvalue()))
    assert "'gif' is not served" in refused(model_dir, with_image(data, "gif"))
    assert "the limit is 1000" in refused(model_dir, with_image(data), max_pixels=1000)
    smuggled = TrainingSample(
        (vm.IMAGE_TOKEN, *sample.tokens[1:]), sample.loss_fn_inputs, images=sample.images
    )
    assert "placeholder" in refused(model_dir, smuggled)
    # A sample prompt's images are checked the same way, naming the prompt.
    prompt = SampleRequest(prompts=(sample.tokens,), prompt_images=(wrong.images,))
    with pytest.raises(InvalidRequest) as caught:
        checked_prompt_images(model_dir, prompt, max_image_pixels=MAX_PIXELS)
    assert caught.value.param == "model_inputs[0]" and "chunk 3" in caught.value.message
    # A JPEG named as one is taken.
    taken = checked_images(
        model_dir, (with_image(jpeg.getvalue(), "jpeg"),), max_image_pixels=MAX_PIXELS
    )
    assert taken[0].tokens[image.offset] == vm.IMAGE_TOKEN
