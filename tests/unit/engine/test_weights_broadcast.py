"""engine/hosts/replicas/weights_broadcast.py: a bucket's tensors survive packing bit for bit,
whether their bytes then cross a broadcast or a pipe; the pipe transport serves what the broadcast
does."""

from __future__ import annotations

import pickle

import torch
from test_generator_replicas import PROMPT, train_and_publish
from test_process_engine import CONFIG, LORA, MODELS

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.engine.hosts.replicas.weights_broadcast import (
    ALIGN,
    buffer_of,
    pack,
    unpack,
    with_data,
)


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=generator)
    return {
        "float32": base,
        "bfloat16": base.to(torch.bfloat16),  # numpy has no bfloat16: bytes cross as bytes
        "float16": base[:5, :3].to(torch.float16),  # 30 bytes: the next one starts aligned
        "transposed": base.t(),  # not contiguous
        "int64": torch.arange(5),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }


def test_a_packed_bucket_comes_back_bit_for_bit_in_every_dtype_and_layout():
    original = tensors()
    bucket, buffer = pack(original)
    assert all(start % ALIGN == 0 for _, _, _, start, _ in bucket.entries)
    assert buffer.numel() == bucket.nbytes
    piped = pickle.loads(pickle.dumps(with_data(bucket, buffer), protocol=5))
    for back in (unpack(bucket, buffer), unpack(piped, buffer_of(piped))):
        assert back.keys() == original.keys()
        for name, tensor in original.items():
            assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
            assert torch.equal(back[name], tensor), name
    assert bucket.header().data is None and bucket.header().entries == bucket.entries


def test_a_packed_bucket_is_a_snapshot():
    original = tensors()
    bucket, buffer = pack(original)
    original["float32"].add_(1.0)
    assert not torch.equal(unpack(bucket, buffer)["float32"], original["float32"])


def test_the_pipe_transport_serves_what_the_broadcast_does():
    def published(transport: str) -> list:
        config = CONFIG.model_copy(update={"weights_transport": transport})
        engine = ReplicatedEngine(LocalEngine(config, MODELS), config, MODELS)
        try:
            engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=1)
            engine.create_session("r", "s", LORA)
            fence = train_and_publish(engine, 1)
            (results,) = engine.sample_batch("r", [("s", PROMPT)], fence=fence)
            delivery = engine.delivery("r")
            assert (delivery.broadcast > 0) == (transport == "broadcast"), delivery
            assert (delivery.piped > 0) == (transport == "pipe"), delivery
            return results
        finally:
            engine.close()

    assert published("pipe") == published("broadcast")
