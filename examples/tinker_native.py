"""The GRPO loop of grpo.py written for the tinker 0.38 SDK itself, on posttrain's Tinker surface.

    pip install tinker==0.38.0              # its own venv: the Together SDK pins tinker 0.23.1
    python examples/tinker_native.py        # starts `posttrain serve` itself
    python examples/tinker_native.py --base-url http://127.0.0.1:8000

A tinker loop runs on posttrain by pointing ServiceClient at the server (`base_url`, or
TINKER_BASE_URL) with any key that starts with `tml-` (the SDK refuses other keys before it
sends anything; a server with a keys file needs one of its keys). Nothing else changes: the
SDK speaks its own wire protocol, which `posttrain serve` answers at /api/v1 beside the
Together API. The loop is examples/_tinker_grpo.py, the same code tinker_shim.py runs through
together's shim; here the stop is the tokenizer's EOS token id, as tinker-cookbook's renderers
send stops.
"""

from __future__ import annotations

import os

from _common import BASE_MODEL, parser, server
from _tinker_grpo import add_arguments, train

EOS = 0  # the built-in tokenizer's end-of-sequence id


def main() -> None:
    args_parser = parser(__doc__)
    add_arguments(args_parser)
    args = args_parser.parse_args()
    import tinker  # the real SDK, 0.38

    api_key = os.environ.get("TINKER_API_KEY", "tml-local")
    with (
        server(args.base_url) as base_url,
        tinker.ServiceClient(base_url=base_url, api_key=api_key) as service,
    ):
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0)
        train(tinker, training, args, stop=[EOS])


if __name__ == "__main__":
    main()
