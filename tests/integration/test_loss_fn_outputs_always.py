"""`posttrain serve --loss-fn-outputs always` for Tinker-style loops, through together's tinker
shim against real servers: a plain `forward_backward` returns per-sample logprobs (which
tinker-cookbook's supervised and RL loops read without asking), and the default server still
returns none unless asked (api.md). The RL step is sent the cookbook's way, whole sequences
without a mask, so its metrics also show that only completion tokens are counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import together.post_training.tinker as tinker
import torch
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL

# Two supervised sequences; the first position of each predicts a prompt token (weight 0).
SEQUENCES = [[1, 20, 21, 22, 23, 24, 25], [1, 30, 31, 32, 33]]
PROMPT = [1, 40, 41, 42]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]  # one per sampled sequence, as group-centred rewards are


@pytest.fixture(scope="module")
def always_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("loss-fn-outputs-always")
    flags = ("--loss-fn-outputs", "always")
    proc = ServerProcess.started(directory, *flags)
    yield proc
    proc.stop()


def training_client(server: ServerProcess, seed: int = 5) -> tinker.TrainingClient:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    return service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed)


def sft_datum(tokens: list[int]) -> tinker.Datum:
    weights = [0.0] + [1.0] * (len(tokens) - 2)
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def logprobs_of(output: tinker.ForwardBackwardOutput) -> list[list[float]]:
    return [list(out["logprobs"].data) for out in output.loss_fn_outputs]


def test_always_returns_forward_backward_logprobs_equal_to_a_forward_pass(always_server):
    training = training_client(always_server)
    data = [sft_datum(tokens) for tokens in SEQUENCES]
    forward = logprobs_of(training.forward(data, "cross_entropy").result())
    result = training.forward_backward(data, "cross_entropy").result()  # nothing asked for
    returned = logprobs_of(result)
    assert [len(row) for row in returned] == [len(s) - 1 for s in SEQUENCES]
    for got, expected in zip(returned, forward, strict=True):
        assert got[0] == 0.0  # weight-0 position, reported as 0.0 (losses.md 11.1)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # The supervised loop's train_mean_nll (cookbook supervised/common.py compute_mean_nll):
    # -sum(w x) / sum(w), which for cross-entropy is loss / (number of weighted tokens).
    weights = [torch.tensor(d.loss_fn_inputs["weights"].data) for d in data]
    num_weighted = float(sum(w.sum() for w in weights))
    nll = -sum(torch.tensor(x).dot(w) for x, w in zip(returned, weights, strict=True))
    assert num_weighted == 8.0
    assert float(nll) / num_weighted == pytest.approx(result.metrics["loss:sum"] / 8, rel=1e-5)
    training.close()


def f32_tensor(values: list[float]) -> tinker.TensorData:
    return tinker.TensorData.from_torch(torch.tensor(values, dtype=torch.float32))


def cookbook_rl_data(training: tinker.TrainingClient) -> tuple[list[tinker.Datum], int]:
    """Sampled sequences as tinker-cookbook assembles them (rl/data_processing.py): the prompt
    carries sampler logprobs 0, advantages 0 and mask 0; then the loop strips the mask."""
    sampler = training.save_weights_and_get_sampling_client()
    sequences = (
        sampler.sample(
            prompt=tinker.ModelInput.from_ints(PROMPT),
            num_samples=len(ADVANTAGES),
            sampling_params=tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=3),
        )
        .result()
        .sequences
    )
    data, num_completion = [], 0
    pad = len(PROMPT) - 1
    for sequence, advantage in zip(sequences, ADVANTAGES, strict=True):
        tokens = PROMPT + list(sequence.tokens)
        completion = len(sequence.tokens)
        num_completion += completion
        data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_torch(torch.tensor(tokens[1:])),
                    "logprobs": f32_tensor([0.0] * pad + list(sequence.logprobs)),
                    "advantages": f32_tensor([0.0] * pad + [advantage] * completion),
                    "mask": f32_tensor([0.0] * pad + [1.0] * completion),
                },
            )
        )
    return data, num_completion


def without_mask(datum: tinker.Datum) -> tinker.Datum:
    """tinker-cookbook rl/train.py `_remove_mask`."""
    inputs = {k: v for k, v in datum.loss_fn_inputs.items() if k != "mask"}
    return tinker.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def kl_sample_train(data: list[tinker.Datum], training_logprobs: list[torch.Tensor]) -> float:
    """tinker-cookbook rl/metrics.py `compute_kl_sample_train` (v1) over action tokens."""
    diffs = []
    for datum, train_logprobs_T in zip(data, training_logprobs, strict=True):
        action_T = datum.loss_fn_inputs["mask"].to_torch() > 0
        sampler_T = datum.loss_fn_inputs["logprobs"].to_torch()
        diffs.append(sampler_T[action_T] - train_logprobs_T[action_T])
    return float(torch.cat(diffs).mean())


async def cookbook_train_step(
    training: tinker.TrainingClient, data: list[tinker.Datum], num_substeps: int
) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    """tinker-cookbook rl/train.py `train_step`: forward_backward and optim_step of each
    substep enqueued before the previous result is read; reads loss_fn_outputs of every one."""
    size = len(data) // num_substeps
    batches = [data[i : i + size] for i in range(0, len(data), size)]
    adam = tinker.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    logprobs_D: list[torch.Tensor] = []
    metrics: list[dict[str, float]] = []
    pending = []
    for batch in batches:
        fwd_bwd = await training.forward_backward_async(
            [without_mask(d) for d in batch], loss_fn="importance_sampling"
        )
        pending.append((fwd_bwd, await training.optim_step_async(adam)))
    for fwd_bwd, optim in pending:
        result = await fwd_bwd.result_async()
        logprobs_D.extend(output["logprobs"].to_torch() for output in result.loss_fn_outputs)
        metrics.append(result.metrics)
        await optim.result_async()
    return logprobs_D, metrics


def test_cookbook_rl_step_reads_logprobs_and_counts_only_completion_tokens(always_server):
    training = training_client(always_server, seed=9)
    data, num_completion = cookbook_rl_data(training)
    forward = logprobs_of(
        training.forward([without_mask(d) for d in data], "importance_sampling").result()
    )

    logprobs_D, metrics = asyncio.run(cookbook_train_step(training, data, num_substeps=2))

    # The first substep ran before any update: its logprobs are the forward pass's, at every
    # position (no mask: all are included), and the sampler's own at the completion.
    first = metrics[0]
    for got_T, expected in zip(logprobs_D[:2], forward[:2], strict=True):
        assert got_T.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    completion_first = sum(int(d.loss_fn_inputs["mask"].to_torch().sum()) for d in data[:2])
    assert first["valid_tokens:sum"] == completion_first
    # Sampler and trainer share float32 logprob code on the CPU: they agree to rounding.
    assert first["loss/sampler_mismatch/mean"] < 1e-5
    assert abs(first["loss/kl_policy/mean"]) < 1e-5
    assert first["loss/ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(kl_sample_train(data[:2], logprobs_D[:2])) < 1e-5
    # The second substep ran after one optim-step: still only completion tokens are counted.
    assert len(logprobs_D) == len(data)
    assert sum(m["valid_tokens:sum"] for m in metrics) == num_completion
    training.close()


def test_default_server_returns_loss_fn_outputs_only_when_asked(shared_server):
    training = training_client(shared_server)
    data = [sft_datum(tokens) for tokens in SEQUENCES]
    plain = training.forward_backward(data, "cross_entropy").result()
    assert plain.loss_fn_outputs == []
    asked = training.forward_backward(data, "cross_entropy", return_loss_fn_outputs=True).result()
    forward = logprobs_of(training.forward(data, "cross_entropy").result())
    for got, expected in zip(logprobs_of(asked), forward, strict=True):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert asked.metrics == pytest.approx(plain.metrics, rel=1e-6)
    training.close()
