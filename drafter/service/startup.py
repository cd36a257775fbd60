"""Start-up mistakes of `drafter serve`, each said in one line: the flag, its value, what to do.

    preflight(cfg)           before any port is bound: the device exists, the head checkpoint is
                             there and its layout fits --method, --target-model is a checkpoint
    check_port_free(...)     a gRPC port in use, found before gRPC tries (and logs its own error)
    bind_error(flag, ...)    a port that cannot be bound (in use, not an address of this host)
    load_error(cfg, exc)     the engine failed to load: what the loader said, plus the flag to fix

The serve command prints str(StartupError) as its one line on stderr (and in its "failed" event)
and exits non-zero; the traceback stays out of sight (the log has it at debug level).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from drafter.engine.config import METHODS
from drafter.service.config import ServerConfig


class StartupError(Exception):
    """A start-up mistake: `--FLAG VALUE: problem; fix`."""

    def __init__(self, flag: str, value, problem: str, fix: str):
        self.flag, self.value, self.problem, self.fix = flag, value, problem, fix
        super().__init__(f"--{flag} {value}: {problem}; {fix}")


def preflight(cfg: ServerConfig) -> None:
    """Every mistake that can be found before binding a port or loading weights."""
    check_device(cfg.device)
    check_checkpoint(cfg)
    check_tensor_parallel(cfg)


def check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise StartupError("device", device, f"this torch ({torch.__version__}) sees no CUDA GPU",
                           "use --device cpu (or auto: a GPU when there is one)")
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise StartupError("device", device, f"{torch.cuda.device_count()} CUDA GPU(s) visible",
                           "use --device cuda:N with N below that count")


def check_checkpoint(cfg: ServerConfig) -> None:
    from drafter.models.spec import HeadConfigError, parse_head, read_config

    _config_json(cfg.model, "model", "the draft head's checkpoint directory")
    if cfg.target_model:
        _config_json(cfg.target_model, "target-model", "the target's checkpoint directory")
    head = read_config(cfg.model)  # remembers its file: the parser's refusals name it
    try:
        parse_head(head, cfg.method)
    except (KeyError, ValueError, TypeError) as exc:
        what = f"config.json has no {exc}" if isinstance(exc, KeyError) else str(exc)
        guess = [m for m in METHODS if m != cfg.method and _parses(parse_head, head, m)]
        named = head.get("speculators_model_type")
        if named in METHODS and named != cfg.method:
            guess = [named]
        if not guess and isinstance(exc, HeadConfigError):
            # no method reads it: a key the engine refuses, not a wrong --method
            raise StartupError("model", cfg.model, str(exc),
                               "docs/head-configs.md lists what the drafter honours") from None
        fix = (f"it reads as an {guess[0]} head: pass --method {guess[0]}" if guess
               else "pass the --method the checkpoint was trained as, or the right --model")
        raise StartupError("method", cfg.method, f"does not fit the head in --model {cfg.model} ({what})",
                           fix) from None


def check_tensor_parallel(cfg: ServerConfig) -> None:
    """--tensor-parallel-size N: N GPUs from --device on (CUDA), and every size the ranks split (attention
    heads, KV heads, MLP columns or experts, vocabulary) divisible by N, refused naming the config key."""
    world = cfg.tensor_parallel_size
    if world == 1:
        return
    device = cfg.resolved_device()
    if device.startswith("cuda"):
        import torch

        base = int(device.partition(":")[2] or 0)
        if base + world > torch.cuda.device_count():
            raise StartupError("tensor-parallel-size", world, f"needs GPUs {base} .. {base + world - 1} but "
                               f"{torch.cuda.device_count()} are visible", "pick a size that fits the GPUs")
    from drafter.models.spec import parse_head, read_config

    spec = parse_head(read_config(cfg.model), cfg.method)
    try:
        _check_splits(spec, world)
    except ValueError as exc:
        raise StartupError("tensor-parallel-size", world, f"the head in --model {cfg.model} cannot be split: {exc}",
                           "pick a size that divides it") from None


def _check_splits(spec, world: int) -> None:
    from drafter.models.llama_shard import shard_spec
    from drafter.models.sharding import Shard

    shard = Shard(0, world)
    if spec.method != "deepseek_mtp":
        shard_spec(spec, shard)
        return
    shard.span(spec.vocab_size, "vocab_size")
    for layer in spec.layer_shapes:
        shard.span(layer.attn.num_heads, "num_attention_heads")
        if layer.moe is not None:
            shard.span(layer.moe.num_experts, "n_routed_experts")
        else:
            shard.span(layer.intermediate_size, "intermediate_size")


def _parses(parse_head, head: dict, method: str) -> bool:
    try:
        parse_head(head, method)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not this layout"
        return False


def _config_json(path: str, flag: str, what: str) -> dict:
    import json

    p = Path(path)
    if not p.is_dir():
        raise StartupError(flag, path, "no such directory", f"pass {what}")
    if not (p / "config.json").is_file():
        raise StartupError(flag, path, "no config.json in it", f"pass {what} (the folder holding config.json)")
    try:
        return json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StartupError(flag, path, f"config.json is unreadable ({exc})", f"pass {what}") from None


def check_port_free(flag: str, host: str, port: int) -> None:
    """Bind and release the port first (gRPC's own failure is a C-core log line plus an exception
    that names no flag).  Port 0 needs no check."""
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError("host", host, f"does not resolve ({exc.strerror})", "use an address of this host") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            raise bind_error(flag, host, port, exc) from None


def bind_error(flag: str, host: str, port: int, exc: BaseException, cfg: ServerConfig | None = None
               ) -> StartupError:
    """A port that could not be bound (or a TLS file that could not be read), said with its flag."""
    filename = getattr(exc, "filename", None)
    if filename and cfg is not None:
        for name in ("tls_cert", "tls_key", "tls_client_ca", "curve_server_cert", "zmq_ipc"):
            if getattr(cfg, name) and str(getattr(cfg, name)) in (str(filename), f"ipc://{filename}"):
                return StartupError(name.replace("_", "-"), filename, getattr(exc, "strerror", None) or str(exc),
                                    "pass a readable file")
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code == errno.EADDRINUSE or "in use" in text.lower() or "failed to bind" in text.lower():
        return StartupError(flag, port, f"{host}:{port} is already in use (another drafter?)",
                            f"stop what holds it, or pick another --{flag} (0 = any free port)")
    if code == errno.EADDRNOTAVAIL or "not available" in text.lower():
        return StartupError("host", host, "is not an address of this machine",
                            "use 127.0.0.1, 0.0.0.0 or one of this host's addresses")
    if code == errno.EACCES or "permission" in text.lower():
        return StartupError(flag, port, f"no permission to bind {host}:{port} (ports below 1024 need root)",
                            f"pick another --{flag}")
    return StartupError(flag, port, f"cannot listen on {host}:{port}: {text.splitlines()[0] if text else exc!r}",
                        f"pick another --{flag} (0 = any free port)")


def load_error(cfg: ServerConfig, exc: BaseException) -> StartupError | None:
    """The loader's own message, with the flag to fix; None for a failure that is no user mistake."""
    if not isinstance(exc, (ValueError, KeyError, OSError, RuntimeError)):
        return None
    text = str(exc).splitlines()[0] if str(exc) else repr(exc)
    if isinstance(exc, KeyError):
        text = f"a key is missing: {exc}"
    if not cfg.target_model and "target" in text:
        text = re.sub(r":\s*pass the target[^;]*$", "", text)  # the fix below says it with the flag
        return StartupError("target-model", "(not given)", text,
                            "pass --target-model DIR: the target checkpoint whose embeddings / lm_head the head uses")
    if isinstance(exc, RuntimeError) and ("CUDA" in text or "cuda" in text):
        return StartupError("device", cfg.device, text, "use --device cpu, or free / pick another GPU")
    if isinstance(exc, RuntimeError):
        return None
    return StartupError("model", cfg.model, f"cannot load it as an {cfg.method} head ({text})",
                        "check --model, --method and --target-model")
