"""build_app: the Ray Serve application (a router in front of one deployment per replica)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..runtime.config import EngineConfig
from .replica import EngineReplica
from .router import Router

LOAD_OPTIONS = ("device", "dtype", "tensor_parallel_size", "quantization", "tokenizer")
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("model_name", "request_id_prefix"))
ROUTINGS = ("prefix", "round_robin")


def _server_option_names() -> tuple[str, ...]:
    from ..server.state import ServerOptions
    return tuple(f.name for f in fields(ServerOptions) if f.name not in ("model_name", "response_id_prefix"))


@dataclass
class Spec:
    """What every replica builds and the router routes by (pickled to each)."""
    model: str
    served_model_name: str
    load: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    num_replicas: int = 2
    routing: str = "prefix"
    prefix_load_cap: int = 8
    torch_threads: int | None = None
    grace_s: float = 5.0
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""


def build_app(model: str | os.PathLike[str] | None = None, num_replicas: int = 2, **options: Any) -> Any:
    """A Ray Serve application: `num_replicas` replicas each holding one engine of `model` (a
    Hugging Face directory or GGUF file; None: the built-in tiny Llama), behind a router that
    serves pagedecode's OpenAI routes (run it with `ray.serve.run(app)`).

    options: EngineConfig fields (page_size, max_batch_size, ...), the loader's (device, dtype,
    tensor_parallel_size, quantization, tokenizer), build_app's server options (api_keys,
    limits, metrics_compat, ...), served_model_name, chat_template (a file), and for Ray:
    ray_actor_options (each replica's CPUs / GPUs; default 1 CPU), router_actor_options
    (default 0 CPUs), routing ("prefix" or "round_robin"), prefix_load_cap, torch_threads (per
    replica; default: the replica's CPUs), grace_s (a replica's drain on shutdown),
    health_check_period_s, kv_events / kv_events_replay / kv_events_topic (each replica publishes
    its prefix cache's KV events as data_parallel_rank N, vLLM's way for data-parallel engines: a
    connected endpoint is shared, a bound one and the replay endpoint are offset by N)."""
    from ray import serve

    from ..model.default_model import default_model_path
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    path = Path(model) if model is not None else default_model_path()     # made here once, not per replica
    if not path.exists():
        raise ValueError(f"model {str(path)!r} does not exist")
    opts = dict(options)
    replica_opts = dict(opts.pop("ray_actor_options", None) or {"num_cpus": 1})
    router_opts = dict(opts.pop("router_actor_options", None) or {"num_cpus": 0})
    health_s = float(opts.pop("health_check_period_s", 2.0))
    spec = Spec(model=str(path.resolve()), num_replicas=num_replicas,
                served_model_name=opts.pop("served_model_name", None) or (path.stem if path.is_file() else path.name),
                chat_template=opts.pop("chat_template", None), routing=opts.pop("routing", "prefix"),
                prefix_load_cap=int(opts.pop("prefix_load_cap", 8)), torch_threads=opts.pop("torch_threads", None),
                grace_s=float(opts.pop("grace_s", 5.0)), kv_events=opts.pop("kv_events", None),
                kv_events_replay=opts.pop("kv_events_replay", None), kv_events_topic=opts.pop("kv_events_topic", ""))
    if spec.routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {spec.routing!r}")
    server_names = _server_option_names()
    for k in list(opts):
        if k in LOAD_OPTIONS:
            spec.load[k] = opts.pop(k)
        elif k in ENGINE_OPTIONS:
            spec.engine[k] = opts.pop(k)
        elif k in server_names:
            spec.server[k] = opts.pop(k)
    if opts:
        raise TypeError(f"build_app() got unknown options: {', '.join(sorted(opts))}")
    EngineConfig(**spec.engine)       # a bad engine option fails here, not in every replica
    if spec.torch_threads is None:
        spec.torch_threads = max(1, int(replica_opts.get("num_cpus") or 1))
    replicas = [serve.deployment(name=f"replica-{i}", num_replicas=1, ray_actor_options=replica_opts,
                                 max_ongoing_requests=4096, health_check_period_s=health_s,
                                 health_check_timeout_s=max(10.0, 5 * health_s),
                                 graceful_shutdown_timeout_s=spec.grace_s + 5)(EngineReplica).bind(i, spec)
                for i in range(num_replicas)]
    return serve.deployment(name="router", num_replicas=1, ray_actor_options=router_opts,
                            max_ongoing_requests=100_000)(Router).bind(spec, *replicas)
