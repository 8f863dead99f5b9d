"""AdamW on the local slices of FSDP2-sharded parameters (parallel/fsdp.py): the single-tensor
update torch.optim.AdamW applies, run on each rank's plain local tensors (views of the DTensors'
storage) instead of through DTensor dispatch, which costs a dispatch per operation and
parameter: on the CPU about as much as the arithmetic (a 38M model's optim-step on two ranks
took what one process's did, for half the elements).

The state stays the torch.optim.AdamW's (DTensor moments, a CPU step counter per parameter,
initialised as its `_init_group` does), so state_dict, checkpoints and load_state_dict see the
same state as before, and the values are the same operations on the same numbers.

Imports: torch (optim), engine.parallel.fsdp (the shard layout).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from posttrain.engine.parallel.fsdp import local


@torch.no_grad()
def step_local_slices(adamw: torch.optim.AdamW) -> None:
    """One AdamW step of every parameter with a gradient, on this rank's slices."""
    for group in adamw.param_groups:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:  # untouched, as torch.optim.AdamW leaves it
                continue
            state = adamw.state[p]
            if not state:
                # torch's lazy initialisation: the step on the CPU (neither capturable nor
                # fused), the moments laid out as the (sharded) parameter.
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(local(p))
            grads.append(local(p.grad))
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            continue
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,  # the single-tensor path SessionOptimizer's AdamW takes
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
