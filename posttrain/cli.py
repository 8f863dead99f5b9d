"""The `posttrain` command: `serve` (the server) and `demo` (a training run against it).

`serve`'s flags are generated from the ServerConfig fields that config.py marks as flags
(config_sources.settings()): name, help, default and group come from the field, so each
setting is declared once. A bad setting is one line on stderr and exit status 2.

Imports: config, config_sources, api (listen, app, server), demo.command, model.loader (the
start-up checks of --device and --model dirs).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import sys
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin

from posttrain import __version__
from posttrain.config import BUILTIN_MODELS, ServerConfig
from posttrain.config_sources import FLAG_GROUPS, Setting, build_config, settings, stay_offline
from posttrain.demo.command import add_demo_arguments, run_demo_command
from posttrain.engine.hosts.threads import bounded_openmp_spins
from posttrain.errors import ConfigError

DESCRIPTION = """\
posttrain trains language models on your own machine through the Together RL post-training
API: clients (the `together` Python SDK, its tinker shim, or plain HTTP) create model
resources and training sessions, then run forward-backward, optim-step, sample and checkpoint
operations, which posttrain runs with PyTorch on Hugging Face models (LoRA or full weights).
"""

EPILOG = """\
Start with `posttrain serve` and point the SDK at it, or run `posttrain demo` to watch a
model learn addition. `posttrain serve --help` and `posttrain demo --help` list their flags.
"""

SERVE_EPILOG = """\
A flag marked `env` may also come from that environment variable; the flag wins. A bad
setting stops the server at start-up with one line on stderr and exit status 2. Ctrl-C
(SIGINT) or SIGTERM stops it cleanly: held polls are answered, then it exits with status
130 (SIGINT) or 0 (SIGTERM).
"""


ON_OFF = {"on": True, "off": False}  # a bool flag's choices


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error is one line, as a bad setting is."""
        self.exit(2, f"posttrain: {message} (see `{self.prog} --help`)\n")


def shown_default(setting: Setting) -> str:
    if setting.default is not None:
        return setting.default
    value = setting.info.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value is None else str(value)


def add_setting(group: argparse._ArgumentGroup, setting: Setting) -> None:
    """One flag for `setting`: choices from a Literal, `on|off` for a bool (a bare flag for a
    switch); other values pass as text and the config validates them, naming the flag."""
    default = shown_default(setting)
    notes = f"default: {default}" + (f"; env {setting.env}" if setting.env else "")
    text = f"{setting.info.description} ({notes})".replace("%", "%%")
    options: dict[str, Any] = {
        "dest": ".".join(setting.path),
        "default": None,
        "help": argparse.SUPPRESS if setting.hidden else text,
    }
    annotation = setting.info.annotation
    if setting.switch:
        options.update(action="store_const", const=True)
    elif annotation is bool:
        options.update(choices=("on", "off"))
    elif get_origin(annotation) is Literal:
        options.update(choices=get_args(annotation))
    elif setting.path == ("models",):
        options.update(action="append", metavar=setting.metavar)
    else:
        options.update(metavar=setting.metavar or setting.path[-1].upper())
    group.add_argument(setting.flag, **options)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    groups = {name: serve.add_argument_group(name, about) for name, about in FLAG_GROUPS.items()}
    auth = groups["limits and auth"]
    auth.add_argument(
        "--api-key",
        metavar="KEY",
        help="accept this bearer key, for user user_local (default: none: any non-empty key"
        " is accepted as user_local; env POSTTRAIN_API_KEY)",
    )
    auth.add_argument(
        "--keys-file",
        type=Path,
        metavar="PATH",
        help="accept the keys in PATH, one `KEY USER_ID` pair per line, # for comments"
        " (default: none; env POSTTRAIN_KEYS_FILE)",
    )
    for setting in settings():
        add_setting(groups[setting.group], setting)


def parser() -> argparse.ArgumentParser:
    root = Parser(
        prog="posttrain",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument("--version", action="version", version=f"posttrain {__version__}")
    commands = root.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )
    serve = commands.add_parser(
        "serve",
        usage="%(prog)s [flags]",  # 27 flags: the groups below list them
        help="run the server (the API, and a dashboard at its root URL)",
        description="Run the posttrain server: the Together RL post-training API, and a\n"
        "dashboard of its sessions at the root URL.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(serve)
    demo = commands.add_parser(
        "demo",
        help="start a server, warm up then GRPO-train a built-in model on addition, plot it",
        description="Start a server, warm a built-in model up on addition, GRPO-train it, and"
        " plot the reward and held-out accuracy.",
    )
    add_demo_arguments(demo)
    return root


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of `posttrain serve`'s flags, env and defaults."""
    given = vars(args)
    flags: dict[tuple[str, ...], object] = {}
    for setting in settings():
        value = given.get(".".join(setting.path))
        if value is not None:
            # on|off is a bool's spelling; a Literal may name "on" and "off" as its own values.
            is_bool = setting.info.annotation is bool
            flags[setting.path] = ON_OFF[value] if is_bool and isinstance(value, str) else value
    return build_config(api_key=args.api_key, keys_file=args.keys_file, flags=flags)


def check_device(name: str) -> None:
    """A device torch cannot use is a bad setting, found before anything is loaded."""
    from posttrain.model.loader import resolve_device

    try:
        resolve_device(name)
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
        raise ConfigError(f"--device {name}: {message}", param="engine.device") from None


def check_data_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--data-dir {path}: {exc.strerror}", param="data_dir") from None


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine: localhost, 127.0.0.0/8 or ::1. A name
    that is not an address could resolve anywhere, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(config: ServerConfig) -> None:
    """Listening beyond loopback without an API key needs --insecure-no-auth."""
    if config.api_keys or config.insecure_no_auth or is_loopback(config.host):
        return
    raise ConfigError(
        f"--host {config.host} listens beyond loopback without an API key: give --api-key KEY"
        " or --keys-file PATH (env POSTTRAIN_API_KEY, POSTTRAIN_KEYS_FILE), or"
        " --insecure-no-auth to let anyone who reaches the port train and sample",
        param="host",
    )


def serve(args: argparse.Namespace) -> NoReturn:
    from posttrain.api.listen import listening_socket

    config = serve_config(args)
    check_exposure(config)
    stay_offline()  # before transformers is imported
    bounded_openmp_spins()  # before torch is imported (engine/hosts/threads.py says why)
    # Listening before torch is imported: clients that retry across a restart queue instead of
    # being refused (api/listen.py).
    try:
        sock = listening_socket(config.host, config.port)
    except OSError as exc:
        where = f"{config.host}:{config.port}"
        if exc.errno == errno.EADDRINUSE:
            message = f"--port {config.port}: {where} is in use; give another --port (0: any)"
        else:
            message = f"cannot listen on {where}: {exc.strerror}"
        raise ConfigError(message, param="port") from None

    from posttrain.api.app import create_app
    from posttrain.api.server import leave
    from posttrain.api.server import serve as run_server
    from posttrain.engine.hosts.ranks.trainer_group import check_trainer_ranks
    from posttrain.model.loader import servable_problem

    try:
        check_data_dir(config.data_dir)
        check_device(config.engine.device)
        # The built-ins are known to be servable (under any name); the user's directories are
        # checked.
        builtin_dirs = set(BUILTIN_MODELS.values())
        for spec in config.models:
            if spec.path not in builtin_dirs and (problem := servable_problem(spec.path)):
                raise ConfigError(f"--model {spec.path}: {problem}", param="models")
        check_trainer_ranks(config.engine)
    except ConfigError:
        sock.close()
        raise
    leave(run_server(create_app(config), sock=sock, config=config))


def main(argv: list[str] | None = None) -> None:
    root = parser()
    args, unknown = root.parse_known_args(argv)
    if unknown:  # the command's help lists its flags, not the top level's
        root.exit(
            2,
            f"posttrain: unrecognized arguments: {' '.join(unknown)}; run"
            f" `posttrain {args.command} --help` for its flags\n",
        )
    try:
        if args.command == "serve":
            try:
                serve(args)
            except KeyboardInterrupt:  # Ctrl-C before the server had started
                print("posttrain: interrupted while starting", file=sys.stderr)
                sys.exit(130)
        run_demo_command(args)
    except ConfigError as exc:
        print(f"posttrain: {exc.message}", file=sys.stderr)
        sys.exit(2)
