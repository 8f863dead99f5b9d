"""The OpenAI-compatible surface's services: which session a `model` names (targets.py) and
completions as sample operations of the one scheduler (completions.py), their
texts token by token, whole or streamed (texts.py).

Imports: service, types.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.service.openai.completions import Completions
from posttrain.service.openai.targets import ModelTargets


@dataclass(frozen=True)
class OpenAIService:
    targets: ModelTargets
    completions: Completions
