"""`pagedecode serve --ray`: replicas behind Ray Serve's HTTP proxy until SIGINT / SIGTERM."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any


def serve_main(args: Any) -> int:
    """Start (or join, --ray-address) a Ray cluster, run the replicas behind Serve's HTTP proxy on
    --host / --port, and shut all of it down on SIGINT / SIGTERM."""
    import ray
    from ray import serve

    from ..server.flags import api_keys, engine_options, server_options

    from .app import build_app
    try:
        keys = api_keys(args)
        options = engine_options(args, leave_out=("request_id_prefix",))   # before any cluster starts
    except ValueError as e:
        print(f"pagedecode serve: {e}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("pagedecode serve: --replicas must be >= 1", file=sys.stderr)
        return 2
    options.update(server_options(args, keys))
    load = {"device": args.device, "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
            "quantization": args.quantization, "tokenizer": args.tokenizer}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(args.model, args.replicas, served_model_name=args.served_model_name,
                        chat_template=args.chat_template, grace_s=args.grace_seconds, kv_events=args.kv_events,
                        kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic, **load, **options)
        serve.run(app, name="pagedecode", route_prefix="/", blocking=False)
        print(f"pagedecode serve: {args.replicas} replicas on Ray Serve at http://{args.host}:{args.port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
