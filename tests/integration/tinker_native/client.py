"""Scenarios run by the real tinker 0.38 SDK against a posttrain server; each prints one JSON
object on its last stdout line for tests/integration/test_tinker_native.py to check.

Run with the tinker 0.38 interpreter (tests/tinker_env.py): `python client.py SCENARIO URL`.
Nothing here imports posttrain: this is what a user's loop does.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types

BASE_MODEL = "posttrain/tiny-qwen3"
API_KEY = "tml-posttrain-test"
SEQUENCES = [[1, 20, 21, 22, 23, 24, 25], [1, 30, 31, 32, 33], [1, 40, 41, 42, 43, 44]]


def datum(tokens: list[int]) -> types.Datum:
    weights = [0.0] + [1.0] * (len(tokens) - 2)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=weights, dtype="float32"),
        },
    )


def logprobs_of(output: types.ForwardBackwardOutput) -> list[list[float]]:
    return [[float(x) for x in out["logprobs"].data] for out in output.loss_fn_outputs]


def adam(lr: float = 1e-2) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr)


def service(url: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=API_KEY)


def handshake(url: str) -> dict:
    with service(url) as client:
        caps = client.get_server_capabilities()
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1)
        info = training.get_info()
        rest = client.create_rest_client()
        session_id = training.model_id.split(":train:")[0]  # the SDK names runs after it
        mine = rest.get_session(session_id).result()
        listed = rest.list_sessions().result().sessions
        return {
            "session_runs": list(mine.training_run_ids),
            "listed": session_id in listed,
            "models": [m.model_name for m in caps.supported_models],
            "model_id": training.model_id,
            "info_base": info.model_data.model_name,
            "lora_rank": info.lora_rank,
        }


def sl_steps(url: str) -> dict:
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2)
        data = [datum(s) for s in SEQUENCES]
        losses = []
        metrics = None
        for _ in range(4):
            out = training.forward_backward(data, "cross_entropy").result()
            metrics = out.metrics
            losses.append(out.metrics["loss:sum"])
            training.optim_step(adam()).result()
        forward = logprobs_of(training.forward(data, "cross_entropy").result())
        sampler = training.save_weights_and_get_sampling_client()
        scored = [
            sampler.compute_logprobs(types.ModelInput.from_ints(s)).result() for s in SEQUENCES
        ]
        return {"losses": losses, "metrics": metrics, "forward": forward, "scored": scored}


def elementwise(url: str) -> dict:
    """Per-token outputs of cross_entropy and importance_sampling, as a loop reads them."""
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=10)
        data = [datum(s) for s in SEQUENCES]
        policy = [
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "logprobs": types.TensorData(data=[-1.0] * len(s[1:]), dtype="float32"),
                    "advantages": types.TensorData(data=[0.5] * len(s[1:]), dtype="float32"),
                },
            )
            for d, s in zip(data, SEQUENCES, strict=True)
        ]
        seen = {"weights": [list(d.loss_fn_inputs["weights"].data) for d in data]}
        for loss_fn, batch in (("cross_entropy", data), ("importance_sampling", policy)):
            out = training.forward_backward(batch, loss_fn).result()
            seen[loss_fn] = {
                "loss_sum": out.metrics["loss:sum"],
                "keys": [sorted(o) for o in out.loss_fn_outputs],
                "logprobs": logprobs_of(out),
                "elementwise": [
                    [float(x) for x in o["elementwise_loss"].data] for o in out.loss_fn_outputs
                ],
            }
        return seen


def resume(url: str) -> dict:
    """save_state after 2 steps, resume with the optimizer, take the same third step both ways."""
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3)
        data = [datum(s) for s in SEQUENCES]
        for _ in range(2):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam()).result()
        path = training.save_state("after-two").result().path
        resumed = client.create_training_client_from_state_with_optimizer(path)
        losses = {}
        for name, client_ in (("original", training), ("resumed", resumed)):
            client_.forward_backward(data, "cross_entropy").result()
            client_.optim_step(adam()).result()
            out = client_.forward(data, "cross_entropy").result()
            losses[name] = out.metrics["loss:sum"]
        return {"path": path, "model_ids": [training.model_id, resumed.model_id], **losses}


def load_state(url: str) -> dict:
    """save_state after 2 steps; the original run's next two losses, then the same two steps
    after load_state(_with_optimizer) into the same run (after more steps) and into a fresh
    run, and from create_training_client_from_state (weights only: a fresh optimizer)."""
    data = [datum(s) for s in SEQUENCES]

    def two_steps(run: tinker.TrainingClient) -> list[float]:
        losses = []
        for _ in range(2):
            losses.append(run.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            run.optim_step(adam()).result()
        return losses

    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11)
        two_steps(training)
        path = training.save_state("at-two").result().path
        original = two_steps(training)
        two_steps(training)
        training.load_state_with_optimizer(path).result()
        same_with_optimizer = two_steps(training)
        training.load_state(path).result()
        same_without_optimizer = two_steps(training)
        fresh = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=12)
        fresh.load_state_with_optimizer(path).result()
        fresh_with_optimizer = two_steps(fresh)
        from_state = two_steps(client.create_training_client_from_state(path))
        return {
            "original": original,
            "same_with_optimizer": same_with_optimizer,
            "same_without_optimizer": same_without_optimizer,
            "fresh_with_optimizer": fresh_with_optimizer,
            "from_state": from_state,
        }


def snapshot(url: str) -> dict:
    """A snapshot sampler keeps the weights of its moment; a later one sees training."""
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4)
        data = [datum(s) for s in SEQUENCES]
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam(5e-2)).result()
        frozen = training.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(SEQUENCES[0])
        before = frozen.compute_logprobs(prompt).result()
        for _ in range(3):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam(5e-2)).result()
        after = frozen.compute_logprobs(prompt).result()
        fresh = training.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
        base = client.create_sampling_client(base_model=BASE_MODEL)
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7, stop=[])
        sampled = base.sample(prompt, num_samples=3, sampling_params=params).result()
        return {
            "before": before,
            "after": after,
            "fresh": fresh,
            "sampled": [list(map(int, s.tokens)) for s in sampled.sequences],
            "stop_reasons": [s.stop_reason for s in sampled.sequences],
        }


def chunked(url: str) -> dict:
    """1,100 datums in one call (the SDK sends two chunks) against the same data in 4 calls."""
    rng = np.random.default_rng(0)
    seqs = [[1] + [int(t) for t in rng.integers(2, 90, size=5)] for _ in range(1100)]
    data = [datum(s) for s in seqs]
    with service(url) as client:
        result = {}
        for name, calls in (("one", [data]), ("four", [data[i::4] for i in range(4)])):
            training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9)
            total = 0.0
            for part in calls:
                total += (
                    training.forward_backward(part, "cross_entropy").result().metrics["loss:sum"]
                )
            training.optim_step(adam()).result()
            after = training.forward(data[:8], "cross_entropy").result()
            result[name] = {"loss": total, "after": logprobs_of(after)}
        return result


def refusals(url: str) -> dict:
    """Each refusal surfaces as an exception with posttrain's message, never a hang (a
    training client that saw a failure is spent, so each gets its own)."""
    out = {}
    with service(url) as client:

        def run_of(seed: int) -> tinker.TrainingClient:
            return client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed)

        for name, call in (
            ("stable_reinforce", lambda: run_of(5).forward_backward(
                [datum(SEQUENCES[0])], "stable_reinforce")),
            ("out_of_vocabulary", lambda: run_of(6).forward_backward(
                [datum(SEQUENCES[0]), datum([1, 2, 500, 3])], "cross_entropy")),
            ("unknown_model", lambda: client.create_lora_training_client(base_model="no/such")),
        ):  # fmt: skip
            try:
                value = call()
                if hasattr(value, "result"):
                    value.result()
                out[name] = "no error"
            except Exception as exc:  # noqa: BLE001 - the message is what is checked
                out[name] = f"{type(exc).__name__}: {exc}"
    return out


def eviction(url: str) -> dict:
    """On a server hosting 3 sessions per resource: a run and 4 snapshot samplers. The first
    snapshot gives its slot up and, asked again, serves the same weights."""
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6)
        data = [datum(s) for s in SEQUENCES]
        prompt = types.ModelInput.from_ints(SEQUENCES[1])
        samplers, first = [], []
        for _ in range(4):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam(5e-2)).result()
            sampler = training.save_weights_and_get_sampling_client()
            first.append(sampler.compute_logprobs(prompt).result())
            samplers.append(sampler)
        again = [s.compute_logprobs(prompt).result() for s in samplers]
        return {"first": first, "again": again}


def saved_sampler(url: str) -> dict:
    """Before a restart: train, save sampler weights under a name, score a prompt with them."""
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7)
        data = [datum(s) for s in SEQUENCES]
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam(5e-2)).result()
        path = training.save_weights_for_sampler("for-later").result().path
        sampler = client.create_sampling_client(model_path=path)
        prompt = types.ModelInput.from_ints(SEQUENCES[2])
        return {"path": path, "scored": sampler.compute_logprobs(prompt).result()}


def after_restart(url: str, path: str) -> dict:
    """After a restart: a new client samples the path saved before it."""
    with service(url) as client:
        sampler = client.create_sampling_client(model_path=path)
        prompt = types.ModelInput.from_ints(SEQUENCES[2])
        return {"scored": sampler.compute_logprobs(prompt).result()}


def closed_client(url: str) -> dict:
    """A client that trains, saves a state and sampler weights, samples three ways, and
    closes; the next loss its run would have had, to compare after the close."""
    data = [datum(s) for s in SEQUENCES]
    prompt = types.ModelInput.from_ints(SEQUENCES[2])
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=13)
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam(5e-2)).result()
        state = training.save_state("closed-state").result().path
        sampler_path = training.save_weights_for_sampler("closed-sampler").result().path
        sampler = client.create_sampling_client(model_path=sampler_path)
        scored = sampler.compute_logprobs(prompt).result()
        training.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
        client.create_sampling_client(base_model=BASE_MODEL).compute_logprobs(prompt).result()
        loss = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        return {
            "client": training.model_id.split(":train:")[0],
            "state": state,
            "sampler_path": sampler_path,
            "scored": scored,
            "loss": loss,
        }


def after_close(url: str, state: str, sampler_path: str) -> dict:
    """A new client samples a closed client's sampler path and trains from its state."""
    data = [datum(s) for s in SEQUENCES]
    prompt = types.ModelInput.from_ints(SEQUENCES[2])
    with service(url) as client:
        sampler = client.create_sampling_client(model_path=sampler_path)
        params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=3, stop=[])
        sampled = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        training = client.create_training_client_from_state_with_optimizer(state)
        return {
            "client": training.model_id.split(":train:")[0],
            "scored": sampler.compute_logprobs(prompt).result(),
            "sampled": [int(t) for t in sampled.sequences[0].tokens],
            "loss": training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"],
        }


def inflight(url: str) -> dict:
    """An inflight sampler follows the run's weights; top-k prompt logprobs come with it."""
    with service(url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8)
        data = [datum(s) for s in SEQUENCES]
        follower = training.save_weights_and_get_sampling_client(kind="inflight")
        prompt = types.ModelInput.from_ints(SEQUENCES[0])
        before = follower.compute_logprobs(prompt).result()
        for _ in range(2):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam(5e-2)).result()
        # Publishes W2. Awaited: the SDK sends requests from its own loop, so an unawaited
        # save can reach the server after the follower's next sample (seen: "after" == "before").
        training.save_weights_and_get_sampling_client(kind="inflight").result()
        after = follower.compute_logprobs(prompt).result()
        params = types.SamplingParams(max_tokens=1)
        topk = follower.sample(
            prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
        ).result()
        snapshot = training.save_weights_and_get_sampling_client().compute_logprobs(prompt)
        return {
            "before": before,
            "after": after,
            "now": snapshot.result(),
            "topk": [
                None if row is None else [[int(t), float(lp)] for t, lp in row]
                for row in topk.topk_prompt_logprobs
            ],
            "prompt_logprobs": topk.prompt_logprobs,
        }


SCENARIOS = {
    f.__name__: f
    for f in (
        handshake,
        sl_steps,
        elementwise,
        resume,
        load_state,
        snapshot,
        chunked,
        refusals,
        eviction,
        saved_sampler,
        after_restart,
        closed_client,
        after_close,
        inflight,
    )
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])))
