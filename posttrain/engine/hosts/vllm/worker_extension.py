"""Runs inside each vLLM server's worker (its `--worker-extension-cls`), not in posttrain's
process: a full-weight weights-sync reloads the served model from a safetensors file through
vLLM's own `reload_weights`, which repacks each weight the way its backend stores it (a plain
`load_weights` does not on the CPU backend). hosts/vllm/engine.py calls it by name over the
server's /collective_rpc.

It runs in the vLLM venv, so it imports nothing but torch and safetensors (both there);
the packages above it (`posttrain`, `posttrain.engine`, `posttrain.engine.hosts`) import nothing.
"""

from __future__ import annotations


class PosttrainWeights:
    """Mixed into vLLM's worker class (`self` is the worker)."""

    def posttrain_reload(self, path: str) -> int:
        """Reload every weight from the safetensors file at `path` (checkpoint names, as a
        Hugging Face model's state dict); returns how many tensors were read."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
