"""engine/tensor_wire.py: tensors survive the trip as bytes exactly, whatever their dtype
(bfloat16, which numpy lacks, included), shape or layout."""

from __future__ import annotations

import pickle

import torch

from posttrain.engine.tensor_wire import from_wire, to_wire


def test_tensors_come_back_bit_for_bit_in_every_dtype_and_layout():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=generator)
    tensors = {
        "float32": base,
        "bfloat16": base.to(torch.bfloat16),
        "float16": base.to(torch.float16),
        "transposed": base.t(),  # not contiguous
        "int64": torch.arange(5),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }
    back = from_wire(pickle.loads(pickle.dumps(to_wire(tensors), protocol=5)))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
