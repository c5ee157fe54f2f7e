"""The command line's start-up: flag values checked before anything loads or listens, and its plumbing.

A flag value that cannot work is refused up front, in one line that names the flag, the value and
what was expected (:class:`FlagError`; ``main`` prints it and exits 2): a model directory that is
not there or holds no loadable checkpoint (read from the file system only, no weights), a device
this machine does not have, a directory that does not exist, a port already taken. What passes
these checks may still fail later (weights that do not load, a shape that does not match): that
keeps its own reporting. Also here: the listening socket, bound before the app starts; argparse
help that shows every flag's default, and usage errors in two lines: the mistyped subcommand's
usage on one line, then the error (no flag is taken by a prefix of its name).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import itertools
import json
import logging
import logging.handlers
import os
import re
import signal
import socket
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from mla_watch.common.describe import describe_value

__all__ = [
    "FlagError",
    "HelpFormatter",
    "Parser",
    "attn_problem",
    "bind_listener",
    "check_serve_flags",
    "device_problem",
    "end_abandoned_work",
    "finish_parser",
    "held_logs",
    "model_problem",
    "one_thread_for_the_bundled_model",
    "parse_args",
    "require_model_extra",
    "run_server",
]

MODEL_EXPECTED = 'expected "bundled" or a save_pretrained directory'
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_PARSER = "cli_parser"  # the namespace attribute naming the (sub)parser that parsed a command's flags


class FlagError(Exception):
    """A flag value that cannot work: ``main`` prints ``PROG: MESSAGE`` as one line on stderr and exits 2."""


def _shown(value: Any, limit: int = 200) -> str:
    """A flag's value (a path, mostly) as a message shows it: its words, ``limit`` characters of them at most."""
    return describe_value(value, limit, form="words", ellipsis_after_limit=True)


# ---------------------------------------------------------------------------------------------- the model
def bundled_dir() -> Path:
    """Where the bundled model lives, found without importing torch (``mla_watch.models`` does)."""
    return Path(__file__).resolve().parents[1] / "models" / "bundled"


def _close_path(value: str, path: Path) -> str:
    """`` (did you mean "X"?)`` for a mistyped model name or directory, or ``""``."""
    if difflib.get_close_matches(value, ["bundled"], n=1, cutoff=0.6):
        return ' (did you mean "bundled"?)'
    parent = path.parent
    try:
        with os.scandir(parent) as entries:
            siblings = [entry.name for entry in itertools.islice(entries, 1000) if entry.is_dir()]
    except OSError:
        return ""
    match = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    if not match:
        return ""
    return f' (did you mean "{match[0] if str(parent) == "." else parent / match[0]}"?)'


def model_problem(value: str | Path, *, full: bool = True) -> str | None:
    """Why ``--model VALUE`` cannot be loaded, judged from the file system alone; ``None`` when it may.

    ``full=False`` only asks that the directory exists (``check`` reports the rest as its findings).
    Nothing is imported but, for the architecture, transformers' table of configuration classes.
    """
    text = str(value)
    path = bundled_dir() if text == "bundled" else Path(text)
    if not path.exists():
        if text == "bundled":
            return f"the bundled model is missing ({path}): run `python -m mla_watch.models.train` to build it"
        return f"no such directory and not a bundled model name: {MODEL_EXPECTED}{_close_path(text, path)}"
    if not path.is_dir():
        hint = f' (did you mean "{path.parent}"?)' if path.name == "config.json" else ""
        return f"not a directory: {MODEL_EXPECTED}{hint}"
    if not full:
        return None
    config_file = path / "config.json"
    if not config_file.is_file():
        return f"no config.json in {path}: {MODEL_EXPECTED}"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except OSError as error:
        return f"{config_file} cannot be read ({error.strerror or error}): {MODEL_EXPECTED}"
    except ValueError as error:
        return f"{config_file} is not JSON ({_shown(error, 80)}): expected the config.json save_pretrained writes"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        return f'{config_file} has no "model_type": expected the config.json save_pretrained writes'
    if text == "bundled":  # shipped with its weights and tokenizer: nothing to import (transformers takes seconds)
        return None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:  # registered types (AutoConfig.register) are in it too
        match = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
        hint = f' (did you mean "{match[0]}"?)' if match else ""
        return (
            f"{config_file}: model_type {_shown(model_type, 60)!r} is unknown to transformers "
            f"{transformers.__version__}: expected the config of an architecture transformers implements{hint}"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        return f"no weights in {path} (*.safetensors or pytorch_model.bin): {MODEL_EXPECTED}"
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return (
            f"no tokenizer in {path} (tokenizer.json or tokenizer_config.json): expected a save_pretrained "
            "directory the tokenizer was saved to as well"
        )
    return None


# ---------------------------------------------------------------------------------------------- the device
def device_problem(value: str) -> str | None:
    """Why ``--device VALUE`` cannot be used on this machine; ``None`` when it can."""
    if value in ("auto", "cpu"):
        return None
    import torch

    match = re.fullmatch(r"cuda(?::(\d{1,4}))?", value)
    if match is None:
        mps = getattr(torch.backends, "mps", None)
        if value == "mps" and mps is not None and mps.is_available():
            return None
        lowered = value.lower()
        guess = (
            "cuda"
            if lowered.startswith(("gpu", "nvidia", "cuda"))
            else next(iter(difflib.get_close_matches(lowered, ["auto", "cpu", "cuda"], n=1)), None)
        )
        hint = f" (did you mean {guess}?)" if guess else ""
        return f"expected auto, cpu, cuda or cuda:N{hint}"
    if not torch.cuda.is_available():
        why = (
            f"torch {torch.__version__} is built without CUDA"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
        )
        return f"CUDA is not available on this machine ({why}): expected auto or cpu"
    count = torch.cuda.device_count()
    if match.group(1) is not None and int(match.group(1)) >= count:
        devices = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        return f"this machine has {count} CUDA device(s): expected {devices}, cuda, auto or cpu"
    return None


def attn_problem(value: str) -> str | None:
    """Why ``--attn-implementation VALUE`` is no attention transformers knows; ``None`` when it may be."""
    # "org/name": a kernel from the hub, judged when it loads; eager and sdpa are in every transformers 5 (and
    # the default needs no import of it, which takes seconds, before the configuration is judged)
    if value in ("eager", "sdpa") or "/" in value:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.keys()]
    if value in known or value.removeprefix("paged|") in known:
        return None
    match = difflib.get_close_matches(value, known, n=1)
    hint = f" (did you mean {match[0]}?)" if match else ""
    return f"expected one of {', '.join(known)}, or a hub kernel (org/name){hint}"


# ---------------------------------------------------------------------------------------------- paths
def _existing_dir(flag: str, path: Path, what: str) -> None:
    if not path.exists():
        raise FlagError(f"{flag} {_shown(path)}: no such directory: expected {what}")
    if not path.is_dir():
        raise FlagError(f"{flag} {_shown(path)}: not a directory: expected {what}")


def _creatable_dir(flag: str, path: Path, what: str) -> None:
    """``path`` is a writable directory, or one that can be created (nothing is created here)."""
    if path.exists():
        if not path.is_dir():
            raise FlagError(f"{flag} {_shown(path)}: not a directory: expected {what}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise FlagError(f"{flag} {_shown(path)}: not writable: expected {what}")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FlagError(
            f"{flag} {_shown(path)}: cannot be created, {_shown(ancestor)} is not a directory: expected {what}"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise FlagError(
            f"{flag} {_shown(path)}: cannot be created in {_shown(ancestor)} (not writable): expected {what}"
        )


def _public_url(text: str) -> None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise FlagError(
            f"--public-url {_shown(text)}: expected an http:// or https:// URL with a host, the one "
            "on-call opens (links in alerts point there)"
        )


def one_thread_for_the_bundled_model(model: str, device: str) -> None:
    """One intra-op torch thread for the bundled model on the CPU, unless ``OMP_NUM_THREADS`` says how many.

    Its matrices are tiny (3M parameters): the threads of one operation gain little and wait for each other at
    every operation, and on cores shared with other work (the sidecar's own threads, a neighbour) that wait
    costs many times the operation (``bench/cpu_threads.py``).
    """
    if model != "bundled" or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(1)


def check_model_flags(args: argparse.Namespace, *, full: bool = True) -> None:
    """``--model`` (and ``--device``, where the command has it), judged before anything loads."""
    problem = model_problem(args.model, full=full)
    if problem is not None:
        raise FlagError(f"--model {_shown(args.model)}: {problem}")
    device = getattr(args, "device", None)
    if device is not None and (problem := device_problem(device)) is not None:
        raise FlagError(f"--device {_shown(device)}: {problem}")


def check_serve_flags(args: argparse.Namespace) -> None:
    """Every ``serve`` flag whose value can be wrong in a way that would only show once serving."""
    _check_serve_extras(args)
    _existing_dir("--policies", args.policies, "a directory of policy YAML files")
    if args.rules is not None:
        _existing_dir("--rules", args.rules, "a directory of alert rule YAML files")
    _existing_dir("--reference-prompts", args.reference_prompts, "a directory of reference prompt YAML files")
    if args.public_url:
        _public_url(args.public_url)
    if args.model_config is not None and not (
        args.model_config.is_file() or (args.model_config / "config.json").is_file()
    ):
        raise FlagError(
            f"--model-config {_shown(args.model_config)}: "
            f"{'no config.json in it' if args.model_config.is_dir() else 'no such file or directory'}: "
            "expected the config.json the engine loaded, or its directory"
        )
    if getattr(args, "reference_priority", None) is not None and args.engine not in ("vllm", "auto"):
        raise FlagError(
            f"--reference-priority {args.reference_priority}: the request priority is vLLM's: expected "
            f"--engine vllm (not {args.engine})"
        )
    if args.reference_model is not None:
        _existing_dir("--reference-model", args.reference_model, "the checkpoint directory of the served model")
        if not any(args.reference_model.glob("*.safetensors")):
            raise FlagError(
                f"--reference-model {_shown(args.reference_model)}: no *.safetensors file in it: "
                "expected the checkpoint directory of the served model (save_pretrained, safetensors)"
            )
    if (
        args.sglang_recorder_dir is not None
        and args.sglang_recorder_dir.exists()
        and not args.sglang_recorder_dir.is_dir()
    ):
        raise FlagError(
            f"--sglang-recorder-dir {_shown(args.sglang_recorder_dir)}: not a directory: expected the "
            "engine's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
        )
    if args.dataset_dir is not None:
        _creatable_dir(
            "--dataset-dir", args.dataset_dir, "a directory re-tune datasets are read from (created if missing)"
        )
    if args.engine_swap_dir is not None:
        _creatable_dir(
            "--engine-swap-dir",
            args.engine_swap_dir,
            "a directory router checkpoints are written to for the engine (created if missing)",
        )
    if not args.upstream:  # the model is served here: it must load
        check_model_flags(args)
        if (problem := attn_problem(args.attn_implementation)) is not None:
            raise FlagError(f"--attn-implementation {_shown(args.attn_implementation)}: {problem}")


def require_model_extra(what: str) -> None:
    """A :class:`FlagError` naming ``what`` (a flag and its value) and the install that adds the ``[model]`` extra,
    when torch or transformers is missing."""
    from mla_watch.common.extras import needs_model_extra

    if (problem := needs_model_extra(what)) is not None:
        raise FlagError(problem)


def _check_serve_extras(args: argparse.Namespace) -> None:
    """The flags whose feature runs tensors: refused at start-up, in one line, without the ``[model]`` extra."""
    if not args.upstream:
        require_model_extra(f"--model {_shown(args.model)} (serving the model here, without --upstream)")
        return
    if args.sglang_recorder_dir is not None:
        require_model_extra(f"--sglang-recorder-dir {_shown(args.sglang_recorder_dir)} (its .pt dumps)")
    if args.retune_option:
        require_model_extra("--retune-option")


# ---------------------------------------------------------------------------------------------- listening
def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (connections wait in its backlog until served)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets it knows are TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses TIME_WAIT ports
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        address = _address(host, port)
        if isinstance(error, socket.gaierror):
            raise FlagError(
                f"--host {_shown(host)}: cannot resolve it ({error.strerror}): expected an address of "
                "this machine (127.0.0.1, 0.0.0.0, ::) or a name that resolves to one"
            ) from None
        if error.errno == errno.EADDRINUSE:
            raise FlagError(f"--port {port}: {address} is in use: expected a free port (or --port 0 for any)") from None
        if error.errno == errno.EACCES:
            raise FlagError(
                f"--port {port}: binding {address} is not permitted: expected a port >= 1024 (or the "
                "privilege to bind a lower one)"
            ) from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise FlagError(
                f"--host {_shown(host)}: not an address of this machine: expected one of its addresses "
                "(127.0.0.1, 0.0.0.0, ::)"
            ) from None
        raise FlagError(
            f"--host {_shown(host)} --port {port}: cannot listen on {address} "
            f"({error.strerror or error}): expected a local address and a free port"
        ) from None
    return sock


def default_public_url(host: str, port: int) -> str:
    return f"http://{_address(host, port)}"


def run_server(app: Any, sock: socket.socket, **options: Any) -> None:
    """Serve ``app`` with uvicorn on the socket already bound; ``options`` go to ``uvicorn.Config``.

    As ``uvicorn.run``, with the one difference that the socket is not uvicorn's to bind: the app's
    start-up (which logs the status page's URL) runs once the port is known to be this server's.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and sockets:  # uvicorn says it only for the sockets it binds itself
                host, port = sockets[0].getsockname()[:2]
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s (Press CTRL+C to quit)", _address(host, port)
                )

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has shut down, which kills the process (exit 143); a SIGTERM
            # is the stop asked for, and a stop that saved what it must ends with 0.
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
                captured.remove(sig)

    server = Server(uvicorn.Config(app, **options))
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE: the app's start-up failed, and said why


def end_abandoned_work() -> None:
    """End the process now where work the stop abandoned (a re-tune job mid-fit, an engine request awaiting its
    answer) still holds a thread the interpreter would wait for: what must outlive the process was saved by the
    stop, and the pod's grace must not be spent waiting for the rest."""
    left = [
        thread.name
        for thread in threading.enumerate()
        if thread is not threading.current_thread() and thread.is_alive() and not thread.daemon
    ]
    if not left:
        return
    logging.getLogger("mla_watch.server").info(
        "ending the work abandoned at the stop (threads %s)", ", ".join(sorted(left))
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


@contextlib.contextmanager
def held_logs() -> Iterator[None]:
    """The root logger's records held back while the block runs, then let through in order.

    A block that raises :class:`FlagError` drops them: its one line says what is wrong, and the
    lines before it would only bury it. Any other exit (a ``SystemExit`` naming a setting) lets them through.
    """
    root = logging.getLogger()
    saved = root.handlers[:]
    memory = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    root.handlers = [memory]
    keep = True
    try:
        yield
    except FlagError:
        keep = False
        raise
    finally:
        root.handlers = saved
        for record in memory.buffer if keep else ():
            for handler in saved:
                if record.levelno >= handler.level:
                    handler.handle(record)
        memory.buffer.clear()


# ---------------------------------------------------------------------------------------------- argparse
class Parser(argparse.ArgumentParser):
    """argparse's parser, with two differences: a flag is never taken by a prefix of its name (``--no-liv`` is
    an error, not ``--no-live``), and a usage error is two lines, a one-line usage and the error, instead of the
    whole usage (over fifty lines for ``serve``) above the one line that says what is wrong."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def short_usage(self) -> str:
        """``usage: mla-watch retune promote [FLAGS] version (... --help lists them)``, on one line."""
        words = [self.prog, "[FLAGS]"]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                words.append("COMMAND ...")
            elif not action.option_strings:
                words.append(str(action.metavar or action.dest))
        listed = "its commands and flags" if "COMMAND ..." in words else "its flags"
        return f"usage: {' '.join(words)}  ({self.prog} --help lists {listed})"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}\n")


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already says it or there is none to say; lines
    are never broken inside a word (argparse breaks at hyphens: a URL, a flag, ``docs/status-page.md``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()),
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
            break_long_words=False,
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.nargs == 0
            or default is None
            or default is argparse.SUPPRESS
            or default == []
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default %(default)s)" if text else "(default %(default)s)"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, str | None]]:
    """``parser`` and every subparser below it, each with its help line in its parent's listing."""
    yield parser, None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                for found, text in _parsers(sub):
                    yield found, helps.get(name) if found is sub else text


def finish_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Defaults in every ``--help``, a description under each subcommand's usage, the manual's page under it
    (a subcommand without one names its parent's), and the parser that parsed each command recorded in its
    namespace (so that a mistyped flag gets that command's usage)."""
    for sub, text in _parsers(parser):
        sub.formatter_class = HelpFormatter
        if sub.description is None and text:
            sub.description = text[0].upper() + text[1:] + "."
        for action in sub._actions:  # top-down: a parent's epilog is final before its subcommands are seen
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    child.epilog = child.epilog or sub.epilog
        for action in sub._actions:
            if action.help is None and action.option_strings and action.nargs != 0 and action.default is not None:
                action.help = "(default %(default)s)"  # argparse prints nothing for a flag without help
        sub.set_defaults(**{_PARSER: sub})
    return parser


def _flag_hint(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    flags = [option for action in parser._actions for option in action.option_strings]
    guesses = []
    for extra in extras:
        if extra.startswith("--"):
            guesses += difflib.get_close_matches(extra.partition("=")[0], flags, n=1)
    return f" (did you mean {' / '.join(dict.fromkeys(guesses))}?)" if guesses else ""


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, but a flag no parser knows is refused by the subcommand's parser, with its usage and
    the flag it may have meant."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        target = getattr(args, _PARSER, parser)
        target.error(f"unrecognized arguments: {' '.join(extras)}{_flag_hint(target, extras)}")
    return args


def prog(args: argparse.Namespace) -> str:
    parser = getattr(args, _PARSER, None)
    return parser.prog if parser is not None else "mla-watch"
