"""The GRPO loop of grpo.py written for the tinker 0.38 SDK itself, on posttrain's Tinker surface.

The tinker SDK 0.38 needs a venv of its own (the Together SDK's shim pins tinker 0.23.1). In it,
either install posttrain as well, and the example starts `posttrain serve` itself:

    pip install tinker==0.38.0 -e /path/to/posttrain
    python examples/tinker_native.py

or install the client only (no torch: posttrain without its dependencies, for this example's
helpers), and point it at a server running elsewhere:

    pip install tinker==0.38.0
    pip install --no-deps -e /path/to/posttrain
    python examples/tinker_native.py --base-url http://127.0.0.1:8000

A tinker loop runs on posttrain by pointing ServiceClient at the server (`base_url`, or
TINKER_BASE_URL) with any key that starts with `tml-` (the SDK refuses other keys before it
sends anything; a server with a keys file needs one of its keys). Nothing else changes: the
SDK speaks its own wire protocol, which `posttrain serve` answers at /api/v1 beside the
Together API. The loop is examples/_tinker_grpo.py, the same code tinker_shim.py runs through
together's shim; here the stop is the tokenizer's EOS token id, as tinker-cookbook's renderers
send stops. Leaving the `with` block closes the SDK's session (ServiceClient.close, the one
way the SDK ends what it made).
"""

from __future__ import annotations

import os
import sys

from _common import BASE_MODEL, parser, server
from _tinker_grpo import add_arguments, train

EOS = 0  # the built-in tokenizer's end-of-sequence id

MISSING_TINKER = """\
tinker_native.py needs the tinker 0.38 SDK, in a venv of its own (the Together SDK's shim pins
tinker 0.23.1): `pip install tinker==0.38.0 -e /path/to/posttrain` there, or, for a client
without torch against a running server, `pip install tinker==0.38.0` then
`pip install --no-deps -e /path/to/posttrain` and pass --base-url."""


def main() -> None:
    args_parser = parser(__doc__)
    add_arguments(args_parser)
    args = args_parser.parse_args()
    try:
        import tinker  # the real SDK, 0.38
    except ImportError:
        sys.exit(MISSING_TINKER)

    api_key = os.environ.get("TINKER_API_KEY", "tml-local")
    with (
        server(args.base_url) as base_url,
        tinker.ServiceClient(base_url=base_url, api_key=api_key) as service,
    ):
        # 0.38's client-creating calls return futures: .result() is the client.
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0)
        training = training.result()
        train(
            tinker,
            training,
            args,
            stop=[EOS],
            new_sampler=lambda: training.save_weights_and_get_sampling_client().result(),
        )


if __name__ == "__main__":
    main()
