"""Joining a multi-process JAX job (`jax.distributed`), for every command that runs on many hosts
(`lwm train`, `lwm tokenize`): from a `DistributedConfig`, the environment
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) or, on a multi-host TPU
slice, nothing at all."""

from __future__ import annotations

import os
from typing import Any

import jax

from lwm.base.config import ConfigError, DistributedConfig

__all__ = ["init_distributed"]


def init_distributed(cfg: DistributedConfig) -> None:
    """`jax.distributed.initialize` when the job has many processes; nothing otherwise. Call it
    before anything asks JAX for its devices."""
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    multi_host_tpu = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if cfg.enabled == "off" or (cfg.enabled == "auto" and not address and not multi_host_tpu):
        if cfg.enabled == "auto" and not multi_host_tpu and (cfg.num_processes or 1) > 1:
            raise ConfigError(  # else each process would run the whole job alone
                f"a job of {cfg.num_processes} processes needs the coordinator's address "
                "(distributed.coordinator_address, --coordinator or JAX_COORDINATOR_ADDRESS)"
            )
        return
    if cfg.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs: dict[str, Any] = {}
    if address:
        kwargs["coordinator_address"] = address
        num = cfg.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
        pid = cfg.process_id
        if pid is None and os.environ.get("JAX_PROCESS_ID"):
            pid = int(os.environ["JAX_PROCESS_ID"])
        if not num or pid is None:
            raise ConfigError(
                f"a multi-process job with the coordinator {address} needs the number of "
                "processes and this process's id (distributed.num_processes and "
                "distributed.process_id, --num-processes and --process-id, or JAX_NUM_PROCESSES "
                "and JAX_PROCESS_ID)"
            )
        if not 0 <= pid < num:
            raise ConfigError(f"process id {pid} is not in 0..{num - 1} ({num} processes)")
        kwargs.update(num_processes=num, process_id=pid)
    jax.distributed.initialize(**kwargs)
