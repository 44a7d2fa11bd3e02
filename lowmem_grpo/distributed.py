"""Several processes (`accelerate launch`, `torchrun`): ranks, one run directory made by rank 0 for all, rank 0
alone writing files, and the check that data-parallel ranks end with identical adapters. With one process nothing
here touches torch.distributed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError, LowmemError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800  # transformers' ddp_timeout default, so the early process group matches the trainer's


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """Processes in this run: WORLD_SIZE in `environ` (default os.environ), 1 without a launcher."""
    return max(1, _int((os.environ if environ is None else environ).get("WORLD_SIZE"), 1))


def rank() -> int:
    return _int(os.environ.get("RANK"), 0)


def local_rank() -> int:
    return _int(os.environ.get("LOCAL_RANK"), 0)


def is_distributed() -> bool:
    return world_size() > 1


def is_main_process() -> bool:
    """Whether this process writes the run's files (global rank 0)."""
    return rank() == 0


def cuda_device_index() -> int:
    """The GPU this process loads its model onto: its LOCAL_RANK under a launcher, else the current device."""
    import torch

    if is_distributed() and local_rank() < torch.cuda.device_count():
        return local_rank()
    return torch.cuda.current_device()


def deepspeed_zero_stage(environ: Mapping[str, str] | None = None) -> int | None:
    """The ZeRO stage `accelerate launch` set up in `environ` (default os.environ); None without DeepSpeed."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in ("1", "true", "yes"):
        return None
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file:  # the JSON is authoritative: accelerate refuses config keys beside it
        return _json_zero_stage(config_file, "DeepSpeed config")
    return _int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"))


def _json_zero_stage(config: str | dict[str, Any], what: str) -> int | None:
    """zero_optimization.stage of a DeepSpeed config, a JSON file or its dict; BadInputError naming `what`."""
    if not isinstance(config, dict):
        try:
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise BadInputError(f"{what} {config}: {exc}",
                                fix="point it at a readable DeepSpeed JSON file (relative paths start at the "
                                    "working directory)") from exc
    section = config.get("zero_optimization") if isinstance(config, dict) else None
    return _int(section.get("stage")) if isinstance(section, dict) else None


@dataclass(frozen=True)
class Launch:
    """How the launcher runs `train`."""

    num_processes: int = 1
    """Processes of the run (WORLD_SIZE; 1 without a launcher)."""
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage (0-3); None without DeepSpeed."""

    def describe(self) -> str:
        """E.g. "2 processes, DeepSpeed ZeRO-2"."""
        processes = f"{self.num_processes} process{'es' if self.num_processes > 1 else ''}"
        return processes + (f", DeepSpeed ZeRO-{self.zero_stage}" if self.zero_stage is not None else "")


def launch(train_extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Launch:
    """The run's Launch from the launcher's environment, else the ZeRO stage of the recipe's train.deepspeed."""
    stage = deepspeed_zero_stage(environ)
    ds_config = (train_extra or {}).get("deepspeed")
    if stage is None and ds_config:
        stage = _json_zero_stage(ds_config, "train.deepspeed")
    return Launch(world_size(environ), stage)


def launcher_environment(config_file: str | Path) -> dict[str, str]:
    """The launch variables `accelerate launch --config_file CONFIG_FILE` sets for each process
    (accelerate/utils/launch.py prepare_deepspeed_cmd_env); BadInputError for a file that is no accelerate config."""
    import yaml

    try:
        config = yaml.safe_load(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise BadInputError(f"accelerate config {config_file}: {exc}",
                            fix="give an accelerate config file, e.g. recipes/accelerate/zero2.yaml") from exc
    if not isinstance(config, dict) or "distributed_type" not in config:
        raise BadInputError(f"accelerate config {config_file}: no distributed_type, so not an accelerate config",
                            fix="give a file `accelerate config` wrote, e.g. recipes/accelerate/ddp.yaml")
    kind = str(config["distributed_type"]).upper()
    env = {"WORLD_SIZE": str(1 if kind == "NO" else config.get("num_processes", 1))}
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        if ds.get("zero_stage") is not None:
            env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str(ds["zero_stage"])
        if ds.get("deepspeed_config_file"):
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(ds["deepspeed_config_file"])
    return env


def setup(train_extra: dict[str, Any] | None = None) -> None:
    """Join the launcher's process group once, with the recipe's ddp_backend/ddp_timeout (the trainer reuses it)."""
    if not is_distributed():
        return
    import torch
    from accelerate import PartialState

    extra = train_extra or {}
    state = PartialState(cpu=not torch.cuda.is_available(), backend=extra.get("ddp_backend"),
                         timeout=timedelta(seconds=int(extra.get("ddp_timeout", DEFAULT_TIMEOUT_S))))
    log.info("process %d of %d (local rank %d, pid %d, %s, %s over %s)", state.process_index, state.num_processes,
             state.local_process_index, os.getpid(), state.device,
             getattr(state.distributed_type, "value", state.distributed_type), getattr(state, "backend", None))


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first, the others after it (one-time conversions, downloads into a shared cache)."""
    if not is_distributed():
        yield
        return
    from accelerate import PartialState

    with PartialState().main_process_first():
        yield


def agree_on_run_dir(make: Callable[[], Path]) -> Path:
    """Rank 0 calls `make` and every rank gets its path; an error there is raised on every rank alike."""
    if not is_distributed():
        return make()
    from accelerate.utils import broadcast_object_list

    payload: list[Any] = [None]
    error: BaseException | None = None
    if is_main_process():
        try:
            payload = [("ok", str(make()), None)]
        except BadInputError as exc:
            error, payload = exc, [("bad_input", str(exc.args[0]) if exc.args else "", exc.fix)]
        except Exception as exc:  # noqa: BLE001 - the other ranks must hear of any failure, or they wait forever
            error, payload = exc, [("failure", f"{type(exc).__name__}: {exc}", None)]
    broadcast_object_list(payload, from_process=0)
    kind, value, fix = payload[0]
    if error is not None:
        raise error
    if kind == "bad_input":
        raise BadInputError(value, fix=fix)
    if kind == "failure":
        raise LowmemError(f"rank 0 could not create the run directory: {value}")
    return Path(value)


def tensors_digest(tensors: dict[str, Any]) -> str:
    """sha256 over the names, dtypes, shapes and exact bytes of tensors, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_ranks_agree(trainer: Any, record_path: Path) -> dict[str, Any] | None:
    """Gather each rank's pid, host, steps and adapter digest into `record_path` (rank 0); LowmemError on every
    rank when they differ. None for one process."""
    if not is_distributed():
        return None
    import torch.distributed as dist
    from peft import get_peft_model_state_dict

    state = trainer.accelerator.state
    model = trainer.accelerator.unwrap_model(trainer.model)
    mine = {"rank": state.process_index, "local_rank": state.local_process_index, "pid": os.getpid(),
            "host": socket.gethostname(), "device": str(state.device), "global_step": trainer.state.global_step,
            # the adapter's weights as save_pretrained writes them
            "adapter_sha256": tensors_digest(get_peft_model_state_dict(model))}
    ranks: list[Any] = [None] * state.num_processes
    dist.all_gather_object(ranks, mine)
    digests = {r["adapter_sha256"] for r in ranks}
    identical = len(digests) == 1
    kind = getattr(state.distributed_type, "value", str(state.distributed_type))
    record = {"num_processes": state.num_processes, "distributed_type": kind,
              "backend": getattr(state, "backend", None), "adapters_identical": identical, "ranks": ranks}
    if is_main_process():
        Path(record_path).write_text(json.dumps(record, indent=2), encoding="utf-8")
    if not identical:
        raise LowmemError(f"the {state.num_processes} ranks ended with different LoRA weights "
                          f"({len(digests)} distinct digests, see {record_path}); the saved adapter is rank 0's",
                          fix="report this with distributed.json; data-parallel ranks must stay in sync")
    log.info("%d ranks agree on the adapter (sha256 %s)", state.num_processes, next(iter(digests))[:12])
    return record
