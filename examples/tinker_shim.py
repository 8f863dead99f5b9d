"""The GRPO loop of grpo.py written against the tinker API, through together's tinker shim.

    python examples/tinker_shim.py                   # starts `posttrain serve` itself
    python examples/tinker_shim.py --base-url http://127.0.0.1:8000

A script written for the `tinker` SDK runs on posttrain by changing its import line to
`import together.post_training.tinker as tinker` and pointing ServiceClient at the server.
The loop itself is examples/_tinker_grpo.py, which tinker_native.py runs on the tinker SDK.
"""

from __future__ import annotations

from _common import API_KEY, BASE_MODEL, parser, server
from _tinker_grpo import add_arguments, train


def main() -> None:
    args_parser = parser(__doc__)
    add_arguments(args_parser)
    args = args_parser.parse_args()
    import together.post_training.tinker as tinker  # after --help: it loads torch

    with server(args.base_url) as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0)
        train(tinker, training, args)
        training.close()


if __name__ == "__main__":
    main()
