"""Models named by their Hugging Face Hub id (`--model Qwen/Qwen3-8B`): which values are hub
ids, and the local snapshot directory one resolves to, through huggingface_hub's own cache
(HF_HOME / HF_HUB_CACHE): the cached snapshot when it holds a model, else a download of the
files a model needs, with huggingface_hub's progress bar, unless offline.

Not here: what makes a directory servable (loader.servable_problem, checked at start-up on the
snapshot as on any directory), and the name a model is served under (config_sources).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError

# ORG/NAME, optionally @REVISION (a branch, tag or commit hash). Exactly one `/` and no leading
# `.`, `/` or `~`, so that a relative or absolute path is never taken for a hub id.
HUB_ID = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")

# What loading a causal LM reads: config.json, generation_config.json, the tokenizer files
# (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, tokenizer.model,
# special_tokens_map.json), chat templates (chat_template.jinja / .json), preprocessor_config.json
# and the safetensors weights with their index. Not the *.bin / *.pth / *.gguf copies many
# repos also ship: the loader reads safetensors only, and they would double the download.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
# Mistral-style repos ship their weights twice: consolidated*.safetensors beside the sharded
# transformers ones; Meta's keep a second copy under original/.
IGNORE_PATTERNS = ("consolidated*.safetensors", "original/*")


@dataclass(frozen=True)
class HubId:
    repo_id: str  # ORG/NAME, the name the model is served under
    revision: str | None  # None: the repo's default branch (main)

    @property
    def given(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(value: str) -> HubId | None:
    """The hub id `value` spells (`ORG/NAME` or `ORG/NAME@REVISION`), or None."""
    match = HUB_ID.fullmatch(value)
    if match is None:
        return None
    return HubId(repo_id=match["repo_id"], revision=match["revision"])


def has_weights(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def snapshot_dir(hub_id: HubId, *, is_offline: bool, cache_dir: Path | None = None) -> Path:
    """The local directory of `hub_id`'s snapshot: the cached one when it holds config.json
    and safetensors weights (a cache that tinker-cookbook filled holds only a tokenizer), else
    a fresh download into the cache unless `is_offline`.

    `cache_dir`: the hub cache (None: huggingface_hub's, from HF_HUB_CACHE or HF_HOME).
    Raises ConfigError, one line saying what to do, when it can do neither."""
    # huggingface_hub fixes its offline mode, cache paths and progress-bar setting when first
    # imported: imported here, as a hub id is resolved, it reads the user's environment; a
    # server given no hub id imports it only after cli.stay_offline(), as it always has.
    from huggingface_hub.utils.tqdm import disable_progress_bars

    directory = _resolved(hub_id, is_offline=is_offline, cache_dir=cache_dir)
    # The download, if any, is over: from here the server's output is its log lines, not
    # transformers' weight-loading bars (it reads this setting when imported, after this; an
    # explicit HF_HUB_DISABLE_PROGRESS_BARS=0 still wins), as stay_offline() intends.
    disable_progress_bars()
    return directory


def _resolved(hub_id: HubId, *, is_offline: bool, cache_dir: Path | None) -> Path:
    """snapshot_dir's lookup and download (huggingface_hub imported late, as there)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"--model {hub_id.given}"
    local = f"or pass a local directory with --model {hub_id.repo_id}=DIR"

    def snapshot(*, local_files_only: bool) -> Path:
        return Path(
            snapshot_download(
                hub_id.repo_id,
                revision=hub_id.revision,
                cache_dir=cache_dir,
                allow_patterns=list(ALLOW_PATTERNS),
                ignore_patterns=list(IGNORE_PATTERNS),
                local_files_only=local_files_only,
            )
        )

    try:
        cached: Path | None = snapshot(local_files_only=True)
    except LocalEntryNotFoundError:  # not cached, or a snapshot its tree listing calls partial
        cached = None
    except HFValidationError as exc:  # ORG/NAME shaped, yet not a name the hub allows
        raise ConfigError(
            f"{where}: no such directory, and not a Hugging Face Hub id ({_first_line(exc)})",
            param="models",
        ) from None
    if cached is not None and has_weights(cached):
        return cached
    if is_offline:
        state = "not in" if cached is None else "without weights in"
        raise ConfigError(
            f"{where}: no such directory, and {state} the Hugging Face cache while offline"
            f" (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set): download it first with"
            f" `hf download {hub_id.given}`, unset HF_HUB_OFFLINE, {local}",
            param="models",
        )
    try:
        downloaded = snapshot(local_files_only=False)
    except (GatedRepoError, RepositoryNotFoundError) as exc:
        # The hub answers a private or gated repo without a token as if it did not exist.
        raise ConfigError(
            f"{where}: no such directory, and the Hugging Face Hub refused it ({_first_line(exc)}):"
            " check the name, or set HF_TOKEN (or run `hf auth login`) with access to it"
            f" (gated repos: accept their terms on huggingface.co first), {local}",
            param="models",
        ) from None
    except RevisionNotFoundError as exc:
        raise ConfigError(
            f"{where}: revision {hub_id.revision!r} not found on the Hugging Face Hub"
            f" ({_first_line(exc)})",
            param="models",
        ) from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        # LocalEntryNotFoundError: the hub could not be reached and nothing usable is cached.
        raise ConfigError(
            f"{where}: no such directory, and it cannot be downloaded from the Hugging Face Hub"
            f" ({_reason(exc)}): check the network, download it"
            f" with `hf download {hub_id.given}` where the hub is reachable, {local}",
            param="models",
        ) from None
    if not has_weights(downloaded):
        raise ConfigError(
            f"{where}: the Hugging Face Hub repo holds no config.json with safetensors weights"
            f" (downloaded to {downloaded}): {local}",
            param="models",
        )
    return downloaded


def _first_line(exc: BaseException) -> str:
    """huggingface_hub's messages run over several lines; the CLI prints one."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def _reason(exc: BaseException) -> str:
    """The error under a LocalEntryNotFoundError (the hub call that failed), else `exc`."""
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {_first_line(cause)}"
