"""`attnserve COMMAND ...` (or `python -m attnserve COMMAND ...`): one command line for the project.

    attnserve serve   --model-repository models --port 8001     # the server (attnserve.server)
    attnserve export  --preset self_attention                   # ONNX export, parity first
    attnserve health | models | infer | batch  --url HOST:PORT  # the client (attnserve.client)

Each command keeps its own flags, ATTNSERVE_* variables and exit statuses (`attnserve COMMAND
--help`). The modules behind a command are imported only when it runs: `attnserve serve` never
imports torch, and `attnserve --help` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_USAGE = 2
PROG = "attnserve"


def _serve(argv: list[str]) -> int:
    from attnserve.server.__main__ import main

    return main(argv, prog=f"{PROG} serve")


def _export(argv: list[str]) -> int:
    from attnserve.export.__main__ import main

    return main(argv, prog=f"{PROG} export")


def _client(command: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from attnserve.client.__main__ import main

        return main([command, *argv], prog=PROG)

    return run


# name -> (what it does, how it runs); the order is the help's.
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "serve": ("serve a model repository over the Open Inference Protocol (gRPC)", _serve),
    "export": ("export an attention module to ONNX, parity with eager PyTorch proven first", _export),
    "infer": ("one inference from .npy/.npz files", _client("infer")),
    "batch": ("a resumable batch job over many items, outputs in input order", _client("batch")),
    "health": ("server liveness, readiness, grpc.health.v1 status, model readiness", _client("health")),
    "models": ("the models a server serves, with their tensors", _client("models")),
}


class _Version(argparse.Action):
    """--version: the release, whether the native data plane (--data-plane native) can serve, and
    which plane `serve` takes by default (auto); it imports the extension only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from attnserve import __version__
        from attnserve.server.data_plane import why_unavailable

        why = why_unavailable()
        print(f"{PROG} {__version__}\nnative data plane: "
              f"{'available (--data-plane native)' if why is None else 'unavailable: ' + why}\n"
              f"serve's data plane by default (--data-plane auto): {'native' if why is None else 'python'}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Multi-head attention served over the Open Inference Protocol (KServe V2).",
        epilog=f"`{PROG} COMMAND --help` lists a command's flags.")
    parser.add_argument("--version", action=_Version, help="show the version, whether the native data plane "
                        "can serve and which plane serves by default, and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, _run) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        _help, run = COMMANDS[argv[0]]
        return run(argv[1:])
    parser = _parser()
    parser.parse_args(argv)  # --help, --version, or a usage error (exit 2) naming the commands
    return EXIT_USAGE  # not reached: a valid command is dispatched above


if __name__ == "__main__":
    sys.exit(main())
